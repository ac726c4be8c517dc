"""Shared building blocks: embedding, norms, rotary embedding, attention, gated MLP."""
from __future__ import annotations

import math

import torch

from .. import ops
from ..batch import ForwardBatch
from ..config import RopeConfig
from .base import LoadContext, Module
from .linear import Linear


class Embedding(Module):
    """Token embedding table [vocab, hidden]; ``scale`` multiplies the output (Gemma: sqrt(hidden))."""

    def __init__(self, key: str, vocab_size: int, hidden_size: int, scale: float | None = None):
        self.key, self.vocab_size, self.hidden_size, self.scale = key, vocab_size, hidden_size, scale
        self.weight: torch.Tensor | None = None

    def load(self, ctx: LoadContext) -> None:
        self.weight = ctx.store.get(
            f"{self.key}.weight", shape=(self.vocab_size, self.hidden_size), dtype=ctx.dtype, device=ctx.device
        )

    def unload(self) -> None:
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.weight[ids]
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        return x


class RMSNorm(Module):
    """RMSNorm over the last dim; ``unit_offset`` means the stored weight is w - 1 (Gemma)."""

    def __init__(self, key: str, dim: int, eps: float, unit_offset: bool = False, has_weight: bool = True):
        self.key, self.dim, self.eps, self.unit_offset, self.has_weight = key, dim, eps, unit_offset, has_weight
        self.weight: torch.Tensor | None = None

    def load(self, ctx: LoadContext) -> None:
        if self.has_weight:
            self.weight = ctx.store.get(f"{self.key}.weight", shape=(self.dim,), dtype=ctx.dtype, device=ctx.device)

    def unload(self) -> None:
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)


class LayerNorm(Module):
    def __init__(self, key: str, dim: int, eps: float, bias: bool = True):
        self.key, self.dim, self.eps, self.has_bias = key, dim, eps, bias
        self.weight = self.bias = None

    def load(self, ctx: LoadContext) -> None:
        self.weight = ctx.store.get(f"{self.key}.weight", shape=(self.dim,), dtype=ctx.dtype, device=ctx.device)
        if self.has_bias:
            self.bias = ctx.store.get(f"{self.key}.bias", shape=(self.dim,), dtype=ctx.dtype, device=ctx.device)

    def unload(self) -> None:
        self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class RotaryEmbedding:
    """cos/sin tables for one RoPE configuration, grown on demand and shared by all layers using it."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, interleaved: bool = False):
        self.rope, self.head_dim, self.max_pos, self.interleaved = rope, head_dim, max_position_embeddings, interleaved
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self._static = rope.type not in ("dynamic", "longrope")
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, length: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        variant = None if self._static else self._variant(seq_len)
        key = (variant, device)
        cached = self._tables.get(key)
        if cached is not None and cached[0].shape[0] >= length:
            return cached
        size = max(length, 256, 2 * (cached[0].shape[0] if cached else 0))
        inv, scale = self.rope.inv_freq(self.head_dim, self.max_pos, seq_len=seq_len)
        freqs = torch.outer(torch.arange(size, dtype=torch.float32), inv)
        table = ((freqs.cos() * scale).to(device), (freqs.sin() * scale).to(device))
        self._tables[key] = table
        return table

    def _variant(self, seq_len: int):
        if self.rope.type == "dynamic":
            return seq_len if seq_len > self.max_pos else None
        omax = self.rope.original_max_position_embeddings or self.max_pos
        return seq_len > omax  # longrope: long or short factors

    def cos_sin(self, positions: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._table(max_seq_len, max_seq_len, positions.device)
        return cos[positions], sin[positions]


class Attention(Module):
    """Multi-head attention with GQA, RoPE, optional QK-norm, sliding window, softcap and sinks."""

    def __init__(
        self,
        key: str,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RotaryEmbedding | None,
        qkv_bias: bool | None = False,
        o_bias: bool | None = False,
        qk_norm_eps: float | None = None,
        sliding_window: int = 0,
        softcap: float = 0.0,
        scale: float | None = None,
    ):
        self.key, self.layer_idx = key, layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(f"{key}.q_proj", hidden_size, num_heads * head_dim, qkv_bias)
        self.k_proj = Linear(f"{key}.k_proj", hidden_size, num_kv_heads * head_dim, qkv_bias)
        self.v_proj = Linear(f"{key}.v_proj", hidden_size, num_kv_heads * head_dim, qkv_bias)
        self.o_proj = Linear(f"{key}.o_proj", num_heads * head_dim, hidden_size, o_bias)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(f"{key}.q_norm", head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(f"{key}.k_norm", head_dim, qk_norm_eps)
        self.rope = rope
        self.sliding_window, self.softcap = sliding_window, softcap
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)

    def kv_shape(self) -> tuple[int, int, int]:
        return self.num_kv_heads, self.head_dim, self.head_dim

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(batch.positions, batch.max_seq_len)
            q = ops.rotary_embedding(q, cos, sin, self.rope.interleaved)
            k = ops.rotary_embedding(k, cos, sin, self.rope.interleaved)
        if batch.cache is None:
            o = ops.attention_varlen(q, k, v, batch.cu_seqlens, self.scale, self.sliding_window, self.softcap)
        else:
            layer = batch.cache.layers[self.layer_idx]
            layer.store(k, v, batch.slots)
            o = layer.attend(q, batch, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class GatedMLP(Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, key: str, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool | None = False):
        self.key, self.activation = key, activation
        self.gate_proj = Linear(f"{key}.gate_proj", hidden_size, intermediate_size, bias)
        self.up_proj = Linear(f"{key}.up_proj", hidden_size, intermediate_size, bias)
        self.down_proj = Linear(f"{key}.down_proj", intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        return self.down_proj(ops.gated_activation(self.gate_proj(x), self.up_proj(x), self.activation))
