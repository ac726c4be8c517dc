"""Gemma (GemmaForCausalLM): Llama with 1 + w RMSNorms, GeGLU and embeddings scaled by sqrt(hidden).

Gemma 2 and 3 build on the same options (see their plugins).
"""
from __future__ import annotations

import math

import attrs
import trellm
from trellm.sdk import DecoderOptions, decoder_family

OPTIONS = DecoderOptions(norm_unit_offset=True)


def configure(cfg, opts: DecoderOptions) -> DecoderOptions:
    return attrs.evolve(opts, embed_scale=math.sqrt(cfg.hidden_size))


SPEC = decoder_family("gemma", ("GemmaForCausalLM",), OPTIONS, configure, description="Gemma 1: 1+w norms, GeGLU, scaled embeddings")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
