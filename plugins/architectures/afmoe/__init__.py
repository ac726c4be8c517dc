"""AfMoE (AfmoeForCausalLM, Arcee Trinity): sandwich-normed blocks, attention with QK-norm and a sigmoid
output gate per channel, RoPE on sliding-window layers only (global layers are NoPE), and sigmoid-routed experts
with an expert bias, ``route_scale`` and shared experts after ``num_dense_layers`` dense layers."""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    CausalLM,
    DecoderConfig,
    DecoderLayer,
    Experts,
    GatedMLP,
    MoE,
    Module,
    OutputGate,
    OutputGatedAttention,
    RMSNorm,
    RotaryEmbedding,
    Router,
    ScoreTopK,
    config_int,
)


def build(cfg: DecoderConfig) -> CausalLM:
    x = cfg.extra
    eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
    types = list(cfg.layer_types) or ["sliding_attention"] * cfg.num_hidden_layers
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    num_experts, size = config_int(x, "num_experts"), config_int(x, "moe_intermediate_size")
    n_shared = config_int(x, "num_shared_experts", default=0)
    dense_layers = config_int(x, "num_dense_layers", default=0)
    strategy = ScoreTopK(config_int(x, "num_experts_per_tok"), score="sigmoid", scaling=float(x.get("route_scale", 1.0)))
    layers: list[Module] = []
    for i, kind in enumerate(types):
        key = f"model.layers.{i}"
        sliding = kind == "sliding_attention"
        attn = OutputGatedAttention(
            f"{key}.self_attn", i, hidden, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            rope if sliding else None, OutputGate("sigmoid"), qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
            qk_norm_eps=eps, sliding_window=cfg.sliding_window if sliding else 0,
        )
        m = f"{key}.mlp"
        if i < dense_layers:
            mlp: Module = GatedMLP(m, hidden, cfg.intermediate_size, cfg.hidden_act)
        else:
            mlp = MoE(
                m,
                Router(f"{m}.router.gate", hidden, num_experts, strategy, correction_bias_key=f"{m}.expert_bias"),
                Experts(f"{m}.experts", num_experts, hidden, size, cfg.hidden_act),
                GatedMLP(f"{m}.shared_experts", hidden, size * n_shared, cfg.hidden_act) if n_shared else None,
            )
        inp, pre_mlp, post_attn, post_mlp = (
            RMSNorm(f"{key}.{n}", hidden, eps)
            for n in ("input_layernorm", "pre_mlp_layernorm", "post_attention_layernorm", "post_mlp_layernorm")
        )
        layers.append(DecoderLayer(key, inp, attn, pre_mlp, mlp, attn_out_norm=post_attn, mlp_out_norm=post_mlp))
    scale = hidden**0.5 if x.get("mup_enabled") else None
    return CausalLM.from_layers(cfg, layers, embed_scale=scale)


SPEC = ArchitectureSpec(
    name="afmoe",
    architectures=("AfmoeForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="Arcee AfMoE (Trinity): gated attention, NoPE global layers, sigmoid-routed experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
