"""Mixture-of-experts ops: the router's softmax + top-k, and the sync-free (token, expert) pair matmuls of a
decode step (expert weights reached on the device, so no host sync and the step can be graph captured).
Torch references; ``trellm.kernels_cuda`` registers the CUDA versions. The EXL3 expert set they take is
``trellm.quant.exl3.format.EXL3ExpertSet``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from . import op, route_from_env
from .dense import activation_fn, gated_activation

if TYPE_CHECKING:
    from ..quant.exl3.format import EXL3ExpertSet


MOE_DECODE_ENV = "TRELLM_MOE_DECODE"
MOE_DECODE_MODES = ("pairs", "fused", "one_launch")


def moe_decode_mode() -> str:
    """``TRELLM_MOE_DECODE``, the MoE decode route on CUDA: "pairs" runs the shared expert as its own MLP;
    "fused" (default) folds a foldable shared expert into the routed pair launches; "one_launch" also finishes
    each EXL3 pair matmul in the launch that computes it (the last block of each output group sums the others'
    partial results: one launch per projection instead of two). On the H200 (2026-12-05, ``bench_moe_decode.py``,
    the Qwen3.5-35B-A3B shape at 4 bpw, fused delta net, captured) fused decodes 261 / 1,582 tok/s at batch 1 / 16,
    one_launch 253 / 1,517, pairs 216 / 1,508."""
    return route_from_env(MOE_DECODE_ENV, MOE_DECODE_MODES, "fused")


@op
def softmax_topk(logits: torch.Tensor, k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], ids int64 [T, k]): softmax over the experts, the k most probable, renormalised
    to sum 1 when ``normalize``. One op so that a backend can do it in one launch (decode runs it every layer)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


SHARED_PAIR_MODES = ("one", "sigmoid")


@op
def softmax_topk_shared(
    logits: torch.Tensor, k: int, normalize: bool = True, scaling: float = 1.0, shared: str = "sigmoid"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of a decode step whose shared expert runs as one more (token, expert) pair: (weights float32
    [T, k + 1], ids int64 [T, k + 1]).

    The first k columns are :func:`softmax_topk` over the E routed experts, times ``scaling``; column k is
    expert E (the shared expert's slot) with weight 1 (``shared="one"``, logits [T, E]) or sigmoid of the
    shared gate's logit, the last column of logits [T, E + 1] (``shared="sigmoid"``: router and shared
    gate run as one matmul). One op, so that a backend does the whole routing in one launch.
    """
    if shared not in SHARED_PAIR_MODES:
        raise ValueError(f"shared={shared!r}: expected one of {SHARED_PAIR_MODES}")
    experts = logits.shape[-1] - (shared == "sigmoid")
    weights, ids = softmax_topk.reference(logits[:, :experts], k, normalize)
    if scaling != 1.0:
        weights = weights * scaling
    if shared == "sigmoid":
        shared_weight = logits[:, experts:].float().sigmoid()
    else:
        shared_weight = weights.new_ones(weights.shape[0], 1)
    shared_id = torch.full_like(ids[:, :1], experts)
    return torch.cat([weights, shared_weight], 1), torch.cat([ids, shared_id], 1)


def combine_pairs(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_j weights[t, j] * y[t * top_k + j] for pairs ordered token-major: [T * top_k, H] -> [T, H]."""
    tokens, top_k = weights.shape
    return (y.view(tokens, top_k, -1).float() * weights.float()[..., None]).sum(1).to(dtype)


def expert_activation(activation: str | Callable, gated: bool = True) -> Callable[..., torch.Tensor]:
    """An expert's activation as a callable: ``act(gate, up)`` for gated experts, ``act(up)`` for experts with no
    gate (down(act(up(x)))); a callable ``activation`` is taken as it is."""
    if callable(activation):
        return activation
    if not gated:
        return activation_fn(activation)
    return lambda gate, up: gated_activation(gate, up, activation)


PAIR_DEVICE_TYPES = ("cuda",)


def takes_pairs(device: torch.device | str) -> bool:
    """Whether MoE decode on ``device`` runs the sync-free pair ops (its type in :data:`PAIR_DEVICE_TYPES`): on CUDA,
    where they keep a decode step capturable; a CPU step groups its rows by expert, which is faster there (tests add
    "cpu" to run the pair path on the CPU)."""
    return torch.device(device).type in PAIR_DEVICE_TYPES


def expert_inputs(experts: list) -> list[list] | None:
    """Each expert's input projections' Weights: ``[gate, up]`` (gated experts) or ``[up]`` (experts with no gate:
    down(act(up(x)))); None when the experts differ in that. What a format's pair set stacks or points to."""
    gated = {getattr(e, "gate_proj", None) is not None for e in experts}
    if len(gated) != 1:
        return None
    names = ("gate_proj", "up_proj") if gated.pop() else ("up_proj",)
    return [[getattr(e, name).impl for name in names] for e in experts]


def dense_expert_pairs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                       gate_up_bias: torch.Tensor | None, down: torch.Tensor, down_bias: torch.Tensor | None,
                       act, gated: bool = True) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for dense experts stacked as ``gate_up`` [E, 2I, H] (gate rows,
    then up rows) and ``down`` [E, H, I] (+ biases [E, n]), ``act(gate, up)`` between; not ``gated``: ``gate_up``
    holds the up rows alone ([E, I, H]) and ``act(up)`` is between. Sync-free, every shape fixed by the number of
    pairs (a decode step captures)."""
    expert_of = ids.reshape(-1)
    h = dense_experts_matmul(x, expert_of, gate_up, gate_up_bias, ids.shape[1])
    h = act(*h.chunk(2, dim=-1)) if gated else act(h)
    y = dense_experts_matmul(h.contiguous(), expert_of, down, down_bias, 1)
    return combine_pairs(y, weights, x.dtype)


def _exl3_pairs_reference(x: torch.Tensor, expert_of: torch.Tensor, layers: list, pairs_per_row: int) -> torch.Tensor:
    """[P, n]: pair p through expert expert_of[p]'s Linear on x row p // pairs_per_row (one call per pair)."""
    rows = [layers[e].forward(x[p // pairs_per_row][None])[0] for p, e in enumerate(expert_of.tolist())]
    return torch.stack(rows)


@op
def exl3_experts_gate_up(
    x: torch.Tensor, expert_of: torch.Tensor, experts: "EXL3ExpertSet", pairs_per_row: int, activation: str = "silu"
) -> torch.Tensor:
    """act(gate_e(x_t)) * up_e(x_t) for every pair p (e = expert_of[p], t = p // pairs_per_row): [P, I]; act(up_e(x_t))
    for a set of experts with no gate (``experts.gate`` empty)."""
    up = _exl3_pairs_reference(x, expert_of, experts.up, pairs_per_row)
    if not experts.gate:
        return activation_fn(activation)(up)
    gate = _exl3_pairs_reference(x, expert_of, experts.gate, pairs_per_row)
    return gated_activation(gate, up, activation)


@op
def exl3_experts_down(h: torch.Tensor, expert_of: torch.Tensor, experts: "EXL3ExpertSet", weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down_{e}(h[t * top_k + j]) with e = expert_of[t * top_k + j]: [T, H]."""
    return combine_pairs(_exl3_pairs_reference(h, expert_of, experts.down, 1), weights, h.dtype)


@op
def dense_experts_matmul(
    x: torch.Tensor, expert_of: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pairs_per_row: int
) -> torch.Tensor:
    """y[p] = weight[expert_of[p]] @ x[p // pairs_per_row] (+ bias[expert_of[p]]) for stacked weight [E, n, k]: [P, n].

    The reference gathers each pair's weight (a copy of P matrices): sync-free, but only fit for small P.
    """
    rows = torch.arange(expert_of.shape[0], device=x.device) // pairs_per_row
    y = torch.bmm(weight[expert_of], x[rows].to(weight.dtype)[:, :, None])[:, :, 0]
    if bias is not None:
        y = y + bias[expert_of]
    return y.to(x.dtype)
