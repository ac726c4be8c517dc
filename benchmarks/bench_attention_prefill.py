"""Paged-attention prefill: the per-token kernel (attention.cu) against the tiled one (attention_prefill.cu).

Llama-3.1-8B heads (32 q / 8 kv, d = 128), page 16 in a shuffled page order, one sequence of ``--tokens``
new query tokens after ``--cached`` tokens already in the cache. Times are CUDA-graph replays
(benchmarks/common.py); TFLOP/s counts the causal work only: 4 * hq * d * (tokens * cached + tokens^2 / 2).

    python benchmarks/bench_attention_prefill.py
    python benchmarks/bench_attention_prefill.py --tokens 2048 --cached 2048   # a second prefill chunk
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_graph  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="new query tokens (default 2048)")
    ap.add_argument("--cached", type=int, default=0, help="tokens already in the cache before them")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    from trellm.kernels_cuda import binding

    binding.lib()
    t, c, hq, hkv, d, ps = args.tokens, args.cached, args.hq, args.hkv, args.head_dim, args.page_size
    ctx = c + t
    blocks = (ctx + ps - 1) // ps
    flops = 4 * hq * d * (t * c + t * t / 2)
    print(f"# {torch.cuda.get_device_name()}: {t} query tokens after {c} cached, {hq} q / {hkv} kv heads, d {d}, "
          f"page {ps}")
    print(f"{'dtype':<9} {'per-token us':>13} {'TFLOP/s':>8} {'tiled us':>10} {'TFLOP/s':>8} {'speedup':>8} {'rel diff':>9}",
          flush=True)
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        kp = torch.randn(blocks, ps, hkv, d, device="cuda", dtype=dtype)
        vp = torch.randn_like(kp)
        bt = torch.randperm(blocks, device="cuda").to(torch.int32).view(1, blocks)
        cu = torch.tensor([0, t], device="cuda", dtype=torch.int32)
        cl = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        q = torch.randn(t, hq, d, device="cuda", dtype=dtype)
        scale = d**-0.5
        old = binding.paged_attention(q, kp, vp, bt, cu, cl, scale)
        new = binding.paged_attention_prefill(q, kp, vp, bt, cu, cl, scale)
        diff = ((new.double() - old.double()).norm() / old.double().norm()).item()
        t_old = time_graph(lambda: binding.paged_attention(q, kp, vp, bt, cu, cl, scale), reps=10)
        t_new = time_graph(lambda: binding.paged_attention_prefill(q, kp, vp, bt, cu, cl, scale), reps=20)
        print(f"{str(dtype).removeprefix('torch.'):<9} {t_old * 1e6:>13.1f} {flops / t_old / 1e12:>8.1f} "
              f"{t_new * 1e6:>10.1f} {flops / t_new / 1e12:>8.1f} {t_old / t_new:>7.1f}x {diff:>9.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
