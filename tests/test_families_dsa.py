"""DeepSeek-style sparse attention families (issue 30), GLM 5 and DeepSeek V4, and the shared modules they brought
(hyper-connections, MLA with a DSA indexer, compressed attention), each held against transformers. The prompts
are longer than every window and top-k, so a selection or window that goes wrong changes the logits."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file

from trellm.sdk import HyperConnection, HyperHead, LoadContext, expand_streams
from trellm.sdk.testing import check_parity, make_tiny_hf_model
from trellm.weights import WeightStore

from test_moe_families import randomize


def _load(module, tensors: dict[str, torch.Tensor], tmp_path):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    module.load(LoadContext(store=WeightStore(tmp_path), device=torch.device("cpu"), dtype=torch.float32))
    return module


def _v4_config(**overrides):
    from transformers import DeepseekV4Config

    values = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16, q_lora_rank=16,
                  hc_mult=3, hc_sinkhorn_iters=7, rms_norm_eps=1e-6)
    return DeepseekV4Config(**{**values, **overrides})


def test_hyper_connection_matches_transformers(tmp_path):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    config = _v4_config()
    torch.manual_seed(0)
    ref = DeepseekV4HyperConnection(config)
    with torch.no_grad():
        ref.fn.normal_(0, 0.3)
        ref.base.normal_(0, 0.5)
        ref.scale.uniform_(0.5, 1.5)
    hc = _load(HyperConnection("hc_attn_", 32, 3, 7, config.hc_eps, config.rms_norm_eps),
               {"hc_attn_fn": ref.fn.data, "hc_attn_base": ref.base.data, "hc_attn_scale": ref.scale.data}, tmp_path)
    streams = torch.randn(5, 3, 32)
    block_output = torch.randn(5, 32)
    with torch.no_grad():
        post, comb, collapsed = ref(streams[None])
        want = post[0].unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), streams)
    x, mix = hc.forward(streams)
    torch.testing.assert_close(x, collapsed[0])
    torch.testing.assert_close(mix.merge(streams, block_output), want)
    # the stream mix is doubly stochastic (Sinkhorn): columns sum to 1, rows nearly
    torch.testing.assert_close(mix.comb.sum(-2), torch.ones(5, 3), atol=1e-5, rtol=0)
    assert not torch.allclose(mix.post, mix.post[:1])  # the weights depend on the token


def test_hyper_head_matches_transformers(tmp_path):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    config = _v4_config()
    torch.manual_seed(1)
    ref = DeepseekV4HyperHead(config)
    with torch.no_grad():
        ref.hc_fn.normal_(0, 0.3)
        ref.hc_base.normal_(0, 0.5)
        ref.hc_scale.fill_(1.3)
    head = _load(HyperHead("model.hc_head.hc_", 32, 3, config.hc_eps, config.rms_norm_eps),
                 {"model.hc_head.hc_fn": ref.hc_fn.data, "model.hc_head.hc_base": ref.hc_base.data,
                  "model.hc_head.hc_scale": ref.hc_scale.data}, tmp_path)
    streams = torch.randn(4, 3, 32)
    with torch.no_grad():
        torch.testing.assert_close(head.forward(streams), ref(streams[None])[0])
    assert expand_streams(streams[:, 0], 3).shape == (4, 3, 32)


# ---- GLM 5: MLA with DeepSeek Sparse Attention ------------------------------------------------------------

# index_topk 6 < both prompts (23 and 9 tokens): the later queries of each attend to a selection, not to all
GLM_DSA = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
               q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               index_topk=6, index_head_dim=16, index_n_heads=8, first_k_dense_replace=1, num_hidden_layers=3,
               indexer_types=["full", "shared", "full"], num_key_value_heads=4)


@pytest.fixture(scope="module")
def glm_dsa_dir(tmp_path_factory):
    model_dir = make_tiny_hf_model("GlmMoeDsaForCausalLM", tmp_path_factory.mktemp("glm_dsa"), **GLM_DSA)
    randomize(model_dir, "e_score_correction_bias")
    return model_dir


def test_glm_moe_dsa_parity(glm_dsa_dir):
    report = check_parity(glm_dsa_dir)
    print(report)
    report.assert_ok()


def test_glm_moe_dsa_cache_keeps_indexer_keys_and_refuses_quantized_pages(glm_dsa_dir):
    import trellm
    from trellm.cache.indexed import ExtraRowsKVCacheLayer
    from trellm.cache.quantized import QuantizedKVCacheLayer
    from trellm.errors import ConfigError

    lm = trellm.load(glm_dsa_dir, device="cpu", dtype=torch.float32)
    cache = lm.new_cache(max_tokens=64, page_size=16)
    full, shared, full2 = cache.layers
    assert isinstance(full, ExtraRowsKVCacheLayer) and isinstance(full2, ExtraRowsKVCacheLayer)
    assert not isinstance(shared, ExtraRowsKVCacheLayer)  # a "shared" layer has no indexer, so no keys of its own
    assert full.row_pages.shape == (4, 16, 16)
    assert cache.nbytes() == sum(l.k_pages.numel() + l.v_pages.numel() for l in cache.layers) * 4 + 2 * full.row_pages.numel() * 4
    quantized = QuantizedKVCacheLayer(4, 16, 1, 64, 32, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="QuantizedKVCacheLayer cache cannot serve it: use an unquantized KV cache"):
        lm.model.layers[0].attn.cache_layer(quantized)


# ---- DeepSeek V4: compressed attention, hyper-connections, hash routing ---------------------------------

# 23- and 9-token prompts against a window of 8, CSA windows of 2 (11 entries) of which the indexer keeps 2,
# HCA windows of 4; experts chosen by token id on the first layer; a SwiGLU clamp small enough to bite
DEEPSEEK_V4 = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32, head_dim=32,
                   num_key_value_heads=1, o_groups=2, o_lora_rank=16, index_topk=2, index_head_dim=16, index_n_heads=8,
                   num_hidden_layers=3, sliding_window=8, hc_mult=3, hc_sinkhorn_iters=5, swiglu_limit=0.5,
                   layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                   compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                   mlp_layer_types=["hash_moe", "moe", "moe"])


def random_tid2eid(model_dir, experts: int) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(0)
    for name in tensors:
        if name.endswith("tid2eid"):
            tensors[name] = torch.stack([torch.randperm(experts, generator=g)[:tensors[name].shape[1]] for _ in tensors[name]])
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def deepseek_v4_dir(tmp_path_factory):
    model_dir = make_tiny_hf_model("DeepseekV4ForCausalLM", tmp_path_factory.mktemp("dsv4"), **DEEPSEEK_V4)
    for suffix in ("gate.bias", ".ape"):
        randomize(model_dir, suffix)
    random_tid2eid(model_dir, 8)
    return model_dir


def test_deepseek_v4_parity(deepseek_v4_dir):
    report = check_parity(deepseek_v4_dir)
    print(report)
    report.assert_ok()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["glm_dsa_dir", "deepseek_v4_dir"])
def test_sparse_families_on_cuda(request, family):
    """The torch references on CUDA tensors, through the session cache (CUDA graphs where they capture, else eager):
    the same logits as on the CPU and the same 32 greedy tokens."""
    import trellm

    model_dir = request.getfixturevalue(family)
    cpu = trellm.load(model_dir, device="cpu", dtype=torch.float32)
    gpu = trellm.load(model_dir, device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for n in (23, 9):
        prompt = torch.randint(0, cpu.config.vocab_size, (n,), generator=g).tolist()
        want, got = cpu.logits([prompt])[0], gpu.logits([prompt])[0].cpu()
        assert float((want - got).abs().max()) <= 1e-3 * float(want.max() - want.min())
        assert list(gpu.generate_ids(prompt, 32, stop_token_ids=[])) == list(cpu.generate_ids(prompt, 32, stop_token_ids=[]))


def test_deepseek_v4_prompts_shorter_than_a_window(deepseek_v4_dir):
    """No complete window yet (1 and 3 tokens against windows of 2 and 4): no entries, and decoding goes on."""
    from trellm.sdk import ops

    for overlap, width in ((False, 8), (True, 16)):
        span = 4 if overlap else 2
        assert ops.compressed.fold_windows(torch.randn(0, span, width), torch.randn(0, span, width), torch.zeros(2, width), overlap).shape == (0, 8)
    report = check_parity(deepseek_v4_dir, prompts=[[5], [7, 3, 9]], max_new_tokens=8)
    print(report)
    report.assert_ok()


@pytest.mark.parametrize("checkpoint", ["glm_dsa_dir", "deepseek_v4_dir"])
def test_memory_plan_counts_the_extra_cache_rows(request, checkpoint):
    """The memory plan's KV bytes per token (from a meta load) equal the real cache's, whose layers keep indexer
    keys or compressor inputs beside the K/V rows."""
    import trellm
    from trellm.distributed.plan import layer_costs, plan_memory

    model_dir = request.getfixturevalue(checkpoint)
    cache = trellm.load(model_dir, device="cpu", dtype=torch.float32, tokenizer=False).new_cache(max_tokens=1024, page_size=16)
    per_token = cache.nbytes() // (cache.num_pages * cache.page_size)
    assert per_token > sum(l.k_pages[0, 0].numel() + l.v_pages[0, 0].numel() for l in cache.layers) * 4  # rows beyond K/V
    assert plan_memory(model_dir, device="cpu", dtype=torch.float32).ranks[0].kv_per_token == per_token
    assert sum(layer_costs(model_dir, device="cpu", dtype=torch.float32).layer_kv) == per_token
