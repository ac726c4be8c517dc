"""Shared building blocks: embedding, norms, rotary embedding, attention, gated MLP."""
from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F

from .. import ops
from ..batch import ForwardBatch
from ..cache import KVCacheLayer
from ..config import RopeConfig
from ..errors import WeightError
from ..ops.attention import rotary_qk, rotary_qk_write_kv
from ..ops.dense import activation_fn, xielu
from ..ops.projection import GatedAct, Hidden, Normed, Residual, RopeKV, RowNorm, project
from .base import LoadContext, Module, Sublayer
from .linear import DenseLinear, Linear, LinearGroup


class Embedding(Module):
    """Token embedding table [vocab, hidden]; ``scale`` multiplies the output.

    ``round_scale``: the scale is first rounded to the model dtype (Gemma's sqrt(hidden) is a
    tensor in the model dtype); Granite-style muP multipliers are exact floats (``False``).
    """

    def __init__(self, key: str, vocab_size: int, hidden_size: int, scale: float | None = None, round_scale: bool = True):
        self.key, self.vocab_size, self.hidden_size, self.scale = key, vocab_size, hidden_size, scale
        self.round_scale = round_scale
        self.weight: torch.Tensor | None = None

    def load(self, ctx: LoadContext) -> None:
        self.weight = ctx.tensor(f"{self.key}.weight", shape=(self.vocab_size, self.hidden_size))

    def unload(self) -> None:
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.weight[ids]
        if self.scale is not None:
            x = x * (torch.tensor(self.scale, dtype=x.dtype) if self.round_scale else self.scale)
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

    def row_norm(self, ssq: torch.Tensor | None = None) -> RowNorm:
        """This norm as a projection's pre step (``ssq``: the input's sums of squares, when known)."""
        return RowNorm(ssq, self.weight, self.eps, self.unit_offset)


class LayerNorm(Module):
    """LayerNorm over the last dim; ``bias=False`` for the weight-only kind (Cohere), ``has_weight=False``
    for the parameter-free one (OLMo 1).

    ``unit_offset``: the stored weight is w - 1 (Nemotron's LayerNorm1P); 1 is added at load, in
    the model dtype, as the reference does.
    """

    def __init__(self, key: str, dim: int, eps: float, bias: bool = True, unit_offset: bool = False, has_weight: bool = True):
        self.key, self.dim, self.eps, self.has_bias, self.unit_offset = key, dim, eps, bias, unit_offset
        self.has_weight = has_weight
        self.weight = self.bias = None

    def load(self, ctx: LoadContext) -> None:
        if not self.has_weight:
            return
        self.weight = ctx.store.get(f"{self.key}.weight", shape=(self.dim,), dtype=ctx.dtype, device=ctx.device)
        if self.unit_offset:
            self.weight = self.weight + 1.0
        if self.has_bias:
            self.bias = ctx.store.get(f"{self.key}.bias", shape=(self.dim,), dtype=ctx.dtype, device=ctx.device)

    def unload(self) -> None:
        self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class HeadLayerNorm(Module):
    """Weight-only LayerNorm over each head with its own weight row, ``weight`` [heads, head_dim] (Cohere QK-norm)."""

    def __init__(self, key: str, num_heads: int, head_dim: int, eps: float):
        self.key, self.num_heads, self.head_dim, self.eps = key, num_heads, head_dim, eps
        self.weight: torch.Tensor | None = None

    def load(self, ctx: LoadContext) -> None:
        shape = (self.num_heads, self.head_dim)
        self.weight = ctx.store.get(f"{self.key}.weight", shape=shape, dtype=ctx.dtype, device=ctx.device)

    def unload(self) -> None:
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.layer_norm(x.float(), None, None, self.eps) * self.weight.float()
        return y.to(x.dtype)


NORM_KINDS = ("rms", "layer", "layer_nobias", "layer_noparam")


def make_norm(kind: str, key: str, dim: int, eps: float, unit_offset: bool = False) -> Module:
    """The hidden-state norm a family uses (one of NORM_KINDS); ``unit_offset`` scales by 1 + w."""
    if kind == "rms":
        return RMSNorm(key, dim, eps, unit_offset)
    if kind in ("layer", "layer_nobias", "layer_noparam"):
        return LayerNorm(key, dim, eps, bias=kind == "layer", unit_offset=unit_offset, has_weight=kind != "layer_noparam")
    raise ValueError(f"{key}: unknown norm kind {kind!r}; known: {', '.join(NORM_KINDS)}")


class FusedSliceLinear(Linear):
    """One projection of a fused checkpoint tensor (Phi-3 ``qkv_proj``, ``gate_up_proj``), split at load.

    Loads ``key`` itself when the checkpoint has it (quantized checkpoints store the parts apart);
    otherwise rows ``[start, start + out_features)`` of the dense ``fused_key`` tensor, whose shape
    must be ``[fused_rows, in_features]``. Keeping the parts separate gives every family the same
    module layout for the quantizer, kernels and checkpoints with either spelling.
    """

    def __init__(
        self, key: str, in_features: int, out_features: int, bias: bool | None, fused_key: str, start: int, fused_rows: int
    ):
        super().__init__(key, in_features, out_features, bias)
        self.fused_key, self.start, self.fused_rows = fused_key, start, fused_rows

    def load(self, ctx: LoadContext) -> None:
        store = ctx.store
        if f"{self.key}.weight" in store or any(f.detect(store, self.key) for f in ctx.quant_formats):
            return super().load(ctx)
        name = f"{self.fused_key}.weight"
        if name not in store:
            raise WeightError(f"{store.model_dir}: neither {self.key + '.weight'!r} nor the fused tensor {name!r} is present")
        rows = slice(self.start, self.start + self.out_features)
        weight = store.get(name, shape=(self.fused_rows, self.in_features), dtype=ctx.dtype, device=ctx.device)
        bias = None
        has_bias = self.bias if self.bias is not None else f"{self.fused_key}.bias" in store
        if has_bias:
            bias = store.get(f"{self.fused_key}.bias", shape=(self.fused_rows,), dtype=ctx.dtype, device=ctx.device)[rows].contiguous()
        self.impl = DenseLinear(weight[rows].contiguous(), bias)


def fused_parts(key: str, fused_name: str, names: tuple[str, ...], in_features: int, sizes: tuple[int, ...], bias) -> list[Linear]:
    """``FusedSliceLinear`` parts ``{key}.{name}`` of the fused ``{key}.{fused_name}``, in the order stored."""
    parts, start = [], 0
    for name, size in zip(names, sizes):
        parts.append(FusedSliceLinear(f"{key}.{name}", in_features, size, bias, f"{key}.{fused_name}", start, sum(sizes)))
        start += size
    return parts


class RotaryEmbedding:
    """cos/sin tables for one RoPE configuration, grown on demand and shared by all layers using it."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, interleaved: bool = False):
        self.rope, self.head_dim, self.max_pos, self.interleaved = rope, head_dim, max_position_embeddings, interleaved
        self.rotary_dim = rope.rotary_dim(head_dim)
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
        cos, sin = self.tables(max_seq_len, positions.device)
        return cos[positions], sin[positions]

    def tables(self, max_seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole float32 cos/sin tables [>= max_seq_len, rotary_dim/2] for a batch whose longest sequence
        is ``max_seq_len``: fused RoPE ops look rows up by position themselves (no gather per layer)."""
        return self._table(max_seq_len, max_seq_len, device)


QK_NORM_KINDS = ("head", "full", "layer_head")


class Attention(Sublayer):
    """Multi-head attention with GQA, RoPE, optional QK-norm, sliding window, softcap and sinks.

    ``sinks``: one learned logit per head (``{key}.sinks``) that takes softmax mass but no value (gpt-oss).
    ``values_from_keys``: no v_proj, the values are the key projection before its norm and RoPE; ``v_norm_eps``:
    values RMS-normalised per head without a weight (both Gemma 4).

    ``qk_norm`` says where the QK-norm (enabled by ``qk_norm_eps``) normalises: ``"head"`` RMSNorm
    over each head (Qwen3, Gemma 3), ``"full"`` RMSNorm over the whole q/k projection (Olmo 2/3),
    ``"layer_head"`` LayerNorm with per-head weights (Cohere). ``fused_qkv`` names a fused
    [q; k; v] checkpoint tensor (Phi-3 ``qkv_proj``), split into q_proj/k_proj/v_proj at load.
    """

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
        qk_norm: str = "head",
        qk_norm_unit_offset: bool = False,
        fused_qkv: str | None = None,
        o_proj_name: str = "o_proj",
        clip_qkv: float | None = None,
        sinks: bool = False,
        values_from_keys: bool = False,
        v_norm_eps: float | None = None,
    ):
        self.key, self.layer_idx = key, layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        if fused_qkv:
            self.q_proj, self.k_proj, self.v_proj = fused_parts(
                key, fused_qkv, ("q_proj", "k_proj", "v_proj"), hidden_size, (q_size, kv_size, kv_size), qkv_bias
            )
        else:
            self.q_proj = Linear(f"{key}.q_proj", hidden_size, q_size, qkv_bias)
            self.k_proj = Linear(f"{key}.k_proj", hidden_size, kv_size, qkv_bias)
            self.v_proj = Linear(f"{key}.v_proj", hidden_size, kv_size, qkv_bias)
        self.o_proj = Linear(f"{key}.{o_proj_name}", q_size, hidden_size, o_bias)
        if values_from_keys:
            self.v_proj = None
        self.qkv = LinearGroup(*(p for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None))
        self.v_norm = RMSNorm(f"{key}.v_norm", head_dim, v_norm_eps, has_weight=False) if v_norm_eps is not None else None
        self.q_norm = self.k_norm = None
        self.qk_norm = qk_norm
        if qk_norm_eps is not None:
            if qk_norm == "head":
                self.q_norm = RMSNorm(f"{key}.q_norm", head_dim, qk_norm_eps, qk_norm_unit_offset)
                self.k_norm = RMSNorm(f"{key}.k_norm", head_dim, qk_norm_eps, qk_norm_unit_offset)
            elif qk_norm == "full":
                self.q_norm = RMSNorm(f"{key}.q_norm", q_size, qk_norm_eps, qk_norm_unit_offset)
                self.k_norm = RMSNorm(f"{key}.k_norm", kv_size, qk_norm_eps, qk_norm_unit_offset)
            elif qk_norm == "layer_head":
                self.q_norm = HeadLayerNorm(f"{key}.q_norm", num_heads, head_dim, qk_norm_eps)
                self.k_norm = HeadLayerNorm(f"{key}.k_norm", num_kv_heads, head_dim, qk_norm_eps)
            else:
                raise ValueError(f"{key}: unknown qk_norm {qk_norm!r}; known: {', '.join(QK_NORM_KINDS)}")
        self.rope = rope
        self.clip_qkv = clip_qkv  # OLMo 1 clamps the projections to [-clip, clip]
        self.sliding_window, self.softcap = sliding_window, softcap
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.has_sinks = sinks

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        if self.has_sinks:
            self.sinks = ctx.store.get(f"{self.key}.sinks", shape=(self.num_heads,), dtype=torch.float32, device=ctx.device)

    def unload(self) -> None:
        super().unload()
        self.sinks = None

    has_sinks = False
    sinks: torch.Tensor | None = None

    def kv_shape(self) -> tuple[int, int, int]:
        return self.num_kv_heads, self.head_dim, self.head_dim

    def project_qkv(self, x: torch.Tensor | Normed, head_norm: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D]: projected, QK-normed, not yet rotated.

        ``head_norm=False`` leaves a per-head QK-norm to the caller (the fused RoPE op applies it).
        """
        t = x.shape[0]
        qkv = project(x, self.qkv.weights())
        q, k, v = qkv if self.v_proj is not None else (*qkv, qkv[1].clone())  # a copy: fused RoPE may rotate k in place
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        if self.q_norm is not None and self.qk_norm == "full":
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.v_norm is not None:
            v = self.v_norm.forward(v)
        if head_norm and self.q_norm is not None and self.qk_norm != "full":
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        return q, k, v

    def rotate(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """RoPE of the batch's positions on x [T, heads, D] (x itself without RoPE)."""
        if self.rope is None:
            return x
        cos, sin = self.rope.cos_sin(batch.positions, batch.max_seq_len)
        return ops.rotary_embedding(x, cos, sin, self.rope.interleaved)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Rotate q/k, store k/v in the cache (when there is one) and attend; returns [T, H, D]."""
        q, k = self.rotate(q, batch), self.rotate(k, batch)
        if batch.cache is None:
            return ops.attention_varlen(q, k, v, batch.cu_seqlens, self.scale, self.sliding_window, self.softcap, self.sinks)
        layer = batch.cache.layers[self.layer_idx]
        layer.store(k, v, batch.slots)
        return layer.attend(q, batch, self.scale, self.sliding_window, self.softcap, self.sinks)

    def _fused_rope(self, batch: ForwardBatch) -> bool:
        """Whether q/k can be (head-normed,) rotated and stored in one op: a plain RoPE table, token
        positions, and no QK-norm or a per-head RMSNorm with weights."""
        if not isinstance(self.rope, RotaryEmbedding):
            return False  # no RoPE, or one whose angles are not a plain table's
        if batch.positions.dim() != 1:
            return False
        if self.q_norm is None:
            return True
        return (
            self.qk_norm == "head"
            and isinstance(self.q_norm, RMSNorm)
            and isinstance(self.k_norm, RMSNorm)
            and self.q_norm.weight is not None
            and self.k_norm.weight is not None
            and self.q_norm.eps == self.k_norm.eps
        )

    def _head_norm_args(self) -> dict:
        """The per-head QK-norm arguments of the fused RoPE ops (none without a QK-norm)."""
        if self.q_norm is None:
            return {}
        return {
            "q_norm": self.q_norm.weight, "k_norm": self.k_norm.weight, "norm_eps": self.q_norm.eps,
            "norm_unit_offset": self.q_norm.unit_offset,
        }

    def _rope_kv(self, batch: ForwardBatch) -> RopeKV | None:
        """The q/k/v projection's post step when this layer's math after it is exactly (per-head norm,) RoPE
        from a plain table and a paged-cache write; None otherwise (the caller projects, then rotates)."""
        layer = batch.cache.layers[self.layer_idx] if batch.cache is not None else None
        plain_values = self.v_proj is not None and self.v_norm is None  # the values the projection writes as they are
        if type(layer) is not KVCacheLayer or self.clip_qkv is not None or not plain_values or not self._fused_rope(batch):
            return None
        cos_table, sin_table = self.rope.tables(batch.max_seq_len, batch.positions.device)
        return RopeKV(self.head_dim, cos_table, sin_table, batch.positions, layer.k_pages, layer.v_pages, batch.slots,
                      self.rope.interleaved, **self._head_norm_args())

    def attend_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """:meth:`attend` for q/k not yet head-normed, with QK-norm, RoPE and the KV-page write in one op."""
        cos_table, sin_table = self.rope.tables(batch.max_seq_len, q.device)
        norm = self._head_norm_args()
        layer = batch.cache.layers[self.layer_idx] if batch.cache is not None else None
        if type(layer) is KVCacheLayer:
            q, k = rotary_qk_write_kv(
                q, k, v, cos_table, sin_table, batch.positions, layer.k_pages, layer.v_pages, batch.slots,
                self.rope.interleaved, **norm,
            )
            return layer.attend(q, batch, self.scale, self.sliding_window, self.softcap, self.sinks)
        q, k = rotary_qk(q, k, cos_table, sin_table, batch.positions, self.rope.interleaved, **norm)
        if layer is None:
            return ops.attention_varlen(q, k, v, batch.cu_seqlens, self.scale, self.sliding_window, self.softcap, self.sinks)
        layer.store(k, v, batch.slots)
        return layer.attend(q, batch, self.scale, self.sliding_window, self.softcap, self.sinks)

    def attention(self, x: torch.Tensor | Normed, batch: ForwardBatch) -> torch.Tensor:
        """q/k/v of x [T, hidden], RoPE, the cache and attention: o [T, heads * head_dim], before o_proj."""
        rope_kv = self._rope_kv(batch)
        if rope_kv is not None:
            q, _ = project(x, self.qkv.weights(), post=rope_kv)
            layer = batch.cache.layers[self.layer_idx]
            o = layer.attend(q, batch, self.scale, self.sliding_window, self.softcap, self.sinks)
        elif self._fused_rope(batch):
            o = self.attend_fused(*self.project_qkv(x, head_norm=False), batch)
        else:
            o = self.attend(*self.project_qkv(x), batch)
        return o.reshape(x.shape[0], self.num_heads * self.head_dim)

    def project_out(self, o: torch.Tensor, residual: Hidden | None = None) -> torch.Tensor | Hidden:
        """o_proj of o; with ``residual``, added to it (:class:`~trellm.ops.Residual`)."""
        if residual is None:
            return self.o_proj(o)
        return project(o, self.o_proj.impl, post=Residual(residual.value()))

    def forward(
        self, x: torch.Tensor | Normed, batch: ForwardBatch, residual: Hidden | None = None
    ) -> torch.Tensor | Hidden:
        """Attention of x [T, hidden] (a :class:`~trellm.modules.base.Sublayer`)."""
        return self.project_out(self.attention(x, batch), residual)


GATE_ACTIVATIONS = ("sigmoid", "softplus")


@attrs.frozen
class OutputGate:
    """How an attention scales its output by a gate computed from the layer input: ``o * act(g)``.

    ``act`` is ``"sigmoid"`` (AfMoE, Qwen3-Next) or ``"softplus"`` (Laguna), computed in float32;
    ``per_head``: ``g`` holds one value per head, broadcast over its channels (Laguna), else one per
    channel of ``o``.
    """

    activation: str = attrs.field(default="sigmoid", validator=attrs.validators.in_(GATE_ACTIVATIONS))
    per_head: bool = False

    def width(self, num_heads: int, head_dim: int) -> int:
        """How many gate values a token needs (the gate projection's output size)."""
        return num_heads if self.per_head else num_heads * head_dim

    def apply(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``o`` [T, heads * head_dim] gated by the gate logits ``g`` [T, :meth:`width`]."""
        g = g.float()
        g = (torch.sigmoid(g) if self.activation == "sigmoid" else F.softplus(g)).to(o.dtype)
        if not self.per_head:
            return o * g.reshape(o.shape)
        t, heads = g.shape
        return (o.reshape(t, heads, -1) * g[..., None]).reshape(o.shape)


class OutputGatedAttention(Attention):
    """:class:`Attention` whose output is gated before o_proj by ``{key}.{gate_name}`` of the same input
    (see :class:`OutputGate`); every other argument is Attention's."""

    def __init__(self, key: str, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope: RotaryEmbedding | None, gate: OutputGate, gate_name: str = "gate_proj", **attention: Any):
        super().__init__(key, layer_idx, hidden_size, num_heads, num_kv_heads, head_dim, rope, **attention)
        self.gate = gate
        self.gate_proj = Linear(f"{key}.{gate_name}", hidden_size, gate.width(num_heads, head_dim))

    def forward(self, x: torch.Tensor | Normed, batch: ForwardBatch, residual: Hidden | None = None) -> torch.Tensor | Hidden:
        o = self.gate.apply(self.attention(x, batch), project(x, self.gate_proj.impl))
        return self.project_out(o, residual)


class XIELU(Module):
    """The xIELU activation (Apertus) with its trained per-layer scalars ``alpha_p``, ``alpha_n``, ``beta``, ``eps``."""

    DEFAULTS: ClassVar[dict[str, float]] = {"beta": 0.5, "eps": -1e-6}

    def __init__(self, key: str):
        self.key = key
        self.params: dict[str, float] = {}

    def load(self, ctx: LoadContext) -> None:
        self.params = {}
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            full = f"{self.key}.{name}"
            if full in ctx.store:
                self.params[name] = float(ctx.store.get(full, dtype=torch.float32).reshape(-1)[0])
            elif name in self.DEFAULTS:
                self.params[name] = self.DEFAULTS[name]
            else:
                raise WeightError(f"{ctx.store.model_dir}: tensor {full!r} (xIELU parameter) is missing")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return xielu(x, **self.params)


class GatedMLP(Sublayer):
    """down(act(gate(x)) * up(x)); ``fused_gate_up`` names a fused [gate; up] checkpoint tensor (Phi-3, GLM 4)."""

    def __init__(
        self,
        key: str,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        bias: bool | None = False,
        fused_gate_up: str | None = None,
    ):
        self.key, self.activation, self.intermediate_size = key, activation, intermediate_size
        if fused_gate_up:
            self.gate_proj, self.up_proj = fused_parts(
                key, fused_gate_up, ("gate_proj", "up_proj"), hidden_size, (intermediate_size, intermediate_size), bias
            )
        else:
            self.gate_proj = Linear(f"{key}.gate_proj", hidden_size, intermediate_size, bias)
            self.up_proj = Linear(f"{key}.up_proj", hidden_size, intermediate_size, bias)
        self.down_proj = Linear(f"{key}.down_proj", intermediate_size, hidden_size, bias)
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj)

    def forward(
        self, x: torch.Tensor | Normed, batch: ForwardBatch | None = None, residual: Hidden | None = None
    ) -> torch.Tensor | Hidden:
        """The MLP of x [T, hidden] (a :class:`~trellm.modules.base.Sublayer`)."""
        gate, up = project(x, self.gate_up.weights())
        post = Residual(residual.value()) if residual is not None else None
        return project(gate, self.down_proj.impl, pre=GatedAct(up, self.activation), post=post)


class MLP(Sublayer):
    """down(act(up(x))), the ungated MLP (Arcee relu2, Apertus xIELU, Nemotron)."""

    def __init__(
        self,
        key: str,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "relu2",
        bias: bool | None = False,
        up_name: str = "up_proj",
        down_name: str = "down_proj",
    ):
        self.key, self.activation = key, activation
        self.up_proj = Linear(f"{key}.{up_name}", hidden_size, intermediate_size, bias)
        self.down_proj = Linear(f"{key}.{down_name}", intermediate_size, hidden_size, bias)
        self.act_fn = XIELU(f"{key}.act_fn") if activation == "xielu" else None
        self._act = None if activation == "xielu" else activation_fn(activation)

    def forward(
        self, x: torch.Tensor | Normed, batch: ForwardBatch | None = None, residual: Hidden | None = None
    ) -> torch.Tensor | Hidden:
        """The MLP of x [T, hidden] (a :class:`~trellm.modules.base.Sublayer`)."""
        h = project(x, self.up_proj.impl)
        h = self.act_fn.forward(h) if self.act_fn is not None else self._act(h)
        return project(h, self.down_proj.impl, post=Residual(residual.value()) if residual is not None else None)
