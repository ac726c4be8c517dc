"""Gemma 3 text (Gemma3ForCausalLM): Gemma 2's block with 1 + w QK-norm and a separate RoPE base for local layers.

Sliding (local) layers use ``rope_parameters["sliding_attention"]`` (older configs:
``rope_local_base_freq``); full layers use the scaled global RoPE. The final-logit softcap applies when set; the attention softcap
key is ignored, as in the reference implementation.
"""
from __future__ import annotations

import trellm
from trellm.sdk import GEMMA3_OPTIONS, configure_gemma3, decoder_family, read_gemma3_config

SPEC = decoder_family("gemma3", ("Gemma3ForCausalLM",), GEMMA3_OPTIONS, configure_gemma3, read_gemma3_config,
                      description="Gemma 3 text: QK-norm, local/global attention with two RoPE bases")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
