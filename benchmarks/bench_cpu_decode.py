"""Batch-1 CPU decode and prefill speed on SmolLM2-135M-Instruct: trellm vs HF transformers, same process.

    python benchmarks/bench_cpu_decode.py [--tokens 64] [--prefill 1920] [--repeat 3] [--threads N]

Prints tokens/s for each and the ratio. Decode: both run fp32 greedy decoding with a KV cache from the
same prompt, after one warm-up run each. Prefill: the time to the first token of a ``--prefill``-token
prompt (0 skips it); transformers computes the last position's logits only, as its ``generate`` does.
Each figure is the best of ``--repeat`` runs, the engines taking turns, so that a change in the machine's
load falls on all of them alike (the load average is printed beside). ``trellm (reference ops)`` is trellm
with ``TRELLM_OPS=reference``: every op's plain torch reference, the CPU route before the CPU ops
(``trellm.ops`` ops with a ``"cpu"`` implementation, as attention).
"""
from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import trellm
from trellm.default_model import default_model_dir


@contextmanager
def reference_ops(on: bool):
    """``TRELLM_OPS=reference`` inside (when ``on``)."""
    before = os.environ.get("TRELLM_OPS")
    if on:
        os.environ["TRELLM_OPS"] = "reference"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRELLM_OPS", None)
        else:
            os.environ["TRELLM_OPS"] = before


def trellm_engine(lm, reference: bool):
    """(decode(ids, n) -> tokens, prefill(ids)) for trellm, on its CPU ops or on the references."""
    def decode(ids, n):
        with reference_ops(reference):
            return list(lm.generate_ids(ids, max_new_tokens=n, stop_token_ids=[]))

    def prefill(ids):
        with reference_ops(reference):
            list(lm.generate_ids(ids, max_new_tokens=1, stop_token_ids=[]))

    return decode, prefill


def hf_engine(model):
    def decode(ids, n):
        x = torch.tensor([ids])
        kw = dict(attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            return model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)[0, len(ids):].tolist()

    def prefill(ids):
        x = torch.tensor([ids])
        with torch.inference_mode():
            model(x, attention_mask=torch.ones_like(x), use_cache=True, logits_to_keep=1).logits[0, -1].argmax()

    return decode, prefill


def best_times(engines: dict, run, repeat: int) -> dict[str, float]:
    """Best wall seconds of ``run(name, engine)`` per engine, over ``repeat`` rounds in which each takes a turn."""
    best = {name: float("inf") for name in engines}
    for _ in range(repeat):
        for name, engine in engines.items():
            t = time.perf_counter()
            run(name, engine)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=1920, help="prompt tokens for the prefill timing (0: skip)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine; the best counts")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    model_dir = default_model_dir()
    lm = trellm.load(model_dir, device="cpu", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engines = {"trellm": trellm_engine(lm, False), "trellm (reference ops)": trellm_engine(lm, True),
               "transformers": hf_engine(hf)}
    ids = lm.tokenizer.encode("Write a short story about a lighthouse keeper who")
    outputs = {name: decode(ids, 4) for name, (decode, _) in engines.items()}  # warm-up
    decode_s = best_times(engines, lambda name, e: outputs.__setitem__(name, e[0](ids, args.tokens)), args.repeat)
    same = len({tuple(out) for out in outputs.values()}) == 1
    load = os.getloadavg()[0]
    print(f"SmolLM2-135M fp32, batch 1, {torch.get_num_threads()} threads, best of {args.repeat}; "
          f"load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"decode {args.tokens} tokens after a {len(ids)}-token prompt (same greedy tokens: {same})")
    print(f"{'engine':<24}{'tokens/s':>10}{'vs transformers':>17}")
    for name, s in decode_s.items():
        print(f"{name:<24}{args.tokens / s:>10.1f}{decode_s['transformers'] / s:>16.2f}x")
    if args.prefill:
        text = (Path(trellm.__file__).parent / "data" / "eval.txt").read_text()
        long_ids = (lm.tokenizer.encode(text) * 8)[: args.prefill]
        prefill_s = best_times(engines, lambda name, e: e[1](long_ids), args.repeat)
        print(f"prefill {len(long_ids)} tokens (time to the first token); load average {os.getloadavg()[0]:.1f}")
        print(f"{'engine':<24}{'seconds':>10}{'tokens/s':>10}{'vs transformers':>17}")
        for name, s in prefill_s.items():
            print(f"{name:<24}{s:>10.2f}{len(long_ids) / s:>10.0f}{prefill_s['transformers'] / s:>16.2f}x")


if __name__ == "__main__":
    main()
