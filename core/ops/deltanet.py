"""Ops of the gated-delta-net (linear attention) layers: a causal depthwise conv1d and the gated delta rule.

Varlen layout as everywhere: tokens of all sequences concatenated along dim 0, ``cu_seqlens`` [B+1].
Each sequence brings its own initial state (from its cache slot, or zeros) and gets its final state back.

The gated delta rule keeps, per value head, a state S [Dk, Dv]; for each token t
    S <- exp(g_t) * S                       (KDA: diag(exp(g_t)) S, a decay per key channel)
    u_t = beta_t * (v_t - S^T k_t)          (the part of v_t the state does not predict yet)
    S <- S + k_t u_t^T
    o_t = S^T (q_t * Dk^-1/2)
:func:`gated_delta_rule_step` runs this for one token of every sequence (decode);
:func:`gated_delta_rule_chunked` gives the same result for long runs with matrix products over
chunks: inside a chunk the u's solve one unit lower-triangular system, and the state is carried
from chunk to chunk. Kimi delta attention (KDA: Kimi Linear, GLM 5.3-Flash) is the same rule with g
[.., H, Dk] per key channel: :func:`kda_step_slots` and :func:`kda_chunked`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import op, route_from_env
from .dense import rms_norm


@op
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    activation: str | None = "silu",
    dilation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of each sequence: x [T, C], weight [C, K] -> (out [T, C], final states [B, C, S]).

    ``initial_states`` [B, C, S] are the last S = (K-1) * dilation inputs before each sequence's new tokens
    (zeros when None); tap j of the kernel reads the input (K-1-j) * dilation steps back.
    """
    channels, width = weight.shape
    span = (width - 1) * dilation
    bounds = cu_seqlens.tolist()
    nseq = len(bounds) - 1
    if initial_states is None:
        initial_states = x.new_zeros(nseq, channels, span)
    out = torch.empty_like(x)
    finals = []
    for b in range(nseq):
        s0, s1 = bounds[b], bounds[b + 1]
        seq = torch.cat([initial_states[b].to(weight.dtype), x[s0:s1].t().to(weight.dtype)], dim=1)  # [C, S+L]
        y = F.conv1d(seq[None], weight[:, None, :], bias, groups=channels, dilation=dilation)[0]  # [C, L]
        if activation == "silu":
            y = F.silu(y)
        elif activation is not None:
            raise ValueError(f"causal_conv1d: unsupported activation {activation!r}")
        out[s0:s1] = y.t().to(x.dtype)
        finals.append(seq[:, seq.shape[1] - span:])
    return out, torch.stack(finals).to(initial_states.dtype)


@op
def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor, activation: str | None = "silu",
    dilation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per sequence: x [B, C], states [B, C, S] -> (out [B, C], new states [B, C, S]), S = (K-1) *
    dilation: :func:`causal_conv1d` of one token (tap j reads the input (K-1-j) * dilation steps back)."""
    window = torch.cat([states.to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=2)  # [B, C, S + 1]
    y = (window[:, :, ::dilation] * weight[None]).sum(-1)
    if bias is not None:
        y = y + bias
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d_step: unsupported activation {activation!r}")
    return y.to(x.dtype), window[:, :, 1:].to(states.dtype)


@op
def gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent form, one token per sequence: q/k [B, H, Dk], v [B, H, Dv], g/beta [B, H], state [B, H, Dk, Dv].

    Returns (out [B, H, Dv] in v's dtype, new state float32). q/k are expected L2-normalised.
    """
    return _delta_rule_step(q, k, v, g.float().exp()[..., None, None], beta, state)


def _delta_rule_step(q, k, v, decay: torch.Tensor, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One delta-rule step; ``decay`` multiplies the state's rows ([B, H, 1, 1] scalar per head, [B, H, Dk, 1] KDA)."""
    qf, kf, vf = q.float() * q.shape[-1] ** -0.5, k.float(), v.float()
    s = state.float() * decay
    predicted = torch.einsum("bhkv,bhk->bhv", s, kf)
    u = beta.float()[..., None] * (vf - predicted)
    s = s + kf[..., :, None] * u[..., None, :]
    out = torch.einsum("bhkv,bhk->bhv", s, qf)
    return out.to(v.dtype), s


@op
def causal_conv1d_step_slots(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """:func:`causal_conv1d_step` on the cache's slot storage, in place: sequence b reads and updates
    ``states[slots[b]]`` ([S, C, K-1]); rows where ``fresh`` [B] is True start from zeros. Returns out [B, C].

    Saves the gather and scatter of the states around the step (two passes over them, and two launches).
    """
    window = states[slots]
    if fresh is not None:
        window = window * (~fresh).view(-1, 1, 1).to(window.dtype)
    out, new = causal_conv1d_step.reference(x, weight, bias, window, activation)
    states[slots] = new.to(states.dtype)
    return out


@op
def gated_delta_rule_step_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`gated_delta_rule_step` on the cache's slot storage, in place: sequence b reads and updates
    ``states[slots[b]]`` (float32 [S, H, Dk, Dv]); rows where ``fresh`` [B] is True start from the zero state.
    Returns out [B, H, Dv] in v's dtype. One read and one write of each state instead of three of each.
    """
    return _step_on_slots(lambda state: gated_delta_rule_step.reference(q, k, v, g, beta, state), states, slots, fresh)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim in float32 (the FLA convention the checkpoints were trained with)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_qkv(mixed: torch.Tensor, num_k_heads: int, head_k_dim: int, heads: int):
    """(q, k, v) of a delta-rule layer from its conv output mixed [T, 2 * Hk * Dk + Hv * Dv] = q | k | v: q and k
    L2-normalised per key head (float32) and each repeated for the Hv / Hk value heads of its group, v [T, Hv, Dv]."""
    t, key_dim = mixed.shape[0], num_k_heads * head_k_dim
    q, k, v = mixed.split([key_dim, key_dim, mixed.shape[1] - 2 * key_dim], dim=-1)
    groups = heads // num_k_heads
    q = l2_normalize(q.reshape(t, num_k_heads, head_k_dim)).repeat_interleave(groups, dim=1)
    k = l2_normalize(k.reshape(t, num_k_heads, head_k_dim)).repeat_interleave(groups, dim=1)
    return q, k, v.reshape(t, heads, -1)


def gated_delta_inputs(
    mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    num_k_heads: int, head_k_dim: int, beta_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, g, beta) of the gated delta rule from a gated delta net's conv output and gate inputs.

    q, k, v as :func:`delta_qkv`; beta = sigmoid(b) * beta_scale and the log decay
    g = -exp(A_log) * softplus(a + dt_bias), float32 [T, Hv] (a, b [T, Hv]; A_log, dt_bias [Hv]).
    """
    q, k, v = delta_qkv(mixed, num_k_heads, head_k_dim, A_log.shape[0])
    beta = torch.sigmoid(b.float())
    if beta_scale != 1.0:
        beta = beta * beta_scale
    g = -A_log.exp() * F.softplus(a.float() + dt_bias)
    return q, k, v, g, beta


@op
def gated_delta_net_step_slots(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None = None,
    num_k_heads: int = 1,
    head_k_dim: int = 128,
    beta_scale: float = 1.0,
) -> torch.Tensor:
    """A gated delta net's decode step from its raw inputs (:func:`gated_delta_inputs`) through
    :func:`gated_delta_rule_step_slots`: out [B, Hv, Dv] in mixed's dtype. One op, so that a backend runs the
    L2 norms, the gates and the recurrence in one launch (about twenty small kernels otherwise)."""
    q, k, v, g, beta = gated_delta_inputs(mixed, a, b, A_log, dt_bias, num_k_heads, head_k_dim, beta_scale)
    return gated_delta_rule_step_slots.reference(q, k, v, g, beta, states, slots, fresh)


GATED_NORM_ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


@op
def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float, activation: str = "silu") -> torch.Tensor:
    """RMSNorm(x) * weight (rounded to x's dtype, as :func:`~trellm.ops.rms_norm`) times act(gate), over the last dim,
    in x's dtype: a gated delta net's (silu) or KDA's (sigmoid) output norm, one launch instead of five."""
    act = GATED_NORM_ACTIVATIONS.get(activation)
    if act is None:
        raise ValueError(f"gated_rms_norm: unknown activation {activation!r}; use one of {sorted(GATED_NORM_ACTIVATIONS)}")
    normed = rms_norm.reference(x, weight, eps)
    return (normed.float() * act(gate.float())).to(x.dtype)


def _step_on_slots(step, states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None) -> torch.Tensor:
    """``step(state) -> (out, new state)`` on the states of ``slots``, written back in place (fresh rows from zero)."""
    state = states[slots]
    if fresh is not None:
        state = state * (~fresh).view(-1, 1, 1, 1).to(state.dtype)
    out, new = step(state)
    states[slots] = new.to(states.dtype)
    return out


def _chunked_one(q, k, v, g, beta, state, chunk: int):
    """One sequence, heads first: q/k [H, L, Dk], v [H, L, Dv], g/beta [H, L], state [H, Dk, Dv] (all float32)."""
    h, length = k.shape[:2]
    dv = v.shape[-1]
    pad = (-length) % chunk
    if pad:  # padded steps have g = 0 (no decay) and beta = 0 (no write): the state passes through unchanged
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // chunk
    q, k, v = (t.reshape(h, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    c = g.cumsum(-1)  # log decay from the chunk start through step i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(c_i - c_j), j <= i
    kb = k * beta[..., None]
    # (I + A) U = beta V - beta exp(c) K S0, with A_ij = beta_i (k_i . k_j) exp(c_i - c_j) for j < i
    system = (kb @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~causal.tril(-1), 0.0) + torch.eye(chunk, device=q.device)
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    keys = torch.linalg.solve_triangular(system, kb * c.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # intra-chunk attention, diagonal included
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    chunk_decay = c[..., -1].exp()[..., None, None]
    out = torch.empty(h, n, chunk, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        u = values[:, i] - keys[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ u
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(h, n * chunk, dv)[:, :length], state


def _chunked_kda_one(q, k, v, g, beta, state, chunk: int):
    """:func:`_chunked_one` with a decay per key channel: g [H, L, Dk]. The pairwise decays exp(c_i - c_j) no
    longer factor out of the k.k products, so each chunk builds them as [H, C, C, Dk] (all <= 1: stable)."""
    h, length = k.shape[:2]
    dv = v.shape[-1]
    pad = (-length) % chunk
    if pad:  # padded steps: g = 0, beta = 0, the state passes through
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (length + pad) // chunk
    q, k, v, g = (t.reshape(h, n, chunk, t.shape[-1]) for t in (q, k, v, g))
    beta = beta.reshape(h, n, chunk)
    c = g.cumsum(2)  # per channel: log decay from the chunk start through step i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk, device=q.device)
    out = torch.empty(h, n, chunk, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        ci, ki, qi = c[:, i], k[:, i], q[:, i]
        kb = ki * beta[:, i, :, None]
        decay = (ci[:, :, None] - ci[:, None, :]).masked_fill(~causal[None, :, :, None], float("-inf")).exp()
        system = torch.einsum("hid,hjd,hijd->hij", kb, ki, decay).masked_fill(~causal.tril(-1), 0.0) + eye
        values = torch.linalg.solve_triangular(system, v[:, i] * beta[:, i, :, None], upper=False, unitriangular=True)
        keys = torch.linalg.solve_triangular(system, kb * ci.exp(), upper=False, unitriangular=True)
        u = values - keys @ state
        scores = torch.einsum("hid,hjd,hijd->hij", qi, ki, decay)
        out[:, i] = (qi * ci.exp()) @ state + scores @ u
        last = ci[:, -1:]
        state = state * last.transpose(-1, -2).exp() + (ki * (last - ci).exp()).transpose(-1, -2) @ u
    return out.reshape(h, n * chunk, dv)[:, :length], state


def _chunked_varlen(one, q, k, v, g, beta, cu_seqlens, initial_states, chunk_size):
    """Run ``one`` (a per-sequence chunked delta rule) over each sequence of a varlen batch, heads first."""
    bounds = cu_seqlens.tolist()
    nseq = len(bounds) - 1
    h, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    if initial_states is None:
        initial_states = torch.zeros(nseq, h, dk, dv, dtype=torch.float32, device=q.device)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    finals = []
    scale = dk**-0.5
    for b in range(nseq):
        s0, s1 = bounds[b], bounds[b + 1]
        heads_first = [t[s0:s1].float().transpose(0, 1) for t in (q, k, v, g, beta)]
        heads_first[0] = heads_first[0] * scale
        o, state = one(*heads_first, initial_states[b].float(), chunk_size)
        out[s0:s1] = o.transpose(0, 1).to(v.dtype)
        finals.append(state)
    return out, torch.stack(finals)


@op
def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form over a varlen batch: q/k [T, H, Dk], v [T, H, Dv], g/beta [T, H], states [B, H, Dk, Dv].

    Returns (out [T, H, Dv] in v's dtype, final states [B, H, Dk, Dv] float32). q/k are expected L2-normalised.
    """
    return _chunked_varlen(_chunked_one, q, k, v, g, beta, cu_seqlens, initial_states, chunk_size)


@op
def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    chunk_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi delta attention over a varlen batch: :func:`gated_delta_rule_chunked` with g [T, H, Dk] (log decay
    per key channel, <= 0). Returns (out [T, H, Dv] in v's dtype, final states [B, H, Dk, Dv] float32)."""
    return _chunked_varlen(_chunked_kda_one, q, k, v, g, beta, cu_seqlens, initial_states, chunk_size)


def kda_log_decay(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """KDA's log decay g [T, H, Dk] (float32, <= 0) from its forget-gate input f [T, H * Dk] (A_log [H], dt_bias
    [H * Dk]): lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), or without a bound -exp(A_log) * softplus(...)."""
    heads = A_log.shape[0]
    x = (f.float() + dt_bias).view(f.shape[0], heads, -1)
    rate = A_log.exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


def kda_inputs(
    mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    num_k_heads: int, head_k_dim: int, lower_bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, g, beta) of Kimi delta attention from its conv output (:func:`delta_qkv`), forget-gate input f
    (:func:`kda_log_decay`) and beta input b [T, H]: beta = sigmoid(b), float32."""
    q, k, v = delta_qkv(mixed, num_k_heads, head_k_dim, A_log.shape[0])
    return q, k, v, kda_log_decay(f, A_log, dt_bias, lower_bound), torch.sigmoid(b.float())


KDA_DECODE_ENV = "TRELLM_KDA_DECODE"
KDA_DECODE_ROUTES = ("reference", "kernel", "fused")


def kda_decode_route() -> str:
    """``TRELLM_KDA_DECODE``, how a KDA layer's decode step runs on CUDA: "reference" the torch ops throughout;
    "kernel", the recurrence (:func:`kda_step_slots`) in one launch, its norms and gates in torch; "fused"
    (default), the step from its raw inputs in one launch (:func:`kimi_delta_attention_step_slots`) and the output
    norm in one (:func:`gated_rms_norm`). On the H200 (2026-12-05, ``bench_kda_step.py``, 64 heads of 128) fused
    takes 9 / 28 / 175 us per step at batch 1 / 8 / 64, kernel 54 / 81 / 228, the reference 73 / 223 / 1,228."""
    return route_from_env(KDA_DECODE_ENV, KDA_DECODE_ROUTES, "fused")


@op
def kda_step_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None = None,
) -> torch.Tensor:
    """One KDA token per sequence on the cache's slots, in place (:func:`gated_delta_rule_step_slots` with
    g [B, H, Dk]). Returns out [B, H, Dv] in v's dtype."""
    return _step_on_slots(lambda state: _delta_rule_step(q, k, v, g.float().exp()[..., None], beta, state),
                          states, slots, fresh)


@op
def kimi_delta_attention_step_slots(
    mixed: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None = None,
    num_k_heads: int = 1,
    head_k_dim: int = 128,
    lower_bound: float | None = -5.0,
) -> torch.Tensor:
    """A KDA layer's decode step from its raw inputs (:func:`kda_inputs`) through :func:`kda_step_slots`: out
    [B, H, Dv] in mixed's dtype. One op, so that a backend runs the L2 norms, the gates and the recurrence in one
    launch (about forty small kernels otherwise, 18 of them the recurrence), as :func:`gated_delta_net_step_slots`
    does."""
    q, k, v, g, beta = kda_inputs(mixed, f, b, A_log, dt_bias, num_k_heads, head_k_dim, lower_bound)
    return kda_step_slots.reference(q, k, v, g, beta, states, slots, fresh)


# ---- Mamba-2 (state-space duality): the same varlen/state conventions, a scalar decay and no delta rule ----
#
# Per head a state S [P, N]; for each token t, with dt_t > 0 and A < 0:
#     S <- exp(dt_t * A) * S + dt_t * x_t B_t^T
#     y_t = S C_t + D * x_t
# (B and C are already expanded from their groups to the heads.)


@op
def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [B, H, P], dt [B, H], a/d [H], b/c [B, H, N], state [B, H, P, N] -> (y, new state f32)."""
    dtf = dt.float()
    s = state.float() * torch.exp(dtf * a.float())[..., None, None]
    s = s + (dtf[..., None] * x.float())[..., :, None] * b.float()[..., None, :]
    y = torch.einsum("bhpn,bhn->bhp", s, c.float()) + d.float()[:, None] * x.float()
    return y.to(x.dtype), s


@op
def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form over a varlen batch: x [T, H, P], dt [T, H], b/c [T, H, N] -> (y [T, H, P], final states [B, H, P, N])."""
    bounds = cu_seqlens.tolist()
    nseq = len(bounds) - 1
    h, p, n = x.shape[1], x.shape[2], b.shape[2]
    if initial_states is None:
        initial_states = torch.zeros(nseq, h, p, n, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    finals = []
    for s_ in range(nseq):
        s0, s1 = bounds[s_], bounds[s_ + 1]
        length = s1 - s0
        pad = (-length) % chunk_size
        xs, dts = x[s0:s1].float().transpose(0, 1), dt[s0:s1].float().transpose(0, 1)  # [H, L, P], [H, L]
        bs, cs = b[s0:s1].float().transpose(0, 1), c[s0:s1].float().transpose(0, 1)  # [H, L, N]
        if pad:  # dt = 0 on padding: no decay, no write
            xs, bs, cs = (F.pad(t, (0, 0, 0, pad)) for t in (xs, bs, cs))
            dts = F.pad(dts, (0, pad))
        k = (length + pad) // chunk_size
        xs, bs, cs = (t.reshape(h, k, chunk_size, t.shape[-1]) for t in (xs, bs, cs))
        dts = dts.reshape(h, k, chunk_size)
        cum = (dts * a.float()[:, None, None]).cumsum(-1)  # log decay from the chunk start
        causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        u = xs * dts[..., None]  # dt-weighted inputs [H, K, C, P]
        scores = (cs @ bs.transpose(-1, -2)) * decay  # [H, K, C, C]
        to_end = (cum[..., -1:] - cum).exp()
        state = initial_states[s_].float()  # [H, P, N]
        ys = torch.empty(h, k, chunk_size, p, dtype=torch.float32, device=x.device)
        for i in range(k):
            ys[:, i] = scores[:, i] @ u[:, i] + cum[:, i].exp()[..., None] * (cs[:, i] @ state.transpose(-1, -2))
            state = state * cum[:, i, -1].exp()[:, None, None] + (u[:, i] * to_end[:, i, :, None]).transpose(-1, -2) @ bs[:, i]
        y = ys.reshape(h, k * chunk_size, p)[:, :length] + d.float()[:, None, None] * xs.reshape(h, -1, p)[:, :length]
        out[s0:s1] = y.transpose(0, 1).to(x.dtype)
        finals.append(state)
    return out, torch.stack(finals)
