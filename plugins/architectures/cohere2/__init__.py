"""Cohere2 (Cohere2ForCausalLM, Command R7B / Command A): Cohere with sliding layers and NoPE global layers."""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import (
    COHERE_OPTIONS,
    DecoderConfig,
    configure_cohere,
    decoder_family,
    layer_types_from_pattern,
    text_config,
)


def read_config(raw: dict) -> DecoderConfig:
    c = text_config(raw)
    if c.get("layer_types"):
        return DecoderConfig.from_hf(raw)
    pattern = int(c.get("sliding_window_pattern") or 4)
    return DecoderConfig.from_hf(raw, layer_types=layer_types_from_pattern(int(c["num_hidden_layers"]), pattern))


SPEC = decoder_family(
    "cohere2",
    ("Cohere2ForCausalLM",),
    attrs.evolve(COHERE_OPTIONS, nope_layer_types=("full_attention",)),
    configure_cohere,
    read_config,
    description="Cohere Command R7B / Command A: local RoPE layers, global NoPE layers",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
