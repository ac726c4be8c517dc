"""bench_decode.py's decode step (the fused non-matmul ops) next to the same step unfused, in one run.

bench_decode.py's step runs ``rotary_qk_write_kv`` (RoPE of q and k by position + the KV-page write in
one launch) and ``add_rms_norm`` (residual add + norm). The unfused step launches RoPE of q, RoPE of k
and the page write separately (cos/sin gathered once per step), and the residual add apart from the
norm. Both group q/k/v and gate/up into one launch each; same random EXL3 weights, same graph-replay
timing. Prints ms/token, tokens/s and the speedup, then checks that both steps give the same logits.
``--split-keys`` times the fused step again with other minimum key counts per attention split (the
TRELLM_ATTN_SPLIT_KEYS knob).

    python benchmarks/bench_decode_fused.py [--bits 4] [--layers 32] [--context 512] [--split-keys 256 64]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as base
from common import copy_bandwidth, time_graph


class UnfusedModel(base.Model):
    def forward_unfused(self, tokens: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, ctx: torch.Tensor):
        from trellm import ops
        from trellm.ops import exl3

        mm = exl3.exl3_matmul
        t = tokens.shape[0]
        h = self.embed[tokens]
        cos, sin = self.cos[positions], self.sin[positions]
        residual = None
        for i, L in enumerate(self.layers):
            residual = h if residual is None else residual + h
            x = ops.rms_norm(residual, L["norm1"], 1e-5)
            q, k, v = exl3.exl3_matmul_group(x, [(*L[p], None) for p in ("q", "k", "v")], "mcg")
            q = ops.rotary_embedding(q.view(t, base.HEADS, base.HEAD_DIM), cos, sin)
            k = ops.rotary_embedding(k.view(t, base.KV_HEADS, base.HEAD_DIM), cos, sin)
            ops.write_kv_pages(k, v.view(t, base.KV_HEADS, base.HEAD_DIM), self.k_pages[i], self.v_pages[i], positions)
            a = ops.paged_attention(q, self.k_pages[i], self.v_pages[i], self.block_table, cu, ctx)
            residual = residual + mm(a.view(t, base.HIDDEN), *L["o"], "mcg")
            x = ops.rms_norm(residual, L["norm2"], 1e-5)
            g, u = exl3.exl3_matmul_group(x, [(*L[p], None) for p in ("gate", "up")], "mcg")
            h = mm(ops.gated_activation(g, u, "silu"), *L["down"], "mcg")
        x = ops.rms_norm(residual + h, self.final_norm, 1e-5)
        return mm(x[-1:], *self.head, "mcg")


def measure(K: int, args: argparse.Namespace) -> None:
    """Time the unfused and the fused decode step of one random model at K bits per weight."""
    model = UnfusedModel(args.layers, K, 6, max(args.context + 1, args.cache_tokens))
    tok = torch.tensor([123], device="cuda")
    pos = torch.tensor([args.context], device="cuda")
    cu = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
    ctx = torch.tensor([args.context + 1], device="cuda", dtype=torch.int32)
    t_unfused = time_graph(lambda: model.forward_unfused(tok, pos, cu, ctx), reps=20)
    t_fused = time_graph(lambda: model.forward(tok, pos, cu, ctx), reps=20)
    for name, t in (("unfused", t_unfused), ("fused", t_fused)):
        print(f"decode K={K} {name}: {t * 1e3:.3f} ms/token = {1 / t:.0f} tokens/s", flush=True)
    print(f"decode K={K}: fused saves {(t_unfused - t_fused) * 1e3:.3f} ms/token ({t_unfused / t_fused:.3f}x)")
    for keys in args.split_keys:  # the split count is fixed when the graph is captured
        os.environ["TRELLM_ATTN_SPLIT_KEYS"] = str(keys)
        t = time_graph(lambda: model.forward(tok, pos, cu, ctx), reps=20)
        os.environ.pop("TRELLM_ATTN_SPLIT_KEYS")
        print(f"decode K={K} fused, >= {keys} keys per attention split: {t * 1e3:.3f} ms/token = {1 / t:.0f} tokens/s")
    y_unfused = model.forward_unfused(tok, pos, cu, ctx).float()
    y_fused = model.forward(tok, pos, cu, ctx).float()
    if not torch.isfinite(y_unfused).all():
        print(f"decode K={K}: random-weight logits not finite; fused vs unfused not compared")
    else:
        err = ((y_unfused - y_fused).norm() / y_unfused.norm().clamp_min(1e-30)).item()
        verdict = "ok" if err < 2e-2 else "MISMATCH"
        print(f"decode K={K}: logits relative difference fused vs unfused {err:.2e} ({verdict})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, nargs="*", default=[4])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=512, help="cached tokens before the decode step")
    ap.add_argument("--cache-tokens", type=int, default=2048, help="cache size (bench_decode.py: its --prompt)")
    ap.add_argument("--split-keys", type=int, nargs="*", default=[256, 128, 64],
                    help="also time the fused step with these minimum keys per attention split (128: the default)")
    args = ap.parse_args()

    from trellm.kernels_cuda import ops as _cuda_ops  # noqa: F401  (registers the CUDA implementations)

    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; {args.layers} layers, 8B shapes")
    for K in args.bits:
        measure(K, args)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
