"""dots.llm1 (Dots1ForCausalLM): Qwen3 attention (QK-norm) with DeepSeek-V3 style routed + shared experts."""
from __future__ import annotations

import trellm
from trellm.config import DecoderConfig
from trellm.modules.decoder import DecoderOptions, build_decoder
from trellm.modules.moe import config_int, deepseek_moe, replace_mlps
from trellm.spec import ArchitectureSpec


def build(cfg: DecoderConfig):
    model = build_decoder(cfg, DecoderOptions(qk_norm=True))
    first_moe = config_int(cfg.extra, "first_k_dense_replace", default=0)
    replace_mlps(model, lambda i, key: deepseek_moe(cfg, f"{key}.mlp") if i >= first_moe else None)
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
