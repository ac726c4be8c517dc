"""Gemma (GemmaForCausalLM): Llama with 1 + w RMSNorms, GeGLU and embeddings scaled by sqrt(hidden).

Gemma 2 and 3 build on the same options (:data:`trellm.sdk.GEMMA_OPTIONS`).
"""
from __future__ import annotations

import trellm
from trellm.sdk import GEMMA_OPTIONS, configure_gemma, decoder_family

SPEC = decoder_family("gemma", ("GemmaForCausalLM",), GEMMA_OPTIONS, configure_gemma, description="Gemma 1: 1+w norms, GeGLU, scaled embeddings")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
