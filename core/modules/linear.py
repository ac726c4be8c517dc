"""Linear layers: a module holding one :class:`~trellm.ops.Weights` (dense or quantized), and groups of
linears that project one x."""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..errors import WeightError
from ..ops.moe import dense_expert_pairs, expert_activation, expert_inputs, takes_pairs
from ..ops.projection import Weights, group_weights
from .base import LoadContext, Module


class DenseLinear(Weights):
    """``{key}.weight`` [out, in] (+ ``{key}.bias``) in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)

    def dense_weight(self) -> torch.Tensor:
        return self.weight

    def expert_set(self, experts: list, device: torch.device) -> "DenseExpertSet | None":
        """Where the pair ops run (:func:`~trellm.ops.moe.takes_pairs`: on CUDA, keeping a decode step free of host
        syncs), :class:`DenseExpertSet`; elsewhere None (a CPU step groups its rows by expert anyway, and stacking
        would only cost load time)."""
        return DenseExpertSet.from_experts(experts) if takes_pairs(device) else None


class DenseExpertSet:
    """Dense per-expert experts (the layout HF checkpoints keep) for the sync-free pair ops: their weights moved
    into stacked tensors once at load (``gate_up`` [E, 2I, H], or [E, I, H] of the up rows alone when the experts
    have no gate; ``down`` [E, H, I]; + biases), each expert's DenseLinear rebound to its views, so nothing is held
    twice and a decode step's MoE needs no host sync."""

    def __init__(self, gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None, down: torch.Tensor,
                 down_bias: torch.Tensor | None, gated: bool = True):
        self.gate_up, self.gate_up_bias, self.down, self.down_bias = gate_up, gate_up_bias, down, down_bias
        self.gated = gated

    @classmethod
    def from_experts(cls, experts: list) -> "DenseExpertSet | None":
        """The set when every expert's input projections (gate and up, or up alone:
        :func:`~trellm.ops.moe.expert_inputs`) and down are DenseLinear of one shape, dtype and device, biased alike,
        each owning its storage; else None. A weight that is already a view (a fused checkpoint tensor's part, or an
        expert stacked before: the shared-expert fold asks again with one more expert) is left alone, since stacking
        it would copy it."""
        inputs = expert_inputs(experts)
        if inputs is None:
            return None
        in_layers = [w for parts in inputs for w in parts]
        down = [e.down_proj.impl for e in experts]
        if not all(type(w) is DenseLinear for w in (*in_layers, *down)):
            return None
        first, last = in_layers[0], down[0]
        for layers, shape in ((in_layers, first.weight.shape), (down, last.weight.shape)):
            for w in layers:
                if (w.weight.shape != shape or w.weight.dtype != first.weight.dtype or w.weight.device != first.weight.device
                        or w.weight._base is not None or (w.bias is None) != (first.bias is None)):
                    return None

        def stacked(parts: list[list[torch.Tensor]]) -> torch.Tensor:
            """[E, sum of the parts' rows, ...]: each expert's parts copied in, each part rebound to its view."""
            rows = sum(t.shape[0] for t in parts[0])
            out = parts[0][0].new_empty(len(parts), rows, *parts[0][0].shape[1:])
            for e, expert in enumerate(parts):
                start = 0
                for t in expert:
                    out[e, start:start + t.shape[0]].copy_(t)
                    start += t.shape[0]
            return out

        biased = first.bias is not None
        gate_up = stacked([[w.weight for w in parts] for parts in inputs])
        down_stack = stacked([[d.weight] for d in down])
        gate_up_bias = stacked([[w.bias for w in parts] for parts in inputs]) if biased else None
        down_bias = stacked([[d.bias] for d in down]) if biased else None
        rows = first.out_features
        for e, (parts, d) in enumerate(zip(inputs, down)):
            for j, w in enumerate(parts):
                w.weight = gate_up[e, j * rows:(j + 1) * rows]
                w.bias = gate_up_bias[e, j * rows:(j + 1) * rows] if biased else None
            d.weight, d.bias = down_stack[e], down_bias[e] if biased else None
        return cls(gate_up, gate_up_bias, down_stack, down_bias, gated=len(inputs[0]) == 2)

    def run_pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, activation: str) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]): the stacked dense pair ops (one kernel launch each on CUDA)."""
        return dense_expert_pairs(x, weights, ids, self.gate_up, self.gate_up_bias, self.down, self.down_bias,
                                  expert_activation(activation, self.gated), gated=self.gated)


def load_dense_linear(ctx: LoadContext, key: str, in_features: int, out_features: int, bias: bool) -> DenseLinear:
    w = ctx.tensor(f"{key}.weight", shape=(out_features, in_features))
    b = None
    if bias:
        b = ctx.store.get(f"{key}.bias", shape=(out_features,), dtype=ctx.dtype, device=ctx.device)
    return DenseLinear(w, b)


class Linear(Module):
    """y = x W^T (+ b). Loads whichever registered format holds ``key``; dense otherwise.

    ``bias=None`` means "optional": loaded when the checkpoint has it. The math is its Weights' (``impl``):
    a fused step around it is :func:`trellm.ops.project` of ``impl``.
    """

    def __init__(self, key: str, in_features: int, out_features: int, bias: bool | None = False, alt_key: str | None = None):
        self.key, self.in_features, self.out_features, self.bias = key, in_features, out_features, bias
        self.alt_key = alt_key  # e.g. tied lm_head reads embed_tokens when lm_head.* is absent
        self.impl: Weights | None = None
        self.device: torch.device | None = None  # where the weights were loaded (LoRA factors go there too)
        # under tensor parallel: which part of the whole projection this rank holds (trellm.distributed.LinearSplit;
        # LoRA factors are cut the same way), None: all of it
        self.split = None

    def _resolve_key(self, ctx: LoadContext) -> str:
        store = ctx.store
        if self.alt_key is None:
            return self.key
        has_own = f"{self.key}.weight" in store or any(f.detect(store, self.key) for f in ctx.quant_formats)
        return self.key if has_own else self.alt_key

    def load(self, ctx: LoadContext) -> None:
        self.device = ctx.device
        key = self._resolve_key(ctx)
        bias = self.bias if self.bias is not None else (f"{key}.bias" in ctx.store)
        for fmt in ctx.quant_formats:
            if fmt.detect(ctx.store, key):
                self.impl = fmt.load_linear(ctx.store, key, self.in_features, self.out_features, bias, ctx.device, ctx.dtype)
                if isinstance(self.impl, Weights):
                    ctx.decoded_nbytes += self.impl.decoded_nbytes()
                return
        if f"{key}.weight" not in ctx.store:
            raise WeightError(f"{ctx.store.model_dir}: tensor {key + '.weight'!r} is missing (no dense or quantized weights for {key!r})")
        self.impl = load_dense_linear(ctx, key, self.in_features, self.out_features, bias)

    def unload(self) -> None:
        self.impl = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl.forward(x)

    __call__ = forward

    def nbytes(self) -> int:
        return self.impl.nbytes() if self.impl is not None else 0


class LinearGroup(Module):
    """Linears that project one x (q/k/v, gate/up) as one grouped Weights (:func:`~trellm.ops.projection.group_weights`:
    quantized parts of one format run in one kernel launch).

    The group is made once per set of loaded weights, at first use, and made again only when a Linear's
    weights are replaced (the converter swaps them for recorders, tests for random ones). It loads nothing
    itself: the Linears are its owner's children.
    """

    def __init__(self, *linears: Linear):
        self.key = "+".join(lin.key for lin in linears)
        self.linears = linears
        self._impls: tuple = ()
        self._weights: Weights | None = None

    def children(self) -> Iterator[Module]:
        return iter(())

    def weights(self) -> Weights:
        impls = tuple(lin.impl for lin in self.linears)
        if impls != self._impls:
            self._impls, self._weights = impls, group_weights(impls)
        return self._weights

    def load(self, ctx: LoadContext) -> None:
        self.unload()

    def unload(self) -> None:
        self._impls, self._weights = (), None
