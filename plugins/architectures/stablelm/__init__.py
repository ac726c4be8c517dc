"""StableLM 2 / StableLM-3B (StableLmForCausalLM): LayerNorm with bias, partial RoPE, optional q/k/v bias
and optional parallel residual (``use_parallel_residual``). The per-head ``qk_layernorm`` is not supported yet.
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import ConfigError, DecoderConfig, DecoderOptions, decoder_family, text_config


def read_config(raw: dict) -> DecoderConfig:
    if text_config(raw).get("qk_layernorm"):
        raise ConfigError("config.json: qk_layernorm=true (StableLM 2 12B) is not supported yet")
    return DecoderConfig.from_hf(raw)


def configure(cfg: DecoderConfig, opts: DecoderOptions) -> DecoderOptions:
    x = cfg.extra
    return attrs.evolve(opts, qkv_bias=bool(x.get("use_qkv_bias", False)), parallel_block=bool(x.get("use_parallel_residual", False)))


SPEC = decoder_family("stablelm", ("StableLmForCausalLM",), DecoderOptions(norm="layer", o_bias=False), configure, read_config,
                      description="Stability StableLM 2 (1.6B) / StableLM-3B-4E1T: LayerNorm, partial rotary")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
