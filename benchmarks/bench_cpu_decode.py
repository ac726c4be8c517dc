"""Batch-1 CPU decode and prefill speed on SmolLM2-135M-Instruct: trellm vs HF transformers, same process.

    python benchmarks/bench_cpu_decode.py [--tokens 64] [--prefill 1920] [--threads N]

Prints tokens/s for each and the ratio. Decode: both run fp32 greedy decoding with a KV cache from the
same prompt, after one warm-up run each. Prefill: the time to the first token of a ``--prefill``-token
prompt (0 skips it), best of two runs each.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

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


def time_prefill(lm, hf, ids) -> tuple[float, float]:
    """Seconds to the first token of ``ids`` (best of two) for trellm and transformers."""
    def best(fn):
        times = []
        for _ in range(2):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    x = torch.tensor([ids])
    with torch.inference_mode():
        tr = best(lambda: list(lm.generate_ids(ids, max_new_tokens=1, stop_token_ids=[])))
        hf_s = best(lambda: hf(x, attention_mask=torch.ones_like(x), use_cache=True).logits[0, -1].argmax())
    return tr, hf_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=1920, help="prompt tokens for the prefill timing (0: skip)")
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
    if args.prefill:
        text = (Path(trellm.__file__).parent / "data" / "eval.txt").read_text()
        long_ids = (lm.tokenizer.encode(text) * 8)[: args.prefill]
        tr_s, hf_s = time_prefill(lm, hf, long_ids)
        print(f"prefill {len(long_ids)} tokens: trellm {tr_s:.2f} s ({len(long_ids) / tr_s:.0f} tokens/s), "
              f"transformers {hf_s:.2f} s ({len(long_ids) / hf_s:.0f} tokens/s); trellm/transformers time {tr_s / hf_s:.2f}x")


if __name__ == "__main__":
    main()
