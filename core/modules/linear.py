"""Linear layers: dense or quantized behind one interface."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from ..errors import WeightError
from .base import LoadContext, Module

if TYPE_CHECKING:
    from ..ops import RowNorm


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


class HiddenSum(NamedTuple):
    """A sub-layer's output added to the residual stream (``h``), with h's float32 sums of squares per row
    and 128-column group (``ssq`` [rows, hidden / 128]) when the projection that produced h summed them
    (EXL3: in the GEMV's finishing step): the next RMSNorm then needs no pass of its own over h."""

    h: torch.Tensor
    ssq: torch.Tensor | None


class NormedInput:
    """A sub-layer's input ``norm(h)`` (an RMSNorm), not computed yet, for a :class:`HiddenSum` h.

    The sub-layer's first projections may norm h in their own input transform from its sums of squares
    (EXL3 groups on CUDA: inside their one GEMV launch, so no RMSNorm launch runs before them); any other
    consumer takes :meth:`normed`.
    """

    def __init__(self, hidden: HiddenSum, norm: Module):
        self.hidden, self.norm = hidden, norm
        self._normed: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.hidden.h.shape

    def dim(self) -> int:
        return self.hidden.h.dim()

    def normed(self) -> torch.Tensor:
        """The input itself (the norm's own forward, once)."""
        if self._normed is None:
            self._normed = self.norm.forward(self.hidden.h)
        return self._normed

    def row_norm(self) -> "RowNorm | None":
        """The norm for an op that computes it from the sums (``row_norm=``); None without sums."""
        from ..ops import RowNorm

        if self.hidden.ssq is None:
            return None
        n = self.norm
        return RowNorm(self.hidden.ssq, n.weight, n.eps, n.unit_offset)


def plain_linear(linear: object) -> bool:
    """Whether ``linear`` is a :class:`Linear` whose forward is Linear's: its implementation's fused paths
    (``forward_group``, ``forward_add``, ...) then compute exactly what its forward would."""
    return isinstance(linear, Linear) and type(linear).forward is Linear.forward


def forward_group(linears: Sequence[Linear], x: torch.Tensor | NormedInput) -> list[torch.Tensor]:
    """Several projections of one x (q/k/v, gate/up), in order.

    When every implementation can run with the first (``groups_with``, e.g. EXL3 layers of one K),
    they run through its ``forward_group`` (one kernel launch on CUDA, which also norms a
    :class:`NormedInput` x from its sums); otherwise one by one.
    """
    impls = [getattr(lin, "impl", None) for lin in linears]
    first = impls[0]
    if all(plain_linear(lin) for lin in linears) and len(impls) > 1 and hasattr(first, "forward_group") and all(
        first.groups_with(i) for i in impls[1:]
    ):
        if isinstance(x, NormedInput):
            row_norm = x.row_norm()
            if row_norm is None:
                return first.forward_group(impls, x.normed())
            return first.forward_group(impls, x.hidden.h, row_norm=row_norm)
        return first.forward_group(impls, x)
    if isinstance(x, NormedInput):
        x = x.normed()
    return [lin(x) for lin in linears]


def forward_add(linear: Linear, x: torch.Tensor, residual: torch.Tensor) -> HiddenSum:
    """``linear(x) + residual``, a sub-layer's last projection and the residual add; with the sums of
    squares where the implementation computes them (``forward_add``, e.g. EXL3: in the GEMV's finishing step)."""
    impl = getattr(linear, "impl", None)
    if plain_linear(linear) and hasattr(impl, "forward_add"):
        return HiddenSum(*impl.forward_add(x, residual))
    return HiddenSum(linear(x) + residual, None)


def forward_gated(linear: Linear, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``linear(gated_activation(gate, up, activation))``, a gated MLP's down projection.

    When the implementation can take gate and up itself (``forward_gated``, e.g. EXL3: the CUDA GEMV
    applies the activation in its input transform), it does; otherwise the activation runs first.
    """
    from .. import ops

    impl = getattr(linear, "impl", None)
    if plain_linear(linear) and hasattr(impl, "forward_gated"):
        return impl.forward_gated(gate, up, activation)
    return linear(ops.gated_activation(gate, up, activation))


def forward_gated_add(linear: Linear, gate: torch.Tensor, up: torch.Tensor, activation: str,
                      residual: torch.Tensor) -> HiddenSum:
    """:func:`forward_add` of ``gated_activation(gate, up, activation)`` (``forward_gated_add`` where the
    implementation has it: one GEMV launch for the activation, the projection and the add)."""
    impl = getattr(linear, "impl", None)
    if plain_linear(linear) and hasattr(impl, "forward_gated_add"):
        return HiddenSum(*impl.forward_gated_add(gate, up, activation, residual))
    return HiddenSum(forward_gated(linear, gate, up, activation) + residual, None)
