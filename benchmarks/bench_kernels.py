"""Dense and attention kernels against the bandwidth limit and against their torch references on the GPU.

Each row: kernel time (a CUDA graph of CHAIN back-to-back calls, its replay divided by CHAIN: a
graph holding one short kernel times mostly its own launch), the bytes it must move, effective
GB/s, % of the copy bandwidth measured in the same run, and the torch reference's time on the same
GPU.

    python benchmarks/bench_kernels.py
    python benchmarks/bench_kernels.py --only viterbi   # one section: dense, attention or viterbi
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, time_eager, time_graph  # noqa: E402

CHAIN = 10  # calls per timed graph


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("dense", "attention", "viterbi"), help="run one section only")
    args = ap.parse_args()
    from trellm.kernels_cuda import ops as cuda_ops  # noqa: F401

    if args.only in (None, "dense", "attention"):
        _bandwidth_sections(args.only)
    if args.only in (None, "viterbi"):
        _viterbi_section()
    return 0


def _bandwidth_sections(only: str | None) -> None:
    from trellm import ops
    from trellm.ops import exl3

    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'kernel':<46} {'us':>8} {'GB/s':>7} {'%copy':>6} {'torch_us':>9} {'speedup':>8}", flush=True)
    dt = torch.float16

    def report(name, fn_cuda, fn_ref, nbytes):
        t = time_graph(lambda: [fn_cuda() for _ in range(CHAIN)]) / CHAIN  # the list keeps each output apart
        t_ref = time_eager(fn_ref)  # references may sync with the host: not capturable
        print(
            f"{name:<46} {t * 1e6:>8.1f} {nbytes / t / 1e9:>7.0f} {100 * nbytes / t / bw:>5.0f}% "
            f"{t_ref * 1e6:>9.1f} {t_ref / t:>7.2f}x",
            flush=True,
        )

    for rows in (1, 2048) if only in (None, "dense") else ():
        x = torch.randn(rows, 4096, device="cuda", dtype=dt)
        r = torch.randn_like(x)
        w = torch.randn(4096, device="cuda", dtype=dt)
        nb = x.numel() * 2 * 2
        report(f"rms_norm [{rows},4096]", lambda: ops.rms_norm.impls["cuda"](x, w, 1e-6),
               lambda: ops.rms_norm.reference(x, w, 1e-6), nb)
        report(f"add_rms_norm [{rows},4096]", lambda: ops.add_rms_norm.impls["cuda"](x, r, w, 1e-6),
               lambda: ops.add_rms_norm.reference(x, r, w, 1e-6), nb * 2)
        report(f"hadamard_128 [{rows},4096]", lambda: exl3.hadamard_128.impls["cuda"](x),
               lambda: exl3.hadamard_128.reference(x), nb)
        g = torch.randn(rows, 14336, device="cuda", dtype=dt)
        u = torch.randn_like(g)
        report(f"gated_activation silu [{rows},14336]", lambda: ops.gated_activation.impls["cuda"](g, u, "silu"),
               lambda: ops.gated_activation.reference(g, u, "silu"), g.numel() * 2 * 3)
        q = torch.randn(rows, 32, 128, device="cuda", dtype=dt)
        ang = torch.randn(rows, 64, device="cuda")
        c, s = ang.cos(), ang.sin()
        report(f"rotary neox [{rows},32,128]", lambda: ops.rotary_embedding.impls["cuda"](q, c, s),
               lambda: ops.rotary_embedding.reference(q, c, s), q.numel() * 2 * 2 + c.numel() * 8)

    # Paged attention decode: Llama-3.1-8B heads (32 q / 8 kv, d=128), page 16; a cache of `cap` tokens
    # per sequence (a server's cache is sized for the longest request, most are shorter).
    cases = ((1, 512, 512), (1, 512, 32768), (1, 4096, 4096), (8, 4096, 4096), (32, 2048, 2048))
    for batch, ctx, cap in cases if only in (None, "attention") else ():
        page = 16
        blocks = cap // page
        kp = torch.randn(batch * blocks, page, 8, 128, device="cuda", dtype=dt)
        vp = torch.randn_like(kp)
        bt = torch.arange(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
        cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        cl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, 32, 128, device="cuda", dtype=dt)
        nb = batch * ctx * 8 * 128 * kp.element_size() * 2  # the K and V rows read
        report(
            f"paged_attention decode b{batch} ctx{ctx}" + (f" cache {cap}" if cap != ctx else ""),
            lambda: ops.paged_attention.impls["cuda"](q, kp, vp, bt, cu, cl),
            lambda: ops.paged_attention.reference(q, kp, vp, bt, cu, cl),
            nb,
        )


def _viterbi_section() -> None:
    """Trellis Viterbi encoder (conversion): a correctness check against the torch reference on 1001
    tiles (enough for the kernel to run several tiles per block, with one spare slot), then weights/s."""
    from trellm.ops import exl3

    for K in (2, 3, 4, 5, 6, 8):
        cb = ("3inst", "mcg", "mul1")[K % 3]
        torch.manual_seed(K)
        targets = torch.randn(1001, 256, device="cuda") * 1.2
        states = exl3.trellis_viterbi.impls["cuda"](targets, K, cb)
        ref = exl3.trellis_viterbi.reference(targets, K, cb)
        lut = exl3.codebook_lut(cb, "cuda", torch.float32)
        valid = torch.equal(states >> K, torch.roll(states, 1, dims=1) & ((1 << (16 - K)) - 1))
        err = ((lut[states.long()] - targets) ** 2).sum(1)
        err_ref = ((lut[ref.long()] - targets) ** 2).sum(1)
        ok = valid and bool(torch.all(err <= err_ref * 1.02 + 1e-4))
        print(f"trellis_viterbi check K={K} ({cb}): valid={valid} err/ref={(err.sum() / err_ref.sum()).item():.5f} "
              f"same={(states == ref).float().mean().item():.3f} {'OK' if ok else 'FAIL'}", flush=True)
    for K in (2, 3, 4, 5, 6, 8):
        tiles = 4096
        targets = torch.randn(tiles, 256, device="cuda") * 1.2
        t = time_eager(lambda: exl3.trellis_viterbi.impls["cuda"](targets, K, "mcg"), reps=3, warmup=1)
        print(f"trellis_viterbi K={K} ({tiles} tiles, mcg)   {t * 1e3:>8.1f} ms  {tiles * 256 / t / 1e6:>6.1f} M weights/s "
              f"(target 20)", flush=True)

if __name__ == "__main__":
    raise SystemExit(main())
