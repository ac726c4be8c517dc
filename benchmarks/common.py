"""Timing helpers shared by the GPU benchmarks: graph-replay timing and the measured copy bandwidth."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def capture_graph(fn: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn()`` (after ``warmup`` eager calls on the capture stream), replayed once."""
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
    return g


def replay_seconds(graph, reps: int = 20) -> float:
    """Median seconds of one replay of a captured CUDA graph, on the inputs it holds now."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def time_graph(fn: Callable[[], object], reps: int = 20, warmup: int = 2) -> float:
    """Median seconds of one replay of a CUDA graph capturing ``fn()`` (launch gaps shrink to the GPU's)."""
    g = capture_graph(fn, warmup)
    seconds = replay_seconds(g, reps)
    del g
    return seconds


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


def kernel_profile(fn: Callable[[], object], reps: int = 10) -> list[tuple[str, int, float]]:
    """Per-kernel GPU time of one replay of a CUDA graph capturing ``fn()``: (kernel, launches, us).

    The graph is replayed ``reps`` times under the torch profiler (CUPTI records the kernels a graph
    launches); counts and times are per replay, longest first. With programmatic dependent launch
    the kernels overlap, so the times can sum to more than the step.
    """
    from torch.profiler import ProfilerActivity, profile

    g = capture_graph(fn, warmup=1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = short_kernel_name(evt.name)
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += evt.time_range.elapsed_us()
    del g
    rows = [(name, round(n / reps), us / reps) for name, (n, us) in totals.items()]
    return sorted(rows, key=lambda r: -r[2])


def short_kernel_name(name: str) -> str:
    """``void ns::kernel<4, 1, ...>(Args)`` -> ``kernel<4, 1, ...>``: template arguments kept, they tell K/MT apart."""
    name = name.replace("(anonymous namespace)::", "")
    name = name[5:] if name.startswith("void ") else name
    head, bracket, targs = name.split("(")[0].partition("<")
    return head.split("::")[-1] + (bracket + targs)[:40]


def print_kernel_profile(rows: list[tuple[str, int, float]], step_s: float) -> None:
    """The table of ``kernel_profile``, each kernel's share of the step time ``step_s``."""
    total = sum(us for _, _, us in rows)
    print(f"  {'kernel':<58} {'launches':>8} {'us/step':>9} {'% of step':>9}")
    for name, n, us in rows:
        print(f"  {name:<58} {n:>8} {us:>9.1f} {100 * us / (step_s * 1e6):>8.1f}%")
    print(f"  {'sum of kernel times':<58} {sum(n for _, n, _ in rows):>8} {total:>9.1f} {100 * total / (step_s * 1e6):>8.1f}%")


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (and says so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    return plt


def save_figure(plt, fig, path, title: str = "") -> bool:
    """Title (if any), tight layout, save, close: the end of every benchmark plot."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot saved to {path}")
    return True
