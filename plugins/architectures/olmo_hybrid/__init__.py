"""OLMo Hybrid (OlmoHybridForCausalLM): gated-delta-net layers (pre-norm) interleaved with OLMo 2 style
attention layers (full-width QK-norm, norms on the attention and MLP outputs, RoPE or NoPE)."""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    Attention,
    ConfigError,
    DecoderConfig,
    DecoderLayer,
    GatedDeltaNet,
    GatedMLP,
    HybridCausalLM,
    Module,
    RMSNorm,
    RotaryEmbedding,
)


def build(cfg: DecoderConfig) -> HybridCausalLM:
    x = cfg.extra
    eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
    types = list(cfg.layer_types)
    if len(types) != cfg.num_hidden_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ConfigError(f"config.json: layer_types {types} must list 'linear_attention'/'full_attention' per layer")
    has_rope = bool((x.get("rope_parameters") or {}).get("rope_theta") or x.get("rope_theta"))
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings) if has_rope else None
    layers: list[Module] = []
    for i, kind in enumerate(types):
        key = f"model.layers.{i}"

        def norm(name: str, key: str = key) -> RMSNorm:
            return RMSNorm(f"{key}.{name}", hidden, eps)

        mlp = GatedMLP(f"{key}.mlp", hidden, cfg.intermediate_size, cfg.hidden_act)
        if kind == "linear_attention":
            mixer = GatedDeltaNet.from_config(
                f"{key}.linear_attn", i, hidden, cfg.require_linear_attention(), eps, "separate",
                beta_scale=2.0 if x.get("linear_allow_neg_eigval", True) else 1.0, norm_eps=1e-5,
            )
            layers.append(DecoderLayer(key, norm("attention_layer_norm"), mixer, norm("feedforward_layer_norm"), mlp))
        else:
            attn = Attention(f"{key}.self_attn", i, hidden, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             rope, cfg.attention_bias, cfg.attention_bias, eps, qk_norm="full")
            layers.append(DecoderLayer(key, None, attn, None, mlp, attn_out_norm=norm("feedforward_layer_norm"),
                                       mlp_out_norm=norm("post_feedforward_layernorm")))
    return HybridCausalLM.from_layers(cfg, layers, "model.embed_tokens", "model.norm")


SPEC = ArchitectureSpec(
    name="olmo_hybrid",
    architectures=("OlmoHybridForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="AllenAI OLMo Hybrid: gated delta net + OLMo 2 attention",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
