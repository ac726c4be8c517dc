"""The generator's batched device sampler (``trellm.generator.sampling``) against the per-row sampler stack:
the same token for every row, whatever the mix of settings in the batch; seeded draws that do not depend on
the batch, on speculative drafts or on the path (device or host)."""
from __future__ import annotations

import random

import pytest
import torch

from trellm.generator.sampling import DeviceSampler, SampleRow
from trellm.samplers import (DRY, XTC, Greedy, LogitBias, MinP, Penalties, SamplerSettings, SamplerStack, SamplingContext,
                             Temperature, TopK, TopP, TypicalP, uniform_for)

VOCAB = 97


def _settings(rng: random.Random) -> SamplerSettings:
    return SamplerSettings(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]), top_k=rng.choice([0, 0, 1, 5, 40, VOCAB + 3]),
        top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.0, 0.1, 0.4]), temperature_last=rng.random() < 0.3,
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]), presence_penalty=rng.choice([0.0, 0.7]),
        frequency_penalty=rng.choice([0.0, 0.2]), penalty_range=rng.choice([0, 5]),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-3, 3) for _ in range(rng.choice([0, 2]))},
        banned_tokens=tuple(rng.sample(range(VOCAB), rng.choice([0, 3]))),
    )


def test_batched_rows_equal_the_per_row_stack():
    """Rows of random logits, each with its own random settings, history, excluded ids and uniform: the
    device sampler's batch gives each row the token the row's own SamplerStack draws at the same uniform."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    sampler = DeviceSampler("cpu")
    for _ in range(60):  # small batches too: there every top-p row often has a top-k (top-p sorts its candidates only)
        n = rng.choice([1, 2, rng.randint(1, 20)])
        logits = torch.randn(n, VOCAB, generator=g) * rng.choice([1.0, 4.0])
        rows, want = [], []
        for i in range(n):
            stack = _settings(rng).build()
            settings = stack.row_sampling()
            assert settings is not None, stack
            history = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]
            exclude = rng.sample(range(VOCAB), rng.choice([0, 0, 2, VOCAB]))  # VOCAB: every token excluded
            u = rng.random()
            ctx = SamplingContext(tokens=history, prompt_len=0)
            want.append(stack.sample(logits[i], ctx, exclude, u=u))
            rows.append(SampleRow(settings, u, settings.counted(history, 0), exclude))
        assert sampler.sample(logits, rows).tolist() == want


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batched_rows_on_cuda_equal_the_per_row_stack_on_the_host():
    """The same random rows sampled on CUDA (one upload, one readback) and row by row on the CPU."""
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    sampler = DeviceSampler("cuda")
    for _ in range(10):
        n = rng.randint(1, 16)
        logits = torch.randn(n, VOCAB, generator=g) * 3
        rows, want = [], []
        for i in range(n):
            stack = _settings(rng).build()
            settings = stack.row_sampling()
            history = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]
            exclude = rng.sample(range(VOCAB), rng.choice([0, 2]))
            u = rng.random()
            want.append(stack.sample(logits[i], SamplingContext(tokens=history), exclude, u=u))
            rows.append(SampleRow(settings, u, settings.counted(history, 0), exclude))
        assert sampler.sample(logits.cuda(), rows).tolist() == want


@pytest.mark.parametrize("stack, batched", [
    (SamplerSettings(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1).build(), True),
    (SamplerSettings.preset("creative").build(), False),  # DRY
    (SamplerStack([TopK(5), Temperature(0.5)]), True),  # temperature last
    (SamplerStack([TopK(5), Temperature(0.5), TopP(0.9)]), False),  # temperature between truncation steps
    (SamplerStack([Temperature(0.5), Penalties(1.2)]), False),  # temperature before the penalties
    (SamplerStack([LogitBias({1: 2.0}), LogitBias({2: 1.0})]), False),  # a step twice
    (SamplerStack([TypicalP(0.9)]), False),
    (SamplerStack([XTC(0.1, 0.5)]), False),
    (SamplerStack([MinP(0.1), Greedy()]), True),
    (SamplerStack([DRY(0.8)]), False),
])
def test_which_stacks_run_batched(stack, batched):
    assert (stack.row_sampling() is not None) is batched


def test_uniforms_are_counter_based():
    assert uniform_for(7, 3) == uniform_for(7, 3) != uniform_for(7, 4) != uniform_for(8, 3)
    draws = [uniform_for(11, i) for i in range(4000)]
    assert all(0.0 <= u < 1.0 for u in draws) and abs(sum(draws) / len(draws) - 0.5) < 0.02


# ---- through the generator ------------------------------------------------------------------------

pytest.importorskip("transformers")


from test_generator_step_inputs import lm  # noqa: E402,F401  (the tiny Llama fixture both files drive)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 40) for _ in range(rng.randint(3, 30))] * 2 for _ in range(n)]


def test_seeded_sampling_same_batched_alone_on_the_host_and_with_drafts(lm):
    """Seeded jobs give the same tokens batched with others, alone, through the host-only path (a DRY step
    that does nothing) and with n-gram drafts verified (one uniform per generated position)."""
    from trellm.generator import Generator, Job, NgramProposer

    prompts = _prompts(4, seed=1)
    settings = SamplerSettings(temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.1, penalty_range=16)
    host_only = SamplerSettings(temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.1, penalty_range=16,
                                extra_steps=(DRY(0.0),))

    def run(gen, sampler, together=True):
        jobs = [Job(p, 12, stop_token_ids=[], sampler=sampler, seed=100 + i) for i, p in enumerate(prompts)]
        if together:
            gen.enqueue(jobs)
            done = {r.job: r.token_ids for r in gen.stream() if type(r).__name__ == "JobFinished"}
            return [done[j] for j in jobs]
        out = []
        for j in jobs:
            gen.enqueue(j)
            out += [r.token_ids for r in gen.stream() if type(r).__name__ == "JobFinished"]
        return out

    gen = Generator(lm, cache_tokens=2048, page_size=16, max_batch_size=4)
    batched = run(gen, settings)
    assert run(gen, settings, together=False) == batched
    assert run(gen, host_only) == batched
    spec = Generator(lm, cache_tokens=2048, page_size=16, max_batch_size=4, proposer=NgramProposer(), num_draft_tokens=3)
    assert run(spec, settings) == batched
    assert spec.stats["draft_proposed"] > 0
    assert len({tuple(t) for t in batched}) > 1


def test_logprobs_from_the_device_path_match_the_host(lm):
    """A sampled job's logprobs and top logprobs (device path) equal those of the host-only path."""
    from trellm.generator import Generator, Job

    prompt = _prompts(1, seed=4)[0]
    device = SamplerSettings(temperature=0.8, top_k=10)
    host = SamplerSettings(temperature=0.8, top_k=10, extra_steps=(DRY(0.0),))
    gen = Generator(lm, cache_tokens=1024, page_size=16)
    a, b = (gen.generate(prompt, 6, sampler=s, seed=3, logprobs=True, top_logprobs=3, stop_token_ids=[], return_results=True)
            for s in (device, host))
    assert a.token_ids == b.token_ids
    chunks = {}
    for s in (device, host):
        job = gen.enqueue(Job(prompt, 6, sampler=s, seed=3, logprobs=True, top_logprobs=3, stop_token_ids=[]))
        chunks[s is device] = [r for r in gen.stream() if type(r).__name__ == "TokenChunk" and r.job is job]
    lp = {k: [x for c in v for x in c.logprobs] for k, v in chunks.items()}
    tops = {k: [x for c in v for x in c.top_logprobs] for k, v in chunks.items()}
    assert len(lp[True]) == 6 and torch.allclose(torch.tensor(lp[True]), torch.tensor(lp[False]), atol=1e-5)
    assert [[t for t, _ in row] for row in tops[True]] == [[t for t, _ in row] for row in tops[False]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_sampling_on_cuda_with_graphs(tmp_path):
    """Seeded sampled jobs on CUDA (captured decode steps, device sampler) give the same tokens batched and alone."""
    import trellm
    from trellm.generator import Generator
    from trellm.sdk.testing import make_tiny_hf_model

    # head_dim 64: the paged-attention kernel's smallest, so decode steps capture (see test_generator)
    model_dir = make_tiny_hf_model("LlamaForCausalLM", tmp_path, hidden_size=128, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=64, max_position_embeddings=1024)
    cuda_lm = trellm.load(model_dir, device="cuda", dtype="float32", tokenizer=False)
    prompts = _prompts(4, seed=2)
    settings = SamplerSettings(temperature=0.9, top_k=30, top_p=0.95, min_p=0.02, repetition_penalty=1.1)
    gen = Generator(cuda_lm, cache_tokens=2048, page_size=16, max_batch_size=4)
    together = gen.generate(prompts, 12, sampler=settings, seed=5, stop_token_ids=[], return_results=True)
    alone = [gen.generate(p, 12, sampler=settings, seed=5, stop_token_ids=[], return_results=True) for p in prompts]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert gen.graph_runner is not None and gen.graph_runner.graphs
    gen.verify_pages()
