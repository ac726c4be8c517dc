"""LFM2 MoE (Lfm2MoeForCausalLM): gated short-conv layers interleaved with QK-norm attention, then a
sigmoid-routed MoE (expert bias steering the choice) after ``num_dense_layers`` dense w1/w3/w2 MLPs."""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    Attention,
    ConfigError,
    DecoderConfig,
    DecoderLayer,
    ExpertMLP,
    Experts,
    HybridCausalLM,
    Linear,
    MoE,
    Module,
    RMSNorm,
    RotaryEmbedding,
    Router,
    ScoreTopK,
    ShortConv,
    config_int,
    text_config,
)


def read_config(raw: dict) -> DecoderConfig:
    c = text_config(raw)
    return DecoderConfig.from_hf(raw, rms_norm_eps=float(c.get("norm_eps", c.get("rms_norm_eps", 1e-5))))


def build(cfg: DecoderConfig) -> HybridCausalLM:
    x = cfg.extra
    eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
    types = list(cfg.layer_types)
    if len(types) != cfg.num_hidden_layers or set(types) - {"conv", "full_attention"}:
        raise ConfigError(f"config.json: layer_types {types} must list 'conv'/'full_attention' for each layer")
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    num_experts, size = config_int(x, "num_experts"), config_int(x, "moe_intermediate_size")
    dense_layers = config_int(x, "num_dense_layers", default=0)
    strategy = ScoreTopK(
        config_int(x, "num_experts_per_tok"), score="sigmoid", normalize=bool(x.get("norm_topk_prob", True)),
        scaling=float(x.get("routed_scaling_factor", 1.0) or 1.0), norm_eps=1e-6,
    )
    layers: list[Module] = []
    for i, kind in enumerate(types):
        key = f"model.layers.{i}"
        if kind == "conv":
            mixer = ShortConv(f"{key}.conv", i, hidden, config_int(x, "conv_L_cache", default=3), bool(x.get("conv_bias", False)))
        else:
            k = f"{key}.self_attn"
            mixer = Attention(k, i, hidden, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rope, qk_norm_eps=eps)
            mixer.q_norm = RMSNorm(f"{k}.q_layernorm", cfg.head_dim, eps)
            mixer.k_norm = RMSNorm(f"{k}.k_layernorm", cfg.head_dim, eps)
            mixer.o_proj = Linear(f"{k}.out_proj", cfg.num_attention_heads * cfg.head_dim, hidden)
        f = f"{key}.feed_forward"
        if i < dense_layers:
            mlp = ExpertMLP(f, hidden, cfg.intermediate_size, names=("w1", "w3", "w2"))
        else:
            use_bias = bool(x.get("use_expert_bias", True))
            mlp = MoE(
                f,
                Router(f"{f}.gate", hidden, num_experts, strategy, correction_bias_key=f"{f}.expert_bias" if use_bias else None),
                Experts(f"{f}.experts", num_experts, hidden, size, names=("w1", "w3", "w2")),
            )
        layers.append(DecoderLayer(key, RMSNorm(f"{key}.operator_norm", hidden, eps), mixer, RMSNorm(f"{key}.ffn_norm", hidden, eps), mlp))
    return HybridCausalLM.from_layers(cfg, layers, "model.embed_tokens", "model.embedding_norm")


SPEC = ArchitectureSpec(
    name="lfm2_moe",
    architectures=("Lfm2MoeForCausalLM",),
    read_config=read_config,
    build=build,
    description="Liquid LFM2 MoE (8B-A1B): short-conv + attention hybrid with sigmoid-routed experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
