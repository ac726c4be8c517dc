"""Linear layers: a module holding one :class:`~trellm.ops.Weights` (dense or quantized), and groups of
linears that project one x."""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..errors import WeightError
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
