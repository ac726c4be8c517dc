"""Recurrent (linear-attention) mixers and the hybrid decoder that interleaves them with attention.

:class:`GatedDeltaNet` is the Qwen3-Next / Qwen3.5 linear-attention layer: input projections, a
causal depthwise conv over q/k/v, the gated delta rule (chunked for prefill, recurrent for decode),
a gated RMSNorm and the output projection. Its state per sequence lives in a
:class:`~trellm.cache.recurrent.RecurrentStateLayer` slot named by ``batch.state_slots``; without a
cache (``batch.cache is None``) every sequence starts from the zero state.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from .. import ops
from ..batch import ForwardBatch
from ..cache import KVCache
from ..capabilities import implements
from ..config import LinearAttentionConfig
from ..errors import WeightError
from ..ops.deltanet import GATED_NORM_ACTIVATIONS, gated_delta_inputs, kda_decode_route, kda_inputs
from .base import LoadContext, Module
from .decoder import CausalLM
from ..ops.projection import Hidden, Normed, project
from .layers import Attention, Embedding, OutputGate, RMSNorm
from .linear import Linear, LinearGroup


def load_split_conv(ctx: LoadContext, key: str, conv_dim: int, width: int) -> torch.Tensor:
    """The q/k/v depthwise conv stored as ``{key}.{q,k,v}_conv1d.weight`` (however the checkpoint split the
    channels), as one [conv_dim, width] weight."""
    parts = [ctx.store.get(f"{key}.{n}_conv1d.weight", dtype=ctx.dtype, device=ctx.device) for n in "qkv"]
    weight = torch.cat(parts)[:, 0].contiguous()
    if weight.shape != (conv_dim, width):
        raise WeightError(f"{ctx.store.model_dir}: {key}.{{q,k,v}}_conv1d.weight hold {list(weight.shape)}, "
                          f"expected {[conv_dim, width]}")
    return weight


def state_cache_inputs(key: str, layer_idx: int, batch: ForwardBatch, tokens: int):
    """(cache layer or None, fresh rows [B] or None, decode?) of a recurrent mixer for this batch.
    ``decode``: one new token per sequence, served in place on the cache's slots."""
    if batch.cache is None:
        return None, None, False
    if batch.state_slots is None:
        raise ValueError(f"{key}: a cached forward pass of a recurrent layer needs batch.state_slots")
    fresh = batch.cached_lens == 0 if batch.cached_lens is not None else None
    return batch.cache.layers[layer_idx], fresh, tokens == batch.num_seqs


def in_steps(batch: ForwardBatch, layer) -> bool:
    """Whether a recurrent mixer takes this batch's tokens one at a time on the cache's slots: a captured draft
    verification (every sequence feeds ``batch.tokens_per_seq`` tokens; the chunked scan would read
    ``cu_seqlens`` on the host, which a graph cannot)."""
    return layer is not None and batch.tokens_per_seq > 1


def stepwise(step, batch: ForwardBatch, fresh: torch.Tensor | None, states: list[torch.Tensor],
             *per_token: torch.Tensor) -> torch.Tensor:
    """``step(*rows, fresh)``, a one-token update of the sequences' state slots in place (the decode op), run
    over each sequence's ``batch.tokens_per_seq`` tokens in order (``per_token``: [T, ...] inputs, sequence by
    sequence); after token j the ``states`` it updates are copied into the checkpoint slots j, so a
    verification that keeps j + 1 tokens resumes from there. Returns the outputs, [T, ...] in token order."""
    width = batch.tokens_per_seq
    columns = [t.unflatten(0, (-1, width)).transpose(0, 1) for t in per_token]  # [width, B, ...]
    out = []
    for j in range(width):
        out.append(step(*(c[j].contiguous() for c in columns), fresh if j == 0 else None))
        if j < width - 1:
            for t in states:
                t[batch.state_checkpoints[j]] = t[batch.state_slots]
    return torch.stack(out, 1).flatten(0, 1)


def delta_recurrence(step, chunked, batch: ForwardBatch, layer, fresh: torch.Tensor | None, decode: bool,
                     conv_state, rec_state, chunk_size: int, *inputs: torch.Tensor) -> torch.Tensor:
    """A delta-rule recurrence over the batch (gated delta net, KDA): decoding runs ``step`` (the one-token op on
    the state slots, in place), a captured verification runs it :func:`stepwise`, anything else runs
    ``chunked`` from the states read and writes the states (with the conv states) back."""
    if decode:
        return step(*inputs, layer.states, batch.state_slots, fresh)
    if in_steps(batch, layer):
        rule = lambda *rows: step(*rows[:-1], layer.states, batch.state_slots, rows[-1])  # noqa: E731
        return stepwise(rule, batch, fresh, [layer.states], *inputs)
    out, rec_state = chunked(*inputs, batch.cu_seqlens, rec_state, chunk_size)
    if layer is not None:
        layer.write(batch.state_slots, conv_state, rec_state)
    return out


def short_conv(mixed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, batch: ForwardBatch, layer,
               fresh: torch.Tensor | None, decode: bool):
    """The causal depthwise conv (+ SiLU) of a recurrent mixer's inputs: (out, conv states or None, recurrent
    states read from the cache or None). Decoding (and a verification taken :func:`stepwise`) updates the conv
    states in place; otherwise the caller writes back the returned conv states with its recurrent states."""
    if decode:
        return ops.causal_conv1d_step_slots(mixed, weight, bias, layer.conv_states, batch.state_slots, fresh), None, None
    if in_steps(batch, layer):
        conv = lambda x, f: ops.causal_conv1d_step_slots(x, weight, bias, layer.conv_states, batch.state_slots, f)  # noqa: E731
        return stepwise(conv, batch, fresh, [layer.conv_states], mixed), None, None
    conv_state = rec_state = None
    if layer is not None:
        conv_state, rec_state = layer.read(batch.state_slots, fresh)
    out, conv_state = ops.causal_conv1d(mixed, weight, bias, batch.cu_seqlens, conv_state)
    return out, conv_state, rec_state


DELTANET_DECODE_ENV = "TRELLM_DELTANET_DECODE"
DELTANET_DECODE_MODES = ("fused", "unfused")


def deltanet_decode_mode() -> str:
    """``TRELLM_DELTANET_DECODE``: "fused" runs a gated delta net's decode step as one op from its raw inputs
    (:func:`~trellm.ops.gated_delta_net_step_slots`) and its output norm as one (:func:`~trellm.ops.gated_rms_norm`)
    (default); "unfused" computes the norms and gates apart. On the H200 (2026-12-05, ``bench_moe_decode.py``, the
    Qwen3.5-35B-A3B shape at 4 bpw, captured) fused decodes 216 tok/s at batch 1 against 170 unfused."""
    return ops.route_from_env(DELTANET_DECODE_ENV, DELTANET_DECODE_MODES, "fused")


class GatedRMSNorm(Module):
    """RMSNorm(x) * w * act(gate), per head (``{key}.weight`` [dim]); act is silu (gated delta net) or sigmoid (KDA).
    ``route``: the layer's decode route knob; on "fused" the norm is one op (:func:`~trellm.ops.gated_rms_norm`)."""

    def __init__(self, key: str, dim: int, eps: float, activation: str = "silu",
                 route: Callable[[], str] = deltanet_decode_mode):
        if activation not in GATED_NORM_ACTIVATIONS:
            raise ValueError(f"{key}: unknown gate activation {activation!r}; use one of {sorted(GATED_NORM_ACTIVATIONS)}")
        self.key, self.dim, self.eps, self.activation, self.route = key, dim, eps, activation, route
        self.weight: torch.Tensor | None = None

    def load(self, ctx: LoadContext) -> None:
        self.weight = ctx.store.get(f"{self.key}.weight", shape=(self.dim,), dtype=ctx.dtype, device=ctx.device)

    def unload(self) -> None:
        self.weight = None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.route() == "fused":
            return ops.gated_rms_norm(x, self.weight, gate, self.eps, self.activation)
        normed = ops.rms_norm(x, self.weight, self.eps)  # the unfused route: norm, casts, activation, product
        return (normed.float() * GATED_NORM_ACTIVATIONS[self.activation](gate.float())).to(x.dtype)


class GatedDeltaNet(Module):
    """Gated delta net linear attention (Qwen3-Next, Qwen3.5).

    ``projection="split"`` (Qwen3.5): ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
    ``projection="fused"`` (Qwen3-Next): ``in_proj_qkvz`` and ``in_proj_ba``, grouped per key head.
    ``projection="separate"`` (OLMo Hybrid): ``q_proj``/``k_proj``/``v_proj``/``g_proj``/``b_proj``/``a_proj``,
    the conv stored as ``q_conv1d``/``k_conv1d``/``v_conv1d``, output ``o_norm`` + ``o_proj``.
    ``beta_scale`` 2 lets beta reach (0, 2) (negative eigenvalues, OLMo Hybrid). ``gate_activation``: the
    output gate's (silu; sigmoid in Qwen 3.8-Flash-Next checkpoints that say so).
    """

    @classmethod
    def from_config(cls, key: str, layer_idx: int, hidden_size: int, sizes: LinearAttentionConfig, eps: float,
                    projection: str, **options) -> "GatedDeltaNet":
        """The layer sized by the config's ``linear_*`` keys (heads, head dims, conv kernel)."""
        return cls(
            key, layer_idx, hidden_size,
            num_k_heads=sizes.num_key_heads, num_v_heads=sizes.num_value_heads,
            head_k_dim=sizes.key_head_dim, head_v_dim=sizes.value_head_dim,
            conv_width=sizes.conv_kernel, eps=eps, projection=projection, **options,
        )

    verifies_in_steps = True  # takes a captured draft verification token by token (see stepwise)

    def __init__(
        self,
        key: str,
        layer_idx: int,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_width: int,
        eps: float,
        projection: str = "split",
        conv_bias: bool = False,
        chunk_size: int = 64,
        beta_scale: float = 1.0,
        norm_eps: float | None = None,
        gate_activation: str = "silu",
    ):
        if num_v_heads % num_k_heads:
            raise ValueError(f"{key}: value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
        if projection not in ("split", "fused", "separate"):
            raise ValueError(f"{key}: unknown projection layout {projection!r}; use 'split', 'fused' or 'separate'")
        self.key, self.layer_idx, self.projection = key, layer_idx, projection
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width, self.conv_bias, self.chunk_size = conv_width, conv_bias, chunk_size
        if projection == "split":
            self.in_proj_qkv = Linear(f"{key}.in_proj_qkv", hidden_size, self.conv_dim)
            self.in_proj_z = Linear(f"{key}.in_proj_z", hidden_size, self.value_dim)
            self.in_proj_b = Linear(f"{key}.in_proj_b", hidden_size, num_v_heads)
            self.in_proj_a = Linear(f"{key}.in_proj_a", hidden_size, num_v_heads)
            self.qkv_z = LinearGroup(self.in_proj_qkv, self.in_proj_z)  # one launch where their format groups them
        elif projection == "fused":
            self.in_proj_qkvz = Linear(f"{key}.in_proj_qkvz", hidden_size, self.conv_dim + self.value_dim)
            self.in_proj_ba = Linear(f"{key}.in_proj_ba", hidden_size, 2 * num_v_heads)
        else:
            self.q_proj = Linear(f"{key}.q_proj", hidden_size, self.key_dim)
            self.k_proj = Linear(f"{key}.k_proj", hidden_size, self.key_dim)
            self.v_proj = Linear(f"{key}.v_proj", hidden_size, self.value_dim)
            self.g_proj = Linear(f"{key}.g_proj", hidden_size, self.value_dim)
            self.b_proj = Linear(f"{key}.b_proj", hidden_size, num_v_heads)
            self.a_proj = Linear(f"{key}.a_proj", hidden_size, num_v_heads)
        separate = projection == "separate"
        self.norm = GatedRMSNorm(f"{key}.{'o_norm' if separate else 'norm'}", head_v_dim, eps if norm_eps is None else norm_eps,
                                 gate_activation)
        self.out_proj = Linear(f"{key}.{'o_proj' if separate else 'out_proj'}", self.value_dim, hidden_size)
        self.beta_scale = beta_scale
        self.conv_weight = self.conv_bias_t = self.dt_bias = self.A_log = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        get = lambda name, shape, dtype=ctx.dtype: ctx.store.get(f"{self.key}.{name}", shape=shape, dtype=dtype, device=ctx.device)
        if self.projection == "separate":
            self.conv_weight = load_split_conv(ctx, self.key, self.conv_dim, self.conv_width)
        else:
            self.conv_weight = get("conv1d.weight", (self.conv_dim, 1, self.conv_width))[:, 0].contiguous()
        self.conv_bias_t = get("conv1d.bias", (self.conv_dim,)) if self.conv_bias else None
        self.dt_bias = get("dt_bias", (self.num_v_heads,), torch.float32)
        self.A_log = get("A_log", (self.num_v_heads,), torch.float32)

    def unload(self) -> None:
        super().unload()
        self.conv_weight = self.conv_bias_t = self.dt_bias = self.A_log = None

    def state_layer(self, max_slots: int, dtype: torch.dtype, device):
        """The cache layer this mixer keeps its per-sequence state in."""
        from ..cache.recurrent import RecurrentStateLayer

        shape = (self.num_v_heads, self.head_k_dim, self.head_v_dim)
        return RecurrentStateLayer(max_slots, self.conv_dim, self.conv_width, shape, dtype, device)

    def _project(self, x: torch.Tensor):
        """(q|k|v before the conv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        t = x.shape[0]
        if self.projection == "separate":
            return self._project_separate(x)
        if self.projection == "split":
            qkv, z = project(x, self.qkv_z.weights())
            return qkv, z.view(t, self.num_v_heads, self.head_v_dim), self.in_proj_b(x), self.in_proj_a(x)
        per = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, self.num_k_heads, 2 * self.head_k_dim + 2 * per * self.head_v_dim)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, per * self.head_v_dim, per * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.num_k_heads, 2 * per).split([per, per], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.num_v_heads, self.head_v_dim), b.reshape(t, -1), a.reshape(t, -1)

    def _project_separate(self, x: torch.Tensor):
        t = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return mixed, self.g_proj(x).view(t, self.num_v_heads, self.head_v_dim), self.b_proj(x), self.a_proj(x)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        layer, fresh, decode = state_cache_inputs(self.key, self.layer_idx, batch, t)
        mixed, conv_state, rec_state = short_conv(mixed, self.conv_weight, self.conv_bias_t, batch, layer, fresh, decode)
        if decode and deltanet_decode_mode() == "fused":  # norms, gates and recurrence in one op
            o = ops.gated_delta_net_step_slots(mixed, a, b, self.A_log, self.dt_bias, layer.states, batch.state_slots, fresh,
                                               self.num_k_heads, self.head_k_dim, self.beta_scale)
        else:
            q, k, v, g, beta = gated_delta_inputs(mixed, a, b, self.A_log, self.dt_bias, self.num_k_heads, self.head_k_dim,
                                                  self.beta_scale)
            o = delta_recurrence(ops.gated_delta_rule_step_slots, ops.gated_delta_rule_chunked, batch, layer, fresh, decode,
                                 conv_state, rec_state, self.chunk_size, q, k, v, g, beta)
        o = self.norm.forward(o.to(x.dtype), z)
        return self.out_proj(o.reshape(t, self.value_dim))


class KimiDeltaAttention(Module):
    """Kimi delta attention (KDA; Kimi Linear, GLM 5.3-Flash): the gated delta rule with a decay per key
    channel instead of per head.

    ``q_proj``/``k_proj``/``v_proj`` (as many key as value heads) through the causal conv + SiLU
    (``{q,k,v}_conv1d``), q and k L2-normalised; the log decay g = ``lower_bound`` * sigmoid(exp(A_log) *
    (f_b(f_a(x)) + dt_bias)) per channel (without a lower bound: -exp(A_log) * softplus(...)); beta =
    sigmoid(``b_proj``); the output RMS-normalised per head and gated by sigmoid(g_b(g_a(x))) (``o_norm``),
    then ``o_proj``. Its state (conv inputs and [H, Dk, Dv] per sequence) lives in a recurrent-state slot.
    """

    verifies_in_steps = True  # takes a captured draft verification token by token (see stepwise)

    def __init__(self, key: str, layer_idx: int, hidden_size: int, num_heads: int, head_dim: int, conv_width: int,
                 eps: float, lower_bound: float | None = -5.0, chunk_size: int = 32):
        self.key, self.layer_idx, self.num_heads, self.head_dim = key, layer_idx, num_heads, head_dim
        self.dim = num_heads * head_dim
        self.conv_dim, self.conv_width, self.lower_bound, self.chunk_size = 3 * self.dim, conv_width, lower_bound, chunk_size
        self.q_proj, self.k_proj, self.v_proj = (Linear(f"{key}.{n}_proj", hidden_size, self.dim) for n in "qkv")
        self.qkv = LinearGroup(self.q_proj, self.k_proj, self.v_proj)
        self.f_a_proj = Linear(f"{key}.f_a_proj", hidden_size, head_dim)
        self.f_b_proj = Linear(f"{key}.f_b_proj", head_dim, self.dim)
        self.g_a_proj = Linear(f"{key}.g_a_proj", hidden_size, head_dim)
        self.g_b_proj = Linear(f"{key}.g_b_proj", head_dim, self.dim)
        self.b_proj = Linear(f"{key}.b_proj", hidden_size, num_heads)
        self.o_norm = GatedRMSNorm(f"{key}.o_norm", head_dim, eps, activation="sigmoid", route=kda_decode_route)
        self.o_proj = Linear(f"{key}.o_proj", self.dim, hidden_size)
        self.conv_weight = self.dt_bias = self.A_log = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        self.conv_weight = load_split_conv(ctx, self.key, self.conv_dim, self.conv_width)
        self.dt_bias = ctx.store.get(f"{self.key}.dt_bias", dtype=torch.float32, device=ctx.device).reshape(self.dim)
        self.A_log = ctx.store.get(f"{self.key}.A_log", dtype=torch.float32, device=ctx.device).reshape(self.num_heads)

    def unload(self) -> None:
        super().unload()
        self.conv_weight = self.dt_bias = self.A_log = None

    def state_layer(self, max_slots: int, dtype: torch.dtype, device):
        """The cache layer this mixer keeps its per-sequence state in."""
        from ..cache.recurrent import RecurrentStateLayer

        shape = (self.num_heads, self.head_dim, self.head_dim)
        return RecurrentStateLayer(max_slots, self.conv_dim, self.conv_width, shape, dtype, device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat(project(x, self.qkv.weights()), dim=-1)
        layer, fresh, decode = state_cache_inputs(self.key, self.layer_idx, batch, t)
        mixed, conv_state, rec_state = short_conv(mixed, self.conv_weight, None, batch, layer, fresh, decode)
        f, b = self.f_b_proj(self.f_a_proj(x)), self.b_proj(x)  # the forget gate's and beta's inputs
        if decode and kda_decode_route() == "fused":  # norms, gates and recurrence in one op
            o = ops.kimi_delta_attention_step_slots(mixed, f, b, self.A_log, self.dt_bias, layer.states, batch.state_slots,
                                                    fresh, h, d, self.lower_bound)
        else:
            q, k, v, g, beta = kda_inputs(mixed, f, b, self.A_log, self.dt_bias, h, d, self.lower_bound)
            o = delta_recurrence(ops.kda_step_slots, ops.kda_chunked, batch, layer, fresh, decode, conv_state, rec_state,
                                 self.chunk_size, q, k, v, g, beta)
        o = self.o_norm.forward(o.to(x.dtype), self.g_b_proj(self.g_a_proj(x)).view(t, h, d))
        return self.o_proj(o.reshape(t, self.dim))


class ShortConv(Module):
    """LFM2's gated short convolution: B, C, x = in_proj(h); y = C * causal_conv(B * x); out_proj(y).

    Its only state is the last ``width - 1`` conv inputs per sequence (a recurrent-state slot).
    """

    def __init__(self, key: str, layer_idx: int, hidden_size: int, width: int, bias: bool = False):
        self.key, self.layer_idx, self.hidden_size, self.width, self.has_bias = key, layer_idx, hidden_size, width, bias
        self.in_proj = Linear(f"{key}.in_proj", hidden_size, 3 * hidden_size, bias)
        self.out_proj = Linear(f"{key}.out_proj", hidden_size, hidden_size, bias)
        self.conv_weight = self.conv_bias = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        w = ctx.store.get(f"{self.key}.conv.weight", shape=(self.hidden_size, 1, self.width), dtype=ctx.dtype, device=ctx.device)
        self.conv_weight = w[:, 0].contiguous()
        if self.has_bias:
            self.conv_bias = ctx.store.get(f"{self.key}.conv.bias", shape=(self.hidden_size,), dtype=ctx.dtype, device=ctx.device)

    def unload(self) -> None:
        super().unload()
        self.conv_weight = self.conv_bias = None

    def state_layer(self, max_slots: int, dtype: torch.dtype, device):
        from ..cache.recurrent import RecurrentStateLayer

        return RecurrentStateLayer(max_slots, self.hidden_size, self.width, (0,), dtype, device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        bx = b * h
        layer = None
        conv_state = None
        if batch.cache is not None:
            if batch.state_slots is None:
                raise ValueError(f"{self.key}: a cached forward pass of a recurrent layer needs batch.state_slots")
            layer = batch.cache.layers[self.layer_idx]
            conv_state, _ = layer.read(batch.state_slots, batch.cached_lens == 0 if batch.cached_lens is not None else None)
        if layer is not None and x.shape[0] == batch.num_seqs:
            y, conv_state = ops.causal_conv1d_step(bx, self.conv_weight, self.conv_bias, conv_state, activation=None)
        else:
            y, conv_state = ops.causal_conv1d(bx, self.conv_weight, self.conv_bias, batch.cu_seqlens, conv_state, activation=None)
        if layer is not None:
            layer.conv_states[batch.state_slots] = conv_state.to(layer.conv_states.dtype)
        return self.out_proj(c * y)


class Mamba2Mixer(Module):
    """Mamba-2 selective state space mixer (NemotronH): in_proj -> [z | x B C | dt], causal conv + SiLU on
    x B C, the SSD recurrence per head, y * silu(z) RMS-normalised per group, out_proj."""

    def __init__(self, key: str, layer_idx: int, hidden_size: int, num_heads: int, head_dim: int, state_size: int,
                 num_groups: int, conv_width: int, eps: float, conv_bias: bool = True, proj_bias: bool = False,
                 dt_min: float = 0.0, chunk_size: int = 64):
        if num_heads % num_groups:
            raise ValueError(f"{key}: mamba heads ({num_heads}) must be a multiple of n_groups ({num_groups})")
        self.key, self.layer_idx = key, layer_idx
        self.num_heads, self.head_dim, self.state_size, self.num_groups = num_heads, head_dim, state_size, num_groups
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * num_groups * state_size
        self.conv_width, self.has_conv_bias, self.eps, self.dt_min, self.chunk_size = conv_width, conv_bias, eps, dt_min, chunk_size
        self.in_proj = Linear(f"{key}.in_proj", hidden_size, self.inner + self.conv_dim + num_heads, proj_bias)
        self.out_proj = Linear(f"{key}.out_proj", self.inner, hidden_size, proj_bias)
        self.conv_weight = self.conv_bias = self.dt_bias = self.A_log = self.D = self.norm_weight = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        get = lambda name, shape, dtype=ctx.dtype: ctx.store.get(f"{self.key}.{name}", shape=shape, dtype=dtype, device=ctx.device)
        self.conv_weight = get("conv1d.weight", (self.conv_dim, 1, self.conv_width))[:, 0].contiguous()
        self.conv_bias = get("conv1d.bias", (self.conv_dim,)) if self.has_conv_bias else None
        h = self.num_heads
        self.dt_bias, self.A_log, self.D = (get(n, (h,), torch.float32) for n in ("dt_bias", "A_log", "D"))
        self.norm_weight = get("norm.weight", (self.inner,))

    def unload(self) -> None:
        super().unload()
        self.conv_weight = self.conv_bias = self.dt_bias = self.A_log = self.D = self.norm_weight = None

    def state_layer(self, max_slots: int, dtype: torch.dtype, device):
        from ..cache.recurrent import RecurrentStateLayer

        shape = (self.num_heads, self.head_dim, self.state_size)
        return RecurrentStateLayer(max_slots, self.conv_dim, self.conv_width, shape, dtype, device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        layer = conv_state = ssm_state = None
        if batch.cache is not None:
            if batch.state_slots is None:
                raise ValueError(f"{self.key}: a cached forward pass of a recurrent layer needs batch.state_slots")
            layer = batch.cache.layers[self.layer_idx]
            conv_state, ssm_state = layer.read(batch.state_slots, batch.cached_lens == 0 if batch.cached_lens is not None else None)
        decode = layer is not None and t == batch.num_seqs
        if decode:
            xbc, conv_state = ops.causal_conv1d_step(xbc, self.conv_weight, self.conv_bias, conv_state)
        else:
            xbc, conv_state = ops.causal_conv1d(xbc, self.conv_weight, self.conv_bias, batch.cu_seqlens, conv_state)
        gn = self.num_groups * self.state_size
        xs, b, c = xbc.split([self.inner, gn, gn], dim=-1)
        per = self.num_heads // self.num_groups
        xs = xs.reshape(t, self.num_heads, self.head_dim)
        b = b.reshape(t, self.num_groups, self.state_size).repeat_interleave(per, dim=1)
        c = c.reshape(t, self.num_groups, self.state_size).repeat_interleave(per, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias).clamp_min(self.dt_min)
        a = -self.A_log.exp()
        if decode:
            y, ssm_state = ops.ssd_step(xs, dt, a, b, c, self.D, ssm_state)
        else:
            y, ssm_state = ops.ssd_chunked(xs, dt, a, b, c, self.D, batch.cu_seqlens, ssm_state, self.chunk_size)
        if layer is not None:
            layer.write(batch.state_slots, conv_state, ssm_state)
        gated = y.reshape(t, self.inner).float() * F.silu(z.float())
        groups = gated.view(t, self.num_groups, -1)
        normed = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).view(t, self.inner)
        return self.out_proj(self.norm_weight * normed.to(x.dtype))


class ResidualBlock(Module):
    """x + mixer(norm(x)): the one-mixer blocks of NemotronH (the mixer is Mamba, attention, an MLP or an MoE).

    The mixer sits in ``attn`` so the cache finds attention and recurrent mixers where it looks for them.
    """

    def __init__(self, key: str, norm: Module, mixer: Module):
        self.key, self.norm, self.attn = key, norm, mixer

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return x + self.attn.forward(self.norm.forward(x), batch)


class GatedAttention(Attention):
    """Attention whose q_proj also yields a per-head output gate, interleaved per head as [q | gate]
    (Qwen3-Next, Qwen3.5): out = o_proj(attn * sigmoid(gate)). ``norm_unit_offset``: q/k norms scale by 1 + w."""

    gate = OutputGate("sigmoid")

    def __init__(self, key: str, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope, qk_norm_eps: float, norm_unit_offset: bool = True, bias: bool = False):
        super().__init__(key, layer_idx, hidden_size, num_heads, num_kv_heads, head_dim, rope, bias, bias, qk_norm_eps)
        self.q_proj = Linear(f"{key}.q_proj", hidden_size, 2 * num_heads * head_dim, bias)
        self.qkv = LinearGroup(self.q_proj, self.k_proj, self.v_proj)
        self.q_norm = RMSNorm(f"{key}.q_norm", head_dim, qk_norm_eps, unit_offset=norm_unit_offset)
        self.k_norm = RMSNorm(f"{key}.k_norm", head_dim, qk_norm_eps, unit_offset=norm_unit_offset)

    def forward(self, x: torch.Tensor | Normed, batch: ForwardBatch, residual: Hidden | None = None) -> torch.Tensor | Hidden:
        t = x.shape[0]
        q_gate, k, v = project(x, self.qkv.weights())
        q, gate = q_gate.view(t, self.num_heads, 2, self.head_dim).unbind(2)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self._fused_rope(batch):  # the q/k norms, RoPE and the KV write in one op
            o = self.attend_fused(q, k, v, batch)
        else:
            o = self.attend(self.q_norm.forward(q), self.k_norm.forward(k), v, batch)
        o = o.reshape(t, self.num_heads * self.head_dim)
        return self.project_out(self.gate.apply(o, gate.reshape(t, -1)), residual)


@runtime_checkable
class RecurrentMixer(Protocol):
    """A mixer that keeps per-sequence state between steps: it makes the cache layer holding that state."""

    def state_layer(self, max_slots: int, dtype: torch.dtype, device): ...


class HybridCausalLM(CausalLM):
    """A CausalLM whose layers mix attention and recurrent mixers; knows how to build its cache."""

    def recurrent_layers(self) -> list[Module | None]:
        """Per decoder layer, the mixer that keeps recurrent state (None for attention layers)."""
        mixers = [getattr(layer, "attn", None) for layer in self.layers]
        return [m if implements(m, RecurrentMixer) else None for m in mixers]

    def make_cache(self, max_tokens: int = 8192, page_size: int = 256, max_slots: int | None = None, **kwargs) -> KVCache:
        """Paged KV for the attention layers plus ``max_slots`` recurrent-state slots (see build_hybrid_cache)."""
        from ..cache.recurrent import DEFAULT_STATE_SLOTS, build_hybrid_cache

        return build_hybrid_cache(self, max_tokens, page_size, max_slots or DEFAULT_STATE_SLOTS, **kwargs)
