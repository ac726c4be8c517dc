"""What a CUDA graph capture refuses, looked for on CPU: a step that reads a device tensor on the host (``.tolist()``,
``.item()``, ``bool()``/``int()``, ``.cpu()``) or copies host data to the device (``torch.tensor(data, device=...)``,
a tensor made without a device and then used beside the step's tensors or moved to them, a Python list as an
index). On CPU both are the same device, so :class:`HostReads` tracks which tensors the step made on the host: those
a factory (``torch.arange``, ``torch.zeros``, ``torch.tensor`` ...) made without ``device=``, and what is computed
from them alone. Every tensor that existed before is taken for a device tensor (weights, cache, the step's inputs).
``HostReads(except_in=cuda_kernel_ops())`` looks at nothing inside the ops the CUDA backend runs as kernels: on the GPU
their kernels run instead of the torch references (which may loop on the host), and their own CUDA tests capture them.
"""
from __future__ import annotations

import sys
import traceback
import weakref
from collections.abc import Collection

import torch
from torch.overrides import TorchFunctionMode

from trellm import ops

FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.randn, torch.rand, torch.randint,
             torch.linspace, torch.eye, torch.randperm, torch.tensor, torch.as_tensor}
HOST_DATA = {torch.tensor, torch.as_tensor}  # with device=: a copy from host memory
READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_select, torch.index_select,
            torch.Tensor.gather, torch.gather, torch.Tensor.index_put_, torch.Tensor.index_add_, torch.Tensor.scatter_}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _int_list(x) -> bool:
    return isinstance(x, list) and any(isinstance(i, int) for i in x) or isinstance(x, tuple) and any(map(_int_list, x))


def cuda_kernel_ops() -> set[str]:
    """The names of the trellm ops the CUDA backend registers kernels for. Without a GPU its module is imported
    against a stand-in library (registering touches no kernel)."""
    if "trellm.kernels_cuda.ops" not in sys.modules:
        from trellm.kernels_cuda import binding

        stand_in = binding._lib is None
        if stand_in:
            binding._lib = object()  # the import only asks for a library; nothing calls into it
        try:
            import trellm.kernels_cuda.ops  # noqa: F401
        finally:
            if stand_in:
                binding._lib = None
    return {name for name, o in ops.all_ops().items() if "cuda" in o.impls}


class HostReads(TorchFunctionMode):
    """A torch function mode collecting ``found``: (what, where) of each host read or host-to-device copy, outside
    the trellm ops named ``except_in`` (whose outputs count as device tensors)."""

    def __init__(self, except_in: Collection[str] = ()):
        super().__init__()
        self._host = weakref.WeakValueDictionary()  # id -> tensor made on the host during the step
        self.found: list[tuple[str, str]] = []
        self.except_in = except_in
        self._excepted = 0  # depth of excepted op calls in progress
        self._op_call = None

    def __enter__(self):
        self._op_call = call = ops.Op.__call__

        def call_excepted(op, *args, **kwargs):
            if op.name not in self.except_in:
                return call(op, *args, **kwargs)
            self._excepted += 1
            try:
                return call(op, *args, **kwargs)
            finally:
                self._excepted -= 1

        ops.Op.__call__ = call_excepted
        return super().__enter__()

    def __exit__(self, *exc):
        ops.Op.__call__ = self._op_call
        return super().__exit__(*exc)

    def _is_host(self, t: torch.Tensor) -> bool:
        return self._host.get(id(t)) is t

    def _flag(self, what: str) -> None:
        self.found.append((what, "".join(traceback.format_stack(limit=8)[:-2])))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._excepted:
            return func(*args, **kwargs)
        ins = [*_tensors(args), *_tensors(kwargs)]
        host = [t for t in ins if self._is_host(t)]
        device = [t for t in ins if not self._is_host(t)]
        name = getattr(func, "__name__", str(func))
        moved = func in MOVES and ("device" in kwargs or any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args[1:]))
        if func in READS and device:
            self._flag(f"{name}() reads a device tensor on the host")
        elif func in HOST_DATA and "device" in kwargs:
            self._flag(f"{name}(..., device=) copies host data to the device")
        elif moved and host:
            self._flag(f"{name}() copies a tensor made on the host to the device")
        elif host and device and (func in INDEXING or any(t.dim() for t in host)):
            self._flag(f"{name}() takes a tensor made on the host beside device tensors")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and device and _int_list(args[1]):
            self._flag(f"{name}() indexes a device tensor with a Python list (copied to the device)")
        out = func(*args, **kwargs)
        if func in FACTORIES:
            made_on_host = "device" not in kwargs
        else:
            made_on_host = bool(ins) and not device and not moved and func not in READS
        for t in _tensors(out) if made_on_host else ():
            self._host[id(t)] = t
        return out
