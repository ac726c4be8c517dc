"""The memory plan (trellm.distributed.plan) against what a real load and a real cache hold, on CPU."""
from __future__ import annotations

import pytest
import torch

import trellm
from trellm.capabilities import is_hybrid
from trellm.cache.quantized import quantized_cache, quantized_layer_factory
from trellm.cli import main as cli_main
from trellm.distributed.plan import GiB, MemoryPlanError, plan_layer_split, plan_memory
from trellm.sdk.testing import make_tiny_hf_model

FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "gemma3": ("Gemma3ForCausalLM", dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", dict(
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    return {name: make_tiny_hf_model(arch, root / name, **kw) for name, (arch, kw) in FAMILIES.items()}


def _real_cache(lm):
    if is_hybrid(lm.model):
        return lm.model.make_cache(max_tokens=1024, page_size=256, max_slots=1)
    return lm.new_cache(1024, 256)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_plan_is_what_a_load_and_a_cache_hold(dirs, name):
    """Weights exactly the loaded modules' bytes; KV per token and state per slot exactly a real cache's."""
    lm = trellm.load(dirs[name], device="cpu", tokenizer=False)
    rank = plan_memory(dirs[name], 1, device="cpu").ranks[0]
    assert rank.weights == lm.model.nbytes()
    cache = _real_cache(lm)
    state = sum(layer.nbytes() for layer in cache.state_layers())
    assert rank.state_per_slot == state
    assert rank.kv_per_token * cache.capacity_tokens == cache.nbytes() - state
    assert (rank.state_per_slot > 0) == (name == "qwen3_5_moe")


def test_quantized_cache_plan(dirs):
    lm = trellm.load(dirs["llama"], device="cpu", tokenizer=False)
    rank = plan_memory(dirs["llama"], 1, device="cpu", cache_kwargs={"layer_factory": quantized_layer_factory(4, 2)}).ranks[0]
    cache = quantized_cache(lm, k_bits=4, v_bits=2, max_tokens=1024, page_size=256)
    assert rank.kv_per_token * cache.capacity_tokens == cache.nbytes()


def test_tensor_parallel_plan_matches_rank_0(dirs):
    """Rank 0's planned share is the bytes the real rank 0 holds; the KV heads halve."""
    one = plan_memory(dirs["qwen3_moe"], 1, device="cpu").ranks[0]
    plan = plan_memory(dirs["qwen3_moe"], 2, device="cpu")
    assert plan.ranks[0].kv_per_token * 2 == one.kv_per_token
    assert plan.ranks[0].weights < 0.6 * one.weights
    with trellm.load(dirs["qwen3_moe"], device="cpu", tokenizer=False, tensor_parallel=2, step_timeout=30) as lm:
        assert lm.model.local.nbytes() == plan.ranks[0].weights


def test_refusal_names_device_need_and_free(dirs):
    plan = plan_memory(dirs["llama"], 2, device="cpu", free=[1.0, 0.0001])
    assert plan.max_context() == 0
    with pytest.raises(MemoryPlanError, match=r"does not fit cpu: it needs .* \(weights .*, KV cache .* for 4096 tokens.*"
                                              r"104.9 KiB is free"):
        plan.check(4096)
    roomy = plan_memory(dirs["llama"], 1, device="cpu", free=[1.0]).ranks[0]
    assert roomy.max_context() == (GiB - roomy.fixed) // roomy.kv_per_token


def test_layer_split_over_simulated_devices(dirs):
    """Layers go in order to devices of different sizes; a split too small is refused naming the layers left."""
    whole = plan_layer_split(dirs["gemma3"], [4.0], context=1 << 20, device="cpu")
    assert [r.layers for r in whole.ranks] == [(0, 2)]
    device = whole.ranks[0]
    one_layer = device.fixed + (device.kv_per_token // 2) * (1 << 20) - device.weights + 2 * device.weights
    split = plan_layer_split(dirs["gemma3"], [one_layer / GiB, 4.0], context=1 << 20, device="cpu")
    assert [r.layers for r in split.ranks] == [(0, 1), (1, 2)]
    assert sum(r.kv_per_token for r in split.ranks) == device.kv_per_token
    with pytest.raises(MemoryPlanError, match="layers 1-1 and the head are left"):
        plan_layer_split(dirs["gemma3"], [one_layer / GiB, 0.1], context=1 << 20, device="cpu")


def test_info_prints_the_plan(dirs, capsys):
    assert cli_main(["info", "-m", str(dirs["llama"]), "--device", "cpu", "--tp", "2", "--context", "2048"]) == 0
    out = capsys.readouterr().out
    assert "memory plan:   tensor parallel over 2 ranks" in out
    assert out.count("cpu (rank ") == 2 and "for 2048 tokens" in out
    assert cli_main(["info", "-m", str(dirs["llama"]), "--device", "cpu", "--gpu-split", "2,2"]) == 0
    assert "largest context that fits:" in capsys.readouterr().out
