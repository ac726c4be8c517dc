"""Gemma 3 text (Gemma3ForCausalLM): Gemma 2's block with 1 + w QK-norm and a separate RoPE base for local layers.

Sliding (local) layers use ``rope_parameters["sliding_attention"]`` (older configs:
``rope_local_base_freq``); full layers use the scaled global RoPE. The final-logit softcap applies when set; the attention softcap
key is ignored, as in the reference implementation.
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import ConfigError, DecoderConfig, RopeConfig, decoder_family, text_config
from trellm.plugins.architectures.gemma2 import OPTIONS as GEMMA2_OPTIONS
from trellm.plugins.architectures.gemma2 import configure as configure_gemma2
from trellm.plugins.architectures.gemma2 import read_config as read_gemma2

OPTIONS = attrs.evolve(GEMMA2_OPTIONS, qk_norm=True)


def read_config(raw: dict) -> DecoderConfig:
    if text_config(raw).get("use_bidirectional_attention"):
        raise ConfigError("config.json: use_bidirectional_attention=true (EmbeddingGemma) is an encoder; trellm serves causal LMs")
    cfg = read_gemma2(raw, default_pattern=6)
    local_base = text_config(raw).get("rope_local_base_freq")
    if "sliding_attention" not in cfg.layer_ropes and local_base:
        cfg = attrs.evolve(cfg, layer_ropes={"sliding_attention": RopeConfig(theta=float(local_base))})
    return cfg


def configure(cfg: DecoderConfig, opts):
    """Gemma 3 keeps ``attn_logit_softcapping`` in its config but does not apply it (HF neither)."""
    return attrs.evolve(configure_gemma2(cfg, opts), attn_softcap=0.0)


SPEC = decoder_family("gemma3", ("Gemma3ForCausalLM",), OPTIONS, configure, read_config,
                      description="Gemma 3 text: QK-norm, local/global attention with two RoPE bases")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
