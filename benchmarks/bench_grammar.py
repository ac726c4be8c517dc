"""Constrained decoding cost: decode tokens/s with and without a JSON schema, and the grammar engines compared.

    python benchmarks/bench_grammar.py                                   # SmolLM2 on CPU, batch 1 and 16
    python benchmarks/bench_grammar.py --device cuda --dtype bfloat16 --batch-sizes 1,16 --new-tokens 256
    python benchmarks/bench_grammar.py --engines                         # llguidance vs xgrammar (if installed)
    python benchmarks/bench_grammar.py --device cpu --async-scheduling on --batch-sizes 16 --new-tokens 32

Each batch size runs the same jobs twice in one process, plain and under a JSON schema (an array of
profiles that cannot close within ``--new-tokens``, so both runs decode the same number of tokens;
stop tokens are off). Prompts are prefilled once before timing, so the rows compare decode steps
only. Printed per row: decode tokens/s plain and constrained, the slowdown, the grammar engine's
own time per step: filling masks and the part a step still waited for the engine's worker thread
after its forward (what the overlap did not hide), and the share of constrained steps queued ahead.
With async scheduling (``--async-scheduling``; on by default on CUDA) a step queued ahead has its
masks filled on the main thread while the device runs its forward, after the step before it is
committed, so nothing waits for the worker; steps that are not queued ahead fill on the worker
beside their forward. Target on the H200: at most 5% slower at batch 16.

``--engines`` times, on the model's tokenizer, compiling a nested schema and computing the mask at
each token of a matching document, for llguidance and (when importable) xgrammar.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import trellm
from trellm.generator import Generator, Job, JobFinished, SamplerSettings, TokenChunk
from trellm.grammar import Grammar

PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "address", "tags", "score"],
    "additionalProperties": False,
}
MANY_PROFILES = {"type": "array", "items": PROFILE, "minItems": 1000}  # never closes within the token budget
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "role": "admin", "address": {"city": "London", "zip": "12345"},
            "tags": ["math", "poetry", "engines"], "score": 0.97}


def decode_rate(gen: Generator, prompts: list[str], new_tokens: int, grammar: Grammar | None) -> tuple[float, int]:
    """Decode tokens/s from every job's first token to the last job's end; and the steps taken."""
    jobs = [Job(p, new_tokens, min_new_tokens=new_tokens, stop_token_ids=[], grammar=grammar,
                sampler=SamplerSettings(temperature=0.7), seed=i) for i, p in enumerate(prompts)]
    gen.enqueue(jobs)
    first: dict[int, float] = {}
    done: list[JobFinished] = []
    steps_before = gen.stats["steps"]
    while gen.has_work():
        for r in gen.iterate():
            if isinstance(r, TokenChunk) and r.token_ids and r.job.job_id not in first:
                first[r.job.job_id] = time.perf_counter()
            elif isinstance(r, JobFinished):
                done.append(r)
    end = time.perf_counter()
    assert all(r.eos_reason == "max_new_tokens" for r in done), [(r.eos_reason, r.error) for r in done]
    decoded = sum(r.generated_tokens - 1 for r in done)
    return decoded / (end - min(first.values())), gen.stats["steps"] - steps_before


def throughput(args: argparse.Namespace, lm) -> None:
    overlap = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    gen = Generator(lm, cache_tokens=args.cache_tokens, page_size=64, max_batch_size=max(args.batch_sizes),
                    cuda_graphs=args.device == "cuda", async_scheduling=overlap)
    schema = Grammar.json_schema(MANY_PROFILES)
    engine = gen.grammar_engine
    print(f"model {args.model or 'SmolLM2-135M-Instruct'}, device {args.device}, dtype {args.dtype}, "
          f"{args.new_tokens} new tokens per job, torch threads {torch.get_num_threads()}, "
          f"async scheduling {'on' if gen.async_scheduling else 'off'}, mask threads {engine.executor_threads}")
    print(f"{'batch':>5} {'plain tok/s':>12} {'schema tok/s':>13} {'slower':>7} {'mask fill ms/step':>18} "
          f"{'mask wait ms/step':>18} {'ahead':>6}")
    for batch in args.batch_sizes:
        prompts = [f"Profile number {i}: describe a person as JSON." for i in range(batch)]
        gen.generate(prompts, 2)  # prefill once: the timed runs reuse the cached prompts
        plain, _ = decode_rate(gen, prompts, args.new_tokens, None)
        before, ahead_before = dict(engine.stats), gen.stats["steps_ahead"]
        constrained, steps = decode_rate(gen, prompts, args.new_tokens, schema)
        fill = (engine.stats["fill_s"] - before["fill_s"]) / max(steps, 1) * 1e3
        wait = (engine.stats["wait_s"] - before["wait_s"]) / max(steps, 1) * 1e3
        ahead = (gen.stats["steps_ahead"] - ahead_before) / max(steps, 1)
        print(f"{batch:>5} {plain:>12.1f} {constrained:>13.1f} {100 * (1 - constrained / plain):>6.1f}% {fill:>18.3f} "
              f"{wait:>18.3f} {100 * ahead:>5.0f}%")


def report(name: str, compile_ms: list[float], mask_us: list[float]) -> None:
    """One engine's line: compile time, the first mask of a fresh grammar, then the mean of the others."""
    rest = mask_us[1:]
    print(f"{name:<11} compile {statistics.median(compile_ms):7.2f} ms (median of 5); first mask {mask_us[0]:8.0f} us; "
          f"then {statistics.mean(rest):6.1f} us/token mean, {statistics.median(rest):6.1f} median, {max(rest):6.0f} max")


def engines(lm) -> None:
    """Compile time and per-token mask time of llguidance and xgrammar on this tokenizer."""
    from trellm.grammar import GrammarEngine

    tok = lm.tokenizer
    vocab = int(lm.config.vocab_size)
    ids = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    print(f"tokenizer: {vocab} tokens; document: {len(ids)} tokens")

    engine = GrammarEngine(tok, vocab, sorted(tok.eos_token_ids))
    import llguidance.torch as llt

    mask = llt.allocate_token_bitmask(1, vocab)
    llt.fill_next_token_bitmask(engine.compile(Grammar.json_schema({"type": "object"})).matcher, mask, 0)  # warm-up
    compile_ms, mask_us = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        state = engine.compile(Grammar.json_schema(PROFILE))
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    for t in ids:
        t0 = time.perf_counter()
        llt.fill_next_token_bitmask(state.matcher, mask, 0)
        mask_us.append((time.perf_counter() - t0) * 1e6)
        assert state.consume(t)
    report("llguidance", compile_ms, mask_us)
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        print("xgrammar: not installed (pip install xgrammar transformers to compare)")
        return
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok.backend), vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compile_ms, mask_us = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(PROFILE), any_whitespace=False)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    compact = tok.encode(json.dumps(DOCUMENT, separators=(", ", ": ")), add_special_tokens=False)
    for t in compact:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        mask_us.append((time.perf_counter() - t0) * 1e6)
        assert matcher.accept_token(t)
    report("xgrammar", compile_ms, mask_us)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch-sizes", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cache-tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                    help="queue each decode step before the previous one is read back (auto: on CUDA)")
    ap.add_argument("--engines", action="store_true", help="compare llguidance and xgrammar instead")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from trellm.default_model import default_model_dir

        path = default_model_dir(show_progress=False)
    else:
        path = args.model
    dtype = getattr(torch, args.dtype) if args.dtype else None
    lm = trellm.load(path, device=args.device, dtype=dtype)
    if args.engines:
        engines(lm)
    else:
        throughput(args, lm)


if __name__ == "__main__":
    main()
