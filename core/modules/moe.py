"""Mixture-of-experts as shared modules: a router (gate Linear + a routing strategy), experts, shared experts.

The families differ mostly in how router logits become (weights, expert ids); that choice is a small
strategy object (:class:`SoftmaxTopK`, :class:`TopKSoftmax`, :class:`ScoreTopK`), so a family is a
few constructor arguments. Experts are either one :class:`ExpertMLP` of :class:`Linear` modules per
expert (HF per-expert tensors; quantized experts load through the same Linear) or a :class:`StackedExperts`
holding 3-D tensors. Dispatch sorts the (token, expert) pairs by expert and runs each expert that
got tokens once on its contiguous block: no Python loop over tokens.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import attrs
import torch
import torch.nn.functional as F

from ..batch import ForwardBatch
from ..errors import WeightError
from ..ops.moe import (  # noqa: F401  (softmax_topk, MOE_DECODE_*: re-exported)
    MOE_DECODE_ENV, MOE_DECODE_MODES, combine_pairs, dense_expert_pairs, dense_experts_matmul, expert_activation,
    moe_decode_mode, softmax_topk, softmax_topk_shared, takes_pairs,
)
from ..ops.projection import Weights, project
from .base import LoadContext, Module
from .layers import GatedMLP
from .linear import DenseLinear, Linear, LinearGroup

# ---- routing strategies ------------------------------------------------------------------------------


@attrs.frozen
class SoftmaxTopK:
    """softmax over all experts, keep the top k, optionally renormalise (Mixtral, Qwen2/3 MoE)."""

    top_k: int
    normalize: bool = True
    scaling: float = 1.0

    def __call__(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = softmax_topk(logits, self.top_k, self.normalize)
        return (weights * self.scaling if self.scaling != 1.0 else weights), ids


@attrs.frozen
class TopKSoftmax:
    """top k of the raw logits (router bias already added), then softmax over the k kept (gpt-oss)."""

    top_k: int

    def __call__(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(values.float(), dim=-1), ids


@attrs.frozen
class ScoreTopK:
    """Score with sigmoid or softmax; choose with ``score + correction_bias``, optionally inside the best groups.

    DeepSeek V3, GLM 4.5, dots.llm1, MiniMax-M2, AfMoE (sigmoid) and ERNIE 4.5 (softmax) route this way.
    The bias only steers the choice: the weights are the unbiased scores of the chosen experts,
    renormalised when ``normalize`` and multiplied by ``scaling`` (``routed_scaling_factor``).
    ``num_groups > 1``: experts form groups ranked by the sum of their two best biased scores; only
    the ``topk_groups`` best groups compete. ``softcap``: the logits become ``softcap * tanh(logits / softcap)``
    first (Laguna).
    """

    top_k: int
    score: str = "sigmoid"  # or "softmax", "sqrtsoftplus" (DeepSeek V4)
    normalize: bool = True
    scaling: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    norm_eps: float = 1e-20
    norm_min: bool = False  # ERNIE: clamp the denominator at norm_eps instead of adding it
    softcap: float = 0.0

    def __call__(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.softcap > 0:
            logits = torch.tanh(logits.float() / self.softcap) * self.softcap
        if self.score == "sigmoid":
            scores = logits.float().sigmoid()
        elif self.score == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
        elif self.score == "sqrtsoftplus":
            scores = F.softplus(logits.float()).sqrt()
        else:
            raise ValueError(f"unknown router score function {self.score!r}; use 'sigmoid', 'softmax' or 'sqrtsoftplus'")
        choice = scores if bias is None else scores + bias.float()
        if self.num_groups > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.num_groups, e // self.num_groups)
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total.clamp_min(self.norm_eps) if self.norm_min else total + self.norm_eps)
        return weights * self.scaling, ids


RoutingStrategy = Callable[[torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor]"]


class Router(Module):
    """``{key}.weight`` [experts, hidden] (+ bias), an optional correction bias, and a strategy."""

    def __init__(
        self,
        key: str,
        hidden_size: int,
        num_experts: int,
        strategy: RoutingStrategy,
        bias: bool = False,
        correction_bias_key: str | None = None,
        float32_logits: bool = False,
    ):
        self.key, self.num_experts, self.strategy = key, num_experts, strategy
        self.gate = Linear(key, hidden_size, num_experts, bias)
        self.correction_bias_key = correction_bias_key
        self.correction_bias: torch.Tensor | None = None
        self.float32_logits = float32_logits  # DeepSeek/GLM compute router logits in fp32

    def load(self, ctx: LoadContext) -> None:
        self.gate.load(ctx)
        if self.correction_bias_key is not None:
            bias = ctx.store.get(self.correction_bias_key, dtype=torch.float32, device=ctx.device)
            if bias.numel() != self.num_experts:  # stored as [E] or [1, E] (ERNIE)
                raise WeightError(
                    f"{ctx.store.model_dir}: tensor {self.correction_bias_key!r} has shape {list(bias.shape)}, "
                    f"expected {self.num_experts} values (one per expert)"
                )
            self.correction_bias = bias.reshape(-1)

    def unload(self) -> None:
        self.gate.unload()
        self.correction_bias = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_logits and isinstance(self.gate.impl, DenseLinear):
            impl = self.gate.impl
            return F.linear(x.float(), impl.weight.float(), None if impl.bias is None else impl.bias.float())
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, k] (float32) and expert ids [T, k] (int64)."""
        return self.strategy(self.logits(x), self.correction_bias)


# ---- experts ---------------------------------------------------------------------------------------------


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's activation: (clamp(up) + 1) * g * sigmoid(alpha * g) with g = gate clamped from above."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def limited_swiglu(limit: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """SwiGLU on clamped inputs, silu(min(gate, limit)) * clamp(up, -limit, limit) (GLM 5.3-Flash): unlike
    :func:`clamped_swiglu`, no alpha and no + 1."""

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    return act


class ExpertMLP(Module):
    """One expert with its own Linear modules (per-expert checkpoint tensors, dense or quantized): down(act(gate(x))
    * up(x)), or with ``gated=False`` down(act(up(x))) (NemotronH's relu^2 experts). A class of its own, not a
    :class:`GatedMLP` or :class:`~trellm.modules.layers.MLP`: tensor parallel leaves a routed expert whole."""

    def __init__(
        self,
        key: str,
        hidden_size: int,
        intermediate_size: int,
        activation: str | Callable = "silu",
        bias: bool | None = False,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        gated: bool = True,
    ):
        self.key = key
        gate, up, down = names
        self.gate_proj = Linear(f"{key}.{gate}", hidden_size, intermediate_size, bias) if gated else None
        self.up_proj = Linear(f"{key}.{up}", hidden_size, intermediate_size, bias)
        self.down_proj = Linear(f"{key}.{down}", intermediate_size, hidden_size, bias)
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj) if gated else None
        self.act = expert_activation(activation, gated)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(self.act(self.up_proj(x)))
        gate, up = project(x, self.gate_up.weights())
        return self.down_proj(self.act(gate, up))


class ExpertList(Module):
    """``num_experts`` :class:`ExpertMLP` under ``{key}.{i}`` (``gated=False``: no gate, down(act(up(x)))).
    ``expert_kwargs`` go to each expert."""

    def __init__(self, key: str, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: str | Callable = "silu", gated: bool = True, **expert_kwargs):
        self.key = key
        self.num_experts = num_experts
        self.activation = activation  # a name, or a callable (no fused path)
        self.gated = gated
        self.pair_set = None  # every expert's weights for the sync-free pair ops, where their format has such a set
        self.lora = None  # the LoraSet when an adapter targets some expert here (trellm.lora): no pair ops then
        self.experts = [ExpertMLP(f"{key}.{i}", hidden_size, intermediate_size, activation, gated=gated, **expert_kwargs)
                        for i in range(num_experts)]

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts[e].forward(x)

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        first = self.experts[0].up_proj.impl if self.experts else None
        self.pair_set = first.expert_set(self.experts, ctx.device) if isinstance(first, Weights) else None

    def unload(self) -> None:
        super().unload()
        self.pair_set = None

    def run_pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """The sync-free path when the experts' weights form a pair set (else None)."""
        if self.pair_set is None or not isinstance(self.activation, str) or self.lora is not None:
            return None
        return self.pair_set.run_pairs(x, weights, ids, self.activation)


SPLIT_STACKED_GATE = "gate_proj.weight"  # every expert's gate rows in one [E, I, H] tensor (per-expert ones are ``{i}.gate_proj``)


class StackedExperts(Module):
    """All experts in 3-D tensors: ``{key}.gate_up_proj`` and ``{key}.down_proj`` (+ ``_bias``).

    Default layout is HF's in-memory one, [E, 2I, H] with gate rows then up rows, and [E, H, I].
    ``transposed``: stored as [E, H, 2I] / [E, I, H] (gpt-oss checkpoints). ``interleaved``: gate and
    up alternate along the 2I axis (gpt-oss). Checkpoints that stack gate and up apart
    (``{key}.gate_proj.weight``, ``{key}.up_proj.weight`` [E, I, H] and ``{key}.down_proj.weight``
    [E, H, I], Step 3.5) are joined at load.
    """

    def __init__(
        self,
        key: str,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str | Callable = "silu",
        bias: bool = False,
        transposed: bool = False,
        interleaved: bool = False,
    ):
        self.key, self.num_experts = key, num_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.act = expert_activation(activation)
        self.has_bias, self.transposed, self.interleaved = bias, transposed, interleaved
        self.gate_up: list[DenseLinear] = []
        self.down: list[DenseLinear] = []
        self.stacked = None

    def _read(self, ctx: LoadContext, name: str, rows: int, cols: int) -> torch.Tensor:
        """[E, rows, cols]; stored so, or transposed (``transposed``, or found so: Qwen3-VL MoE hub files keep
        [E, H, 2I] where transformers now saves [E, 2I, H]; a square matrix can only be read as declared)."""
        name = f"{self.key}.{name}"
        transposed = self.transposed
        if name in ctx.store and rows != cols:
            transposed = tuple(ctx.store.info(name).shape) == (self.num_experts, cols, rows)
        shape = (self.num_experts, cols, rows) if transposed else (self.num_experts, rows, cols)
        w = ctx.store.get(name, shape=shape, dtype=ctx.dtype, device=ctx.device)
        return w.transpose(1, 2).contiguous() if transposed else w

    def load(self, ctx: LoadContext) -> None:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        if f"{self.key}.gate_up_proj" in ctx.store or f"{self.key}.{SPLIT_STACKED_GATE}" not in ctx.store:
            gate_up = self._read(ctx, "gate_up_proj", 2 * i, h)
            down = self._read(ctx, "down_proj", h, i)
        else:
            gate_up = torch.cat([self._read(ctx, SPLIT_STACKED_GATE, i, h), self._read(ctx, "up_proj.weight", i, h)], dim=1)
            down = self._read(ctx, "down_proj.weight", h, i)
        gu_bias = d_bias = None
        if self.has_bias:
            gu_bias = ctx.store.get(f"{self.key}.gate_up_proj_bias", shape=(e, 2 * i), dtype=ctx.dtype, device=ctx.device)
            d_bias = ctx.store.get(f"{self.key}.down_proj_bias", shape=(e, h), dtype=ctx.dtype, device=ctx.device)
        if self.interleaved:  # reorder rows to [gate..., up...] once, so the forward pass is one layout
            order = torch.cat([torch.arange(0, 2 * i, 2), torch.arange(1, 2 * i, 2)]).to(ctx.device)
            gate_up = gate_up[:, order].contiguous()
            gu_bias = gu_bias[:, order].contiguous() if gu_bias is not None else None
        self.gate_up = [DenseLinear(gate_up[x], None if gu_bias is None else gu_bias[x]) for x in range(e)]
        self.down = [DenseLinear(down[x], None if d_bias is None else d_bias[x]) for x in range(e)]
        self.stacked = (gate_up, gu_bias, down, d_bias)  # the same storage, for run_grouped

    def unload(self) -> None:
        self.gate_up, self.down = [], []
        self.stacked = None

    def run_grouped(self, counts: list[int], xs: torch.Tensor) -> torch.Tensor:
        """All experts at once with batched matmuls (rows of ``xs`` sorted by expert, ``counts`` per expert).

        Each expert that got tokens gets a padded row block; a handful of launches replace three
        matmuls per expert, which is what decode steps of many sequences need.
        """
        gate_up, gu_bias, down, d_bias = self.stacked
        hit = [e for e, n in enumerate(counts) if n]
        width = max(counts)
        rows, take, start = [], [], 0
        for j, e in enumerate(hit):
            n = counts[e]
            rows.append(list(range(start, start + n)) + [start] * (width - n))  # pad with a real row; dropped below
            take += range(j * width, j * width + n)
            start += n
        dev = xs.device
        ids = torch.tensor(hit, device=dev)
        xp = xs[torch.tensor(rows, device=dev)]  # [hit, width, H]
        gu = torch.bmm(xp, gate_up[ids].transpose(1, 2))
        if gu_bias is not None:
            gu = gu + gu_bias[ids][:, None]
        gate, up = gu.chunk(2, dim=-1)
        y = torch.bmm(self.act(gate, up), down[ids].transpose(1, 2))
        if d_bias is not None:
            y = y + d_bias[ids][:, None]
        return y.reshape(-1, y.shape[-1])[torch.tensor(take, device=dev)]

    def run_pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sync-free: one GEMV per (token, expert) pair with the expert read on the device, then the weighted sum."""
        gate_up, gu_bias, down, d_bias = self.stacked
        return dense_expert_pairs(x, weights, ids, gate_up, gu_bias, down, d_bias, self.act)

    def nbytes(self) -> int:
        return sum(l.nbytes() for l in self.gate_up + self.down)

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[e].forward(x).chunk(2, dim=-1)
        return self.down[e].forward(self.act(gate, up))


@runtime_checkable
class ExpertCollection(Protocol):
    """What an MoE block needs of its experts: how many there are, and expert e applied to rows x."""

    num_experts: int

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor: ...


def _check_experts(experts: Module) -> None:
    if not isinstance(experts, ExpertCollection):
        raise TypeError(f"{experts!r} is not an expert collection (needs num_experts and run_expert)")


def dispatch_experts_sync_free(experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """:func:`dispatch_experts` without a host sync (fixed shapes, expert ids stay on the device), or None
    when the expert collection has no such path (per-expert dense Linears, mixed quantized formats)."""
    run_pairs = getattr(experts, "run_pairs", None)
    return run_pairs(x, weights, ids) if run_pairs is not None else None


def dispatch_experts(experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t, grouped by expert.

    On CUDA (:func:`~trellm.ops.moe.takes_pairs`), up to SYNC_FREE_MAX_PAIRS (token, expert) pairs (decode) take the
    sync-free pair path, so the step can be captured in a CUDA graph; larger batches (prefill) group tokens by expert.
    """
    if takes_pairs(x.device) and 0 < ids.numel() <= SYNC_FREE_MAX_PAIRS:
        out = dispatch_experts_sync_free(experts, x, weights, ids)
        if out is not None:
            return out
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()  # one host sync per layer
    xs = x[token_of]
    grouped = getattr(experts, "run_grouped", None)
    if grouped is not None:
        ys = grouped(counts, xs)
        return torch.zeros_like(x).index_add_(0, token_of, ys * weights.reshape(-1)[order, None].to(ys.dtype))
    ys = torch.empty_like(xs)
    lora = getattr(experts, "lora", None)  # adapters on the experts see each row's token (trellm.lora)
    start = 0
    for e, n in enumerate(counts):
        if n:  # only the experts that got tokens run
            with lora.regrouped(token_of[start : start + n]) if lora is not None else contextlib.nullcontext():
                ys[start : start + n] = experts.run_expert(e, xs[start : start + n])
            start += n
    ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, ys)


# ---- sync-free expert pairs (decode) ---------------------------------------------------------------
#
# A decode step has few (token, expert) pairs. Grouping them by expert needs the per-expert counts on
# the host: one sync per MoE layer, and no CUDA graph. The pair path instead runs one GEMV per pair
# with the expert id read on the device (expert weights reached through pointer tables built at load),
# so every shape depends only on the number of pairs. It reads an expert once per pair that routes to
# it, so it stops paying off when many pairs share experts: prefill keeps the grouped path.

SYNC_FREE_MAX_PAIRS = 512

# ---- the shared expert as one more pair (decode) ---------------------------------------------------------
#
# A sigmoid-gated shared expert of the routed experts' shape and format (Qwen3.5-MoE, Qwen3-Next: 512 wide
# like the routed ones) is expert E of a pair set over E + 1 experts: the router and the shared gate run
# as one matmul ([E + 1, H] rows), one routing launch writes the k routed pairs plus the shared pair
# (weight sigmoid(gate logit)) and the two pair launches run all k + 1, combining them. That replaces
# the shared MLP's launches, its gate's matmul, sigmoid, product and sum.

@attrs.frozen(eq=False)
class SharedExpertFold:
    """A MoE block's shared expert folded into its routed pair launches (see above).

    ``router`` holds the joint [E (+ 1), H] weight whose rows the router's and shared gate's own Linears view;
    ``parts`` are the Weights the fold was built from: when one is replaced (a LoRA adapter, tensor
    parallel sharding), the fold no longer stands for the block and is not used.
    """

    router: DenseLinear
    pair_set: object  # the format's expert set over the E routed experts and the shared one (index E)
    top_k: int
    normalize: bool
    scaling: float
    shared: str  # "sigmoid" (gated) or "one"
    activation: str
    parts: tuple

    def matches(self, moe: "MoE") -> bool:
        return all(a is b for a, b in zip(self.parts, _fold_parts(moe), strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for x [T, H]: routed experts plus the (gated) shared expert."""
        weights, ids = softmax_topk_shared(self.router.forward(x), self.top_k, self.normalize, self.scaling, self.shared)
        return self.pair_set.run_pairs(x, weights, ids, self.activation)


def _fold_parts(moe: "MoE") -> tuple:
    experts = getattr(moe.experts, "active", moe.experts)
    shared = moe.shared
    gate = moe.shared_gate.impl if moe.shared_gate is not None else None
    return (moe.router.gate.impl, gate, getattr(experts, "pair_set", None), getattr(experts, "lora", None),
            shared.gate_proj.impl, shared.up_proj.impl, shared.down_proj.impl)


def fold_shared_expert(moe: "MoE", device: torch.device) -> SharedExpertFold | None:
    """The fold of ``moe``'s shared expert when it applies, else None: softmax top-k routing by a bias-free
    dense router, per-expert routed experts with a pair set and a named activation, a :class:`GatedMLP` shared
    expert whose projections join that set (same shape and format) under the same activation, a dense
    bias-free [1, H] shared gate or none. Rebinds the router's and shared gate's weights as rows of one tensor."""
    strategy, experts = moe.router.strategy, getattr(moe.experts, "active", moe.experts)
    if type(moe).route is not MoE.route or not isinstance(strategy, SoftmaxTopK) or not isinstance(moe.shared, GatedMLP):
        return None
    if moe.router.correction_bias is not None or moe.router.float32_logits:
        return None
    if (not isinstance(experts, ExpertList) or not experts.gated or experts.pair_set is None
            or experts.activation != moe.shared.activation):
        return None
    router = moe.router.gate.impl
    gate = moe.shared_gate.impl if moe.shared_gate is not None else None
    dense = [w for w in (router, gate) if w is not None]
    if not all(type(w) is DenseLinear and w.bias is None for w in dense):
        return None
    if gate is not None and (gate.weight.shape != (1, router.in_features) or gate.weight.dtype != router.weight.dtype):
        return None
    first = experts.experts[0].gate_proj.impl
    pair_set = first.expert_set([*experts.experts, moe.shared], device)
    if pair_set is None:
        return None
    if gate is not None:
        joint = torch.cat([router.weight, gate.weight])
        router.weight, gate.weight = joint[:-1], joint[-1:]
    else:
        joint = router.weight
    fold = SharedExpertFold(DenseLinear(joint, None), pair_set, strategy.top_k, strategy.normalize, strategy.scaling,
                            "sigmoid" if gate is not None else "one", experts.activation, ())
    return attrs.evolve(fold, parts=_fold_parts(moe))


class MoE(Module):
    """Routed experts plus optional shared experts (optionally scaled by sigmoid(shared_gate(x)))."""

    def __init__(
        self,
        key: str,
        router: Router,
        experts: Module,
        shared: GatedMLP | None = None,
        shared_gate: Linear | None = None,
    ):
        _check_experts(experts)
        if router.num_experts != experts.num_experts:
            raise ValueError(f"{key}: router has {router.num_experts} experts, expert collection {experts.num_experts}")
        self.key, self.router, self.experts, self.shared, self.shared_gate = key, router, experts, shared, shared_gate
        self.shared_fold: SharedExpertFold | None = None  # set at load where the shared expert folds (decode)

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        self.shared_fold = fold_shared_expert(self, ctx.device)

    def unload(self) -> None:
        super().unload()
        self.shared_fold = None

    def fold_for(self, device_type: str, rows: int) -> SharedExpertFold | None:
        """The shared-expert fold when a step of ``rows`` rows takes it: on CUDA, a decode step (few pairs), in
        a mode other than "pairs", with the fold still standing for the block."""
        fold = self.shared_fold
        if fold is None or device_type != "cuda" or rows * (fold.top_k + 1) > SYNC_FREE_MAX_PAIRS:
            return None
        return fold if moe_decode_mode() != "pairs" and fold.matches(self) else None

    def route(self, x: torch.Tensor, batch: ForwardBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, k] (float32) and expert ids [T, k]: the router's (a subclass may route otherwise)."""
        return self.router.forward(x)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        fold = self.fold_for(x.device.type, x.shape[0])
        if fold is not None:
            return fold.forward(x)
        weights, ids = self.route(x, batch)
        out = dispatch_experts(self.experts, x, weights, ids)
        if self.shared is not None:
            shared = self.shared.forward(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out


class Experts(Module):
    """Experts in whichever layout the checkpoint has: stacked 3-D tensors when ``{key}.gate_up_proj``
    exists, else one set of Linear modules per expert (the layout HF saves, and the quantizer writes)."""

    def __init__(
        self,
        key: str,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str | Callable = "silu",
        bias: bool = False,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        transposed: bool = False,
        interleaved: bool = False,
    ):
        self.key, self.num_experts = key, num_experts
        self.per_expert = ExpertList(key, num_experts, hidden_size, intermediate_size, activation=activation, bias=bias, names=names)
        self.stacked = StackedExperts(
            key, num_experts, hidden_size, intermediate_size, activation, bias, transposed=transposed, interleaved=interleaved
        )
        self.layout = ""  # "stacked" or "per_expert" once loaded (a name, not a second reference to a child)

    @property
    def active(self) -> Module:
        return self.stacked if self.layout == "stacked" else self.per_expert

    def load(self, ctx: LoadContext) -> None:
        stacked = any(f"{self.key}.{name}" in ctx.store for name in ("gate_up_proj", SPLIT_STACKED_GATE))
        self.layout = "stacked" if stacked else "per_expert"
        self.active.load(ctx)

    def unload(self) -> None:
        self.per_expert.unload()
        self.stacked.unload()
        self.layout = ""

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.active.run_expert(e, x)

    def run_pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        return self.active.run_pairs(x, weights, ids)

    @property
    def lora(self):
        """The active layout's LoRA set, where an adapter targets its experts (see :class:`ExpertList`)."""
        return getattr(self.active, "lora", None)

    @property
    def run_grouped(self):
        """The batched path when the experts are stacked tensors, else None (one Linear call per expert)."""
        return getattr(self.active, "run_grouped", None) if self.layout == "stacked" else None
