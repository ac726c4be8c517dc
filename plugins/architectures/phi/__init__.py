"""Phi-1 / Phi-1.5 / Phi-2 (PhiForCausalLM): parallel attention + MLP under one LayerNorm, biases everywhere.

Ungated GELU MLP (fc1, fc2), o_proj named ``dense``, partial RoPE, ``model.final_layernorm``, and
an LM head with a bias. The optional per-head ``qk_layernorm`` is not supported yet.
"""
from __future__ import annotations

import trellm
from trellm.sdk import ConfigError, DecoderConfig, DecoderOptions, decoder_family, text_config

OPTIONS = DecoderOptions(
    final_norm_key="model.final_layernorm",
    norm="layer",
    parallel_block=True,
    o_proj_name="dense",
    qkv_bias=True,
    o_bias=True,
    mlp_gated=False,
    mlp_up_name="fc1",
    mlp_down_name="fc2",
    mlp_bias=True,
    lm_head_bias=True,
)


def read_config(raw: dict) -> DecoderConfig:
    if text_config(raw).get("qk_layernorm"):
        raise ConfigError("config.json: qk_layernorm=true is not supported for PhiForCausalLM yet")
    return DecoderConfig.from_hf(raw)


SPEC = decoder_family("phi", ("PhiForCausalLM",), OPTIONS, read_config=read_config,
                      description="Microsoft Phi-1, Phi-1.5, Phi-2: parallel block, LayerNorm, biases")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
