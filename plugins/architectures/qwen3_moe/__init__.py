"""Qwen3 MoE (Qwen3MoeForCausalLM) and Qwen2 MoE-style routing: softmax top-k experts, QK-norm attention."""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    DecoderConfig,
    DecoderOptions,
    Experts,
    MoE,
    Router,
    SoftmaxTopK,
    build_decoder,
    replace_mlps,
)


def build(cfg: DecoderConfig):
    model = build_decoder(cfg, DecoderOptions(qk_norm=True))
    moe_cfg = cfg.require_moe()
    strategy = SoftmaxTopK(moe_cfg.experts_per_token, normalize=bool(moe_cfg.normalize_topk))

    def moe(i: int, key: str):
        if not moe_cfg.is_moe_layer(i):
            return None
        return MoE(
            f"{key}.mlp",
            Router(f"{key}.mlp.gate", cfg.hidden_size, moe_cfg.num_experts, strategy),
            Experts(f"{key}.mlp.experts", moe_cfg.num_experts, cfg.hidden_size, moe_cfg.expert_width(), cfg.hidden_act),
        )

    replace_mlps(model, moe)
    return model


SPEC = ArchitectureSpec(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="Qwen3 MoE (30B-A3B, 235B-A22B): softmax top-k routing, QK-norm",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
