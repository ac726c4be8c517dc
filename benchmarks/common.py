"""Timing helpers shared by the GPU benchmarks: graph-replay timing and the measured copy bandwidth."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_graph(fn: Callable[[], object], reps: int = 20, warmup: int = 2) -> float:
    """Median seconds of one replay of a CUDA graph capturing ``fn()`` (launch gaps shrink to the GPU's)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del g
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    # An SM copy kernel (torch.neg), not cudaMemcpy: inside a graph a memcpy node runs on the copy
    # engines, which are slower than the SMs and are not what kernels compete with.
    t = time_graph(lambda: torch.neg(src, out=dst), reps=20)
    del src, dst
    return 2 * nbytes / t


def copies_for(nbytes: int, cache_bytes: int) -> int:
    """How many independent copies of a working set rotate so repeated runs miss the L2 (3x its size)."""
    return max(1, -(-3 * cache_bytes // max(nbytes, 1)))


def l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))


def time_eager(fn: Callable[[], object], reps: int = 20, warmup: int = 2) -> float:
    """Median seconds of one eager call (for code that cannot be captured, e.g. with host syncs)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)
