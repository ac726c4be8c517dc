"""Constrained decoding cost: decode tokens/s with and without a JSON schema, and the grammar engines compared.

    python benchmarks/bench_grammar.py                                   # SmolLM2 on CPU, batch 1 and 16
    python benchmarks/bench_grammar.py --device cuda --dtype bfloat16 --batch-sizes 1,16 --new-tokens 256
    python benchmarks/bench_grammar.py --engines                         # llguidance vs xgrammar (if installed)
    python benchmarks/bench_grammar.py --mask-costs                      # where a step's mask time goes
    python benchmarks/bench_grammar.py --device cpu --async-scheduling on --batch-sizes 16 --new-tokens 32

Each batch size runs the same jobs twice in one process, plain and under a JSON schema (an array of
profiles that cannot close within ``--new-tokens``, so both runs decode the same number of tokens;
stop tokens are off). Prompts are prefilled once before timing, so the rows compare decode steps
only. Printed per row: decode tokens/s plain and constrained, the slowdown, the grammar engine's
own time per step: filling masks and the part a step still waited for the engine's worker thread
after its forward (CPU only: on CUDA the generator's thread fills them once the forward is queued),
and the share of constrained steps queued ahead by async scheduling (``--async-scheduling``; on by
default on CUDA), whose masks are filled after the step before them is committed, while their
forward runs. Target on the H200: at most 5% slower at batch 16.

``--mask-costs`` replays the tokens the model chose under the schema and times each part of a step's
mask work on this machine: llguidance alone on one thread and on its executor, consuming the tokens
one by one and in parallel, the engine's fill with the Python around it, the same through the worker
thread, and applying the masks on the device.

``--engines`` times, on the model's tokenizer, compiling a nested schema and computing the mask at
each token of a matching document, for llguidance and (when importable) xgrammar.
"""
from __future__ import annotations

import argparse
import json
import os
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


def decode_rate(gen: Generator, prompts: list[str], new_tokens: int,
                grammar: Grammar | None) -> tuple[float, int, list[list[int]]]:
    """Decode tokens/s from every job's first token to the last job's end; the steps taken; each job's tokens."""
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
    tokens = [r.token_ids for r in sorted(done, key=lambda r: jobs.index(r.job))]
    return decoded / (end - min(first.values())), gen.stats["steps"] - steps_before, tokens


def throughput(args: argparse.Namespace, lm) -> None:
    overlap = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    gen = Generator(lm, cache_tokens=args.cache_tokens, page_size=64, max_batch_size=max(args.batch_sizes),
                    cuda_graphs=args.device == "cuda", async_scheduling=overlap)
    engine = gen.grammar_engine
    print(f"model {args.model or 'SmolLM2-135M-Instruct'}, device {args.device}, dtype {args.dtype}, "
          f"{args.new_tokens} new tokens per job, torch threads {torch.get_num_threads()}, "
          f"async scheduling {'on' if gen.async_scheduling else 'off'}, mask threads {engine.executor_threads}")
    print("schema runs: 'new' is a schema the engine has not seen (llguidance builds its lexer states as the "
          "jobs first meet them), 'again' the same schema in new jobs (states built, shared by every job's matcher)")
    print(f"{'batch':>5} {'plain tok/s':>12} {'schema':>6} {'tok/s':>8} {'slower':>7} {'mask fill ms/step':>18} "
          f"{'mask wait ms/step':>18} {'ahead':>6}")
    for batch in args.batch_sizes:
        prompts = [f"Profile number {i}: describe a person as JSON." for i in range(batch)]
        gen.generate(prompts, 2)  # prefill once: the timed runs reuse the cached prompts
        plain, _, _ = decode_rate(gen, prompts, args.new_tokens, None)
        unseen = dict(MANY_PROFILES, description=f"batch {batch}")  # new text: the engine compiles it afresh
        for run in ("new", "again"):
            before, ahead_before = dict(engine.stats), gen.stats["steps_ahead"]
            constrained, steps, _ = decode_rate(gen, prompts, args.new_tokens, Grammar.json_schema(unseen))
            fill = (engine.stats["fill_s"] - before["fill_s"]) / max(steps, 1) * 1e3
            wait = (engine.stats["wait_s"] - before["wait_s"]) / max(steps, 1) * 1e3
            ahead = (gen.stats["steps_ahead"] - ahead_before) / max(steps, 1)
            first = run == "new"
            print(f"{batch if first else '':>5} {f'{plain:.1f}' if first else '':>12} {run:>6} {constrained:>8.1f} "
                  f"{100 * (1 - constrained / plain):>6.1f}% {fill:>18.3f} {wait:>18.3f} {100 * ahead:>5.0f}%")


def mask_costs(args: argparse.Namespace, lm) -> None:
    """Where a step's mask time goes, replayed off-line on the tokens the model chose under the schema
    (per batch size): llguidance alone (one thread, then its executor on 1, 2, ... threads), consuming the
    tokens (one by one, and in parallel), the engine's fill with its Python around llguidance (on this
    thread, as the generator runs it on CUDA; for a schema the engine has not seen yet, whose lexer
    states are built as the jobs meet them; and through the worker thread, as on CPU), and applying the
    masks to logits on the device. Generating the tokens built the schema's states, so the other
    columns are steady-state costs."""
    import llguidance
    import llguidance.torch as llt

    gen = Generator(lm, cache_tokens=args.cache_tokens, page_size=64, max_batch_size=max(args.batch_sizes),
                    cuda_graphs=args.device == "cuda")
    schema = Grammar.json_schema(MANY_PROFILES)
    engine = gen.grammar_engine
    threads = sorted({1, 2, engine.executor_threads, min(os.cpu_count() or 1, 16)})  # beyond the engine's: would more help?
    print(f"mask costs, replayed on the schema outputs of {args.new_tokens} tokens; device {args.device}; "
          f"{os.cpu_count()} CPUs; engine executor threads {engine.executor_threads}; ms per step")
    print(f"{'batch':>5} {'llg 1 thread':>12} " + " ".join(f"{f'llg par {n}':>10}" for n in threads)
          + f" {'consume':>8} {'cons par':>8} {'fill_masks':>10} {'new gram':>8} {'worker':>8} {'apply':>8}")
    for batch in args.batch_sizes:
        prompts = [f"Profile number {i}: describe a person as JSON." for i in range(batch)]
        _, _, tokens = decode_rate(gen, prompts, args.new_tokens, schema)
        steps = min(map(len, tokens)) - 1
        logits = torch.zeros(batch, int(lm.config.vocab_size), device=args.device)
        mask = llt.allocate_token_bitmask(batch, engine.vocab_size)

        def replay(fill, consume=None, grammar: Grammar = schema) -> tuple[float, float]:
            """(ms per step in ``fill(states)``, in consuming the step's tokens) over fresh grammar states."""
            states = [engine.compile(grammar) for _ in range(batch)]
            fill_s = consume_s = 0.0
            for step in range(steps):
                t0 = time.perf_counter()
                fill(states)
                t1 = time.perf_counter()
                if consume is None:
                    assert all(s.consume(t[step]) for s, t in zip(states, tokens))
                else:
                    assert all(consume([(s.matcher, t[step]) for s, t in zip(states, tokens)]))
                consume_s += time.perf_counter() - t1
                fill_s += t1 - t0
            return fill_s / steps * 1e3, consume_s / steps * 1e3

        def sync() -> None:
            if args.device == "cuda":
                torch.cuda.synchronize()

        single, _ = replay(lambda states: [llt.fill_next_token_bitmask(s.matcher, mask, i) for i, s in enumerate(states)])
        par = []
        for n in threads:
            executor = llguidance.LLExecutor(num_threads=n)
            par.append(replay(lambda states: llt.fill_next_token_bitmask_par(
                executor, [(s.matcher, i) for i, s in enumerate(states)], mask))[0])
        # consuming a token right after its step's mask (as the generator does) reuses what the mask computed
        engine_fill = lambda states: llt.fill_next_token_bitmask_par(  # noqa: E731
            engine.executor, [(s.matcher, i) for i, s in enumerate(states)], mask)
        _, consume = replay(engine_fill)
        in_parallel = getattr(engine.executor, "consume_token_par", None)  # absent from older llguidance releases
        consume_par = replay(engine_fill, in_parallel)[1] if in_parallel else float("nan")
        rows = lambda states: [(s, i, []) for i, s in enumerate(states)]  # noqa: E731
        stops = [None] * batch
        ours, _ = replay(lambda states: engine.fill_masks(rows(states), batch, stops))
        unseen = Grammar.json_schema(dict(MANY_PROFILES, description=f"mask costs {batch}"))
        cold, _ = replay(lambda states: engine.fill_masks(rows(states), batch, stops), grammar=unseen)
        worker, _ = replay(lambda states: engine.start_masks(rows(states), batch, stops).result())
        ready = engine.fill_masks(rows([engine.compile(schema) for _ in range(batch)]), batch, stops)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.apply_masks(logits, ready)
            sync()
        apply = (time.perf_counter() - t0) / steps * 1e3
        print(f"{batch:>5} {single:>12.3f} " + " ".join(f"{p:>10.3f}" for p in par)
              + f" {consume:>8.3f} {consume_par:>8.3f} {ours:>10.3f} {cold:>8.3f} {worker:>8.3f} {apply:>8.3f}")


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
    for i in range(5):
        t0 = time.perf_counter()
        state = engine.compile(Grammar.json_schema(dict(PROFILE, description=f"compile {i}")))  # new text: no cache
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
    ap.add_argument("--mask-costs", action="store_true", help="break a step's mask time down instead")
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
    elif args.mask_costs:
        mask_costs(args, lm)
    else:
        throughput(args, lm)


if __name__ == "__main__":
    main()
