"""The collectives of one tensor-parallel model: data (all-reduce, all-gather) and rank 0's step messages.

Its own process groups, made from a store (not torch's default group), so one process may hold several
tensor-parallel models and a ``torchrun`` script keeps its own default group. ``data`` carries
activations (NCCL on CUDA, gloo on CPU); ``ctrl`` (gloo) carries each step's pickled inputs from rank 0.
Every collective waits at most the step timeout, except a worker's wait for the header of rank 0's next
message: that one lasts as long as the user leaves the model idle (``IDLE_TIMEOUT``).
"""
from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

IDLE_TIMEOUT = datetime.timedelta(days=7)  # how long a worker waits for rank 0's next call


def _gloo(store: Any, rank: int, world: int, timeout: datetime.timedelta, loopback: bool) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback
                     else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world, opts)


def _nccl(store: Any, rank: int, world: int, timeout: datetime.timedelta) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, opts)


class Comm:
    """One rank's view of the group: ``rank``, ``world``, its ``device`` and the collectives modules call."""

    def __init__(self, store: Any, rank: int, world: int, device: torch.device, step_timeout: float,
                 loopback: bool = True):
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.timeout = datetime.timedelta(seconds=step_timeout)
        self.ctrl = _gloo(dist.PrefixStore("ctrl/", store), rank, world, self.timeout, loopback)
        if self.device.type == "cuda":
            self.data = _nccl(dist.PrefixStore("data/", store), rank, world, self.timeout)
        else:
            self.data = self.ctrl

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place on a contiguous x; returns the sum)."""
        x = x.contiguous()
        self.data.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (same shape everywhere) concatenated along the last dim, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.data.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def send(self, message: Any) -> None:
        """Rank 0: hand ``message`` (picklable; tensors on the CPU) to every other rank."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.ctrl.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0, IDLE_TIMEOUT).wait()
        self.ctrl.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0).wait()

    def receive(self) -> Any:
        """Ranks > 0: wait (as long as rank 0 stays idle) for rank 0's next message."""
        header = torch.zeros(1, dtype=torch.int64)
        self.ctrl.broadcast(header, 0, IDLE_TIMEOUT).wait()
        payload = torch.empty(int(header.item()), dtype=torch.uint8)
        self.ctrl.broadcast(payload, 0).wait()
        return pickle.loads(payload.numpy().tobytes())

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank (over ``ctrl``: for rare agreements, not steps)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self.ctrl.allgather([sizes], [torch.tensor([payload.numel()], dtype=torch.int64)]).wait()
        longest = max(int(n.item()) for n in sizes)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        self.ctrl.allgather([parts], [torch.nn.functional.pad(payload, (0, longest - payload.numel()))]).wait()
        return [pickle.loads(p[: int(n.item())].numpy().tobytes()) for p, n in zip(parts, sizes)]

    def close(self) -> None:
        """Drop the process groups (their sockets close, so peers still waiting see an error)."""
        for group in {id(self.ctrl): self.ctrl, id(self.data): self.data}.values():
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - a group already broken by a dead peer
                pass
