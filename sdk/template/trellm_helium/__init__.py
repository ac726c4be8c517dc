"""Kyutai Helium (HeliumForCausalLM) for trellm: Llama with GPT-J (interleaved) RoPE.

A family that differs from Llama only in flags and tensor names is one ``decoder_family`` call.
For values read from the checkpoint's config (a softcap, a scale), pass ``configure``; for a
config that needs normalising (a layer pattern), pass ``read_config``.
"""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderOptions, decoder_family

SPEC = decoder_family(
    name="helium",
    architectures=("HeliumForCausalLM",),  # config.json "architectures"[0] values served
    options=DecoderOptions(rope_interleaved=True),
    description="Kyutai Helium: Llama with interleaved RoPE",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
