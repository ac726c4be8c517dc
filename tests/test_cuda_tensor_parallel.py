"""Tensor parallel on the GPU (skipped without CUDA): one rank over its own NCCL group against the plain
one-device load, and the memory plan against what the device really allocates.

With several GPUs, the same parity at 2 ranks (``NCCL_NVLS_ENABLE=0`` and the other multicast switches set), for
Llama and for the CPU suite's hybrid, MLA, DSA and DeepSeek V4 checkpoints.
"""
from __future__ import annotations

import pytest
import torch

import trellm
from trellm.distributed import load_tensor_parallel
from trellm.distributed.plan import plan_memory
from trellm.model import context_length
from trellm.sdk.testing import make_tiny_hf_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("tp_cuda") / "llama")


def _compare(one, split) -> None:
    want, got = one.logits(PROMPTS), split.logits(PROMPTS)
    spread = (want.max() - want.min()).item()
    assert (want - got).abs().max().item() <= 1e-3 * spread
    prompt = PROMPTS[0, :8].tolist()
    greedy = list(one.generate_ids(prompt, max_new_tokens=32, stop_token_ids=[]))
    assert list(split.generate_ids(prompt, max_new_tokens=32, stop_token_ids=[])) == greedy


def test_one_rank_over_nccl_matches_the_plain_load(llama_dir):
    one = trellm.load(llama_dir, device="cuda", dtype="float16", tokenizer=False)
    with load_tensor_parallel(llama_dir, 1, "cuda", "float16", progress=False, tokenizer=False) as split:
        assert "nccl" in split.model.comm.data.name().lower()
        _compare(one, split)
        assert split.model.time_all_reduce(8, reps=5) > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_over_nccl(llama_dir):
    one = trellm.load(llama_dir, device="cuda", dtype="float16", tokenizer=False)
    with trellm.load(llama_dir, device="cuda", dtype="float16", tokenizer=False, tensor_parallel=2) as split:
        _compare(one, split)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name", ["qwen3_5_moe", "deepseek_v3", "glm_dsa", "deepseek_v4", "glm5_next", "qwen4_exp"])
def test_two_ranks_over_nccl_hybrid_and_latent(tmp_path, name):
    """The CPU suite's hybrid (gated delta net + gated attention, experts spread), MLA, DSA sparse MLA, DeepSeek V4,
    GLM 5.3 (KDA by heads) and Qwen 3.8 (PLE delta net and indexed attention by heads) checkpoints on two GPUs,
    float32, against one GPU."""
    from test_tensor_parallel import MODELS, WRITERS  # tests/ is on sys.path

    if name in WRITERS:
        model_dir = WRITERS[name](tmp_path)
    else:
        model_dir = make_tiny_hf_model(MODELS[name][0], tmp_path, **MODELS[name][1])
    one = trellm.load(model_dir, device="cuda", dtype="float32", tokenizer=False)
    with trellm.load(model_dir, device="cuda", dtype="float32", tokenizer=False, tensor_parallel=2) as split:
        _compare(one, split)


def test_exl3_columns_off_the_blocks_on_the_gpu():
    """A column shard off the 128-blocks (ColumnSelect) through the EXL3 kernels: the whole projection's columns."""
    from test_tensor_parallel import _random_exl3

    from trellm.distributed.sharding import ColumnSelect, split_column_ranges
    from trellm.modules.linear import Linear
    from trellm.ops import project

    g = torch.Generator().manual_seed(1)
    whole = _random_exl3(256, 640, g)
    whole = type(whole)(whole.trellis.cuda(), whole.suh.cuda(), whole.svh.cuda(), whole.codebook, 256, 640)
    lin = Linear("p", 256, 640)
    lin.impl = whole
    ranges = [(40, 72), (100, 130), (520, 600)]
    split_column_ranges(lin, ranges)
    assert isinstance(lin.impl, ColumnSelect)
    cols = torch.cat([torch.arange(a, b) for a, b in ranges]).cuda()
    for rows in (1, 5, 300):  # GEMV, mid-size and decoded routes
        x = torch.randn(rows, 256, device="cuda", dtype=torch.float16)
        want = project(x, whole)[:, cols]  # the shard's blocks may take another route than the whole: fp16 rounding
        torch.testing.assert_close(project(x, lin.impl), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_memory_plan_against_the_allocation(llama_dir):
    """Weights and cache exactly what the device holds; the prefill peak printed beside the estimate."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    lm = trellm.load(llama_dir, device="cuda", dtype="float16", tokenizer=False)
    weights = torch.cuda.memory_allocated() - base
    tokens = context_length(lm.model.config)  # the longest prompt the model takes
    plan = plan_memory(llama_dir, 1, "cuda", "float16", chunk_tokens=tokens).ranks[0]
    cache = lm.new_cache(max_tokens=4096, page_size=256)
    cache_bytes = torch.cuda.memory_allocated() - base - weights
    assert abs(weights - plan.weights) <= 0.05 * plan.weights
    assert cache_bytes == plan.kv_per_token * cache.capacity_tokens
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    lm.logits([[1] * tokens])
    peak = torch.cuda.max_memory_allocated() - before
    print(f"memory plan: weights {plan.weights} B planned, {weights} B allocated; cache {cache_bytes} B; "
          f"{tokens}-token forward peak {peak} B, estimated {plan.activations} B")
