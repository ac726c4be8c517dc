"""dots.llm1 (Dots1ForCausalLM): Qwen3 attention (QK-norm) with DeepSeek-V3 style routed + shared experts."""
from __future__ import annotations

import trellm
from trellm.sdk import ArchitectureSpec, DecoderConfig, DecoderOptions, build_decoder, use_deepseek_moe_layers


def build(cfg: DecoderConfig):
    model = build_decoder(cfg, DecoderOptions(qk_norm=True))
    use_deepseek_moe_layers(model, cfg)
    return model


SPEC = ArchitectureSpec(
    name="dots1",
    architectures=("Dots1ForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="rednote dots.llm1: QK-norm attention, sigmoid-routed experts with a shared expert",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
