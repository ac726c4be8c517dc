"""Async scheduling: step n+1 queued on the device before step n is read back, fed the tokens step n
chose without them leaving the device. Whatever jobs do, the results must equal the synchronous
generator's, token for token and event for event."""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from trellm.generator import Generator, Job, JobFinished, NgramProposer, SamplerSettings, TokenChunk


@pytest.fixture(scope="module")
def lm(tiny_llama_smollm2_tokenizer_dir):
    import trellm

    torch.set_num_threads(1)
    return trellm.load(tiny_llama_smollm2_tokenizer_dir, device="cpu", dtype=torch.float32)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 5000) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _jobs(prompts: list[list[int]], stop_token: int) -> list[Job]:
    """Jobs of every kind: greedy, seeded sampling, logprobs, a stop token, stop strings, 1- and 2-token
    limits, min_new_tokens, penalties and banned strings (this one keeps the host's view: no step ahead)."""
    sampled = SamplerSettings(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02)
    kinds = [
        dict(),
        dict(sampler=sampled, seed=7),
        dict(sampler=sampled, seed=8, logprobs=True, top_logprobs=3),
        dict(stop_token_ids=[stop_token]),
        dict(stop_token_ids=[stop_token], min_new_tokens=4),
        dict(stop=["e", " the"]),
        dict(max_new_tokens=1),
        dict(max_new_tokens=2),
        dict(sampler=SamplerSettings(temperature=0.7, repetition_penalty=1.2), seed=9),
        dict(banned_strings=["a"]),
    ]
    out = []
    for i, p in enumerate(prompts):
        kw = dict(kinds[i % len(kinds)])
        kw.setdefault("stop_token_ids", [])
        out.append(Job(p, kw.pop("max_new_tokens", 24), identifier=i, **kw))
    return out


def _run(gen: Generator, jobs: list[Job], late: list[Job] = (), cancel_at: int | None = None) -> list[tuple]:
    """Every result in order as comparable tuples; ``late`` jobs join after three iterations, job 0 is
    cancelled after ``cancel_at`` iterations."""
    gen.enqueue(list(jobs))
    events, n = [], 0
    while gen.has_work():
        n += 1
        if n == 3:
            gen.enqueue(list(late))
        if cancel_at is not None and n == cancel_at:
            gen.cancel(jobs[0])
        for r in gen.iterate():
            if isinstance(r, TokenChunk):
                lp = None if r.logprobs is None else [round(x, 4) for x in r.logprobs]
                events.append(("chunk", r.identifier, r.text, tuple(r.token_ids), lp and tuple(lp)))
            elif isinstance(r, JobFinished):
                events.append(("done", r.identifier, r.text, tuple(r.token_ids), r.eos_reason))
        gen.verify_pages()
    return sorted(events, key=lambda e: e[1])  # per job, in its own order


def test_async_equals_sync_for_every_kind_of_job(lm):
    prompts = _prompts(14, seed=1)
    greedy = list(lm.generate_ids(prompts[3], 8, stop_token_ids=[]))
    stop = greedy[5]  # a token the stop-token jobs actually meet
    late_prompts = _prompts(3, seed=2)
    results = {}
    for mode in (False, True):
        gen = Generator(lm, cache_tokens=4096, page_size=16, max_batch_size=8, async_scheduling=mode)
        late_jobs = [Job(p, 12, identifier=100 + i, stop_token_ids=[]) for i, p in enumerate(late_prompts)]
        results[mode] = _run(gen, _jobs(prompts, stop), late_jobs, cancel_at=6)
        if mode:
            assert gen.stats["steps_ahead"] > 0  # once the penalty and banned-string jobs are done
        else:
            assert gen.stats["steps_ahead"] == 0
    assert results[True] == results[False]
    reasons = {e[4] for e in results[True] if e[0] == "done"}
    assert {"stop_token", "stop_string", "max_new_tokens", "cancelled"} <= reasons


def test_async_steady_decoding_samples_at_the_right_positions(lm):
    """Greedy, seeded sampling, logprobs, a stop id excluded until min_new_tokens and penalties over a
    window (counting the token chosen ahead on the device): every step after the first decode step is queued
    ahead, and the tokens and logprobs equal the synchronous generator's."""
    prompts = _prompts(4, seed=3)
    first = int(lm.logits([prompts[3]])[0, -1].argmax())
    sampled = SamplerSettings(temperature=0.9, top_k=40, top_p=0.95)

    def run(mode: bool):
        gen = Generator(lm, cache_tokens=2048, page_size=16, max_batch_size=5, async_scheduling=mode)
        jobs = [Job(prompts[0], 20, stop_token_ids=[]),
                Job(prompts[1], 20, stop_token_ids=[], sampler=sampled, seed=5),
                Job(prompts[2], 20, stop_token_ids=[], sampler=sampled, seed=6, logprobs=True, top_logprobs=2),
                Job(prompts[3], 20, stop_token_ids=[first], min_new_tokens=20),
                Job(prompts[0], 20, stop_token_ids=[], seed=7,
                    sampler=SamplerSettings(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, penalty_range=8))]
        gen.enqueue(jobs)
        out = {}
        for r in gen.stream():
            if isinstance(r, TokenChunk):
                out.setdefault(r.job, []).append((tuple(r.token_ids), r.logprobs and tuple(round(x, 4) for x in r.logprobs)))
        gen.verify_pages()
        return [out[j] for j in jobs], gen.stats

    (expect, sync), (got, stats) = run(False), run(True)
    assert got == expect
    # one prefill step, then 19 decode steps: the first from the host's view, the other 18 queued ahead
    assert stats["steps_ahead"] == 18 and stats["steps"] == sync["steps"] == 20


def _stand_in_graphs(gen: Generator) -> None:
    """Give ``gen`` the decode path a GPU takes: steps staged into fixed graph inputs and replayed (eager stand-ins)."""
    from test_graph_hybrid import EagerGraphs

    gen.graph_runner = EagerGraphs(gen.model, gen.cache, batch_sizes=(1, 2, 4, 8), max_context=gen.cache.capacity_tokens)


def test_async_through_graph_inputs_equals_sync(lm):
    """The GPU's decode path (each step staged into a graph's fixed inputs, fed the ids the step before chose,
    still on the device; eager stand-ins replay the graphs), graphs captured up front: every kind of job gives
    the synchronous eager generator's events (stop tokens, stop strings, min_new_tokens, lengths, cancelling,
    late joins), and so do greedy jobs of staggered lengths, all queued ahead, whose next step feeds only the
    rows of the jobs still running. No step captures a graph after ``capture_graphs``; no page is left held."""
    prompts = _prompts(14, seed=1)
    stop = list(lm.generate_ids(prompts[3], 8, stop_token_ids=[]))[5]
    late_prompts = _prompts(3, seed=2)
    staggered = _prompts(6, seed=5)

    def run(mode: bool | None):
        gen = Generator(lm, cache_tokens=4096, page_size=16, max_batch_size=8, async_scheduling=bool(mode))
        if mode is not None:
            _stand_in_graphs(gen)
            assert gen.capture_graphs() == [1, 2, 4, 8]
            captured = dict(gen.graph_runner.graphs)
        late_jobs = [Job(p, 12, identifier=100 + i, stop_token_ids=[]) for i, p in enumerate(late_prompts)]
        every_kind = _run(gen, _jobs(prompts, stop), late_jobs, cancel_at=6)
        ahead = gen.stats["steps_ahead"]
        lengths = _run(gen, [Job(p, 3 + 4 * i, identifier=i, stop_token_ids=[]) for i, p in enumerate(staggered)])
        if mode is not None:
            assert gen.graph_runner.graphs == captured and gen.graph_runner.replays > 40
        if mode:  # one prefill step, the first decode step from the host's view, every later one queued ahead
            assert gen.stats["steps_ahead"] - ahead == 3 + 4 * 5 - 2
        gen.verify_pages()
        return every_kind, lengths

    expect = run(None)
    assert run(False) == expect
    assert run(True) == expect
    assert {e[4] for e in expect[0] if e[0] == "done"} >= {"stop_token", "stop_string", "max_new_tokens", "cancelled"}


def test_capture_graphs_runs_in_inference_mode(lm):
    """Capturing up front runs as a step does, in inference mode: the warm-up writes into buffers earlier steps
    made as inference tensors, which torch refuses outside it (every size fell back to eager on the H200)."""
    gen = Generator(lm, cache_tokens=2048, page_size=16)
    _stand_in_graphs(gen)
    with torch.inference_mode():
        workspace = torch.zeros(3)  # as a buffer an earlier step made
    capture = gen.graph_runner._capture

    def capture_writing_workspace(*args):
        workspace.add_(1)  # raises outside inference mode
        return capture(*args)

    gen.graph_runner._capture = capture_writing_workspace
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sizes = gen.capture_graphs()
    assert not [w for w in caught if "capture failed" in str(w.message)]
    assert sizes == [1, 2, 4, 8] and workspace.tolist() == [4.0, 4.0, 4.0]


def test_async_falls_back_for_drafts_and_abort_drains(lm):
    """With a proposer (drafts need the host's tokens) nothing is queued ahead; abort() reads a step in
    flight back before failing the jobs, and leaves no page held."""
    prompts = [p * 3 for p in _prompts(2, seed=4)]
    spec = Generator(lm, cache_tokens=2048, page_size=16, proposer=NgramProposer(), async_scheduling=True)
    spec.generate(prompts, 12, stop_token_ids=[])
    assert spec.stats["steps_ahead"] == 0
    gen = Generator(lm, cache_tokens=2048, page_size=16, async_scheduling=True)
    gen.enqueue([Job(p, 50, stop_token_ids=[]) for p in prompts])
    for _ in range(4):
        gen.iterate()
    assert gen._inflight is not None
    done = [r for r in gen.abort() if isinstance(r, JobFinished)]
    assert len(done) == 2 and all(r.eos_reason == "error" for r in done)
    assert not gen.has_work()
    gen.verify_pages()
    assert gen.cache.prefix_cache.available() == gen.cache.allocator.num_pages


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_on_cuda_with_graphs(tiny_llama_smollm2_tokenizer_dir):
    """On a GPU (captured decode steps, pinned read-backs in flight while the next step runs) async scheduling
    gives the synchronous generator's events for every kind of job."""
    import trellm

    lm = trellm.load(tiny_llama_smollm2_tokenizer_dir, device="cuda", dtype=torch.float32)
    prompts = _prompts(14, seed=1)
    stop = list(lm.generate_ids(prompts[3], 8, stop_token_ids=[]))[5]
    results = {}
    for mode in (False, True):
        gen = Generator(lm, cache_tokens=4096, page_size=16, max_batch_size=8, async_scheduling=mode)
        results[mode] = _run(gen, _jobs(prompts, stop), cancel_at=6)
        assert gen.graph_runner is not None and gen.graph_runner.graphs
    assert results[True] == results[False]
