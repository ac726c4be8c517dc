"""The Module interface: a named piece of a model that loads its own tensors.

Deliberately not ``torch.nn.Module``: modules hold plain tensors, load themselves from a
:class:`~trellm.weights.WeightStore` (dense or quantized), and run on a typed
:class:`~trellm.batch.ForwardBatch`. Children are found from attributes, as in torch.
"""
from __future__ import annotations

from typing import Iterator

import attrs
import torch

from ..weights import WeightStore


@attrs.define
class LoadContext:
    store: WeightStore
    device: torch.device
    dtype: torch.dtype
    quant_formats: list = attrs.field(factory=list)
    # tensors already loaded, by (name, dtype, device): a tied LM head shares the embedding's memory (a copy when a
    # layer split puts it on another device)
    loaded: dict = attrs.field(factory=dict)
    # bytes of dense copies that weights of a format with no kernel on the device decoded at load
    decoded_nbytes: int = 0

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """``name`` from the store in the model dtype on the model device, loaded once per model and device."""
        key = (name, self.dtype, self.device)
        t = self.loaded.get(key)
        if t is None:
            t = self.store.get(name, shape=shape, dtype=self.dtype, device=self.device)
            self.loaded[key] = t
        elif shape is not None and tuple(t.shape) != tuple(shape):
            t = self.store.get(name, shape=shape)  # raises the store's shape error, naming the tensor
        return t


class Module:
    key: str = ""

    def children(self) -> Iterator["Module"]:
        for v in vars(self).values():
            if isinstance(v, Module):
                yield v
            elif isinstance(v, (list, tuple)):
                yield from (m for m in v if isinstance(m, Module))

    def modules(self) -> Iterator["Module"]:
        yield self
        for c in self.children():
            yield from c.modules()

    def load(self, ctx: LoadContext) -> None:
        for c in self.children():
            c.load(ctx)

    def unload(self) -> None:
        for c in self.children():
            c.unload()

    def own_tensors(self) -> list[torch.Tensor]:
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in self.own_tensors())
        return own + sum(c.nbytes() for c in self.children())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key!r})"


class Sublayer(Module):
    """A block's attention or MLP that takes part in the residual stream.

    ``forward(x, batch, residual=None)``: x is a tensor or a :class:`~trellm.ops.Normed` (its input norm not
    computed yet: the first projections may apply it inside their matmul); with ``residual`` (the block's
    :class:`~trellm.ops.Hidden` input) it returns ``residual + output`` as a Hidden, the add made by its last
    projection (:class:`~trellm.ops.Residual`). Every projection goes through :func:`trellm.ops.project`.
    """
