"""Qwen3-Next (Qwen3NextForCausalLM) and the Qwen hybrid decoder it shares with Qwen3.5.

Layers alternate gated-delta-net linear attention (``linear_attn``) and gated full attention
(``self_attn``, q_proj also yields a sigmoid output gate) as ``layer_types`` says; every RMSNorm
scales by 1 + w; MLPs are dense or MoE with a sigmoid-gated shared expert.
"""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    ConfigError,
    DecoderConfig,
    DecoderLayer,
    Experts,
    GatedAttention,
    GatedDeltaNet,
    GatedMLP,
    HybridCausalLM,
    Linear,
    MoE,
    Module,
    RMSNorm,
    RotaryEmbedding,
    Router,
    SoftmaxTopK,
    build_qwen_mtp_head,
    config_int,
)


def layer_types(cfg: DecoderConfig) -> list[str]:
    types = list(cfg.layer_types)
    if not types:
        interval = int(cfg.extra.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(cfg.num_hidden_layers)]
    if len(types) != cfg.num_hidden_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ConfigError(f"config.json: layer_types {types} must list 'linear_attention'/'full_attention' per layer")
    return types


def qwen_moe_mlp(cfg: DecoderConfig, key: str, normalize: bool) -> MoE:
    x = cfg.extra
    num_experts = config_int(x, "num_experts")
    shared_size = config_int(x, "shared_expert_intermediate_size", default=0)
    return MoE(
        key,
        Router(f"{key}.gate", cfg.hidden_size, num_experts, SoftmaxTopK(config_int(x, "num_experts_per_tok"), normalize)),
        Experts(f"{key}.experts", num_experts, cfg.hidden_size, config_int(x, "moe_intermediate_size"), cfg.hidden_act),
        GatedMLP(f"{key}.shared_expert", cfg.hidden_size, shared_size, cfg.hidden_act) if shared_size else None,
        Linear(f"{key}.shared_expert_gate", cfg.hidden_size, 1) if shared_size else None,
    )


def build_qwen_hybrid(cfg: DecoderConfig, prefix: str, projection: str, moe_layer) -> HybridCausalLM:
    """The Qwen3-Next / Qwen3.5 hybrid decoder. ``moe_layer(i)`` -> MoE module key or None for a dense MLP."""
    x = cfg.extra
    eps = cfg.rms_norm_eps
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    layers: list[Module] = []
    for i, kind in enumerate(layer_types(cfg)):
        key = f"{prefix}.layers.{i}"
        if kind == "linear_attention":
            mixer = GatedDeltaNet.from_config(f"{key}.linear_attn", i, cfg.hidden_size, x, eps, projection)
        else:
            mixer = GatedAttention(
                f"{key}.self_attn", i, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                rope, eps, norm_unit_offset=True, bias=cfg.attention_bias,
            )
        mlp = moe_layer(i, f"{key}.mlp") or GatedMLP(f"{key}.mlp", cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        layers.append(
            DecoderLayer(key, RMSNorm(f"{key}.input_layernorm", cfg.hidden_size, eps, unit_offset=True), mixer,
                         RMSNorm(f"{key}.post_attention_layernorm", cfg.hidden_size, eps, unit_offset=True), mlp)
        )
    return HybridCausalLM.from_layers(cfg, layers, f"{prefix}.embed_tokens", f"{prefix}.norm", norm_unit_offset=True)


def build(cfg: DecoderConfig) -> HybridCausalLM:
    x = cfg.extra
    step = config_int(x, "decoder_sparse_step", default=1)
    only_dense = set(x.get("mlp_only_layers") or [])
    has_experts = config_int(x, "num_experts", default=0) > 0
    norm = bool(x.get("norm_topk_prob", True))

    def moe_layer(i: int, key: str):
        if has_experts and i not in only_dense and (i + 1) % step == 0:
            return qwen_moe_mlp(cfg, key, norm)
        return None

    model = build_qwen_hybrid(cfg, "model", "fused", moe_layer)
    mtp_mlp = qwen_moe_mlp(cfg, "mtp.layers.0.mlp", norm) if has_experts else None
    model.mtp = build_qwen_mtp_head(cfg, mtp_mlp)  # loads only if the checkpoint has mtp.* tensors
    return model


SPEC = ArchitectureSpec(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="Qwen3-Next: gated delta net + gated attention hybrid, MoE with shared expert",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
