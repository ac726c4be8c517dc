"""A model on a CUDA device other than the thread's current one (skipped without two GPUs): the Generator's
events must record on the stream its copies ran on (the device's), and its graphs capture on that device.

Recording on the current device's stream instead (``event.record()``) made every wait return at once: the token
read-back read the pinned buffer before the copy landed, and the input / sampler staging buffers were
overwritten while their uploads were pending; torch's default capture stream (made on cuda:0) captured nothing
of cuda:1's kernels.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import trellm
from trellm.generator import Generator, Job, JobFinished, SamplerSettings
from trellm.sdk.testing import make_tiny_hf_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("second_device") / "llama")


def _tokens(lm, asynchronous: bool) -> tuple[dict, list[int]]:
    prompts = torch.randint(0, 256, (6, 12), generator=torch.Generator().manual_seed(5)).tolist()
    penalized = SamplerSettings(temperature=0.8, top_k=20, repetition_penalty=1.3)  # through the device sampler
    gen = Generator(lm, cache_tokens=2048, page_size=16, max_batch_size=4, async_scheduling=asynchronous)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*capture failed")  # a failed capture warns
        captured = gen.capture_graphs()
        jobs = [Job(p, 24 + 4 * i, identifier=i, stop_token_ids=[], sampler=penalized if i % 2 else None, seed=i)
                for i, p in enumerate(prompts)]
        out = _run(gen, jobs)
    gen.verify_pages()
    return out, captured


def _run(gen, jobs) -> dict:
    gen.enqueue(jobs)
    done = {}
    while gen.has_work():
        for r in gen.iterate():
            if isinstance(r, JobFinished):
                done[r.identifier] = list(r.token_ids)
    return done


@pytest.mark.parametrize("asynchronous", [False, True])
def test_generator_on_the_second_device_equals_the_first(llama_dir, asynchronous):
    assert torch.cuda.current_device() == 0
    want, sizes0 = _tokens(trellm.load(llama_dir, device="cuda:0"), asynchronous)
    got, sizes1 = _tokens(trellm.load(llama_dir, device="cuda:1"), asynchronous)
    assert sizes1 == sizes0 and sizes1  # every decode size captured on cuda:1 as on cuda:0
    assert got == want
