"""The projection seam: one op, :func:`project`, for every matmul a module makes with its weights.

A module states the math: ``project(x, weights, pre=..., post=...)`` with an optional step before the
matmul (:class:`RowNorm`: x is RMSNormed first; :class:`GatedAct`: x is ``act(x) * up``) and one after
(:class:`Residual`: the residual add; :class:`RopeKV`: q/k/v split into heads, per-head norm, RoPE and
the KV-page write). The torch reference below is that math, unfused. A backend registers a faster
implementation that chooses how to fuse it (``trellm.kernels_cuda.ops``: the EXL3 GEMV / mid-size / cuBLAS
routes, the norm in the GEMV's input transform, the residual add and the RoPE in its finishing step);
no module decides a route. Weights that add something around another's projection (a LoRA adapter) are
:class:`WrappedWeights`: they take the call and run the inner weights through ``project`` again.

:class:`Weights` is what a projection multiplies by (dense, EXL3, later others). Several projections of
one x (q/k/v, gate/up) are one grouped Weights, made once by :func:`group_weights`; its ``forward``
returns one tensor per part.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence

import attrs
import torch

from . import Op, _OPS
from .dense import gated_activation, rms_norm

__all__ = [
    "GatedAct", "Hidden", "Normed", "Residual", "RopeKV", "RowNorm", "WeightList", "Weights", "WrappedWeights",
    "group_weights", "project", "projection_input",
]


class Weights(abc.ABC):
    """The weights of one linear projection y = x W^T (+ b), in whatever format they are stored.

    ``forward`` is the plain projection (its own route choice, e.g. ``exl3_matmul``); the fused steps
    around it are :func:`project`'s. A LoRA adapter or a tensor-parallel shard is a Weights that wraps
    another.
    """

    in_features: int
    out_features: int

    @abc.abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes held on the device."""

    @abc.abstractmethod
    def dense_weight(self) -> torch.Tensor:
        """The equivalent dense weight [out, in]."""

    def decoded_nbytes(self) -> int:
        """Of :meth:`nbytes`, those of a dense copy decoded at load because no kernel runs this format on the
        device (0: none)."""
        return 0

    def grouped(self, parts: Sequence["Weights"]) -> "Weights | None":
        """``parts`` (self first, or self the first wrapper among them) as one Weights whose forward runs them
        together on one x, or None when this format cannot (then they run one by one)."""
        return None

    def expert_set(self, experts: list, device: torch.device):
        """Every expert's weights (``experts``: the MoE's ExpertMLPs, this the first one's gate) as one set the
        sync-free pair ops take (``run_pairs(x, weights, ids, activation)``), or None when this format has none."""
        return None


class WeightList(Weights):
    """Projections of one x run one after the other: the group any Weights can form."""

    def __init__(self, parts: Sequence[Weights]):
        self.parts = list(parts)
        self.in_features = self.parts[0].in_features
        self.out_features = sum(p.out_features for p in self.parts)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[override]
        return [p.forward(x) for p in self.parts]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def decoded_nbytes(self) -> int:
        return sum(p.decoded_nbytes() for p in self.parts)

    def dense_weight(self) -> torch.Tensor:
        return torch.cat([p.dense_weight() for p in self.parts])


class WrappedWeights(Weights):
    """Weights that add their own part around another Weights' projection (a LoRA adapter's update).

    :func:`project` hands a wrapper the whole call (:meth:`project`); the wrapper runs ``base`` through
    ``project`` again, so the base keeps every fused route of its format, and no route can skip the
    wrapper's part. A group with a wrapper among its parts is the wrapper's to make (:meth:`grouped`).
    """

    base: Weights

    @abc.abstractmethod
    def project(self, x: "torch.Tensor | Normed", pre: "Pre" = None, post: "Post" = None):
        """What :func:`project` returns for these weights (the reference's math, any route for the base)."""


def group_weights(parts: Sequence[Weights]) -> Weights:
    """One Weights for several projections of one x: the format's own group when it has one
    (:meth:`Weights.grouped`, e.g. EXL3 parts of one K: one kernel launch; a wrapper's group when a part is
    one), else a :class:`WeightList`."""
    lead = next((p for p in parts if isinstance(p, WrappedWeights)), parts[0])
    grouped = lead.grouped(parts) if len(parts) > 1 and isinstance(lead, Weights) else None
    return grouped if grouped is not None else WeightList(parts)


# ---- the steps around the matmul ------------------------------------------------------------------------


@attrs.frozen(eq=False)
class RowNorm:
    """Pre step: the matmul's input is ``rms_norm(x, weight, eps, unit_offset)``. ``ssq`` [rows, k / 128]
    float32, when given, holds x's sums of squares per row and 128-column group, as the projection that
    produced x returned them (:class:`Residual`): a backend may then norm x in the matmul's input transform
    (the CUDA GEMV does: no RMSNorm launch)."""

    ssq: torch.Tensor | None
    weight: torch.Tensor | None
    eps: float
    unit_offset: bool = False

    def apply(self, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """``rms_norm(x)`` (its reference with ``reference``); the sums are computed again from x."""
        norm = rms_norm.reference if reference else rms_norm
        return norm(x, self.weight, self.eps, self.unit_offset)


@attrs.frozen(eq=False)
class GatedAct:
    """Pre step: the matmul's input is ``gated_activation(x, up, activation)`` (x the gate): a gated MLP's down
    projection. A backend may apply it in the matmul's input transform."""

    up: torch.Tensor
    activation: str

    def apply(self, gate: torch.Tensor) -> torch.Tensor:
        return gated_activation(gate, self.up, self.activation)


@attrs.frozen(eq=False)
class Residual:
    """Post step: the projection is added to the residual stream's ``h``; the result is a :class:`Hidden`."""

    h: torch.Tensor


@attrs.frozen(eq=False)
class RopeKV:
    """Post step of a q/k/v group: split into heads of ``head_dim``, per-head RMSNorm (``q_norm`` / ``k_norm``
    weights, when given), RoPE from the float32 ``cos_table`` / ``sin_table`` rows at ``positions``, and k / v
    stored in the paged cache at ``slots``; the result is the rotated ``(q, k)``."""

    head_dim: int
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    positions: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    slots: torch.Tensor
    interleaved: bool = False
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm_eps: float = 1e-6
    norm_unit_offset: bool = False

    def apply(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from .attention import rotary_qk_write_kv

        t, d = q.shape[0], self.head_dim
        return rotary_qk_write_kv(q.reshape(t, -1, d), k.reshape(t, -1, d), v.reshape(t, -1, d), self.cos_table,
                                  self.sin_table, self.positions, self.k_pages, self.v_pages, self.slots,
                                  self.interleaved, self.q_norm, self.k_norm, self.norm_eps, self.norm_unit_offset)


@attrs.frozen(eq=False)
class Hidden:
    """A hidden state of the residual stream: ``x + residual`` (``residual`` None: x itself), the add left to
    whoever norms it next (``add_rms_norm``: one launch for both), and x's sums of squares per row and
    128-column group (``ssq``) where the projection that made it summed them."""

    x: torch.Tensor
    residual: torch.Tensor | None = None
    ssq: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def value(self) -> torch.Tensor:
        """The hidden state as one tensor (the add, when one is pending)."""
        return self.x if self.residual is None else self.x + self.residual


@attrs.define(eq=False)
class Normed:
    """A projection input given as ``norm.apply(x)`` (an RMSNorm), not computed yet: :func:`project` hands
    ``norm`` to a backend that applies it inside the matmul; anything else takes :meth:`value` (once)."""

    x: torch.Tensor
    norm: RowNorm
    _value: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def dim(self) -> int:
        return self.x.dim()

    def value(self) -> torch.Tensor:
        if self._value is None:
            self._value = self.norm.apply(self.x)
        return self._value


def tensor(x: torch.Tensor | Normed) -> torch.Tensor:
    """x itself, or a :class:`Normed` input computed."""
    return x.value() if isinstance(x, Normed) else x


# ---- the op ------------------------------------------------------------------------------------------------

Pre = RowNorm | GatedAct | None
Post = Residual | RopeKV | None


def projection_input(x: torch.Tensor | Normed, pre: Pre = None) -> torch.Tensor:
    """The matmul's input as a tensor: x (a :class:`Normed` x computed) with ``pre`` applied."""
    x = tensor(x)
    return x if pre is None else pre.apply(x)


def _project_reference(x: torch.Tensor | Normed, weights: Weights, pre: Pre = None, post: Post = None):
    """``weights.forward(pre(x))``, then ``post``: the unfused math.

    Returns the projection (one tensor per part for a grouped Weights); with :class:`Residual`, a
    :class:`Hidden` whose add is left to the next norm; with :class:`RopeKV`, the rotated ``(q, k)``.
    """
    y = weights.forward(projection_input(x, pre))
    if post is None:
        return y
    if isinstance(post, Residual):
        return Hidden(y, post.h)
    return post.apply(*y)


class ProjectOp(Op):
    """:func:`project`: dispatched on the device of x (or of a :class:`Normed` x's input); a
    :class:`WrappedWeights` takes the call itself."""

    def __call__(self, x, weights, pre: Pre = None, post: Post = None):
        if isinstance(weights, WrappedWeights):
            return weights.project(x, pre, post)
        t = x.x if isinstance(x, Normed) else x
        if t.device.type == "cpu":
            return self.reference(x, weights, pre, post)
        return self.implementation(t.device.type)(x, weights, pre, post)


project = ProjectOp("project", _project_reference)
_OPS["project"] = project
