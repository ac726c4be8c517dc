"""Mixture-of-experts as shared modules: a router (gate Linear + a routing strategy), experts, shared experts.

The families differ mostly in how router logits become (weights, expert ids); that choice is a small
strategy object (:class:`SoftmaxTopK`, :class:`TopKSoftmax`, :class:`ScoreTopK`), so a family is a
few constructor arguments. Experts are either one :class:`ExpertMLP` of :class:`Linear` modules per
expert (HF per-expert tensors; EXL3 experts load through the same Linear) or a :class:`StackedExperts`
holding 3-D tensors. Dispatch sorts the (token, expert) pairs by expert and runs each expert that
got tokens once on its contiguous block: no Python loop over tokens.
"""
from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from .. import ops
from ..batch import ForwardBatch
from ..ops import op
from ..errors import WeightError
from .base import LoadContext, Module
from .layers import GatedMLP
from .linear import DenseLinear, Linear, forward_group

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


@op
def softmax_topk(logits: torch.Tensor, k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], ids int64 [T, k]): softmax over the experts, the k most probable, renormalised
    to sum 1 when ``normalize``. One op so that a backend can do it in one launch (decode runs it every layer)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


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
    the ``topk_groups`` best groups compete.
    """

    top_k: int
    score: str = "sigmoid"  # or "softmax"
    normalize: bool = True
    scaling: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    norm_eps: float = 1e-20
    norm_min: bool = False  # ERNIE: clamp the denominator at norm_eps instead of adding it

    def __call__(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.score == "sigmoid":
            scores = logits.float().sigmoid()
        elif self.score == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
        else:
            raise ValueError(f"unknown router score function {self.score!r}; use 'sigmoid' or 'softmax'")
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


def _activation(activation: str | Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if callable(activation):
        return activation
    return lambda gate, up: ops.gated_activation(gate, up, activation)


class ExpertMLP(Module):
    """One expert with its own Linear modules (per-expert checkpoint tensors; EXL3 works unchanged)."""

    def __init__(
        self,
        key: str,
        hidden_size: int,
        intermediate_size: int,
        activation: str | Callable = "silu",
        bias: bool | None = False,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ):
        self.key = key
        self.act = _activation(activation)
        gate, up, down = names
        self.gate_proj = Linear(f"{key}.{gate}", hidden_size, intermediate_size, bias)
        self.up_proj = Linear(f"{key}.{up}", hidden_size, intermediate_size, bias)
        self.down_proj = Linear(f"{key}.{down}", intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        gate, up = forward_group((self.gate_proj, self.up_proj), x)
        return self.down_proj(self.act(gate, up))


class ExpertList(Module):
    """``num_experts`` :class:`ExpertMLP` under ``{key}.{i}``."""

    def __init__(self, key: str, num_experts: int, hidden_size: int, intermediate_size: int, **expert_kwargs):
        self.key = key
        self.num_experts = num_experts
        self.activation = expert_kwargs.get("activation", "silu")  # a name, or a callable (no fused path)
        self.exl3_set: EXL3ExpertSet | None = None
        self.experts = [ExpertMLP(f"{key}.{i}", hidden_size, intermediate_size, **expert_kwargs) for i in range(num_experts)]

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts[e].forward(x)

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        self.exl3_set = EXL3ExpertSet.from_experts(self.experts, ctx.device)

    def unload(self) -> None:
        super().unload()
        self.exl3_set = None

    def run_pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """The sync-free path when every expert is EXL3 of one shape and format (else None)."""
        bank = self.exl3_set
        if bank is None or not isinstance(self.activation, str):
            return None
        expert_of = ids.reshape(-1)
        hidden = exl3_experts_gate_up(x, expert_of, bank, ids.shape[1], self.activation)
        return exl3_experts_down(hidden, expert_of, bank, weights)


class StackedExperts(Module):
    """All experts in 3-D tensors: ``{key}.gate_up_proj`` and ``{key}.down_proj`` (+ ``_bias``).

    Default layout is HF's in-memory one, [E, 2I, H] with gate rows then up rows, and [E, H, I].
    ``transposed``: stored as [E, H, 2I] / [E, I, H] (gpt-oss checkpoints). ``interleaved``: gate and
    up alternate along the 2I axis (gpt-oss).
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
        self.act = _activation(activation)
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
        gate_up = self._read(ctx, "gate_up_proj", 2 * i, h)
        down = self._read(ctx, "down_proj", h, i)
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
        tokens, top_k = ids.shape
        expert_of = ids.reshape(-1)
        gate, up = dense_experts_matmul(x, expert_of, gate_up, gu_bias, top_k).chunk(2, dim=-1)
        y = dense_experts_matmul(self.act(gate, up).contiguous(), expert_of, down, d_bias, 1)
        return combine_pairs(y, weights, x.dtype)

    def nbytes(self) -> int:
        return sum(l.nbytes() for l in self.gate_up + self.down)

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[e].forward(x).chunk(2, dim=-1)
        return self.down[e].forward(self.act(gate, up))


def _check_experts(experts: Module) -> None:
    if not hasattr(experts, "run_expert") or not hasattr(experts, "num_experts"):
        raise TypeError(f"{experts!r} is not an expert collection (needs num_experts and run_expert)")


def dispatch_experts_sync_free(experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """:func:`dispatch_experts` without a host sync (fixed shapes, expert ids stay on the device), or None
    when the expert collection has no such path (per-expert dense Linears, mixed EXL3 formats)."""
    run_pairs = getattr(experts, "run_pairs", None)
    return run_pairs(x, weights, ids) if run_pairs is not None else None


def dispatch_experts(experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t, grouped by expert.

    On CUDA, up to SYNC_FREE_MAX_PAIRS (token, expert) pairs (decode) take the sync-free pair path, so
    the step can be captured in a CUDA graph; larger batches (prefill) group tokens by expert.
    """
    if x.device.type == "cuda" and 0 < ids.numel() <= SYNC_FREE_MAX_PAIRS:
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
    start = 0
    for e, n in enumerate(counts):
        if n:  # only the experts that got tokens run
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


def combine_pairs(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_j weights[t, j] * y[t * top_k + j] for pairs ordered token-major: [T * top_k, H] -> [T, H]."""
    tokens, top_k = weights.shape
    return (y.view(tokens, top_k, -1).float() * weights.float()[..., None]).sum(1).to(dtype)


@attrs.define(eq=False)
class EXL3ExpertSet:
    """The EXL3 gate, up and down Linears of all experts, plus device pointer tables for the pair kernels.

    ``gate_up_table`` int64 [2, E, 4] and ``down_table`` [1, E, 4] hold {trellis, suh, svh, bias or 0}
    pointers; they stay valid while the Linears hold their tensors (the set is rebuilt at every load).
    """

    gate: list
    up: list
    down: list
    gate_up_table: torch.Tensor
    down_table: torch.Tensor

    @staticmethod
    def _uniform(layers: list) -> bool:
        first = layers[0]
        return all(
            type(l).__name__ == "EXL3Linear"
            and l.in_features == l.padded_in and l.out_features == l.padded_out  # no padding to undo per pair
            and l.trellis.shape == first.trellis.shape and l.codebook == first.codebook
            for l in layers
        )

    @classmethod
    def from_experts(cls, experts: list, device) -> "EXL3ExpertSet | None":
        """The set when every expert's three projections are EXL3 with one shape and format per projection
        (gate and up alike), else None."""
        gate, up, down = ([getattr(e, name).impl for e in experts] for name in ("gate_proj", "up_proj", "down_proj"))
        if not experts or not all(cls._uniform(layers) for layers in (gate, up, down)):
            return None
        if gate[0].trellis.shape != up[0].trellis.shape or gate[0].codebook != up[0].codebook:
            return None

        def table(*projections: list) -> torch.Tensor:
            rows = [[[l.trellis.data_ptr(), l.suh.data_ptr(), l.svh.data_ptr(), l.bias.data_ptr() if l.bias is not None else 0]
                     for l in layers] for layers in projections]
            return torch.tensor(rows, dtype=torch.int64, device=device)

        return cls(gate, up, down, table(gate, up), table(down))

    @staticmethod
    def dims(layers: list) -> tuple[int, int, int, str]:
        """(k, n, bits, codebook) of one projection."""
        l = layers[0]
        return l.padded_in, l.padded_out, l.bits, l.codebook


def _exl3_pairs_reference(x: torch.Tensor, expert_of: torch.Tensor, layers: list, pairs_per_row: int) -> torch.Tensor:
    """[P, n]: pair p through expert expert_of[p]'s Linear on x row p // pairs_per_row (one call per pair)."""
    rows = [layers[e].forward(x[p // pairs_per_row][None])[0] for p, e in enumerate(expert_of.tolist())]
    return torch.stack(rows)


@op
def exl3_experts_gate_up(
    x: torch.Tensor, expert_of: torch.Tensor, experts: EXL3ExpertSet, pairs_per_row: int, activation: str = "silu"
) -> torch.Tensor:
    """act(gate_e(x_t)) * up_e(x_t) for every pair p (e = expert_of[p], t = p // pairs_per_row): [P, I]."""
    gate = _exl3_pairs_reference(x, expert_of, experts.gate, pairs_per_row)
    up = _exl3_pairs_reference(x, expert_of, experts.up, pairs_per_row)
    return ops.gated_activation(gate, up, activation)


@op
def exl3_experts_down(h: torch.Tensor, expert_of: torch.Tensor, experts: EXL3ExpertSet, weights: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        weights, ids = self.router.forward(x)
        out = dispatch_experts(self.experts, x, weights, ids)
        if self.shared is not None:
            shared = self.shared.forward(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out


class Experts(Module):
    """Experts in whichever layout the checkpoint has: stacked 3-D tensors when ``{key}.gate_up_proj``
    exists, else one set of Linear modules per expert (the layout HF saves, and EXL3 quantizes)."""

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
        self.layout = "stacked" if f"{self.key}.gate_up_proj" in ctx.store else "per_expert"
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
    def run_grouped(self):
        """The batched path when the experts are stacked tensors, else None (one Linear call per expert)."""
        return getattr(self.active, "run_grouped", None) if self.layout == "stacked" else None
