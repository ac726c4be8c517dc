"""Capabilities are Protocols (trellm.capabilities); configs carry typed MoE / linear-attention records."""
from __future__ import annotations

import pytest
import torch

from trellm import capabilities as caps
from trellm.cache import KVCache, KVCacheLayer
from trellm.cache.quantized import QuantizedKVCacheLayer
from trellm.cache.recurrent import RecurrentStateLayer
from trellm.config import DecoderConfig
from trellm.errors import ConfigError
from trellm.sdk import build_decoder, build_qwen3_5, build_qwen3_5_moe

TINY = dict(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, architectures=["Qwen3_5ForCausalLM"])
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def test_models_and_cache_layers_are_told_apart_by_their_protocols():
    llama = build_decoder(DecoderConfig.from_hf(TINY))
    hybrid = build_qwen3_5(DecoderConfig.from_hf({**TINY, **LINEAR}))
    assert caps.is_hybrid(hybrid) and not caps.is_hybrid(llama)
    assert caps.mtp_head(hybrid) is hybrid.mtp and caps.mtp_head(llama) is None
    assert not caps.supports_images(hybrid)

    cache = hybrid.make_cache(max_tokens=64, page_size=16, max_slots=2, dtype=torch.float32, device="cpu")
    dense = KVCacheLayer(4, 16, 2, 32, 32, torch.float32, "cpu")
    quant = QuantizedKVCacheLayer(4, 16, 2, 32, 32, torch.float16, "cpu")
    state = next(layer for layer in cache.layers if isinstance(layer, RecurrentStateLayer))
    assert [caps.is_paged_layer(x) for x in (dense, quant, state, None)] == [True, True, False, False]
    assert [caps.has_dense_pages(x) for x in (dense, quant, state)] == [True, False, False]
    assert [caps.is_state_layer(x) for x in (dense, quant, state)] == [False, False, True]
    assert cache.state_layers() == [layer for layer in cache.layers if isinstance(layer, RecurrentStateLayer)]
    assert not KVCache.for_model(llama, max_tokens=64, page_size=16, dtype=torch.float32, device="cpu").state_layers()


@pytest.mark.parametrize("protocol", [caps.HasRecurrentState, caps.SupportsImages, caps.HasMTPHead, caps.PagedKVLayer,
                                      caps.DenseKVPages, caps.StateSlots, caps.DraftsFromHiddenStates])
def test_implements_is_isinstance_of_the_runtime_protocol(protocol):
    objects = [build_decoder(DecoderConfig.from_hf(TINY)), build_qwen3_5(DecoderConfig.from_hf({**TINY, **LINEAR})),
               KVCacheLayer(4, 16, 2, 8, 8, torch.float32, "cpu"), RecurrentStateLayer(2, 4, 4, (2, 2), torch.float32, "cpu"),
               object(), None]
    assert [caps.implements(o, protocol) for o in objects] == [isinstance(o, protocol) for o in objects]


def test_moe_keys_are_read_once_whatever_their_spelling():
    for count_key in ("n_routed_experts", "num_local_experts", "num_experts"):
        moe = DecoderConfig.from_hf({**TINY, count_key: 8, "num_experts_per_tok": 2}).require_moe()
        assert (moe.num_experts, moe.experts_per_token) == (8, 2)
    cfg = DecoderConfig.from_hf({**TINY, **EXPERTS, "first_k_dense_replace": 1, "decoder_sparse_step": 1, "mlp_only_layers": [2]})
    assert [cfg.moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert DecoderConfig.from_hf(TINY).moe is None and DecoderConfig.from_hf(TINY).linear_attention is None


def test_missing_moe_and_linear_attention_keys_are_named():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        DecoderConfig.from_hf({**TINY, "num_experts": 4}).require_moe()
    with pytest.raises(ConfigError, match="n_routed_experts"):
        build_qwen3_5_moe(DecoderConfig.from_hf({**TINY, **LINEAR}))
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        build_qwen3_5(DecoderConfig.from_hf(TINY))
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        build_qwen3_5_moe(DecoderConfig.from_hf({**TINY, **LINEAR, "num_experts": 4, "num_experts_per_tok": 2}))


def test_a_family_reads_its_own_keys_into_a_typed_record():
    from trellm.config import read_keys
    from trellm.sdk.families import GraniteKeys

    cfg = DecoderConfig.from_hf({**TINY, "logits_scaling": 8, "attention_multiplier": None, "residual_multiplier": "0.5"})
    assert read_keys(GraniteKeys, cfg) == GraniteKeys(embedding_multiplier=1.0, residual_multiplier=0.5, logits_scaling=8.0)
    with pytest.raises(ConfigError, match="embedding_multiplier='twelve'"):
        read_keys(GraniteKeys, {**TINY, "embedding_multiplier": "twelve"})
