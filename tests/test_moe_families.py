"""Mixture-of-experts families against HF transformers on tiny random weights, plus the MoE modules themselves.

Router correction biases are zero in a fresh HF model; the tests overwrite them with random values
in the saved checkpoint (HF and trellm then load the same numbers), so the biased choice is exercised.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from trellm.modules.moe import (
    ExpertList,
    ScoreTopK,
    SoftmaxTopK,
    StackedExperts,
    TopKSoftmax,
    dispatch_experts,
)
from trellm.sdk.testing import check_parity, make_tiny_hf_model

DEEPSEEK_ROUTING = {
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2,
    "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
}

MLA = {"q_lora_rank": 32, "kv_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "num_key_value_heads": 4}

FAMILIES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3_moe_unnormalised": ("Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": False}),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "gpt_oss": ("GptOssForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "head_dim": 16, "sliding_window": 8}),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(DEEPSEEK_ROUTING, partial_rotary_factor=0.5, attention_bias=True)),
    "glm4_moe_qk_norm": ("Glm4MoeForCausalLM", dict(DEEPSEEK_ROUTING, use_qk_norm=True, n_group=1, topk_group=1)),
    "dots1": ("Dots1ForCausalLM", DEEPSEEK_ROUTING),
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1, "tie_word_embeddings": False}),
    "minimax_m2": ("MiniMaxM2ForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    "afmoe": ("AfmoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_dense_layers": 1, "num_hidden_layers": 3,
        "head_dim": 16, "sliding_window": 8, "route_scale": 2.0, "mup_enabled": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(DEEPSEEK_ROUTING, **MLA)),
    "deepseek_v3_no_q_lora_yarn": ("DeepseekV3ForCausalLM", dict(
        DEEPSEEK_ROUTING, **{**MLA, "q_lora_rank": None}, rope_interleave=False, n_group=1, topk_group=1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
}


def randomize(model_dir: Path, suffix: str, scale: float = 0.5, seed: int = 0) -> None:
    """Overwrite every tensor whose name ends with ``suffix`` with random values, in place."""
    from safetensors.torch import load_file, save_file

    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    for name in tensors:
        if name.endswith(suffix):
            tensors[name] = torch.randn(tensors[name].shape, generator=g) * scale
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("name", list(FAMILIES))
def test_moe_family_parity(tmp_path, name):
    arch, cfg = FAMILIES[name]
    model_dir = make_tiny_hf_model(arch, tmp_path, **cfg)
    randomize(model_dir, "e_score_correction_bias")
    randomize(model_dir, "expert_bias")
    check_parity(model_dir, max_new_tokens=12).assert_ok()


# ---- the modules --------------------------------------------------------------------------------------


def test_score_topk_groups_restrict_the_choice():
    """With 4 groups of 2 and topk_groups=1, both chosen experts come from the group with the best pair."""
    logits = torch.tensor([[0.0, 0.0, 3.0, -5.0, 2.0, 2.0, -1.0, -1.0]])
    weights, ids = ScoreTopK(2, num_groups=4, topk_groups=1, normalize=True)(logits)
    assert sorted(ids[0].tolist()) == [4, 5]  # group 2 sums 2+2 > group 1's 3-5
    assert torch.allclose(weights.sum(-1), torch.ones(1))
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0, 0.0, 0.0, 0.0, 0.0])
    _, ids = ScoreTopK(2, num_groups=4, topk_groups=1)(logits, bias)
    assert sorted(ids[0].tolist()) == [2, 3]  # the bias moves the choice; weights stay unbiased scores


def test_topk_softmax_equals_renormalised_softmax_topk():
    logits = torch.randn(5, 8)
    w1, i1 = TopKSoftmax(3)(logits)
    w2, i2 = SoftmaxTopK(3, normalize=True)(logits)
    assert torch.equal(i1, i2) and torch.allclose(w1, w2, atol=1e-6)


def _stacked_and_list(tmp_path, e=5, h=16, i=8, interleaved=False, declared_transposed=True):
    """The same random experts stored stacked ([E, 2I, H] / [E, H, I]) and per expert."""
    from safetensors.torch import save_file
    from trellm.modules.base import LoadContext
    from trellm.weights import WeightStore

    g = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g), torch.randn(e, h, i, generator=g)
    if interleaved:
        gate_up = torch.stack([gate, up], dim=2).reshape(e, 2 * i, h)
    else:
        gate_up = torch.cat([gate, up], dim=1)
    tensors = {"stk.gate_up_proj": gate_up.transpose(1, 2).contiguous(), "stk.down_proj": down.transpose(1, 2).contiguous()}
    for x in range(e):
        tensors[f"lst.{x}.gate_proj.weight"], tensors[f"lst.{x}.up_proj.weight"] = gate[x], up[x]
        tensors[f"lst.{x}.down_proj.weight"] = down[x]
    save_file(tensors, tmp_path / "model.safetensors")
    ctx = LoadContext(store=WeightStore(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    stacked = StackedExperts("stk", e, h, i, transposed=declared_transposed, interleaved=interleaved)
    stacked.load(ctx)
    per_expert = ExpertList("lst", e, h, i)
    per_expert.load(ctx)
    return stacked, per_expert


@pytest.mark.parametrize("interleaved", [False, True])
def test_stacked_experts_equal_per_expert_linears(tmp_path, interleaved):
    stacked, per_expert = _stacked_and_list(tmp_path, interleaved=interleaved)
    x = torch.randn(3, 16)
    for e in range(5):
        assert torch.allclose(stacked.run_expert(e, x), per_expert.run_expert(e, x), atol=1e-5)


def test_stacked_experts_found_transposed(tmp_path):
    """Qwen3-VL MoE hub files keep [E, H, 2I] / [E, I, H] where the family declares transformers' [E, 2I, H]."""
    stacked, per_expert = _stacked_and_list(tmp_path, i=6, declared_transposed=False)  # 2I != H: not square
    x = torch.randn(3, 16)
    for e in range(5):
        assert torch.allclose(stacked.run_expert(e, x), per_expert.run_expert(e, x), atol=1e-5)


def test_dispatch_matches_a_loop_over_tokens(tmp_path):
    _, experts = _stacked_and_list(tmp_path)
    x = torch.randn(11, 16)
    weights, ids = SoftmaxTopK(2)(torch.randn(11, 5))
    got = dispatch_experts(experts, x, weights, ids)
    want = torch.stack([
        sum(weights[t, j] * experts.run_expert(int(ids[t, j]), x[t : t + 1])[0] for j in range(2)) for t in range(11)
    ])
    assert torch.allclose(got, want, atol=1e-4)


def test_mla_caches_one_latent_per_token(tmp_path):
    """DeepSeek V3's cache holds [c | k_pe] and c for one KV head, not per-head keys and values."""
    import trellm

    model_dir = make_tiny_hf_model("DeepseekV3ForCausalLM", tmp_path, **dict(DEEPSEEK_ROUTING, **MLA))
    lm = trellm.load(model_dir, device="cpu", dtype=torch.float32)
    layer = lm.new_cache(max_tokens=32, page_size=16).layers[0]
    assert layer.k_pages.shape[2:] == (1, 24 + 8) and layer.v_pages.shape[2:] == (1, 24)


@pytest.mark.parametrize("interleaved", [False, True])
def test_grouped_stacked_dispatch_matches_per_expert(tmp_path, interleaved):
    """Stacked experts run all at once (padded batched matmuls); per-expert Linears one by one: same sums."""
    stacked, per_expert = _stacked_and_list(tmp_path, interleaved=interleaved)
    x = torch.randn(9, 16)
    weights, ids = SoftmaxTopK(3)(torch.randn(9, 5))
    assert torch.allclose(dispatch_experts(stacked, x, weights, ids), dispatch_experts(per_expert, x, weights, ids), atol=1e-4)
