"""Compressed attention (DeepSeek V4): sliding-window attention over one shared K = V head, plus long-range
entries that each fold a window of ``rate`` tokens into one (:func:`trellm.ops.compressed.fold_windows`).

Three layer kinds: ``sliding_attention`` (the window only), ``heavily_compressed_attention`` (HCA: every
entry the query has passed, non-overlapping windows) and ``compressed_sparse_attention`` (CSA: overlapping
windows, of which a lightning indexer, :class:`CompressedIndexer`, keeps the top k per query). RoPE
(GPT-J pairs) rotates the trailing ``rope_dim`` dims of queries, keys and entries (an entry at its window's
first position), and is undone on the attention output. Learned per-head sinks; a grouped low-rank output
projection.

The paged cache keeps, per token, the sliding key and the compressor's (and indexer compressor's) inputs,
and per window the entries folded from them (:class:`~trellm.cache.indexed.ExtraRowsKVCacheLayer`): a
forward pass folds only its new tokens' windows (:func:`~trellm.cache.indexed.completed_windows`; CSA's overlap
reads the window before too), so a decode step's work and reads do not grow with the context but for the
entries attention reads (all of them for HCA; CSA reads the indexer's keys and only the entries it picks). Everything lives in pages under the
block table: prefix pages stay shareable, and no per-sequence state outlives the pages.
"""
from __future__ import annotations

import torch

from .. import ops
from ..batch import ForwardBatch
from ..cache.indexed import (CompletedWindows, ExtraRowsKVCacheLayer, WindowEntries, completed_windows, window_entry_pages,
                             window_rows)
from ..ops.compressed import compressed_attention, fold_windows
from ..ops.sparse import sparse_index_topk, varlen_as_pages
from .base import LoadContext, Module
from .layers import RMSNorm, RotaryEmbedding
from .linear import Linear

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (GPT-J pairs) of the last ``2 * cos.shape[-1]`` dims of x [T, H, D]; the leading dims pass through."""
    r = 2 * cos.shape[-1]
    return torch.cat([x[..., :-r], ops.rotary_embedding(x[..., -r:], cos, sin, True)], dim=-1)


class WindowCompressor(Module):
    """Per-token ``wkv`` / ``wgate`` projections (width ``dim``, doubled when ``overlap``), the position bias
    ``ape`` [rate, width] and the entries' RMSNorm ``norm`` (hub names under ``{key}``)."""

    def __init__(self, key: str, hidden_size: int, dim: int, rate: int, overlap: bool, eps: float, rope: RotaryEmbedding):
        self.key, self.dim, self.rate, self.overlap, self.rope = key, dim, rate, overlap, rope
        self.width = 2 * dim if overlap else dim
        self.wkv = Linear(f"{key}.wkv", hidden_size, self.width)
        self.wgate = Linear(f"{key}.wgate", hidden_size, self.width)
        self.norm = RMSNorm(f"{key}.norm", dim, eps)
        self.ape = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        self.ape = ctx.store.get(f"{self.key}.ape", shape=(self.rate, self.width), dtype=torch.float32, device=ctx.device)

    def unload(self) -> None:
        super().unload()
        self.ape = None

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache keeps per token: [T, 2 * width] (kv | gate)."""
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    @property
    def span(self) -> int:
        """Tokens an entry reads: its window, and with ``overlap`` the window before."""
        return 2 * self.rate if self.overlap else self.rate

    def entries(self, rows: torch.Tensor, valid: torch.Tensor, windows: CompletedWindows, max_seq_len: int) -> torch.Tensor:
        """The entries [N, dim] of ``windows`` from their span's rows [N, span, 2 * width] (``valid`` [N, span]:
        tokens before the sequence start read as nothing), each rotated at its window's first position."""
        kv, gate = rows.split(self.width, dim=-1)
        kv, gate = kv.masked_fill(~valid[..., None], 0), gate.masked_fill(~valid[..., None], float("-inf"))
        e = self.norm.forward(fold_windows(kv, gate, self.ape, self.overlap).to(rows.dtype))
        cos, sin = self.rope.cos_sin(windows.window * self.rate, max_seq_len)
        return rope_tail(e[:, None], cos, sin)[:, 0]


class CompressedIndexer(Module):
    """The CSA lightning indexer: its own overlapping :class:`WindowCompressor` of ``head_dim`` keys, ``heads``
    query heads from the query latent (``wq_b``, RoPE on the trailing dims), heads weighted per token by
    ``weights_proj(x) / sqrt(heads)``; keeps the ``topk`` best entries the query has passed."""

    def __init__(self, key: str, hidden_size: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, rate: int,
                 eps: float, rope: RotaryEmbedding):
        self.key, self.heads, self.head_dim, self.topk, self.rate, self.rope = key, heads, head_dim, topk, rate, rope
        self.compressor = WindowCompressor(f"{key}.compressor", hidden_size, head_dim, rate, True, eps, rope)
        self.wq_b = Linear(f"{key}.wq_b", q_lora_rank, heads * head_dim)
        self.weights_proj = Linear(f"{key}.weights_proj", hidden_size, heads)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               batch: ForwardBatch, cos_sin) -> torch.Tensor:
        """[T, topk] entry indices each query attends to (-1: none); ``keys``: the entries' (pages, block table,
        count per sequence), as :func:`~trellm.cache.indexed.window_entry_pages` gives them."""
        q = rope_tail(self.wq_b(q_resid).view(-1, self.heads, self.head_dim), *cos_sin)
        weights = self.weights_proj(x).float() * self.heads**-0.5
        key_pages, table, key_counts = keys
        return sparse_index_topk(q, weights, key_pages, table, batch.cu_seqlens, key_counts, batch.positions,
                                 self.topk, self.head_dim**-0.5, self.rate)


class CompressedAttention(Module):
    """One DeepSeek V4 attention layer of ``kind`` (SLIDING, CSA or HCA) under ``key`` (hub names: ``wq_a``,
    ``q_norm``, ``wq_b``, ``wkv``, ``norm``, ``wo_a``, ``wo_b``, ``attn_sink``, ``compressor.*``, ``indexer.*``).
    ``rope`` is the layer's table: the main one for sliding layers, the compressed one otherwise."""

    def __init__(self, key: str, layer_idx: int, kind: str, hidden_size: int, heads: int, head_dim: int, q_lora_rank: int,
                 o_groups: int, o_lora_rank: int, sliding_window: int, rate: int, eps: float, rope: RotaryEmbedding,
                 indexer: CompressedIndexer | None = None):
        if kind not in (SLIDING, CSA, HCA):
            raise ValueError(f"{key}: unknown attention kind {kind!r}; known: {SLIDING}, {CSA}, {HCA}")
        if (kind == CSA) != (indexer is not None):
            raise ValueError(f"{key}: a {kind} layer {'needs' if kind == CSA else 'has no'} indexer")
        self.key, self.layer_idx, self.kind, self.rope, self.indexer = key, layer_idx, kind, rope, indexer
        self.heads, self.head_dim, self.o_groups, self.eps = heads, head_dim, o_groups, eps
        self.sliding_window, self.rate, self.scale = sliding_window, rate, head_dim**-0.5
        self.wq_a = Linear(f"{key}.wq_a", hidden_size, q_lora_rank)
        self.q_norm = RMSNorm(f"{key}.q_norm", q_lora_rank, eps)
        self.wq_b = Linear(f"{key}.wq_b", q_lora_rank, heads * head_dim)
        self.wkv = Linear(f"{key}.wkv", hidden_size, head_dim)
        self.kv_norm = RMSNorm(f"{key}.norm", head_dim, eps)
        self.wo_a = Linear(f"{key}.wo_a", heads * head_dim // o_groups, o_groups * o_lora_rank)
        self.wo_b = Linear(f"{key}.wo_b", o_groups * o_lora_rank, hidden_size)
        self.compressor = None if kind == SLIDING else WindowCompressor(f"{key}.compressor", hidden_size, head_dim, rate, kind == CSA, eps, rope)
        self.sinks = self.wo_a_groups = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        self.sinks = ctx.store.get(f"{self.key}.attn_sink", shape=(self.heads,), dtype=torch.float32, device=ctx.device)
        w = self.wo_a.impl.dense_weight().to(ctx.dtype)
        self.wo_a_groups = w.view(self.o_groups, -1, w.shape[-1])  # [groups, o_lora_rank, heads * head_dim / groups]

    def unload(self) -> None:
        super().unload()
        self.sinks = self.wo_a_groups = None

    def kv_shape(self) -> tuple[int, int, int]:
        return 1, self.head_dim, self.head_dim

    def row_width(self) -> int:
        """Per-token compressor inputs the cache keeps (0 for a sliding layer)."""
        indexer = 0 if self.indexer is None else 2 * self.indexer.compressor.width
        return 0 if self.compressor is None else 2 * self.compressor.width + indexer

    def _compressors(self) -> dict[str, WindowCompressor]:
        """The compressors whose entries this layer caches, by entry name, in the order of their cached rows."""
        named = {} if self.compressor is None else {"entries": self.compressor}
        return named | ({"index_keys": self.indexer.compressor} if self.indexer is not None else {})

    def cache_layer(self, kv_layer):
        if self.compressor is None:
            return kv_layer
        entries = [WindowEntries(name, self.rate, c.dim) for name, c in self._compressors().items()]
        return ExtraRowsKVCacheLayer(kv_layer, self.row_width(), entries=entries)

    def _entries(self, x: torch.Tensor, batch: ForwardBatch) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each compressor's entries of every complete window (pages, block table, count per sequence): the
        windows this batch completes are folded from their tokens' rows (stored first, with a cache) and join
        the cached ones."""
        compressors = self._compressors()
        rows = torch.cat([c.rows(x) for c in compressors.values()], dim=-1)
        row_pages = None
        if batch.cache is not None:
            layer = batch.cache.layers[self.layer_idx]
            layer.store_rows(rows, batch.slots)
            row_pages = layer.row_pages
        span = max(c.span for c in compressors.values())
        windows = completed_windows(batch, self.rate, span * rows.shape[-1])
        span_rows, valid = window_rows(windows, span, rows, batch, row_pages)
        out, start = {}, 0
        for name, c in compressors.items():
            width = 2 * c.width
            own = span_rows[:, -c.span:, start:start + width]
            values = c.entries(own, valid[:, -c.span:], windows, batch.max_seq_len) if windows.count else own.new_zeros(0, c.dim)
            out[name] = window_entry_pages(batch, self.layer_idx, name, windows, values)
            start += width
        return out

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = self.rope.cos_sin(batch.positions, batch.max_seq_len)
        q_resid = self.q_norm.forward(self.wq_a(x))
        q = self.wq_b(q_resid).view(t, self.heads, self.head_dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(self.kv_norm.forward(self.wkv(x))[:, None], cos, sin)
        if batch.cache is None:
            k_pages, table, ctx = varlen_as_pages(kv, batch.cu_seqlens)
        else:
            layer = batch.cache.layers[self.layer_idx]
            layer.store(kv, kv, batch.slots)
            k_pages, table, ctx = layer.k_pages, batch.block_table, batch.context_lens
        entry_pages = entry_table = selection = None
        if self.compressor is not None:
            entries = self._entries(x, batch)
            entry_pages, entry_table, _ = entries["entries"]
            if self.indexer is not None:
                selection = self.indexer.select(x, q_resid, entries["index_keys"], batch, (cos, sin))
        o = compressed_attention(q, k_pages, table, batch.cu_seqlens, ctx, entry_pages, entry_table, self.scale,
                                 self.sliding_window, self.rate, self.sinks, selection)
        o = rope_tail(o, cos, -sin).reshape(t, self.o_groups, -1)
        o = torch.einsum("tgi,goi->tgo", o, self.wo_a_groups).reshape(t, -1)
        return self.wo_b(o)
