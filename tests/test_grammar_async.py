"""Grammar jobs under async scheduling: step n+1's forward is queued before step n is read back, and its
masks are filled once step n is committed, while that forward runs. Whatever the jobs do (finish by a
grammar's end, a stop string, their own stop ids or their length, join late, get cancelled, sit beside
plain jobs), the results must equal the synchronous generator's, event for event. A 2-layer random Llama
with SmolLM2's tokenizer: a random model samples anything, so the grammars, not the model, shape the text."""
from __future__ import annotations

import json
import re

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

import trellm  # noqa: E402
from test_generator_async import _run as _events  # noqa: E402  (tests/ is on sys.path)
from test_grammar import PERSON, lm  # noqa: E402,F401  (the tiny Llama with SmolLM2's tokenizer)
from trellm.generator import Generator, Job, JobFinished, SamplerSettings  # noqa: E402
from trellm.grammar import Grammar  # noqa: E402

NEVER_CLOSES = {"type": "array", "items": PERSON, "minItems": 1000}


def _jobs(lm) -> tuple[list[Job], list[Job]]:
    """Grammar jobs of every kind beside plain ones, and three late ones (a schema, a choice, a plain job)."""
    person, digits = Grammar.json_schema(PERSON), Grammar.regex(r"[0-9]{1,6}")
    stop_id = lm.tokenizer.encode("!", add_special_tokens=False)[0]
    hot = SamplerSettings(temperature=1.0)
    jobs = [
        Job("Cancelled:", 80, grammar=Grammar.json_schema(NEVER_CLOSES), stop_token_ids=[]),
        *[Job("A person:", 200, grammar=person, sampler=hot, seed=s) for s in range(3)],
        Job("A person:", 200, grammar=person),  # greedy
        Job("Logprobs:", 30, grammar=person, sampler=hot, seed=11, logprobs=True, top_logprobs=2),
        Job("Cut short:", 7, grammar=person, sampler=hot, seed=12),  # ends by its length mid-object
        Job("Say:", 40, grammar=Grammar.regex(r"[a-z ]{1,40}"), stop=["e"], sampler=hot, seed=13),
        *[Job("Digits:", 12, grammar=digits, stop_token_ids=[stop_id], sampler=hot, seed=s) for s in range(20, 26)],
        Job("Digits:", 12, grammar=digits, stop_token_ids=[stop_id], min_new_tokens=4, sampler=hot, seed=27),
        Job("Plain:", 20, stop_token_ids=[]),
        Job("Plain sampled:", 20, stop_token_ids=[], sampler=hot, seed=14),
    ]
    late = [Job("Late person:", 200, grammar=person, sampler=hot, seed=15),
            Job("Late pick:", 10, grammar=Grammar.choice(["yes", "no", "maybe"]), sampler=hot, seed=16),
            Job("Late plain:", 12, stop_token_ids=[])]
    for i, job in enumerate(jobs + late):
        job.identifier = i
    return jobs, late


def test_grammar_jobs_async_equal_sync(lm):
    results, stats = {}, {}
    for mode in (False, True):
        gen = Generator(lm, cache_tokens=8192, page_size=16, max_batch_size=16, async_scheduling=mode)
        jobs, late = _jobs(lm)
        results[mode] = _events(gen, jobs, late, cancel_at=6)
        stats[mode] = gen.stats
    assert stats[False]["steps_ahead"] == 0 and stats[True]["steps_ahead"] > 0.5 * stats[True]["steps"]
    # a cancellation lands after the step in flight, which async scheduling had queued already: the
    # cancelled job may get one token more; every other job's results are the same
    assert [e for e in results[True] if e[1] != 0] == [e for e in results[False] if e[1] != 0]
    cancelled = {mode: [e for e in results[mode] if e[1] == 0] for mode in results}
    assert [e[4] for e in cancelled[True] if e[0] == "done"] == ["cancelled"]
    kept, extra = cancelled[False][-1][3], cancelled[True][-1][3]
    assert extra[: len(kept)] == kept and len(extra) - len(kept) <= 1
    done = {e[1]: e for e in results[True] if e[0] == "done"}
    reasons = {e[4] for e in done.values()}
    assert {"grammar_end", "stop_string", "stop_token", "max_new_tokens", "cancelled"} <= reasons, reasons
    people = [done[i] for i in (1, 2, 3, 4, 17) if done[i][4] == "grammar_end"]  # sampled, greedy, late
    assert len(people) >= 3, [done[i][4] for i in (1, 2, 3, 4, 17)]
    for e in people:
        jsonschema.validate(json.loads(e[2]), PERSON)
    assert done[7][4] == "stop_string" and re.fullmatch(r"[a-z ]*", done[7][2])
    digit_jobs = [done[i] for i in range(8, 15)]
    assert all(re.fullmatch(r"[0-9]{1,6}", e[2]) for e in digit_jobs)
    # the job's own stop id is allowed exactly where the digits may end; min_new_tokens holds it back
    assert any(e[4] == "stop_token" for e in digit_jobs) and len(done[14][3]) >= 4
    assert done[18][2] in ("yes", "no", "maybe")


def test_grammar_steps_are_queued_ahead_in_steady_decoding(lm):
    """Schema jobs that never finish early: after the prefill step and the first decode step (both read back
    first), every step is queued ahead, and the tokens and log-probabilities equal the synchronous ones."""
    grammar = Grammar.json_schema(NEVER_CLOSES)

    def run(mode: bool):
        gen = Generator(lm, cache_tokens=4096, page_size=16, max_batch_size=4, async_scheduling=mode)
        jobs = [Job("Profiles:", 20, min_new_tokens=20, stop_token_ids=[], grammar=grammar),
                Job("Profiles:", 20, min_new_tokens=20, stop_token_ids=[], grammar=grammar,
                    sampler=SamplerSettings(temperature=1.0), seed=3, logprobs=True),
                Job("Profiles:", 20, min_new_tokens=20, stop_token_ids=[], grammar=grammar,
                    sampler=SamplerSettings(temperature=0.8, top_k=50, repetition_penalty=1.2), seed=4)]
        for i, job in enumerate(jobs):
            job.identifier = i
        return _events(gen, jobs), gen.stats, gen.grammar_engine.stats

    (expect, sync, _), (got, stats, engine) = run(False), run(True)
    assert got == expect
    assert stats["steps_ahead"] == 18 and stats["steps"] == sync["steps"] == 20
    assert engine["masks"] == 3 * 20


def test_a_failing_mask_step_fails_its_jobs_and_the_generator_goes_on(lm, monkeypatch):
    """An error while the masks of a step queued ahead are filled fails that step's jobs with the error,
    frees their pages, and the next jobs run."""
    gen = Generator(lm, cache_tokens=4096, page_size=16, max_batch_size=4, async_scheduling=True)
    grammar = Grammar.regex(r"[a-z]{30}")
    engine = gen.grammar_engine
    real = engine.fill_masks

    def broken(*args):
        raise RuntimeError("mask computation failed")

    monkeypatch.setattr(engine, "fill_masks", broken)
    jobs = [Job("A:", 20, grammar=grammar), Job("B:", 20, grammar=grammar, sampler=SamplerSettings(temperature=1.0), seed=1)]
    gen.enqueue(jobs)
    finished = [r for r in gen.stream() if isinstance(r, JobFinished)]
    assert [r.eos_reason for r in finished] == ["error", "error"] and "mask computation failed" in finished[0].error
    assert all(0 < r.generated_tokens < 20 for r in finished)  # the steps read back first went through
    gen.verify_pages()
    assert not gen.has_work()
    monkeypatch.setattr(engine, "fill_masks", real)
    gen.enqueue(Job("C:", 10, grammar=grammar))
    result = [r for r in gen.stream() if isinstance(r, JobFinished)][0]
    assert result.eos_reason in ("max_new_tokens", "grammar_end") and re.fullmatch(r"[a-z]{1,30}", result.text)
    gen.verify_pages()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grammar_async_on_cuda_with_graphs(tiny_llama_smollm2_tokenizer_dir):
    """On a GPU (captured decode steps, masks copied from pinned buffers behind the forward) grammar jobs
    queued ahead give the synchronous generator's events."""
    lm = trellm.load(tiny_llama_smollm2_tokenizer_dir, device="cuda", dtype=torch.float32)
    results = {}
    for mode in (False, True):
        gen = Generator(lm, cache_tokens=8192, page_size=16, max_batch_size=16, async_scheduling=mode)
        jobs, late = _jobs(lm)
        results[mode] = _events(gen, jobs, late)
        assert gen.graph_runner is not None and gen.graph_runner.graphs
        assert (gen.stats["steps_ahead"] > 0) == mode
    assert results[True] == results[False]
