"""DeepSeek V3 (DeepseekV3ForCausalLM): multi-head latent attention (MLA) and sigmoid-routed grouped experts.

MLA (:class:`trellm.sdk.LatentAttention`) caches one latent per token, not per-head keys and values,
and attends in the absorbed form; the MoE is :func:`trellm.sdk.use_deepseek_moe_layers`.
"""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    DecoderConfig,
    LatentAttention,
    RotaryEmbedding,
    build_decoder,
    config_int,
    use_deepseek_moe_layers,
)


def build(cfg: DecoderConfig):
    model = build_decoder(cfg)
    x = cfg.extra
    interleaved = bool(x.get("rope_interleave", True))
    rope = RotaryEmbedding(cfg.rope, config_int(x, "qk_rope_head_dim"), cfg.max_position_embeddings)
    for i, layer in enumerate(model.layers):
        layer.attn = LatentAttention(f"{layer.key}.self_attn", i, cfg, rope, interleaved)
    use_deepseek_moe_layers(model, cfg)
    return model


SPEC = ArchitectureSpec(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="DeepSeek V3 / R1 (and Kimi K2-shaped checkpoints): MLA with a latent KV cache, grouped sigmoid routing",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
