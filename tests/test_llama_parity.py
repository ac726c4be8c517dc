"""Llama parity with HF transformers on tiny random weights: logits and cached greedy decoding."""
import pytest

pytest.importorskip("transformers")

from trellm.sdk.testing import check_parity, make_tiny_hf_model  # noqa: E402

CONFIGS = {
    "gqa_untied": dict(tie_word_embeddings=False),
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "mqa_bias": dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    "head_dim_override": dict(head_dim=32),
    "rope_linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "rope_dynamic": dict(
        max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    ),
    "rope_llama3": dict(
        rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0,
        }
    ),
    "rope_yarn": dict(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama_parity(tmp_path, name):
    model_dir = make_tiny_hf_model("LlamaForCausalLM", tmp_path, **CONFIGS[name])
    report = check_parity(model_dir)
    report.assert_ok()


def test_legacy_rope_scaling_key_is_read(tmp_path):
    """Old checkpoints spell RoPE as rope_theta + rope_scaling; both spellings must load the same way."""
    import json

    model_dir = make_tiny_hf_model(
        "LlamaForCausalLM", tmp_path, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    )
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 5000.0
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (model_dir / "config.json").write_text(json.dumps(cfg))
    from trellm.config import DecoderConfig

    rope = DecoderConfig.from_hf(cfg).rope
    assert (rope.type, rope.factor, rope.theta) == ("linear", 2.0, 5000.0)
    check_parity(model_dir, max_new_tokens=8).assert_ok()
