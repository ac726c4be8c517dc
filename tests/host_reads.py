"""What a CUDA graph capture refuses, looked for on CPU: a step that reads a device tensor on the host (``.tolist()``,
``.item()``, ``bool()``/``int()``, ``.cpu()``) or copies host data to the device (``torch.tensor(data, device=...)``,
a tensor made without a device and then used beside the step's tensors or moved to them, a Python list as an
index). On CPU both are the same device, so :class:`HostReads` tracks which tensors the step made on the host: those
a factory (``torch.arange``, ``torch.zeros``, ``torch.tensor`` ...) made without ``device=``, and what is computed
from them alone. Every tensor that existed before is taken for a device tensor (weights, cache, the step's inputs).
"""
from __future__ import annotations

import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode

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


class HostReads(TorchFunctionMode):
    """A torch function mode collecting ``found``: (what, where) of each host read or host-to-device copy."""

    def __init__(self):
        super().__init__()
        self._host = weakref.WeakValueDictionary()  # id -> tensor made on the host during the step
        self.found: list[tuple[str, str]] = []

    def _is_host(self, t: torch.Tensor) -> bool:
        return self._host.get(id(t)) is t

    def _flag(self, what: str) -> None:
        self.found.append((what, "".join(traceback.format_stack(limit=8)[:-2])))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
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
