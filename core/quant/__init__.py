"""Weight formats behind one Linear interface.

A :class:`QuantFormat` recognises its tensors in a :class:`~trellm.weights.WeightStore` and loads a
:class:`LinearWeights` for a module key; the dense format (``{key}.weight``) is the fallback. Every
family gets every format for free because :class:`trellm.modules.Linear` asks the formats, not the
family.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..weights import WeightStore


@runtime_checkable
class LinearWeights(Protocol):
    """A loaded linear layer: ``forward(x[..., in]) -> [..., out]``."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def nbytes(self) -> int: ...

    def dense_weight(self) -> torch.Tensor:
        """The equivalent dense weight [out, in] (tests, conversion, fallbacks)."""
        ...


@runtime_checkable
class QuantFormat(Protocol):
    name: str

    def detect(self, store: WeightStore, key: str) -> bool:
        """True when ``store`` holds this format's tensors for module ``key``."""
        ...

    def load_linear(
        self,
        store: WeightStore,
        key: str,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> LinearWeights: ...
