"""Compressed attention (DeepSeek V4): sliding-window attention over one shared K = V head, plus long-range
entries that each fold a window of ``rate`` tokens into one (:func:`trellm.ops.compressed.compress_windows`).

Three layer kinds: ``sliding_attention`` (the window only), ``heavily_compressed_attention`` (HCA: every
entry the query has passed, non-overlapping windows) and ``compressed_sparse_attention`` (CSA: overlapping
windows, of which a lightning indexer, :class:`CompressedIndexer`, keeps the top k per query). RoPE
(GPT-J pairs) rotates the trailing ``rope_dim`` dims of queries, keys and entries (an entry at its window's
first position), and is undone on the attention output. Learned per-head sinks; a grouped low-rank output
projection.

The paged cache keeps, per token, the sliding key and the compressor's (and indexer compressor's) inputs,
so a window's entry is rebuilt from its tokens whenever the window is complete
(:class:`~trellm.cache.indexed.ExtraRowsKVCacheLayer`): prefix pages stay shareable, and no per-sequence
state outlives the pages.
"""
from __future__ import annotations

import torch

from .. import ops
from ..batch import ForwardBatch
from ..cache.indexed import ExtraRowsKVCacheLayer
from ..ops.attention import gather_pages
from ..ops.compressed import compress_windows, compressed_attention
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

    def entries(self, rows: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """The entries [n, dim] of one sequence's complete windows from its tokens' rows [S, 2 * width]."""
        kv, gate = rows.split(self.width, dim=-1)
        e = self.norm.forward(compress_windows(kv, gate, self.ape, self.rate, self.overlap).to(rows.dtype))
        positions = torch.arange(e.shape[0], device=e.device) * self.rate
        cos, sin = self.rope.cos_sin(positions, max_seq_len)
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

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, keys: list[torch.Tensor], batch: ForwardBatch, cos_sin) -> torch.Tensor:
        """[T, topk] entry indices each query attends to (-1: none); ``keys[b]``: sequence b's entries."""
        q = rope_tail(self.wq_b(q_resid).view(-1, self.heads, self.head_dim), *cos_sin)
        weights = self.weights_proj(x).float() * self.heads**-0.5
        counts = torch.tensor([0] + [k.shape[0] for k in keys], device=x.device).cumsum(0).to(torch.int32)
        key_pages, table, key_counts = varlen_as_pages(torch.cat(keys), counts)
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

    def cache_layer(self, kv_layer):
        return kv_layer if self.compressor is None else ExtraRowsKVCacheLayer(kv_layer, self.row_width())

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        rows = [self.compressor.rows(x)] + ([self.indexer.compressor.rows(x)] if self.indexer is not None else [])
        return torch.cat(rows, dim=-1)

    def _sequence_rows(self, rows: torch.Tensor, batch: ForwardBatch) -> list[torch.Tensor]:
        """Each sequence's rows from its first token: from the cache (after storing the new ones) or this batch."""
        if batch.cache is None:
            bounds = batch.cu_seqlens.tolist()
            return [rows[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        layer = batch.cache.layers[self.layer_idx]
        layer.store_rows(rows, batch.slots)
        return [gather_pages(layer.row_pages, batch.block_table[b], n) for b, n in enumerate(batch.context_lens.tolist())]

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
        entries, selection = [kv.new_zeros(0, self.head_dim)] * (batch.cu_seqlens.shape[0] - 1), None
        if self.compressor is not None:
            seqs = self._sequence_rows(self._rows(x), batch)
            width = 2 * self.compressor.width
            entries = [self.compressor.entries(r[:, :width], batch.max_seq_len) for r in seqs]
            if self.indexer is not None:
                keys = [self.indexer.compressor.entries(r[:, width:], batch.max_seq_len) for r in seqs]
                selection = self.indexer.select(x, q_resid, keys, batch, (cos, sin))
        o = compressed_attention(q, k_pages, table, batch.cu_seqlens, ctx, entries, self.scale, self.sliding_window,
                                 self.rate, self.sinks, selection)
        o = rope_tail(o, cos, -sin).reshape(t, self.o_groups, -1)
        o = torch.einsum("tgi,goi->tgo", o, self.wo_a_groups).reshape(t, -1)
        return self.wo_b(o)
