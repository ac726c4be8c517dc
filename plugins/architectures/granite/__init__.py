"""Granite (GraniteForCausalLM): Llama with muP multipliers on embeddings, residuals, attention and logits.

Logits are divided by ``logits_scaling``; the softmax scale is ``attention_multiplier``.
"""
from __future__ import annotations

import trellm
from trellm.sdk import configure_granite, decoder_family

SPEC = decoder_family("granite", ("GraniteForCausalLM",), configure=configure_granite,
                      description="IBM Granite 3.x dense: muP multipliers")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
