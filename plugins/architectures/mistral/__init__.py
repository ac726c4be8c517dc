"""Mistral (MistralForCausalLM) and Ministral: Llama with a sliding window.

Mistral's window, when set, covers every layer; Ministral lists ``layer_types`` per layer.
"""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderConfig, decoder_family, sliding_on_every_layer

SPEC = decoder_family(
    "mistral",
    ("MistralForCausalLM", "MinistralForCausalLM"),
    read_config=lambda raw: sliding_on_every_layer(DecoderConfig.from_hf(raw)),
    description="Mistral 7B / Nemo / Small and Ministral: Llama with sliding-window attention",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
