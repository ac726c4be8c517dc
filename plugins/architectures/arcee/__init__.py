"""Arcee AFM (ArceeForCausalLM): Llama with an ungated ReLU² MLP (up_proj, down_proj)."""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderOptions, decoder_family

SPEC = decoder_family("arcee", ("ArceeForCausalLM",), DecoderOptions(mlp_gated=False),
                      description="Arcee AFM-4.5B: ungated relu2 MLP")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
