"""Parity of every dense family plugin with HF transformers on tiny random weights.

One case per family and option set (sliding windows, softcaps, NoPE layers, biases, fused
tensors, RoPE variants). Each case builds a 2-layer model with transformers, loads it with trellm
and runs :func:`trellm.sdk.testing.check_parity`: prompt logits, logits through the paged cache
one token at a time, and 32 greedy tokens must match HF.
"""
import pytest

transformers = pytest.importorskip("transformers")

from trellm.sdk.testing import check_parity, make_tiny_hf_model

SLIDING = dict(sliding_window=8)  # shorter than the 23-token prompt, so the window matters
LOCAL_GLOBAL = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])

LONGROPE = dict(
    partial_rotary_factor=0.5,
    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.0, 2.0, 4.0, 8.0]},
)

CASES = {
    "mistral_sliding": ("MistralForCausalLM", SLIDING),
    "mistral_full": ("MistralForCausalLM", dict(sliding_window=None)),
    "ministral_layer_types": ("MinistralForCausalLM", dict(LOCAL_GLOBAL, head_dim=16)),
    "qwen2": ("Qwen2ForCausalLM", dict()),
    "qwen2_sliding": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32)),
    "smollm3_nope": ("SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    "gemma": ("GemmaForCausalLM", dict(head_dim=16)),
    "gemma2_softcap": (
        "Gemma2ForCausalLM",
        dict(LOCAL_GLOBAL, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        dict(
            LOCAL_GLOBAL, head_dim=16, query_pre_attn_scalar=16,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
    ),
    "gemma3_softcap": ("Gemma3ForCausalLM", dict(LOCAL_GLOBAL, head_dim=16, final_logit_softcapping=3.0, attn_logit_softcapping=2.0)),
    "phi3_fused_sliding": ("Phi3ForCausalLM", dict(SLIDING, pad_token_id=0)),
    # LongRoPE: long factors from the first token (both prompts exceed the original length 8) ...
    "phi3_longrope_long_partial": ("Phi3ForCausalLM", dict(pad_token_id=0, **LONGROPE, original_max_position_embeddings=8)),
    # ... and short factors throughout (never crosses 64), where the cached path is compared too
    "phi3_longrope_short_partial": ("Phi3ForCausalLM", dict(pad_token_id=0, **LONGROPE, original_max_position_embeddings=64)),
    "olmo1_clip_qkv": ("OlmoForCausalLM", dict(clip_qkv=0.5)),
    "olmo2": ("Olmo2ForCausalLM", dict()),
    "olmo3_sliding": ("Olmo3ForCausalLM", LOCAL_GLOBAL),
    "cohere": ("CohereForCausalLM", dict(logit_scale=0.5)),
    "cohere_qk_norm": ("CohereForCausalLM", dict(use_qk_norm=True)),
    "cohere2_nope_global": ("Cohere2ForCausalLM", LOCAL_GLOBAL),
    "exaone4_sliding_nope": ("Exaone4ForCausalLM", dict(sliding_window=8, sliding_window_pattern=2)),
    "exaone4_full": ("Exaone4ForCausalLM", dict(sliding_window=None, layer_types=["full_attention"] * 2)),
    "glm4": ("Glm4ForCausalLM", dict()),
    "glm": ("GlmForCausalLM", dict()),
    "apertus_xielu": ("ApertusForCausalLM", dict()),
    "arcee_relu2": ("ArceeForCausalLM", dict()),
    "seed_oss_biases": ("SeedOssForCausalLM", dict(attention_bias=True, attention_out_bias=True)),
    "ernie4_5": ("Ernie4_5ForCausalLM", dict(use_bias=True)),
    "granite": (
        "GraniteForCausalLM",
        dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    ),
    "hyperclovax_peri_ln": (
        "HyperCLOVAXForCausalLM",
        dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=0.5),
    ),
    "starcoder2_sliding": ("Starcoder2ForCausalLM", dict(SLIDING, use_bias=True)),
    "nemotron": ("NemotronForCausalLM", dict(partial_rotary_factor=0.5)),
    "phi2_parallel": ("PhiForCausalLM", dict(partial_rotary_factor=0.5)),
    "stablelm_qkv_bias": ("StableLmForCausalLM", dict(use_qkv_bias=True)),
    "stablelm_parallel": ("StableLmForCausalLM", dict(use_parallel_residual=True)),
}


def _case(name: str):
    architecture, overrides = CASES[name]
    if not hasattr(transformers, architecture):
        pytest.skip(f"transformers {transformers.__version__} has no {architecture}")
    return architecture, overrides


@pytest.mark.parametrize("name", list(CASES))
def test_family_parity(tmp_path, name):
    architecture, overrides = _case(name)
    model_dir = make_tiny_hf_model(architecture, tmp_path, **overrides)
    report = check_parity(model_dir)
    print(report)
    report.assert_ok()


# ---- the plugin template (sdk/template) works as shipped ---------------------------------------


@pytest.fixture
def template_plugin():
    """The template's plugin module, registered at run time as if it were pip-installed."""
    import importlib.util
    from pathlib import Path

    import trellm.sdk
    from trellm import registry

    path = Path(trellm.sdk.__file__).parent / "template" / "trellm_helium" / "__init__.py"
    spec = importlib.util.spec_from_file_location("trellm_helium_template", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    registry.load_plugins()
    registry.pm.register(module, name="template-helium")
    try:
        yield module
    finally:
        registry.pm.unregister(module)


def test_plugin_template_parity(template_plugin, assert_parity):
    report = assert_parity("HeliumForCausalLM", head_dim=16, tie_word_embeddings=True)
    assert report.ok


def test_unregistered_architecture_names_itself(tmp_path):
    import json

    import trellm
    from trellm.errors import UnknownArchitectureError

    model_dir = make_tiny_hf_model("LlamaForCausalLM", tmp_path)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["NobodysForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownArchitectureError, match="NobodysForCausalLM"):
        trellm.load(model_dir, device="cpu")


def test_fused_tensor_with_wrong_shape_names_it(tmp_path):
    """Fused Phi-3 tensors are split at load; a wrong fused shape is reported with the tensor's name."""
    import json

    import trellm
    from trellm.errors import WeightError

    model_dir = make_tiny_hf_model("Phi3ForCausalLM", tmp_path, pad_token_id=0)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_key_value_heads"] = 4  # the stored qkv_proj holds 2 kv heads
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight.*\[128, 64\].*\[192, 64\]"):
        trellm.load(model_dir, device="cpu")


def test_every_family_is_registered_through_its_entry_point():
    """Each CASES architecture is served by a built-in plugin found through the ``trellm`` entry points."""
    from trellm import registry

    table = registry.architectures()
    missing = sorted({arch for arch, _ in CASES.values()} - set(table))
    assert not missing, f"architectures without a plugin: {missing} (run pip install -e . --no-deps after adding entry points)"
    assert table["Gemma3ForCausalLM"][0] == "gemma3" and table["Olmo3ForCausalLM"][0] == "olmo"


@pytest.mark.parametrize(
    "architecture, overrides, key",
    [
        ("PhiForCausalLM", dict(qk_layernorm=True), "qk_layernorm"),
        ("StableLmForCausalLM", dict(qk_layernorm=True), "qk_layernorm"),
        ("Gemma3ForCausalLM", dict(head_dim=16, use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("Olmo3ForCausalLM", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ],
)
def test_unsupported_config_values_name_the_key(tmp_path, architecture, overrides, key):
    """Values a family does not support fail at load with a ConfigError naming the config key."""
    import json

    import trellm
    from trellm.errors import ConfigError

    model_dir = make_tiny_hf_model(architecture, tmp_path, **overrides)
    if architecture == "Olmo3ForCausalLM":  # corrupt it: three layer types for two layers
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg["layer_types"].append("full_attention")
        (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=key):
        trellm.load(model_dir, device="cpu")
