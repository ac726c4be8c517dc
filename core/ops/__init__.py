"""Numeric primitives used by the modules, each with a torch reference implementation.

Every op is one :class:`Op` object. Its reference is plain torch (device-agnostic, the oracle in
tests); a faster backend (``trellm.kernels_cuda``) registers an implementation with
:meth:`Op.register`. A call dispatches on the device of the first tensor argument: CUDA tensors go
to the CUDA implementation when it is registered and ``TRELLM_OPS=reference`` is not set. A few ops
also register a ``"cpu"`` implementation (torch's fused CPU kernels where the reference's plain math
costs several times more, as attention's scores matrix); the rest run their reference on CPU.
This is llama.cpp's test-backend-ops idea: tests hold each backend against the reference.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

__all__ = ["Op", "op", "all_ops", "load_backends"]

_OPS: dict[str, "Op"] = {}
_backends_loaded = False


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            return a
    return None


class Op:
    """A named primitive: a torch reference plus optional per-device-type implementations."""

    def __init__(self, name: str, reference: Callable[..., Any]):
        self.name = name
        self.reference = reference
        self.impls: dict[str, Callable[..., Any]] = {}
        self.__doc__ = reference.__doc__
        self.__wrapped__ = reference

    def register(self, device_type: str) -> Callable[[Callable], Callable]:
        """Decorator registering a faster implementation for ``device_type`` (e.g. ``"cuda"``)."""

        def deco(fn: Callable) -> Callable:
            self.impls[device_type] = fn
            return fn

        return deco

    def implementation(self, device_type: str) -> Callable[..., Any]:
        if os.environ.get("TRELLM_OPS", "") != "reference":
            if device_type != "cpu":
                load_backends()
            impl = self.impls.get(device_type)
            if impl is not None:
                return impl
        return self.reference

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = _first_tensor(args, kwargs)
        device_type = "cpu" if t is None else t.device.type
        if device_type == "cpu" and "cpu" not in self.impls:
            return self.reference(*args, **kwargs)
        return self.implementation(device_type)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<trellm op {self.name} impls={sorted(self.impls) or ['reference']}>"


def op(fn: Callable[..., Any]) -> Op:
    """Declare ``fn`` as the torch reference of a new op named after it."""
    if fn.__name__ in _OPS:
        raise ValueError(f"op {fn.__name__!r} is declared twice")
    o = Op(fn.__name__, fn)
    _OPS[fn.__name__] = o
    return o


def all_ops() -> dict[str, Op]:
    """Every declared op by name (this package imports the modules that declare the core ones)."""
    return dict(_OPS)


def route_from_env(name: str, choices: tuple[str, ...], default: str) -> str:
    """The route an environment variable picks among ``choices`` (``default`` when unset): how a backend's
    alternative kernels (e.g. ``TRELLM_MOE_DECODE``) are chosen for timing and as fallbacks."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {choices}")
    return value


def load_backends() -> None:
    """Import optional backends once; a backend that cannot load (no nvcc, no cffi) is skipped."""
    global _backends_loaded
    if _backends_loaded:
        return
    _backends_loaded = True
    if not torch.cuda.is_available():
        return
    try:
        from trellm.kernels_cuda import ops as _cuda_ops  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the machine
        import warnings

        warnings.warn(f"trellm: CUDA kernels unavailable, using torch reference ops ({e})")


# The op catalogue: each module declares its ops with @op. Imported last so ``op`` exists.
from .dense import (  # noqa: E402,F401
    add_rms_norm,
    gated_activation,
    layer_norm,
    rms_norm,
    rotary_embedding,
)
from .attention import attention_varlen, paged_attention, write_kv_pages  # noqa: E402,F401
from .projection import (  # noqa: E402,F401
    GatedAct, Hidden, Normed, Residual, RopeKV, RowNorm, Weights, WrappedWeights, project, projection_input,
)
from . import compressed, exl3, hyper, moe, sparse  # noqa: E402,F401
from .deltanet import (  # noqa: E402,F401
    causal_conv1d,
    causal_conv1d_step,
    causal_conv1d_step_slots,
    gated_delta_rule_chunked,
    gated_delta_rule_step,
    gated_delta_net_step_slots,
    gated_delta_rule_step_slots,
    gated_rms_norm,
    kda_chunked,
    kda_step_slots,
    kimi_delta_attention_step_slots,
    ssd_chunked,
    ssd_step,
)
from .kv_quant import kv_dequantize, kv_dequantize_pages, kv_quantize, kv_quantize_store  # noqa: E402,F401
from .lora import lora_add, lora_add_parts  # noqa: E402,F401
