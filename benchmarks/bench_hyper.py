"""One block's hyper-connection (mHC) on each ``TRELLM_HYPER_CONNECTIONS`` route: its weights (the streams
through fn, the Sinkhorn-normalised mix, the block input) and the merge of the block's output back, next to the
bytes they must move.

    python benchmarks/bench_hyper.py                     # GLM 5.3-Flash: 4 streams of 4096, 20 Sinkhorn iterations
    python benchmarks/bench_hyper.py --dim 7168 --tokens 1 16 --profile   # DeepSeek V4's width; kernels per route

A decoder layer runs two (attention and MLP): GLM 5.3-Flash's 45 layers 90 per decode step. The torch route
launches ~140 small kernels per block's weights (6 per Sinkhorn iteration), which at batch 1 costs far more than
its bytes: fn float32 [(2 + N) * N, N * D] read once per call, the streams read twice and written once. Each route
is captured in a CUDA graph over enough copies of fn and the streams that replays read them from memory.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copies_for, copy_bandwidth, kernel_profile, l2_bytes, print_kernel_profile, time_graph  # noqa: E402

from trellm.ops.hyper import (  # noqa: E402
    HYPER_CONNECTIONS_ENV, HYPER_CONNECTIONS_ROUTES, hyper_connection_merge, hyper_connection_weights,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def block_inputs(tokens: int, n: int, d: int, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    mixes = (2 + n) * n
    t = dict(streams=torch.randn(tokens, n, d, generator=g).to(dtype), fn=torch.randn(mixes, n * d, generator=g) * 0.01,
             base=torch.randn(mixes, generator=g), scale=torch.rand(3, generator=g) + 0.5,
             out=torch.randn(tokens, d, generator=g).to(dtype))
    return {k: v.cuda() for k, v in t.items()}


def block(t: dict, iters: int) -> torch.Tensor:
    """The block's hyper-connection as HyperDecoderLayer runs it (the block itself left out)."""
    _, post, comb = hyper_connection_weights(t["streams"], t["fn"], t["base"], t["scale"], iters, 1e-6, 1e-6)
    return hyper_connection_merge(t["streams"], t["out"], post, comb)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--sinkhorn-iters", type=int, default=20)
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="each route's kernels per call (torch profiler)")
    args = ap.parse_args()

    n, d, dtype = args.streams, args.dim, DTYPES[args.dtype]
    bandwidth = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s measured (H200 nominal 4.8 TB/s)")
    print(f"# one block's hyper-connection: {n} streams of {d}, {args.sinkhorn_iters} Sinkhorn iterations, {args.dtype}")
    print(f"{'tokens':>6} {'route':>9} {'us/block':>9} {'MB moved':>9} {'GB/s':>8} {'% copy bw':>9} {'vs reference':>12}")
    for tokens in args.tokens:
        stream_bytes = tokens * n * d * dtype.itemsize
        moved = (2 + n) * n * n * d * 4 + 4 * stream_bytes  # fn; streams read twice, new streams written, block input
        copies = copies_for(moved, l2_bytes())
        sets = [block_inputs(tokens, n, d, dtype, seed) for seed in range(copies)]
        times = {}
        for route in HYPER_CONNECTIONS_ROUTES:
            os.environ[HYPER_CONNECTIONS_ENV] = route
            times[route] = time_graph(lambda: [block(t, args.sinkhorn_iters) for t in sets], reps=args.reps) / copies
            rate = moved / times[route]
            print(f"{tokens:>6} {route:>9} {times[route] * 1e6:>9.1f} {moved / 1e6:>9.2f} {rate / 1e9:>8.1f} "
                  f"{100 * rate / bandwidth:>8.1f}% {times['reference'] / times[route]:>11.2f}x")
            if args.profile:
                print_kernel_profile(kernel_profile(lambda: block(sets[0], args.sinkhorn_iters)), times[route])
        print(f"{tokens:>6} {'limit':>9} {moved / bandwidth * 1e6:>9.1f} {moved / 1e6:>9.2f} {bandwidth / 1e9:>8.1f} "
              f"{100.0:>8.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
