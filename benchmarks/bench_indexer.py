"""The DSA lightning indexer's decode step (``sparse_index_topk``: GLM 5, DeepSeek V3.2 / V4) on each
``TRELLM_SPARSE_INDEX`` route, beside the time its keys take to read at the measured copy bandwidth.

    python benchmarks/bench_indexer.py                                  # 64 heads of 128, top-2048, 4k/16k/64k, batch 1/8/32
    python benchmarks/bench_indexer.py --contexts 131072 --batch 1 --profile
    python benchmarks/bench_indexer.py --capacity 65536        # tables as wide as a 64k-token cache's graphs see

Each sequence holds ``context`` bf16 keys in pages of ``--page-size`` tokens; one decode step scores them all for
its one new token and keeps the top k. The floor is the keys' bytes over the copy bandwidth (the kernel reads each
visible key once per token; its [T, W] float32 logits and torch's top-k over them come on top, and are timed apart:
"logits" is the kernel alone, "kernel" the whole route). The reference scores every token against the whole block
table in torch while that stays under ``INDEX_GATHER_MAX_PAIRS`` (token, key) pairs, captured in a graph as the
kernel's route is; past it, it loops over the sequences with host reads and is timed eagerly ("ref (eager)").
Keys rotate over enough copies that replays read them from memory, not the L2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    copies_for, copy_bandwidth, kernel_profile, l2_bytes, print_kernel_profile, time_eager, time_graph,
)

from trellm.ops import sparse  # noqa: E402
from trellm.ops.sparse import SPARSE_INDEX_ENV, sparse_index_topk  # noqa: E402


def decode_step_inputs(batch: int, context: int, capacity: int, heads: int, dim: int, page_size: int, seed: int) -> dict:
    """One decode step's arguments: ``batch`` sequences of ``context`` keys on scattered pages, one query each, in a
    block table spanning ``capacity`` tokens (as the Generator's graphs span the cache)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_seq = -(-context // page_size)
    key_pages = torch.randn(batch * pages_per_seq, page_size, dim, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.zeros(batch, max(pages_per_seq, -(-capacity // page_size)), dtype=torch.int32, device="cuda")
    table[:, :pages_per_seq] = torch.randperm(batch * pages_per_seq, device="cuda", generator=g).view(batch, -1)
    return dict(
        q=torch.randn(batch, heads, dim, device="cuda", generator=g).to(torch.bfloat16),
        weights=torch.randn(batch, heads, device="cuda", generator=g) * heads**-0.5,
        key_pages=key_pages, block_table=table,
        cu_seqlens=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        key_counts=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        positions=torch.full((batch,), context - 1, dtype=torch.long, device="cuda"),
    )


def step(t: dict, topk: int, scale: float) -> torch.Tensor:
    return sparse_index_topk(t["q"], t["weights"], t["key_pages"], t["block_table"], t["cu_seqlens"], t["key_counts"],
                             t["positions"], topk, scale)


def logits_only(t: dict, scale: float) -> torch.Tensor:
    from trellm.kernels_cuda import binding

    return binding.sparse_index_logits(t["q"], t["weights"], t["key_pages"], t["block_table"], t["cu_seqlens"],
                                       t["key_counts"], t["positions"], scale, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=0,
                    help="tokens each block-table row spans (the Generator's graphs: the cache's capacity); 0: the context")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="the kernel route's kernels per step (torch profiler)")
    args = ap.parse_args()

    from trellm.kernels_cuda import ops as _cuda_ops  # noqa: F401  (builds the library, registers the kernels)

    scale = args.dim**-0.5
    bandwidth = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s measured (H200 nominal 4.8 TB/s)")
    print(f"# one DSA indexer decode step: {args.heads} heads of {args.dim}, bf16 keys in pages of {args.page_size}, "
          f"top-{args.topk}, block tables spanning {args.capacity or 'the context'} tokens; floor = keys read / copy "
          f"bandwidth; % = floor / time")
    print(f"{'context':>7} {'batch':>5} {'keys MB':>8} {'floor us':>8} {'logits us':>9} {'%':>5} {'kernel us':>9} "
          f"{'%':>5} {'reference us':>13} {'kernel vs ref':>13}")
    for context in args.contexts:
        for batch in args.batch:
            key_bytes = batch * context * args.dim * 2
            copies = copies_for(key_bytes, l2_bytes())
            sets = [decode_step_inputs(batch, context, args.capacity, args.heads, args.dim, args.page_size, seed)
                    for seed in range(copies)]
            floor = key_bytes / bandwidth
            os.environ[SPARSE_INDEX_ENV] = "kernel"
            t_logits = time_graph(lambda: [logits_only(t, scale) for t in sets], reps=args.reps) / copies
            t_kernel = time_graph(lambda: [step(t, args.topk, scale) for t in sets], reps=args.reps) / copies
            os.environ[SPARSE_INDEX_ENV] = "reference"
            ref_sets = sets[:2]  # the reference is slow: two sets, fewer reps
            run_ref = lambda: [step(t, args.topk, scale) for t in ref_sets]  # noqa: E731
            captured = batch * sets[0]["block_table"].shape[1] * args.page_size <= sparse.INDEX_GATHER_MAX_PAIRS
            t_ref = (time_graph if captured else time_eager)(run_ref, reps=max(3, args.reps // 4)) / len(ref_sets)
            ref = f"{t_ref * 1e6:.1f}" + ("" if captured else " (eager)")
            print(f"{context:>7} {batch:>5} {key_bytes / 1e6:>8.1f} {floor * 1e6:>8.1f} {t_logits * 1e6:>9.1f} "
                  f"{100 * floor / t_logits:>4.0f}% {t_kernel * 1e6:>9.1f} {100 * floor / t_kernel:>4.0f}% {ref:>13} "
                  f"{t_ref / t_kernel:>12.1f}x")
            if args.profile:
                os.environ[SPARSE_INDEX_ENV] = "kernel"
                print_kernel_profile(kernel_profile(lambda: step(sets[0], args.topk, scale)), t_kernel)
            del sets
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
