"""End-to-end speed of a Llama-3.1-8B-shaped model with random EXL3 weights, built from trellm.ops.

Batch-1 decode: one step (32 layers: norms, q/k/v/o, RoPE, paged-KV write and attention, gated MLP,
lm_head) captured in one CUDA graph and replayed; tokens/s is printed next to the bandwidth ideal
(all weight bytes / the copy bandwidth measured in the same run). Prompt processing: one
2048-token prefill chunk, eager. Random weights: the speed is what is measured, not the output.

    python benchmarks/bench_decode.py [--bits 4 2] [--layers 32] [--profile]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, kernel_profile, print_kernel_profile, time_graph  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 8, 128, 14336, 128256
PAGE = 16


def exl3_layer(k: int, n: int, K: int):
    return (
        torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), device="cuda", dtype=torch.int16),
        (torch.randn(k, device="cuda") * 0.02).half(),
        (torch.randn(n, device="cuda") * 0.02).half(),
    )


def nbytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in layer)


class Model:
    def __init__(self, layers: int, K: int, head_K: int, max_tokens: int, codebook: str = "mcg"):
        self.codebook = codebook
        self.layers = []
        for _ in range(layers):
            self.layers.append(
                dict(
                    q=exl3_layer(HIDDEN, HEADS * HEAD_DIM, K),
                    k=exl3_layer(HIDDEN, KV_HEADS * HEAD_DIM, K),
                    v=exl3_layer(HIDDEN, KV_HEADS * HEAD_DIM, K),
                    o=exl3_layer(HEADS * HEAD_DIM, HIDDEN, K),
                    gate=exl3_layer(HIDDEN, INTER, K),
                    up=exl3_layer(HIDDEN, INTER, K),
                    down=exl3_layer(INTER, HIDDEN, K),
                    norm1=torch.rand(HIDDEN, device="cuda", dtype=torch.float16) + 0.5,
                    norm2=torch.rand(HIDDEN, device="cuda", dtype=torch.float16) + 0.5,
                )
            )
        self.head = exl3_layer(HIDDEN, VOCAB, head_K)
        self.final_norm = torch.rand(HIDDEN, device="cuda", dtype=torch.float16) + 0.5
        self.embed = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.float16) * 0.02
        pages = (max_tokens + PAGE - 1) // PAGE
        self.k_pages = [torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16) for _ in range(layers)]
        self.v_pages = [torch.randn_like(p) for p in self.k_pages]
        self.block_table = torch.arange(pages, device="cuda", dtype=torch.int32).view(1, pages)
        inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
        pos = torch.arange(max_tokens, device="cuda").float()
        ang = pos[:, None] * inv[None, :]
        self.cos, self.sin = ang.cos(), ang.sin()

    def weight_bytes(self) -> int:
        total = nbytes(self.head) + self.embed[0].numel() * 2
        for L in self.layers:
            total += sum(nbytes(L[n]) for n in ("q", "k", "v", "o", "gate", "up", "down")) + 4 * HIDDEN
        return total

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, ctx: torch.Tensor, group: bool = True,
                qkv_rope: bool = True, summed: bool = True, all_logits: bool = False):
        """One step; ``group``: q/k/v and gate/up each in one ``exl3_matmul_group`` launch and the down
        projection as ``exl3_matmul_gated`` (as the model does); otherwise one launch per op.
        ``qkv_rope`` (with ``group``): RoPE and the KV write inside the q/k/v launch
        (``exl3_qkv_rope_write_kv``, as the model does), else in a launch of their own.
        ``summed`` (with ``group``): o_proj and down add the residual and sum the squares in their launch
        (``exl3_matmul_add``, ``exl3_matmul_gated_add``) and q/k/v and gate/up norm their input from those
        sums (``row_norm``), as the model does; else an ``add_rms_norm`` launch before each block.
        ``all_logits``: the head for every row (a batched decode step: one row per sequence), else the last."""
        from trellm import ops
        from trellm.ops import exl3
        from trellm.ops.attention import rotary_qk_write_kv

        mm = exl3.exl3_matmul
        cb = self.codebook
        t = tokens.shape[0]
        h = self.embed[tokens]
        slots = positions.to(torch.int64)  # one sequence, pages in order
        residual, ssq = None, None
        summed = summed and group

        def pre_norm(h, residual, ssq, weight):
            """(the block's input, its row_norm or None, the residual stream). residual None: h is the
            whole hidden state (the embeddings, or a summed projection's output)."""
            if residual is None and ssq is not None:
                return h, ops.RowNorm(ssq, weight, 1e-5, False), h
            if residual is None:
                return ops.rms_norm(h, weight, 1e-5), None, h
            x, residual = ops.add_rms_norm(h, residual, weight, 1e-5)
            return x, None, residual

        for i, L in enumerate(self.layers):
            x, norm, residual = pre_norm(h, residual, ssq, L["norm1"])
            qkv = [(*L[p], None) for p in ("q", "k", "v")]
            if group and qkv_rope:
                q, _ = exl3.exl3_qkv_rope_write_kv(x, qkv, cb, HEAD_DIM, self.cos, self.sin, positions,
                                                   self.k_pages[i], self.v_pages[i], slots, row_norm=norm)
            else:
                if group:
                    q, k, v = exl3.exl3_matmul_group(x, qkv, cb, norm)
                else:
                    q, k, v = (mm(x, *L[p], cb) for p in ("q", "k", "v"))
                q, k, v = q.view(t, HEADS, HEAD_DIM), k.view(t, KV_HEADS, HEAD_DIM), v.view(t, KV_HEADS, HEAD_DIM)
                q, _ = rotary_qk_write_kv(q, k, v, self.cos, self.sin, positions, self.k_pages[i], self.v_pages[i], slots)
            a = ops.paged_attention(q, self.k_pages[i], self.v_pages[i], self.block_table, cu, ctx)
            if summed:
                h, ssq = exl3.exl3_matmul_add(a.view(t, HIDDEN), *L["o"], cb, None, residual)
                residual = None  # h holds it now (ssq None past 16 rows: the next norm reads h itself)
            else:
                h = mm(a.view(t, HIDDEN), *L["o"], cb)
            x, norm, residual = pre_norm(h, residual, ssq, L["norm2"])
            if group:
                g, u = exl3.exl3_matmul_group(x, [(*L[p], None) for p in ("gate", "up")], cb, norm)
                if summed:
                    h, ssq = exl3.exl3_matmul_gated_add(g, u, "silu", *L["down"], cb, None, residual)
                    residual = None
                else:
                    h = exl3.exl3_matmul_gated(g, u, "silu", *L["down"], cb)
            else:
                g, u = mm(x, *L["gate"], cb), mm(x, *L["up"], cb)
                h = mm(ops.gated_activation(g, u, "silu"), *L["down"], cb)
        if residual is None:
            x = ops.rms_norm(h, self.final_norm, 1e-5)
        else:
            x, _ = ops.add_rms_norm(h, residual, self.final_norm, 1e-5)
        return mm(x if all_logits else x[-1:], *self.head, cb)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, nargs="*", default=[4, 2])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=512, help="cached tokens before the decode step")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--profile", action="store_true", help="also print each kernel's time in the decode step")
    args = ap.parse_args()

    from trellm.kernels_cuda import ops as _cuda_ops  # noqa: F401  (registers the CUDA implementations)

    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; {args.layers} layers, 8B shapes")
    for K in args.bits:
        model = Model(args.layers, K, 6, max(args.context + 1, args.prompt))
        wb = model.weight_bytes()
        # Decode: batch 1 at position `context`.
        tok = torch.tensor([123], device="cuda")
        pos = torch.tensor([args.context], device="cuda")
        cu = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
        ctx = torch.tensor([args.context + 1], device="cuda", dtype=torch.int32)
        from trellm.kernels_cuda import binding

        t_sep = time_graph(lambda: model.forward(tok, pos, cu, ctx, group=False), reps=20)
        binding.set_pdl(False)
        t_nopdl = time_graph(lambda: model.forward(tok, pos, cu, ctx), reps=20)
        # Back to the default (on). set_pdl returns the NEW state: restoring with what set_pdl(False) returned
        # left PDL off for every later graph (NOTES 2026-12-04a).
        binding.set_pdl(True)
        t_rope_apart = time_graph(lambda: model.forward(tok, pos, cu, ctx, qkv_rope=False), reps=20)
        t_norm_apart = time_graph(lambda: model.forward(tok, pos, cu, ctx, summed=False), reps=20)
        t_step = time_graph(lambda: model.forward(tok, pos, cu, ctx), reps=20)
        ideal = wb / bw
        print(f"decode K={K}, RoPE + KV write in a launch of their own: {t_rope_apart * 1e3:.3f} ms/token "
              f"(inside the q/k/v launch: {t_rope_apart / t_step:.3f}x faster)", flush=True)
        print(f"decode K={K}, residual add + RMSNorm in add_rms_norm launches: {t_norm_apart * 1e3:.3f} ms/token "
              f"(in the GEMVs' finishing step and input transform: {t_norm_apart / t_step:.3f}x faster)", flush=True)
        print(f"decode K={K}, one launch per projection: {t_sep * 1e3:.3f} ms/token = {1 / t_sep:.0f} tokens/s; "
              f"grouped q/k/v, gate/up without programmatic dependent launch: {t_nopdl * 1e3:.3f} ms = "
              f"{1 / t_nopdl:.0f} tokens/s (final figure below: {t_sep / t_step:.2f}x and {t_nopdl / t_step:.2f}x faster)", flush=True)
        print(
            f"decode K={K} (head 6 bpw): {t_step * 1e3:.3f} ms/token = {1 / t_step:.0f} tokens/s; "
            f"weights {wb / 1e9:.2f} GB, bandwidth ideal {ideal * 1e3:.3f} ms = {1 / ideal:.0f} tokens/s "
            f"({100 * ideal / t_step:.0f}% of ideal)",
            flush=True,
        )
        if args.profile:
            print_kernel_profile(kernel_profile(lambda: model.forward(tok, pos, cu, ctx)), t_step)
        # Prompt processing: one chunk of `prompt` tokens from position 0.
        n = args.prompt
        toks = torch.randint(0, VOCAB, (n,), device="cuda")
        poss = torch.arange(n, device="cuda")
        cu_p = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        ctx_p = torch.tensor([n], device="cuda", dtype=torch.int32)
        model.forward(toks, poss, cu_p, ctx_p)
        torch.cuda.synchronize()
        reps = 3
        t0 = time.perf_counter()
        for _ in range(reps):
            model.forward(toks, poss, cu_p, ctx_p)
        torch.cuda.synchronize()
        t_pp = (time.perf_counter() - t0) / reps
        print(f"prefill K={K}: {n} tokens in {t_pp * 1e3:.1f} ms = {n / t_pp:.0f} tokens/s", flush=True)
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
