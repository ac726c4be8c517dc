"""Laguna and Gemma 4 against HF transformers on tiny random weights (issue 30).

Laguna's layers here differ in query-head count and attention kind (a sliding layer with full RoPE, a full
layer rotating half of each head), its router softcaps its logits, and the correction bias is overwritten
with random values in the saved checkpoint so the biased choice is exercised.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from trellm.sdk.testing import TINY_DEFAULTS, check_parity, make_tiny_hf_model  # noqa: E402
from test_moe_families import randomize  # noqa: E402  (tests/ is on sys.path)

LAGUNA = dict(
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_attention_heads_per_layer=[4, 8, 2],
    layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=8,
    mlp_layer_types=["dense", "sparse", "sparse"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, moe_routed_scaling_factor=2.5, moe_router_logit_softcapping=2.0,
)


@pytest.mark.parametrize("gating", ["per-head", "per-element"])
def test_laguna_parity(tmp_path, gating):
    model_dir = make_tiny_hf_model("LagunaForCausalLM", tmp_path, gating=gating, **LAGUNA)
    randomize(model_dir, "e_score_correction_bias")
    report = check_parity(model_dir)
    print(report)
    report.assert_ok()


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads_per_layer": [4, 8]}, "per-layer head counts list 2 entries for 3 layers"),
    ({"num_attention_heads_per_layer": [4, 3, 2]}, "[3] are not positive multiples of num_key_value_heads (2)"),
    ({"gating": "per-channel"}, "gating='per-channel'"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types must list 'dense' or 'sparse'"),
])
def test_laguna_config_errors_name_the_key(change, message):
    from trellm.registry import find_architecture
    from trellm.sdk import ConfigError

    raw = dict(TINY_DEFAULTS, **LAGUNA, architectures=["LagunaForCausalLM"], gating="per-head")
    raw.update(change)
    spec = find_architecture("LagunaForCausalLM")
    with pytest.raises(ConfigError) as err:
        spec.build(spec.read_config(raw))
    assert message in str(err.value)
