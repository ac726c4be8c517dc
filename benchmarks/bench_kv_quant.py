"""KV-cache quantize / dequantize kernels (kernels_cuda/kv_quant.cu) against the copy bandwidth.

Each row: kernel time (CUDA graph replay over enough independent copies of the data to miss the L2),
the bytes it must move (fp K/V rows one way, packed codes + fp16 scales the other), effective GB/s,
% of the device-to-device copy bandwidth measured in the same run, and the torch reference's time.
Shapes: one layer's K of Llama-3.1-8B (8 kv heads x 128 = 1024 values per token), fp16.

    python benchmarks/bench_kv_quant.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copies_for, copy_bandwidth, l2_bytes, time_eager, time_graph  # noqa: E402

KV_WIDTH = 8 * 128
PAGE_SIZE = 16


def main() -> int:
    from trellm.kernels_cuda import binding
    from trellm.ops.kv_quant import GROUP, kv_dequantize, kv_quantize

    bw = copy_bandwidth()
    l2 = l2_bytes()
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s, L2 {l2 >> 20} MiB")
    print(f"{'kernel':<44} {'us':>8} {'GB/s':>7} {'%copy':>6} {'torch_us':>9} {'speedup':>8}", flush=True)
    dt = torch.float16

    def report(name, make_call, ref_call, nbytes):
        # Rotate copies past the L2; decode-sized calls stop at 32 (their data sits in the L2 anyway,
        # and a graph of 10^5 launches measures the launches).
        copies = min(copies_for(nbytes, l2), 32)
        calls = [make_call(i) for i in range(copies)]
        t = time_graph(lambda: [c() for c in calls]) / copies  # the list keeps each call's output apart
        t_ref = time_eager(ref_call)
        print(f"{name:<44} {t * 1e6:>8.2f} {nbytes / t / 1e9:>7.0f} {100 * nbytes / t / bw:>5.0f}% "
              f"{t_ref * 1e6:>9.1f} {t_ref / t:>7.1f}x", flush=True)

    for bits in (2, 4, 8):
        packed_row_bytes = KV_WIDTH // GROUP * (bits * 4 + 2)
        # quantize: decode (a batch's new tokens) and prefill chunks, written to scattered cache slots
        for tokens in (1, 32, 2048, 8192):
            slots_total = max(4 * tokens, 1024)
            xs = [torch.randn(tokens, KV_WIDTH, device="cuda", dtype=dt)
                  for _ in range(min(copies_for(tokens * KV_WIDTH * 2, l2), 32))]
            packed = torch.empty(slots_total, KV_WIDTH // GROUP * bits, dtype=torch.int32, device="cuda")
            scales = torch.empty(slots_total, KV_WIDTH // GROUP, dtype=torch.float16, device="cuda")
            slots = torch.randperm(slots_total, device="cuda")[:tokens]
            nbytes = tokens * (KV_WIDTH * 2 + packed_row_bytes + 8)
            report(f"kv_quantize_store {bits}b [{tokens},{KV_WIDTH}]",
                   lambda i: (lambda: binding.kv_quantize_store(xs[i % len(xs)], bits, packed, scales, slots)),
                   lambda: kv_quantize.reference(xs[0], bits), nbytes)
        # dequantize: the pages of a decode batch's contexts (fused page gather) and a flat prefill range
        for batch, ctx in ((1, 4096), (32, 2048)):
            rows = batch * ctx
            n_pages = rows // PAGE_SIZE
            x = torch.randn(rows, KV_WIDTH, device="cuda", dtype=dt)
            p, s = binding.kv_quantize(x, bits)
            pages = torch.randperm(n_pages, device="cuda")
            nbytes = rows * (KV_WIDTH * 2 + packed_row_bytes) + n_pages * 8

            def pages_call(i, p=p, s=s, pages=pages):  # copy i of the cache, so replays miss the L2
                pc, sc = (p, s) if i == 0 else (p.clone(), s.clone())
                pc, sc = pc.view(n_pages, PAGE_SIZE, -1), sc.view(n_pages, PAGE_SIZE, -1)
                return lambda: binding.kv_dequantize_pages(pc, sc, pages, bits, dt)

            def flat_call(i, p=p, s=s):
                pc, sc = (p, s) if i == 0 else (p.clone(), s.clone())
                return lambda: binding.kv_dequantize(pc, sc, bits, dt)

            report(f"kv_dequantize_pages {bits}b b{batch} ctx{ctx}", pages_call,
                   lambda: kv_dequantize.reference(p.view(n_pages, PAGE_SIZE, -1)[pages].view(rows, -1),
                                                   s.view(n_pages, PAGE_SIZE, -1)[pages].view(rows, -1), bits, dt),
                   nbytes)
            report(f"kv_dequantize {bits}b [{rows},{KV_WIDTH}]", flat_call,
                   lambda: kv_dequantize.reference(p, s, bits, dt), rows * (KV_WIDTH * 2 + packed_row_bytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
