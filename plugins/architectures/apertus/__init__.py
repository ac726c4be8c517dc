"""Apertus (ApertusForCausalLM): per-head QK-norm and an ungated xIELU MLP, norms named for their sub-layer."""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderOptions, decoder_family

OPTIONS = DecoderOptions(
    input_norm_name="attention_layernorm",
    post_attn_norm_name="feedforward_layernorm",
    qk_norm=True,
    mlp_gated=False,
)

SPEC = decoder_family("apertus", ("ApertusForCausalLM",), OPTIONS,
                      description="Swiss AI Apertus: QK-norm, xIELU ungated MLP")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
