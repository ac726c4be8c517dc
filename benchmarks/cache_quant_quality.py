"""Quality cost of the quantized KV cache: KL divergence of next-token distributions vs an fp16 cache.

    python benchmarks/cache_quant_quality.py                  # SmolLM2, a few hundred tokens of text
    python benchmarks/cache_quant_quality.py --tokens 1024 --chunk 128 --model /path/to/hf-dir

The text is prefilled through the paged cache in chunks, so every position attends to keys and
values read back from the cache (quantized ones included, the current chunk too). For each
(k_bits, v_bits) setting it prints mean KL(fp16-cache || quantized-cache) per position, its 99th
percentile, and how often the top-1 token agrees.
"""
from __future__ import annotations

import argparse
import inspect
import time

import torch

import trellm
from trellm.batch import ForwardBatch
from trellm.cache import KVCache, SequenceState
from trellm.cache.quantized import quantized_layer_factory

SETTINGS = [(8, 8), (6, 6), (5, 5), (4, 4), (4, 3), (3, 4), (3, 3), (4, 2), (2, 4), (2, 2)]


def sample_text() -> str:
    """Plain English prose shipped with Python itself (module docs), so the script needs no download."""
    import argparse as a
    import json
    import textwrap
    import unittest

    return "\n\n".join(inspect.getdoc(m) or "" for m in (a, json, unittest, textwrap))


@torch.inference_mode()
def logprobs_through_cache(model, ids: list[int], cache: KVCache, chunk: int) -> torch.Tensor:
    """Log-probabilities [T, vocab] of every position, prefilled chunk by chunk through ``cache``."""
    seq = SequenceState(cache)
    seq.reserve(len(ids))
    out = []
    try:
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            batch = ForwardBatch.with_cache([piece], [seq.length], [seq.pages], cache, all_logits=True)
            out.append(torch.log_softmax(model.forward(batch).float(), dim=-1))
            seq.length += len(piece)
    finally:
        seq.release()
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--settings", default=None, help="e.g. 8:8,4:4,4:2 (k_bits:v_bits)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default; 1 is faster on a busy machine)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from trellm.default_model import default_model_dir

        args.model = default_model_dir()
    lm = trellm.load(args.model, device=args.device)
    ids = lm.tokenizer.encode(sample_text())[: args.tokens]
    settings = [tuple(int(b) for b in s.split(":")) for s in args.settings.split(",")] if args.settings else SETTINGS
    print(f"model {lm!r}, {len(ids)} tokens, chunks of {args.chunk}, reference: fp16 cache")

    def cache(factory=None, dtype=torch.float16) -> KVCache:
        return KVCache.for_model(lm.model, max_tokens=len(ids), page_size=args.page_size, dtype=dtype, layer_factory=factory)

    reference = logprobs_through_cache(lm.model, ids, cache(), args.chunk)
    fp32 = logprobs_through_cache(lm.model, ids, cache(dtype=torch.float32), args.chunk)
    rows = [("fp32", fp32)]
    print(f"{'cache':>8} {'bits/val':>8} {'mean KL':>10} {'p99 KL':>10} {'top-1 agree':>12} {'time s':>7}")

    def report(name: str, bits: float, lp: torch.Tensor, seconds: float) -> None:
        kl = (reference.exp() * (reference - lp)).sum(-1).clamp_min(0)
        agree = (reference.argmax(-1) == lp.argmax(-1)).float().mean().item()
        print(f"{name:>8} {bits:8.2f} {kl.mean().item():10.5f} {kl.quantile(0.99).item():10.5f} {agree:12.1%} {seconds:7.1f}", flush=True)

    report(*rows[0][:1], 32.0, fp32, 0.0)
    for k_bits, v_bits in settings:
        t0 = time.time()
        lp = logprobs_through_cache(lm.model, ids, cache(quantized_layer_factory(k_bits, v_bits)), args.chunk)
        # storage per value: the code bits plus one fp16 scale per 32 values
        report(f"K{k_bits}V{v_bits}", (k_bits + v_bits) / 2 + 16 / 32, lp, time.time() - t0)


if __name__ == "__main__":
    main()
