"""One Kimi delta attention (KDA) decode step of a GLM 5.3-Flash layer on each ``TRELLM_KDA_DECODE`` route,
next to the bandwidth limit of the state it must read and write.

    python benchmarks/bench_kda_step.py                         # GLM 5.3-Flash: 64 heads of 128, batch 1 8 32 64
    python benchmarks/bench_kda_step.py --batch 1 16 --dtype float16 --lower-bound none
    python benchmarks/bench_kda_step.py --profile               # + each route's kernels and launches per step
    python benchmarks/bench_kda_step.py --device cpu --batch 2  # CPU smoke run of the reference route, eager

The step takes the layer's raw decode inputs (the conv output q | k | v, the forget-gate input f, beta's b) and
updates each sequence's float32 state slot [H, Dk, Dv] in place, as the layer does: "reference" runs the torch
ops (L2 norms, gates, the recurrence; what the default route runs on CUDA), "kernel" the same glue around the
recurrence kernel (``kda_step_slots``), "fused" everything in one launch (``kimi_delta_attention_step_slots``).
Each route is captured in a CUDA graph over enough independent copies of the states that every replay reads
them from memory, not from the L2 (a model has one per layer). The state read and write bound the step:
2 * B * H * Dk * Dv * 4 bytes, over the copy bandwidth measured in this process (H200: about 4.8 TB/s nominal).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copies_for, copy_bandwidth, kernel_profile, l2_bytes, print_kernel_profile, time_graph  # noqa: E402

from trellm import ops  # noqa: E402
from trellm.ops.deltanet import KDA_DECODE_ENV, KDA_DECODE_ROUTES, kda_inputs  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def layer_inputs(batch: int, heads: int, dk: int, dv: int, dtype: torch.dtype, device: str, seed: int) -> dict:
    """A KDA layer's raw decode inputs for ``batch`` sequences and their state slots (rows in a shuffled order)."""
    g = torch.Generator().manual_seed(seed)
    t = dict(
        mixed=torch.randn(batch, heads * (2 * dk + dv), generator=g).to(dtype),
        f=torch.randn(batch, heads * dk, generator=g).to(dtype), b=torch.randn(batch, heads, generator=g).to(dtype),
        A_log=torch.rand(heads, generator=g) * 2, dt_bias=torch.randn(heads * dk, generator=g),
        states=torch.randn(batch, heads, dk, dv, generator=g) * 0.1, slots=torch.randperm(batch, generator=g),
    )
    return {n: x.to(device) for n, x in t.items()}


def decode_step(route: str, t: dict, heads: int, dk: int, lower_bound: float | None) -> torch.Tensor:
    """The layer's decode step on ``route`` (KimiDeltaAttention.forward's, from its conv output on)."""
    args = (t["mixed"], t["f"], t["b"], t["A_log"], t["dt_bias"])
    if route == "fused":
        return ops.kimi_delta_attention_step_slots(*args, t["states"], t["slots"], None, heads, dk, lower_bound)
    q, k, v, g, beta = kda_inputs(*args, heads, dk, lower_bound)
    return ops.kda_step_slots(q, k, v, g, beta, t["states"], t["slots"], None)


def cpu_seconds(fn, reps: int) -> float:
    """Median seconds of one eager call on the CPU (the smoke run)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128, help="Dk = Dv (GLM 5.3-Flash: 128)")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--lower-bound", default="-5", help="the decay's lower bound, or 'none' (softplus decay)")
    ap.add_argument("--routes", nargs="+", choices=KDA_DECODE_ROUTES, default=list(KDA_DECODE_ROUTES))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="each route's kernels per step (torch profiler)")
    args = ap.parse_args()

    cuda = args.device.startswith("cuda")
    heads, d, dtype = args.heads, args.head_dim, DTYPES[args.dtype]
    lower_bound = None if args.lower_bound.lower() == "none" else float(args.lower_bound)
    routes = args.routes if cuda else ["reference"]
    bandwidth = copy_bandwidth() if cuda else None
    if cuda:
        print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s measured "
              f"(H200 nominal 4.8 TB/s)")
    print(f"# KDA decode step: {heads} heads, Dk = Dv = {d}, {args.dtype} inputs, float32 state, lower bound "
          f"{lower_bound}")
    print(f"{'batch':>5} {'route':>9} {'us/step':>9} {'R+W MB':>9} {'GB/s':>8} {'% copy bw':>9} {'vs reference':>12}")
    for batch in args.batch:
        state_bytes = 2 * batch * heads * d * d * 4  # each slot read and written once
        copies = copies_for(state_bytes, l2_bytes()) if cuda else 1
        sets = [layer_inputs(batch, heads, d, d, dtype, args.device, seed) for seed in range(copies)]
        times = {}
        for route in routes:
            os.environ[KDA_DECODE_ENV] = route
            run = lambda: [decode_step(route, t, heads, d, lower_bound) for t in sets]  # noqa: E731
            seconds = time_graph(run, reps=args.reps) if cuda else cpu_seconds(run, args.reps)
            times[route] = seconds / copies
            rate = state_bytes / times[route]
            share = f"{100 * rate / bandwidth:8.1f}%" if bandwidth else f"{'-':>9}"
            speedup = times["reference"] / times[route] if "reference" in times else float("nan")
            print(f"{batch:>5} {route:>9} {times[route] * 1e6:>9.1f} {state_bytes / 1e6:>9.2f} {rate / 1e9:>8.1f} "
                  f"{share} {speedup:>11.2f}x")
            if args.profile and cuda:
                step = lambda: decode_step(route, sets[0], heads, d, lower_bound)  # noqa: E731
                print_kernel_profile(kernel_profile(step), times[route])
        if bandwidth:
            print(f"{batch:>5} {'limit':>9} {state_bytes / bandwidth * 1e6:>9.1f} {state_bytes / 1e6:>9.2f} "
                  f"{bandwidth / 1e9:>8.1f} {100.0:>8.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
