"""CUDA-graph capture of the decode step.

One cffi or torch launch from Python costs ~10-20 µs; a decode step of a 32-layer model makes
hundreds, which costs more than reading its 4-bit weights. So decode steps (every sequence adds
exactly one token) are captured once per padded batch size and replayed. Inputs live in static
buffers (one per size, filled by one host->device copy per step); unused rows of a padded batch
write to a scratch page (and, on a model with recurrent layers, a scratch state slot) and are ignored. The runner
takes that page and slot when it is made, while the cache is still empty: a capture happens lazily,
in the middle of decoding, when running jobs may hold every page, so it must never need a free one.

Speculative verification steps feed each sequence its last token and up to k draft tokens. They are
captured per (padded batch size, width = k + 1): every row holds ``width`` tokens, a row with a shorter
draft is filled up with placeholder tokens after its real ones (causal attention keeps them out of the
real positions' results; their logits rows are never read, and their cache entries lie past the
sequence's length, where rejected draft tokens go too), and a row whose pages end before its last
placeholder borrows the scratch page for it. With ``hidden_states`` every graph also returns the
decoder's hidden rows (before the final norm), which an MTP draft head reads.

Capture needs every op on the path to be free of host syncs (the CUDA kernels are); when capture
fails the runner falls back to eager execution and says so once.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

from .batch import ForwardBatch, StepBuffers
from .cache import CacheFullError
from .cache.recurrent import alloc_state_slot, free_state_slot

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


class GraphRunner:
    """``forward(batch)`` like ``model.forward``, replaying a captured graph for decode batches.

    Each padded batch size has its own :class:`StepBuffers` (fixed address): the graph reads its
    inputs from them. A caller that builds the step straight into them (:meth:`staging`, then
    :meth:`replay`) pays one host->device copy per step; ``forward(batch)`` copies a batch built
    elsewhere into them field by field.
    """

    def __init__(self, model, cache, batch_sizes=DEFAULT_BATCH_SIZES, max_context: int | None = None,
                 hidden_states: bool = False, max_width: int = 1):
        self.model, self.cache = model, cache
        self.max_width = max_width  # tokens per row of the widest verification graph (1 + draft tokens)
        self.hidden_states = hidden_states  # each graph returns (hidden rows before the final norm, logits)
        self.device = cache.device
        # a tensor-parallel model sends each step's inputs to its other ranks: no graph can hold that
        self.enabled = self.device.type == "cuda" and getattr(model, "capturable", True)
        self.batch_sizes = sorted(batch_sizes)
        self.page_size = cache.page_size
        self.max_pages = cache.pages_for(max_context) if max_context else cache.num_pages
        # (padded batch size, tokens per row) -> (graph, its static inputs, its outputs)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, ForwardBatch, Any]] = {}
        self.buffers: dict[tuple[int, int], StepBuffers] = {}
        self._failed: set[tuple[int, int]] = set()
        self.pool = None
        self._logits: torch.Tensor | None = None  # every graph's logits rows (see _shared_logits)
        self._scratch_page: int | None = self._reserve_scratch_page()
        self.state_slots = bool(cache.state_layers())  # the step reads each sequence's recurrent-state slot
        self._scratch_slot: int | None = self._reserve_scratch_slot() if self.state_slots else None
        self._lora_version = self._lora_now()

    def _lora_now(self) -> int | None:
        """The model's LoRA adapter set version (None: no adapters): graphs captured under another one
        hold stale adapter routes and factor addresses."""
        lora = getattr(getattr(self.model, "language", self.model), "lora", None)
        return None if lora is None else lora.version

    def _reserve_scratch_page(self) -> int | None:
        """The page every padding row writes its KV to, taken (evicting a prefix-cached page if need be)
        now rather than at the first capture. None, and no graphs, when the cache has no page to spare."""
        try:
            return self.cache.prefix_cache.alloc(1)[0]
        except CacheFullError as e:
            if self.enabled:
                warnings.warn(f"trellm: no cache page left for the CUDA graphs' scratch page, decoding eagerly ({e})")
            self.enabled = False
            return None

    def _reserve_scratch_slot(self) -> int | None:
        """The recurrent-state slot every padding row runs in (None, and no graphs, when none is free)."""
        try:
            return alloc_state_slot(self.cache)
        except CacheFullError as e:
            if self.enabled:
                warnings.warn(f"trellm: no recurrent-state slot left for the CUDA graphs' padding rows, decoding eagerly ({e})")
            self.enabled = False
            return None

    def _is_decode(self, batch: ForwardBatch) -> bool:
        return (
            self.enabled
            and batch.cache is self.cache
            and batch.input_embeds is None
            and batch.num_tokens == batch.num_seqs
            and batch.num_seqs <= self.batch_sizes[-1]
            and batch.block_table.shape[1] <= self.max_pages
            and (batch.state_slots is not None) == self.state_slots
        )

    def _padding_batch(self, size: int, width: int = 1) -> ForwardBatch:
        """The graph's static inputs: ``size`` padding rows of ``width`` tokens each (written to the scratch page)."""
        key = (size, width)
        if key not in self.buffers:
            self.buffers[key] = self._new_buffers(size, width)
        if width == 1:
            return self._build(self.buffers[key], [], [], [], [], size, state_slots=[] if self.state_slots else None)
        states = [] if self.state_slots else None
        return self.stage(size, [], [], [], width=width, state_slots=states, checkpoint_slots=states)

    def _new_buffers(self, size: int, width: int) -> StepBuffers:
        """Fixed-address buffers for the inputs of a step of ``size`` rows of ``width`` tokens."""
        tokens = size * width
        # ids, positions, slots, logits rows, lora slots (int64, per token), state slots, state checkpoints (per
        # row and token) + table, cu, ctx, cached (int32); each field 16-byte aligned
        need = 6 * (tokens + 2) + size * width + (size * self.max_pages + 3 * size + 16) // 2 + 8
        return StepBuffers(self.device, capacity=need, growable=False)

    def _build(self, buffers: StepBuffers, feeds, cached_lens, page_rows, logits_rows, size: int,
               lora_slots: Sequence[int] | None = None, state_slots: Sequence[int] | None = None,
               state_checkpoints: Sequence[Sequence[int]] | None = None) -> ForwardBatch:
        if lora_slots is None and self._lora_version is not None:  # a model with adapters: the graph reads the slots
            lora_slots = [-1] * len(feeds)
        return buffers.build(feeds, cached_lens, page_rows, self.cache, logits_rows, state_slots=state_slots, pad_to=size,
                             table_width=self.max_pages, pad_page=self._scratch_page,
                             max_seq_len=self.max_pages * self.page_size, lora_slots=lora_slots,
                             pad_state_slot=self._scratch_slot or 0, state_checkpoints=state_checkpoints)

    def _step(self, batch: ForwardBatch) -> Any:
        """What a graph runs: the model's forward, and with ``hidden_states`` the hidden rows it came from."""
        if not self.hidden_states:
            return self.model.forward(batch)
        hidden = self.model.hidden_states(batch)
        return hidden, self.model.logits_from_hidden(hidden, batch)

    def _record(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        """``run`` (a step over static inputs) captured as a CUDA graph: (the graph, the outputs it writes)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy tables, kernel library loading, autotuning
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # on this device's stream: torch's default capture stream is made once, on whichever device was current
        # (a thread's is cuda:0), and its synchronize is the current device's
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = run()
        self.pool = graph.pool()
        return graph, out

    def _shared_logits(self, rows: int) -> torch.Tensor | None:
        """The first ``rows`` of one float32 [largest batch x max_width, vocab] buffer that every graph writes its
        logits to. Only one graph's output is live at a time (each is consumed before the next replay, as a
        replay of the same graph overwrites it anyway), and each graph holding its own would cost the sum over
        batch sizes and widths: ~1.9 GB at vocab 248k with batches up to 64 and 4 draft tokens, 0.3 GB shared.
        None (each graph keeps its own) when the model's head has no ``out_features`` or the rows exceed it."""
        if self._logits is None:
            head = getattr(getattr(self.model, "language", self.model), "lm_head", None)
            vocab = getattr(head, "out_features", None)
            if not isinstance(vocab, int):
                return None
            self._logits = torch.empty(self.batch_sizes[-1] * self.max_width, vocab, dtype=torch.float32, device=self.device)
        return self._logits[:rows] if rows <= self._logits.shape[0] else None

    def _capture(self, size: int, width: int = 1):
        batch = self._padding_batch(size, width)
        batch.logits_out = self._shared_logits(size * width)
        graph, out = self._record(lambda: self._step(batch))
        return graph, batch, out

    def fits(self, page_rows: Sequence[Sequence[int]], width: int = 1) -> bool:
        """Whether a step with these page lists fits the graphs' block table (a verification row may borrow
        the scratch page for its placeholder tokens, so it needs one column more)."""
        return max(map(len, page_rows)) + (width > 1) <= self.max_pages and width <= self.page_size

    def graph_size(self, num_seqs: int, width: int = 1) -> int | None:
        """The padded batch size whose graph runs a step of ``num_seqs`` sequences feeding ``width`` tokens each
        (1: a decode step; k + 1: a verification of k draft tokens), captured now if it is not yet; None when
        that step must run eagerly (no graphs here, too many sequences, capture failed)."""
        if not self.enabled or num_seqs > self.batch_sizes[-1]:
            return None
        if self._lora_now() != self._lora_version:  # adapters loaded or unloaded since these were captured
            self.graphs.clear()
            self.buffers.clear()
            self._failed.clear()
            self._lora_version = self._lora_now()
        size = next(b for b in self.batch_sizes if b >= num_seqs)
        key = (size, width)
        if key in self._failed:
            return None
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(size, width)
            except Exception as e:  # an op on the path is not capturable: run eagerly
                self._failed.add(key)
                # e.g. an op that reads device values on the host: the reference paged attention (head
                # sizes the CUDA kernel lacks) or the quantized KV cache's page gather
                what = f"batch {size}" if width == 1 else f"batch {size} verifying {width - 1} draft tokens"
                warnings.warn(f"trellm: CUDA graph capture failed for {what}, running it eagerly ({e})")
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return None
        return size

    def stage(self, size: int, feeds: Sequence[Sequence[int]], cached_lens: Sequence[int],
              page_rows: Sequence[Sequence[int]], lora_slots: Sequence[int] | None = None,
              state_slots: Sequence[int] | None = None, width: int = 1,
              checkpoint_slots: Sequence[Sequence[int]] | None = None) -> ForwardBatch:
        """Write one step into graph ``(size, width)``'s inputs (one host->device copy): each sequence's fed
        tokens (one, or at most ``width`` for a verification), then placeholder tokens and padding rows.
        ``checkpoint_slots`` (a verification on a model with recurrent layers): per sequence, ``width - 1``
        slots that receive its state after each of its first ``width - 1`` tokens (see ``trellm.modules.recurrent.stepwise``)."""
        if width == 1:
            return self._build(self.buffers[size, 1], feeds, cached_lens, page_rows, range(len(feeds)), size, lora_slots,
                               state_slots)
        # padding rows of ``width`` tokens are written here (StepBuffers pads with one-token rows)
        pad, scratch = size - len(feeds), self._scratch_page
        rows = [list(f) + [0] * (width - len(f)) for f in feeds] + [[0] * width] * pad
        pages = [p if len(p) * self.page_size >= c + width else [*p, scratch] for p, c in zip(page_rows, cached_lens)]
        checkpoints = None
        if state_slots is not None:
            state_slots = [*state_slots, *[self._scratch_slot] * pad]
            checkpoints = [*checkpoint_slots, *[[self._scratch_slot] * (width - 1)] * pad]
        batch = self._build(self.buffers[size, width], rows, [*cached_lens, *[0] * pad], pages + [[scratch]] * pad, None,
                            size, None if lora_slots is None else [*lora_slots, *[-1] * pad], state_slots, checkpoints)
        batch.tokens_per_seq = width
        return batch

    def replay(self, size: int, num_seqs: int, width: int = 1) -> Any:
        """Replay graph ``(size, width)`` on what :meth:`stage` wrote; the outputs of the first ``num_seqs`` rows
        (``width`` token rows each): logits, or (hidden rows, logits) with ``hidden_states``."""
        graph, _, out = self.graphs[size, width]
        graph.replay()
        rows = num_seqs * width
        return tuple(t[:rows] for t in out) if self.hidden_states else out[:rows]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if not self._is_decode(batch):
            return self.model.forward(batch)
        n = batch.num_seqs
        size = self.graph_size(n)
        if size is None:
            return self.model.forward(batch)
        _, s, _ = self.graphs[size, 1]
        width = batch.block_table.shape[1]
        s.input_ids[:n].copy_(batch.input_ids)
        s.positions[:n].copy_(batch.positions)
        s.block_table[:n, :width].copy_(batch.block_table)
        s.block_table[:n, width:].fill_(self._scratch_page)
        s.context_lens[:n].copy_(batch.context_lens)
        s.slots[:n].copy_(batch.slots)
        if batch.cached_lens is not None:
            s.cached_lens[:n].copy_(batch.cached_lens)
        if s.lora_slots is not None:
            if batch.lora_slots is not None:
                s.lora_slots[:n].copy_(batch.lora_slots)
            else:
                s.lora_slots[:n].fill_(-1)
            s.lora_slots[n:].fill_(-1)
        if s.state_slots is not None:
            s.state_slots[:n].copy_(batch.state_slots)
            s.state_slots[n:].fill_(self._scratch_slot)
        if n < size:  # padding rows: one token at the scratch page
            s.block_table[n:].fill_(self._scratch_page)
            s.context_lens[n:].fill_(1)
            s.cached_lens[n:].zero_()
            s.slots[n:].fill_(self._scratch_page * self.page_size)
            s.positions[n:].zero_()
        rows = self.replay(size, n)
        return rows if batch.logits_indices is None or batch.logits_indices.numel() == n else rows[batch.logits_indices]

    def close(self) -> None:
        """Drop the graphs and give the scratch page back; later decode steps run eagerly."""
        self.enabled = False
        self.graphs.clear()
        self.buffers.clear()
        if self._scratch_page is not None:
            self.cache.allocator.decref([self._scratch_page])
            self._scratch_page = None
        free_state_slot(self.cache, self._scratch_slot)
        self._scratch_slot = None
