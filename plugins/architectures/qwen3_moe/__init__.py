"""Qwen3 MoE (Qwen3MoeForCausalLM) and Qwen2 MoE-style routing: softmax top-k experts, QK-norm attention."""
from __future__ import annotations

import trellm
from trellm.sdk import ArchitectureSpec, DecoderConfig, DecoderOptions, build_decoder, use_qwen3_moe_layers


def build(cfg: DecoderConfig):
    model = build_decoder(cfg, DecoderOptions(qk_norm=True))
    use_qwen3_moe_layers(model, cfg)
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
