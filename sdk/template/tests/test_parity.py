"""Parity of the plugin with HF transformers, through the fixtures trellm installs as a pytest plugin.

``assert_parity(architecture, **config_overrides)`` builds a tiny random-weight model with
transformers, loads it with trellm and compares prompt logits, cached decoding and 32 greedy tokens.
One test per option set the family has (here: grouped-query vs multi-head attention, tied embeddings).
"""
import pytest

# Helium's config defaults head_dim to 128 and its o_proj is [hidden, hidden]: keep heads * head_dim == hidden.
CONFIGS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_helium_parity(assert_parity, name):
    assert_parity("HeliumForCausalLM", **CONFIGS[name])


def test_plugin_is_registered():
    from trellm.sdk import find_architecture

    assert find_architecture("HeliumForCausalLM").name == "helium"
