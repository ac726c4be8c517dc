"""Decode steps of models with recurrent layers through the GraphRunner: each row's state slot is a graph
input, padding rows run in the runner's scratch slot. Capture itself needs a GPU, so here eager forwards
stand in for the captured graphs and everything else (static buffers, padding, replay into a fixed
output, slot accounting) is the runner's own code."""
from __future__ import annotations

import pytest
import torch

import trellm
from trellm.cache.recurrent import alloc_state_slot, free_state_slot
from trellm.generator import Generator, Job, SamplerSettings
from trellm.graph import GraphRunner
from trellm.sdk.testing import make_tiny_hf_model

from test_hybrid_families import FAMILIES


class EagerRecording:
    """Mixed into a GraphRunner: its "captured graph" is an eager run of the same step over the same static inputs,
    copied into fixed outputs as a replay would leave them."""

    replays = 0

    def _record(self, run):
        first = run()
        runner = self

        def fixed(t: torch.Tensor) -> torch.Tensor:  # the runner's shared logits rows stay shared, as in real graphs
            shared = runner._logits is not None and t.untyped_storage().data_ptr() == runner._logits.untyped_storage().data_ptr()
            return t if shared else t.clone()

        out = tuple(map(fixed, first)) if isinstance(first, tuple) else fixed(first)

        class Replay:
            def replay(self):
                runner.replays += 1
                now = run()
                for dst, src in zip(out, now) if isinstance(out, tuple) else ((out, now),):
                    dst.copy_(src)

        return Replay(), out


class EagerGraphs(EagerRecording, GraphRunner):
    """A GraphRunner replaying eager stand-ins for its graphs; ``staged`` logs each verification step's (width,
    tokens fed per real row)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.enabled = self._scratch_page is not None and (self._scratch_slot is not None or not self.state_slots)
        self.staged: list[tuple[int, list[int]]] = []

    def stage(self, size, feeds, *args, width: int = 1, **kwargs):
        if width > 1 and feeds:
            self.staged.append((width, [len(f) for f in feeds]))
        return super().stage(size, feeds, *args, width=width, **kwargs)


def tiny_hybrid(name: str, path, **sizes):
    """A tiny random checkpoint of the family ``name`` (test_hybrid_families' configs; Qwen 3.8-Flash-Next's from
    test_families_next), ``sizes`` overriding its text config."""
    if name == "qwen4_exp":
        from test_families_next import qwen4_exp_checkpoint

        return qwen4_exp_checkpoint(path, **sizes)
    arch, cfg = FAMILIES[name]
    return make_tiny_hf_model(arch, path, **{**cfg, **sizes})


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h", "lfm2_moe", "qwen4_exp"])
def hybrid(request, tmp_path_factory):
    torch.set_num_threads(1)
    return trellm.load(tiny_hybrid(request.param, tmp_path_factory.mktemp(request.param)), device="cpu",
                       dtype=torch.float32, tokenizer=False)


def vocab_size(lm) -> int:
    """The text model's vocabulary (a vision-language config keeps it in its text config)."""
    return getattr(lm.config, "text", lm.config).vocab_size


def _jobs(vocab: int) -> list[Job]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 5, 20)]
    sampled = SamplerSettings(temperature=0.8, top_k=20)
    return [Job(prompts[0], 16, identifier=0, stop_token_ids=[]),
            Job(prompts[1], 16, identifier=1, stop_token_ids=[], sampler=sampled, seed=1),
            Job(prompts[2], 10, identifier=2, stop_token_ids=[])]


def test_hybrid_decode_through_the_graph_runner(hybrid):
    """Three jobs in graphs of 4 rows (one padding row, in the scratch slot, next to real slots): the same
    tokens as eager decoding, prefix reuse through checkpoints included, and every slot accounted for."""
    def run(graphs: bool):
        gen = Generator(hybrid, cache_tokens=1024, page_size=16, max_batch_size=4, max_chunk_tokens=32)
        if graphs:  # the scratch slot is not slot 0, where a padding row left to the buffer's zeros would run
            first = alloc_state_slot(gen.cache)
            gen.graph_runner = EagerGraphs(gen.model, gen.cache, batch_sizes=(1, 2, 4), max_context=gen.cache.capacity_tokens)
            free_state_slot(gen.cache, first)
            assert gen.graph_runner._scratch_slot != 0
        out = []
        for _ in range(2):  # the second round reuses the first one's pages and state checkpoints
            gen.enqueue(_jobs(vocab_size(hybrid)))
            out.append(sorted((r.identifier, r.token_ids) for r in gen.stream() if type(r).__name__ == "JobFinished"))
            gen.verify_pages()
        return out, gen

    (eager, _), (replayed, gen) = run(False), run(True)
    assert replayed == eager
    assert gen.graph_runner.replays > 20 and sorted(gen.graph_runner.graphs) == [(2, 1), (4, 1)]
    assert gen.stats["reused_tokens"] > 0
    gen.graph_runner.close()
    gen.clear_prefix_cache()
    gen.verify_pages()


def test_hybrid_async_scheduling(hybrid):
    """Async scheduling on a model with recurrent layers: the same tokens as the synchronous generator, also
    for follow-up prompts that reuse the state checkpoints taken while decoding (no step is queued ahead of
    one that fills a page), slots accounted for, and most decode steps queued ahead."""
    def run(overlap: bool):
        gen = Generator(hybrid, cache_tokens=1024, page_size=16, max_batch_size=4, max_chunk_tokens=32,
                        async_scheduling=overlap)
        jobs = _jobs(vocab_size(hybrid))
        gen.enqueue(jobs)
        first = {r.identifier: r.token_ids for r in gen.stream() if type(r).__name__ == "JobFinished"}
        # the conversations go on: their prompts reuse pages (and state checkpoints) filled while decoding
        gen.enqueue([Job(j.prompt_ids + first[i] + [7, 8, 9], 8, identifier=i, stop_token_ids=[]) for i, j in enumerate(jobs)])
        second = {r.identifier: r.token_ids for r in gen.stream() if type(r).__name__ == "JobFinished"}
        gen.verify_pages()
        return (first, second), gen

    (sync, _), (overlapped, gen) = run(False), run(True)
    assert overlapped == sync
    assert gen.stats["reused_tokens"] >= 3 * 16 and gen.stats["steps_ahead"] > 15


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "lfm2_moe", "qwen4_exp"])
def test_hybrid_graphs_capture_on_cuda(tmp_path, name):
    """On a GPU the recurrent decode step really is captured (no eager fallback) and gives the eager tokens,
    with async scheduling on and off. NemotronH's ungated experts take the pair path; Qwen 3.8-Flash-Next's
    rotations and per-layer embeddings read nothing on the host."""
    # head sizes the CUDA kernels take (64): the torch reference of paged attention reads sequence lengths on the
    # host, which no graph can capture (every capture then falls back to eager)
    gpu_sizes = {"hidden_size": 256, "head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                 "mamba_head_dim": 64} if name != "lfm2_moe" else {"hidden_size": 256}
    if name == "qwen4_exp":
        gpu_sizes["indexer_head_dim"] = 64
    model_dir = tiny_hybrid(name, tmp_path, **gpu_sizes)
    lm = trellm.load(model_dir, device="cuda", dtype=torch.float32, tokenizer=False)
    out = {}
    for graphs, overlap in ((False, False), (True, False), (True, True)):
        gen = Generator(lm, cache_tokens=1024, page_size=16, max_batch_size=4, cuda_graphs=graphs, async_scheduling=overlap)
        gen.enqueue(_jobs(vocab_size(lm)))
        out[graphs, overlap] = sorted((r.identifier, r.token_ids) for r in gen.stream() if type(r).__name__ == "JobFinished")
        gen.verify_pages()
        if graphs:
            assert gen.graph_runner.graphs and not gen.graph_runner._failed
    assert out[True, False] == out[False, False] == out[True, True]
    prompt = _jobs(vocab_size(lm))[0].prompt_ids
    simple = list(lm.generate_ids(prompt, 12, stop_token_ids=[]))  # the session cache's batch-1 graph
    assert lm._runner is not None and lm._runner.graphs and not lm._runner._failed
    assert simple == list(lm.generate_ids(prompt, 12, stop_token_ids=[], cache=lm.new_cache(max_tokens=512, page_size=16)))
