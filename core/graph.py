"""CUDA-graph capture of the decode step.

One cffi or torch launch from Python costs ~10-20 µs; a decode step of a 32-layer model makes
hundreds, which costs more than reading its 4-bit weights. So decode steps (every sequence adds
exactly one token) are captured once per padded batch size and replayed. Inputs live in static
buffers; unused rows of a padded batch write to a reserved scratch page and are ignored.

Capture needs every op on the path to be free of host syncs (the CUDA kernels are); when capture
fails the runner falls back to eager execution and says so once.
"""
from __future__ import annotations

import warnings

import torch

from .batch import ForwardBatch

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


class GraphRunner:
    """``forward(batch)`` like ``model.forward``, replaying a captured graph for decode batches."""

    def __init__(self, model, cache, batch_sizes=DEFAULT_BATCH_SIZES, max_context: int | None = None):
        self.model, self.cache = model, cache
        self.device = cache.device
        self.enabled = self.device.type == "cuda"
        self.batch_sizes = sorted(batch_sizes)
        self.page_size = cache.page_size
        self.max_pages = cache.pages_for(max_context) if max_context else cache.num_pages
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self._failed: set[int] = set()
        self._scratch_page: int | None = None
        self.pool = None

    def _is_decode(self, batch: ForwardBatch) -> bool:
        return (
            self.enabled
            and batch.cache is self.cache
            and batch.input_embeds is None
            and batch.num_tokens == batch.num_seqs
            and batch.num_seqs <= self.batch_sizes[-1]
            and batch.block_table.shape[1] <= self.max_pages
        )

    def _static_inputs(self, size: int) -> dict[str, torch.Tensor]:
        if self._scratch_page is None:
            self._scratch_page = self.cache.allocator.alloc(1)[0]
        d = self.device
        scratch_slot = self._scratch_page * self.page_size
        return dict(
            input_ids=torch.zeros(size, dtype=torch.long, device=d),
            positions=torch.zeros(size, dtype=torch.long, device=d),
            cu_seqlens=torch.arange(size + 1, dtype=torch.int32, device=d),
            logits_indices=torch.arange(size, dtype=torch.long, device=d),
            block_table=torch.full((size, self.max_pages), self._scratch_page, dtype=torch.int32, device=d),
            context_lens=torch.ones(size, dtype=torch.int32, device=d),
            slots=torch.full((size,), scratch_slot, dtype=torch.long, device=d),
            cached_lens=torch.zeros(size, dtype=torch.int32, device=d),
        )

    def _batch(self, s: dict[str, torch.Tensor]) -> ForwardBatch:
        return ForwardBatch(
            input_ids=s["input_ids"], positions=s["positions"], cu_seqlens=s["cu_seqlens"],
            logits_indices=s["logits_indices"], cache=self.cache, block_table=s["block_table"],
            context_lens=s["context_lens"], slots=s["slots"], cached_lens=s["cached_lens"],
            max_seq_len=self.max_pages * self.page_size,
        )

    def _capture(self, size: int):
        static = self._static_inputs(size)
        batch = self._batch(static)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy tables, kernel library loading, autotuning
                self.model.forward(batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.forward(batch)
        self.pool = graph.pool()
        return graph, static, out

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if not self._is_decode(batch):
            return self.model.forward(batch)
        n = batch.num_seqs
        size = next(b for b in self.batch_sizes if b >= n)
        if size in self._failed:
            return self.model.forward(batch)
        if size not in self.graphs:
            try:
                self.graphs[size] = self._capture(size)
            except Exception as e:  # an op on the path is not capturable: run eagerly
                self._failed.add(size)
                warnings.warn(f"trellm: CUDA graph capture failed for batch {size}, decoding eagerly ({e})")
                torch.cuda.synchronize(self.device)
                return self.model.forward(batch)
        graph, s, out = self.graphs[size]
        width = batch.block_table.shape[1]
        s["input_ids"][:n].copy_(batch.input_ids)
        s["positions"][:n].copy_(batch.positions)
        s["block_table"][:n, :width].copy_(batch.block_table)
        s["block_table"][:n, width:].fill_(self._scratch_page)
        s["context_lens"][:n].copy_(batch.context_lens)
        s["slots"][:n].copy_(batch.slots)
        if batch.cached_lens is not None:
            s["cached_lens"][:n].copy_(batch.cached_lens)
        if n < size:  # padding rows: one token at the scratch page
            s["block_table"][n:].fill_(self._scratch_page)
            s["context_lens"][n:].fill_(1)
            s["slots"][n:].fill_(self._scratch_page * self.page_size)
            s["positions"][n:].zero_()
        graph.replay()
        rows = out[:n]
        return rows if batch.logits_indices is None or batch.logits_indices.numel() == n else rows[batch.logits_indices]

    def close(self) -> None:
        self.graphs.clear()
        if self._scratch_page is not None:
            self.cache.allocator.decref([self._scratch_page])
            self._scratch_page = None
