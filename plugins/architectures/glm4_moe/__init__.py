"""GLM 4.5 / 4.6 MoE (Glm4MoeForCausalLM): partial RoPE, optional QK-norm, biased q/k/v, and DeepSeek-V3
style routing (sigmoid + correction bias, expert groups, routed scaling) after ``first_k_dense_replace`` dense layers.

SolarOpen (SolarOpenForCausalLM) is the same model with no QK-norm and no leading dense layers (its config
has neither key, and both default off)."""
from __future__ import annotations

import trellm
from trellm.sdk import ArchitectureSpec, DecoderConfig, DecoderOptions, build_decoder, use_deepseek_moe_layers


def build(cfg: DecoderConfig):
    model = build_decoder(cfg, DecoderOptions(qk_norm=bool(cfg.extra.get("use_qk_norm", False)), o_bias=False))
    use_deepseek_moe_layers(model, cfg)
    return model


SPEC = ArchitectureSpec(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM", "SolarOpenForCausalLM"),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="GLM 4.5 / 4.6 (Air), Upstage Solar Open: DeepSeek-style routed + shared experts, partial RoPE",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
