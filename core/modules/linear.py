"""Linear layers: dense or quantized behind one interface."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import WeightError
from .base import LoadContext, Module


class DenseLinear:
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

    ``bias=None`` means "optional": loaded when the checkpoint has it.
    """

    def __init__(self, key: str, in_features: int, out_features: int, bias: bool | None = False, alt_key: str | None = None):
        self.key, self.in_features, self.out_features, self.bias = key, in_features, out_features, bias
        self.alt_key = alt_key  # e.g. tied lm_head reads embed_tokens when lm_head.* is absent
        self.impl = None

    def _resolve_key(self, ctx: LoadContext) -> str:
        store = ctx.store
        if self.alt_key is None:
            return self.key
        has_own = f"{self.key}.weight" in store or any(f.detect(store, self.key) for f in ctx.quant_formats)
        return self.key if has_own else self.alt_key

    def load(self, ctx: LoadContext) -> None:
        key = self._resolve_key(ctx)
        bias = self.bias if self.bias is not None else (f"{key}.bias" in ctx.store)
        for fmt in ctx.quant_formats:
            if fmt.detect(ctx.store, key):
                self.impl = fmt.load_linear(ctx.store, key, self.in_features, self.out_features, bias, ctx.device, ctx.dtype)
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


def forward_group(linears: Sequence[Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """Several projections of one x (q/k/v, gate/up), in order.

    When every implementation can run with the first (``groups_with``, e.g. EXL3 layers of one K),
    they run through its ``forward_group`` (one kernel launch on CUDA); otherwise one by one.
    """
    plain = all(isinstance(lin, Linear) and type(lin).forward is Linear.forward for lin in linears)
    impls = [getattr(lin, "impl", None) for lin in linears]
    first = impls[0]
    if plain and len(impls) > 1 and hasattr(first, "forward_group") and all(first.groups_with(i) for i in impls[1:]):
        return first.forward_group(impls, x)
    return [lin(x) for lin in linears]


def forward_gated(linear: Linear, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``linear(gated_activation(gate, up, activation))``, a gated MLP's down projection.

    When the implementation can take gate and up itself (``forward_gated``, e.g. EXL3: the CUDA GEMV
    applies the activation in its input transform), it does; otherwise the activation runs first.
    """
    from .. import ops

    impl = getattr(linear, "impl", None)
    if isinstance(linear, Linear) and type(linear).forward is Linear.forward and hasattr(impl, "forward_gated"):
        return impl.forward_gated(gate, up, activation)
    return linear(ops.gated_activation(gate, up, activation))
