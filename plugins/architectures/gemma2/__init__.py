"""Gemma 2 (Gemma2ForCausalLM): Gemma with sandwich norms, alternating sliding/full layers and softcaps.

Each sub-layer has a norm before it and one on its output; attention logits and final logits are
tanh-softcapped; the softmax scale is ``query_pre_attn_scalar ** -0.5``.
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import DecoderConfig, DecoderOptions, decoder_family, layer_types_from_pattern, text_config
from trellm.plugins.architectures.gemma import OPTIONS as GEMMA_OPTIONS
from trellm.plugins.architectures.gemma import configure as configure_gemma

OPTIONS = attrs.evolve(
    GEMMA_OPTIONS,
    input_norm_name="input_layernorm",
    attn_out_norm_name="post_attention_layernorm",
    post_attn_norm_name="pre_feedforward_layernorm",
    mlp_out_norm_name="post_feedforward_layernorm",
)


def read_config(raw: dict, default_pattern: int = 2) -> DecoderConfig:
    """Older configs give ``sliding_window_pattern`` (every n-th layer full) instead of ``layer_types``."""
    c = text_config(raw)
    if c.get("layer_types") or not c.get("sliding_window"):
        return DecoderConfig.from_hf(raw)
    pattern = int(c.get("sliding_window_pattern") or default_pattern)
    return DecoderConfig.from_hf(raw, layer_types=layer_types_from_pattern(int(c["num_hidden_layers"]), pattern))


def configure(cfg: DecoderConfig, opts: DecoderOptions) -> DecoderOptions:
    x = cfg.extra
    scalar = x.get("query_pre_attn_scalar")
    return attrs.evolve(
        configure_gemma(cfg, opts),
        attn_scale=float(scalar) ** -0.5 if scalar else None,
        attn_softcap=float(x.get("attn_logit_softcapping") or 0.0),
        final_logit_softcap=float(x.get("final_logit_softcapping") or 0.0),
    )


SPEC = decoder_family("gemma2", ("Gemma2ForCausalLM",), OPTIONS, configure, read_config,
                      description="Gemma 2: sandwich norms, local/global attention, logit softcaps")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
