"""Cohere Command-R (CohereForCausalLM): parallel attention + MLP under one weight-only LayerNorm.

GPT-J (interleaved) RoPE, logits multiplied by ``logit_scale``, optional per-head LayerNorm QK-norm
(``use_qk_norm``), tied embeddings.
"""
from __future__ import annotations

import trellm
from trellm.sdk import COHERE_OPTIONS, configure_cohere, decoder_family

SPEC = decoder_family("cohere", ("CohereForCausalLM",), COHERE_OPTIONS, configure_cohere,
                      description="Cohere Command-R / R+: parallel block, LayerNorm, logit scale")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
