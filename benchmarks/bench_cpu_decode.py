"""Batch-1 CPU decode speed on SmolLM2-135M-Instruct: trellm vs HF transformers, same process.

    python benchmarks/bench_cpu_decode.py [--tokens 64] [--threads N]

Prints tokens/s for each and the ratio. Both run fp32 greedy decoding with a KV cache from the
same prompt, after one warm-up run each.
"""
from __future__ import annotations

import argparse
import time

import torch

import trellm
from trellm.default_model import default_model_dir


def time_trellm(lm, ids, n):
    list(lm.generate_ids(ids, max_new_tokens=4, stop_token_ids=[]))  # warm-up
    t = time.perf_counter()
    out = list(lm.generate_ids(ids, max_new_tokens=n, stop_token_ids=[]))
    return n / (time.perf_counter() - t), out


def time_hf(model, ids, n):
    x = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(x, max_new_tokens=4, min_new_tokens=4, **kw)
        t = time.perf_counter()
        out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
    return n / (time.perf_counter() - t), out[0, len(ids):].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    model_dir = default_model_dir()
    lm = trellm.load(model_dir, device="cpu", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = lm.tokenizer.encode("Write a short story about a lighthouse keeper who")
    tr_tps, tr_out = time_trellm(lm, ids, args.tokens)
    hf_tps, hf_out = time_hf(hf, ids, args.tokens)
    print(f"SmolLM2-135M fp32, batch 1, {args.tokens} tokens, {torch.get_num_threads()} threads, prompt {len(ids)} tokens")
    print(f"{'engine':<14}{'tokens/s':>10}")
    print(f"{'trellm':<14}{tr_tps:>10.1f}")
    print(f"{'transformers':<14}{hf_tps:>10.1f}")
    print(f"ratio trellm/transformers: {tr_tps / hf_tps:.2f}x   (same greedy tokens: {tr_out == hf_out})")


if __name__ == "__main__":
    main()
