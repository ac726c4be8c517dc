"""The generator's per-step inputs: one reusable index buffer (``StepBuffers``) instead of a tensor
per field, and greedy tokens taken as a batched argmax instead of per-job sampling on the host."""
from __future__ import annotations

import random

import pytest
import torch

from trellm.batch import ForwardBatch, StepBuffers
from trellm.samplers import DRY, Greedy, LogitBias, SamplerSettings, SamplerStack, Temperature, TopK

FIELDS = ("input_ids", "positions", "cu_seqlens", "logits_indices", "block_table", "context_lens", "slots",
          "cached_lens", "state_slots")


class _Cache:
    page_size = 4
    device = torch.device("cpu")


def _random_step(rng: random.Random, page_lists: list[list[int]]):
    b = rng.randint(1, len(page_lists))
    which = rng.sample(range(len(page_lists)), b)
    decode = rng.random() < 0.5
    pages = [page_lists[w] for w in which]
    feeds = [[rng.randint(0, 99) for _ in range(1 if decode else min(rng.choice([1, 2, 5]), 4 * len(p)))] for p in pages]
    cached = [rng.randint(0, len(p) * 4 - len(f)) for p, f in zip(pages, feeds)]
    return feeds, cached, pages


def test_step_buffers_match_with_cache_over_reused_buffers():
    """Steps of varying shape on one StepBuffers (rows kept from the step before, layout moving under
    them) give exactly what ForwardBatch.with_cache builds field by field."""
    rng = random.Random(0)
    page_lists = [rng.sample(range(64), rng.randint(1, 5)) for _ in range(8)]
    buf = StepBuffers("cpu", capacity=16)
    for step in range(400):
        if rng.random() < 0.1:  # a job grows (pages appended in place) or a new job's list arrives
            k = rng.randrange(len(page_lists))
            if rng.random() < 0.5:
                page_lists[k] += [rng.randrange(64)]
            else:
                page_lists[k] = rng.sample(range(64), rng.randint(1, 5))
        feeds, cached, pages = _random_step(rng, page_lists)
        slots = [rng.randrange(10) for _ in feeds]
        want = ForwardBatch.with_cache(feeds, cached, pages, _Cache(), state_slots=slots)
        got = buf.build(feeds, cached, pages, _Cache(), want.logits_indices.tolist(), state_slots=slots)
        for f in FIELDS:
            a, g = getattr(want, f), getattr(got, f)
            assert a.dtype == g.dtype and torch.equal(a, g), (step, f, a, g)
        assert got.max_seq_len == want.max_seq_len


def test_step_buffers_padding_rows_for_a_graph():
    buf = StepBuffers("cpu", capacity=64, growable=False)
    pages = [[3, 5], [7]]
    batch = buf.build([[11], [12]], [5, 2], pages, _Cache(), range(2), pad_to=4, table_width=3, pad_page=9, max_seq_len=12)
    assert batch.input_ids.tolist() == [11, 12, 0, 0]
    assert batch.positions.tolist() == [5, 2, 0, 0]
    assert batch.slots.tolist() == [5 * 4 + 1, 7 * 4 + 2, 36, 36]
    assert batch.cu_seqlens.tolist() == [0, 1, 2, 3, 4]
    assert batch.context_lens.tolist() == [6, 3, 1, 1]
    assert batch.cached_lens.tolist() == [5, 2, 0, 0]
    assert batch.logits_indices.tolist() == [0, 1, 2, 3]
    assert batch.block_table.tolist() == [[3, 5, 9], [7, 9, 9], [9, 9, 9], [9, 9, 9]]
    assert batch.max_seq_len == 12
    # one job left: its row moves nowhere, the freed row becomes padding again
    batch = buf.build([[13]], [6], pages[:1], _Cache(), range(1), pad_to=4, table_width=3, pad_page=9, max_seq_len=12)
    assert batch.block_table.tolist() == [[3, 5, 9], [9, 9, 9], [9, 9, 9], [9, 9, 9]]
    assert batch.context_lens.tolist() == [7, 1, 1, 1]
    with pytest.raises(ValueError, match="fixed buffers"):
        buf.build([[1]] * 8, [0] * 8, [[1]] * 8, _Cache(), range(8), table_width=40)


def test_step_buffers_reject_a_sequence_without_room():
    with pytest.raises(ValueError, match="cache slots"):
        StepBuffers("cpu").build([[1, 2]], [7], [[0, 1]], _Cache(), [1])


@pytest.mark.parametrize("stack, argmax", [
    (SamplerSettings.greedy().build(), True),
    (SamplerStack([Temperature(0.0)]), True),
    (SamplerStack([Greedy(), LogitBias({3: 1.0})]), False),  # a step that changes scores
    (SamplerStack([Greedy(), TopK(5)]), False),  # not one of the known no-op steps
    (SamplerSettings(temperature=0.7).build(), False),
])
def test_is_argmax(stack, argmax):
    assert stack.is_argmax is argmax


# ---- the generator ----------------------------------------------------------------------------------

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    import trellm
    from trellm.sdk.testing import make_tiny_hf_model

    torch.set_num_threads(1)
    model_dir = make_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)
    return trellm.load(model_dir, device="cpu", dtype="float32", tokenizer=False)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def test_device_argmax_matches_host_sampling_in_one_batch(lm, monkeypatch):
    """Plain greedy jobs (batched argmax) next to greedy jobs whose stack goes through the batched device
    sampler (a zero logit bias: same scores), a job whose stack only runs on the host (a DRY step that does
    nothing) and a min_new_tokens job (stop ids excluded at first, on the device): the same tokens as each
    job alone, and only the host-only job reaches SamplerStack.sample."""
    from trellm.generator import Generator, Job

    prompts = _prompts(6, seed=3)
    alone = [list(lm.generate_ids(p, 10, stop_token_ids=[])) for p in prompts]
    device = SamplerStack([Greedy(), LogitBias({0: 0.0})])
    host = SamplerStack([Greedy(), DRY(multiplier=0.0)])
    assert device.row_sampling() is not None and host.row_sampling() is None
    calls = {"n": 0}
    original = SamplerStack.sample

    def counting(self, *a, **k):
        calls["n"] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(SamplerStack, "sample", counting)
    gen = Generator(lm, cache_tokens=1024, page_size=16, max_batch_size=6)
    stacks = {1: device, 4: host}
    jobs = [Job(p, 10, stop_token_ids=[], sampler=stacks.get(i)) for i, p in enumerate(prompts)]
    jobs.append(Job(prompts[2], 10, stop_token_ids=[alone[2][0]], min_new_tokens=2))
    gen.enqueue(jobs)
    done = {}
    while gen.has_work():
        for r in gen.iterate():
            if type(r).__name__ == "JobFinished":
                done[r.job] = r.token_ids
    for i, job in enumerate(jobs[:6]):
        assert done[job] == alone[i]
    first = lm.logits([prompts[2]])[0, -1].clone()
    first[alone[2][0]] = float("-inf")  # the stop id is excluded while fewer than min_new_tokens are out
    assert done[jobs[6]][0] == int(first.argmax()) != alone[2][0]
    assert calls["n"] == 10  # the host-only job's tokens
    gen.verify_pages()


def test_steps_build_no_per_field_tensors(lm, monkeypatch):
    """A generator step builds its batch in the reused StepBuffers, not with ForwardBatch.with_cache."""
    from trellm.generator import Generator

    def refuse(*a, **k):
        raise AssertionError("the generator built a batch field by field")

    gen = Generator(lm, cache_tokens=1024, page_size=16, max_batch_size=4)
    monkeypatch.setattr(ForwardBatch, "with_cache", refuse)
    out = gen.generate(_prompts(3, seed=5), 6, stop_token_ids=[])
    assert len(out) == 3 and gen.stats["steps"] >= 6
