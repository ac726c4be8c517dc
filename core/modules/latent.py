"""Multi-head latent attention (MLA, DeepSeek V2/V3, Kimi K2, GLM 5), dense or with DSA sparse selection.

MLA caches one latent per token, not per-head keys and values: the normalised compressed KV
``c`` [kv_lora_rank] and the shared rotary key ``k_pe`` [qk_rope_head_dim]. Attention runs in the
absorbed form: the per-head key up-projection is folded into the query (q_nope W_uk) and the value
up-projection is applied after attention, so every head attends to the same single-"head" latent,
MQA-style. The paged cache therefore holds K = [c | k_pe] and V = c for one KV head, and the shared
paged-attention op serves prefill and decode unchanged.

:class:`SparseLatentAttention` adds DeepSeek Sparse Attention: a :class:`SparseIndexer` picks the
``index_topk`` cached tokens each query attends to (its keys kept in the cache beside the latent,
:class:`~trellm.cache.indexed.ExtraRowsKVCacheLayer`), or a layer reuses the selection of the last layer
that ran an indexer (GLM 5's shared layers). The indexer may score pools of tokens instead of tokens
(GLM 5.3-Flash): a pool's key is folded once, by the forward pass that completes the pool, and cached in the
layer's entry pages beside its tokens' rows. The attention may have no RoPE part at all (``qk_rope_head_dim``
0, GLM 5.3-Flash).
"""
from __future__ import annotations

import math

import torch

from .. import ops
from ..batch import ForwardBatch
from ..cache.indexed import (ExtraRowsKVCacheLayer, WindowEntries, completed_windows, require_dense_pages, window_entry_pages,
                             window_rows)
from ..config import DecoderConfig, config_int
from ..ops.sparse import sparse_index_topk, sparse_paged_attention, varlen_as_pages
from .base import LoadContext, Module
from .layers import Attention, LayerNorm, RMSNorm, RotaryEmbedding
from .linear import Linear, LinearGroup


def _yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


class LatentAttention(Attention):
    """Multi-head latent attention; an :class:`Attention` to the cache (``kv_shape`` = one latent head).
    ``rope`` None: NoPE (no rotary part, ``qk_rope_head_dim`` 0); ``norm_eps``: the q / kv latent RMSNorms'."""

    def __init__(self, key: str, layer_idx: int, cfg: DecoderConfig, rope: RotaryEmbedding | None, interleaved: bool,
                 norm_eps: float = 1e-6):
        x = cfg.extra
        self.key, self.layer_idx, self.rope, self.interleaved = key, layer_idx, rope, interleaved
        self.num_heads = self.num_kv_heads = cfg.num_attention_heads
        self.q_lora_rank = x.get("q_lora_rank")
        self.kv_lora_rank = config_int(x, "kv_lora_rank")
        self.nope_dim, self.rope_dim = config_int(x, "qk_nope_head_dim"), config_int(x, "qk_rope_head_dim")
        self.v_dim = config_int(x, "v_head_dim")
        self.head_dim = self.nope_dim + self.rope_dim
        self.sliding_window, self.softcap = 0, 0.0
        h, hidden, bias = self.num_heads, cfg.hidden_size, cfg.attention_bias
        if self.q_lora_rank:
            self.q_a_proj = Linear(f"{key}.q_a_proj", hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(f"{key}.q_a_layernorm", self.q_lora_rank, norm_eps)
            self.q_b_proj = Linear(f"{key}.q_b_proj", self.q_lora_rank, h * self.head_dim)
        else:
            self.q_proj = Linear(f"{key}.q_proj", hidden, h * self.head_dim)
        self.kv_a_proj_with_mqa = Linear(f"{key}.kv_a_proj_with_mqa", hidden, self.kv_lora_rank + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(f"{key}.kv_a_layernorm", self.kv_lora_rank, norm_eps)
        self.kv_b_proj = Linear(f"{key}.kv_b_proj", self.kv_lora_rank, h * (self.nope_dim + self.v_dim))
        # the projections of x: one kernel launch where the weights format groups them
        self.x_proj = LinearGroup(*self.x_projections())
        self.o_proj = Linear(f"{key}.o_proj", h * self.v_dim, hidden, bias)
        self.scale = self.head_dim**-0.5
        rp = cfg.rope
        if rp.type != "default" and rp.mscale_all_dim:
            self.scale *= _yarn_mscale(rp.factor, rp.mscale_all_dim) ** 2
        self.w_uk = self.w_uv = None

    def x_projections(self) -> list[Linear]:
        """The projections of the layer input, grouped into one (a subclass adds its own)."""
        return [self.q_a_proj if self.q_lora_rank else self.q_proj, self.kv_a_proj_with_mqa]

    def kv_shape(self) -> tuple[int, int, int]:
        return 1, self.kv_lora_rank + self.rope_dim, self.kv_lora_rank

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        w = self.kv_b_proj.impl.dense_weight().to(ctx.dtype).view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope_dim].contiguous()  # [H, nope, r]
        self.w_uv = w[:, self.nope_dim :].contiguous()  # [H, v, r]

    def unload(self) -> None:
        super().unload()
        self.w_uk = self.w_uv = None

    def attention(self, x, batch: ForwardBatch) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        q, kv, *rest = ops.project(x, self.x_proj.weights())
        if self.q_lora_rank:
            q_resid = self.q_a_layernorm.forward(q)
            q = self.q_b_proj(q_resid)
        else:
            q_resid = None
        q_nope, q_pe = q.view(t, h, self.head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm.forward(c)
        cos_sin, k_pe = None, k_pe[:, None]
        if self.rope is not None:
            cos_sin = self.rope.cos_sin(batch.positions, batch.max_seq_len)
            q_pe = ops.rotary_embedding(q_pe, *cos_sin, self.interleaved)
            k_pe = ops.rotary_embedding(k_pe, *cos_sin, self.interleaved)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)
        q = torch.cat([q_latent, q_pe], dim=-1)
        k = torch.cat([c[:, None], k_pe], dim=-1)
        o = self.attend_latent(q, k, c[:, None], batch, cos_sin, q_resid, rest, x)
        o = torch.einsum("thr,hvr->thv", o, self.w_uv)
        return o.reshape(t, h * self.v_dim)

    def attend_latent(self, q, k, v, batch: ForwardBatch, cos_sin, q_resid, x_rest, x) -> torch.Tensor:
        """Attention over the latent keys/values (stored in the cache when there is one): [T, H, kv_lora_rank].
        ``q_resid`` (the normed query latent), ``x_rest`` (the subclass's projections of x) and the layer input
        ``x`` are for a subclass; ``cos_sin`` is None without RoPE."""
        if batch.cache is None:
            return ops.attention_varlen(q, k, v, batch.cu_seqlens, self.scale)
        layer = batch.cache.layers[self.layer_idx]
        layer.store(k, v, batch.slots)
        return layer.attend(q, batch, self.scale)


class SparseIndexer(Module):
    """The DSA lightning indexer: ``heads`` small query heads (from the query latent, ``wq_b``) against one key per
    token (``k_norm(wk(x))``, a LayerNorm with bias), RoPE on the first ``rope_dim`` dims of both (none when the
    attention has no RoPE), heads weighted per token by ``weights_proj(x) / sqrt(heads)``; keeps the ``topk`` best
    tokens (:func:`trellm.ops.sparse.sparse_index_topk`).

    ``pool`` > 1 (GLM 5.3-Flash): it scores pools of ``pool`` tokens instead. A pool's key is its tokens' keys
    softmax-weighted per channel by gate logits (``index_kpool_compress_gate`` x, plus the in-pool position bias
    ``index_kpool_compress_ape``); a query keeps the ``topk / pool`` best pools it has seen whole and, with
    ``pool_tail``, the tokens of its own incomplete pool."""

    def __init__(self, key: str, hidden_size: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, interleaved: bool,
                 pool: int = 1, pool_tail: bool = True):
        if pool < 1 or topk % pool:
            raise ValueError(f"{key}: top-k {topk} must be a multiple of the pool size {pool} >= 1")
        self.key, self.heads, self.head_dim, self.topk, self.interleaved = key, heads, head_dim, topk, interleaved
        self.hidden_size, self.pool, self.pool_tail = hidden_size, pool, pool_tail
        self.wq_b = Linear(f"{key}.wq_b", q_lora_rank, heads * head_dim)
        self.wk = Linear(f"{key}.wk", hidden_size, head_dim)
        self.k_norm = LayerNorm(f"{key}.k_norm", head_dim, 1e-6)
        self.weights_proj = Linear(f"{key}.weights_proj", hidden_size, heads)
        self.pool_bias = self.pool_gate = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        if self.pool > 1:
            get = lambda name, shape: ctx.store.get(f"{self.key}.{name}", shape=shape, dtype=ctx.dtype, device=ctx.device)  # noqa: E731
            self.pool_bias = get("index_kpool_compress_ape", (self.pool, self.head_dim))
            self.pool_gate = get("index_kpool_compress_gate", (self.head_dim, self.hidden_size))

    def unload(self) -> None:
        super().unload()
        self.pool_bias = self.pool_gate = None

    @property
    def row_width(self) -> int:
        """Values cached per token: its key, and when pooling its gate logits."""
        return self.head_dim * (2 if self.pool > 1 else 1)

    def keys(self, wk_x: torch.Tensor, cos_sin, x: torch.Tensor) -> torch.Tensor:
        """Each token's cached row [T, row_width] from its ``wk`` projection (and the layer input ``x``)."""
        k = self.k_norm.forward(wk_x)
        if cos_sin is not None:
            k = ops.rotary_embedding(k[:, None], *cos_sin, self.interleaved)[:, 0]
        return k if self.pool == 1 else torch.cat([k, x @ self.pool_gate.t()], dim=-1)

    def entries(self) -> list[WindowEntries]:
        """The per-pool entries a pooling indexer caches: each complete pool's key, float32 as it is computed."""
        return [WindowEntries(POOLED_KEYS, self.pool, self.head_dim, torch.float32)] if self.pool > 1 else []

    def select(self, q_resid: torch.Tensor, weights_x: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               batch: ForwardBatch, cos_sin) -> torch.Tensor:
        """[T, topk (+ pool - 1 tail tokens)] positions each query attends to (-1: none), scoring ``keys``: (pages,
        block table, count per sequence) of the tokens' keys, or of the pools' keys when pooling (:meth:`pooled`)."""
        q = self.wq_b(q_resid).view(-1, self.heads, self.head_dim)
        if cos_sin is not None:
            q = ops.rotary_embedding(q, *cos_sin, self.interleaved)
        weights = weights_x.float() * self.heads**-0.5
        scale = self.head_dim**-0.5
        key_pages, table, counts = keys
        if self.pool == 1:
            return sparse_index_topk(q, weights, key_pages, table, batch.cu_seqlens, counts, batch.positions, self.topk, scale)
        chosen = sparse_index_topk(q, weights, key_pages, table, batch.cu_seqlens, counts, batch.positions,
                                   self.topk // self.pool, scale, rate=self.pool)
        return pool_tokens(chosen, self.pool, batch.positions if self.pool_tail else None)

    def pooled(self, rows: torch.Tensor, batch: ForwardBatch, layer_idx: int,
               row_pages: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every complete pool's key as (pages, block table, count per sequence): the pools this batch completes
        are folded from their tokens' rows (``rows`` [T, row_width], this batch's; with a cache, ``row_pages``,
        holding them already) and join the cached ones of layer ``layer_idx``."""
        windows = completed_windows(batch, self.pool, self.pool * self.row_width)
        pool_rows, _ = window_rows(windows, self.pool, rows, batch, row_pages)
        return window_entry_pages(batch, layer_idx, POOLED_KEYS, windows, self.pool_keys(pool_rows))

    def pool_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """The keys [N, head_dim] (float32) of N pools from their tokens' rows [N, pool, row_width]: the keys
        softmax-weighted per channel by their gate logits plus the in-pool position bias."""
        keys, gates = rows.float().unflatten(-1, (2, self.head_dim)).unbind(2)
        return ((gates + self.pool_bias.float()).softmax(dim=1) * keys).sum(1)


POOLED_KEYS = "pooled_keys"


def pool_tokens(chosen: torch.Tensor, pool: int, tail_positions: torch.Tensor | None) -> torch.Tensor:
    """Pool indices [T, k] (-1: none) as the token indices [T, k * pool + pool - 1] they cover, followed by the
    tokens of each query's own incomplete pool (``tail_positions``: the queries' positions; None: no tail)."""
    offsets = torch.arange(pool, device=chosen.device)
    tokens = torch.where(chosen[..., None] >= 0, chosen[..., None] * pool + offsets, -1).flatten(1)
    tail = torch.full((chosen.shape[0], pool - 1), -1, dtype=tokens.dtype, device=chosen.device)
    if tail_positions is not None:
        start = (tail_positions + 1) // pool * pool
        candidates = start[:, None] + offsets[: pool - 1]
        tail = torch.where(candidates <= tail_positions[:, None], candidates, -1)
    return torch.cat([tokens, tail], dim=1)


class SparseLatentAttention(LatentAttention):
    """MLA over the tokens a :class:`SparseIndexer` selects (DeepSeek V3.2, GLM 5). A layer without an indexer
    reuses ``source``'s selection of the same forward pass (the layers run in order, so it is made first)."""

    def __init__(self, key: str, layer_idx: int, cfg: DecoderConfig, rope: RotaryEmbedding | None, interleaved: bool,
                 indexer: SparseIndexer | None, source: "SparseLatentAttention | None" = None, norm_eps: float = 1e-6):
        if (indexer is None) == (source is None):
            raise ValueError(f"{key}: a sparse attention layer runs its own indexer or reuses another's, not both or neither")
        self.indexer, self.source = indexer, source
        super().__init__(key, layer_idx, cfg, rope, interleaved, norm_eps)
        self.selection: torch.Tensor | None = None  # this forward pass's [T, topk], for the layers that reuse it

    def children(self):
        """Not ``source``: it is another layer's, loaded (and counted, and split) there."""
        return (c for c in super().children() if c is not self.source)

    def x_projections(self) -> list[Linear]:
        extra = [self.indexer.wk, self.indexer.weights_proj] if self.indexer is not None else []
        return super().x_projections() + extra

    def cache_layer(self, kv_layer):
        """The K/V layer, with a page pool for the indexer's keys when this layer runs one."""
        if self.indexer is None:
            return require_dense_pages(kv_layer)
        return ExtraRowsKVCacheLayer(kv_layer, self.indexer.row_width, entries=self.indexer.entries())

    def attend_latent(self, q, k, v, batch: ForwardBatch, cos_sin, q_resid, x_rest, x) -> torch.Tensor:
        if batch.cache is None:
            k_pages, table, ctx = varlen_as_pages(k, batch.cu_seqlens)
            v_pages = v.unsqueeze(1)
        else:
            layer = batch.cache.layers[self.layer_idx]
            layer.store(k, v, batch.slots)
            k_pages, v_pages, table, ctx = layer.k_pages, layer.v_pages, batch.block_table, batch.context_lens
        if self.indexer is None:  # the source may sit on another device (a layer split): its selection comes here
            self.selection = self.source.selection.to(k_pages.device)
        else:
            wk_x, weights_x = x_rest
            rows = self.indexer.keys(wk_x, cos_sin, x)
            row_pages = None
            if batch.cache is not None:
                layer.store_rows(rows, batch.slots)
                row_pages = layer.row_pages
            if self.indexer.pool > 1:
                keys = self.indexer.pooled(rows, batch, self.layer_idx, row_pages)
            else:
                keys = (rows.unsqueeze(1), table, ctx) if row_pages is None else (row_pages, table, ctx)
            self.selection = self.indexer.select(q_resid, weights_x, keys, batch, cos_sin)
        return sparse_paged_attention(q, k_pages, v_pages, table, batch.cu_seqlens, ctx, self.selection, self.scale)
