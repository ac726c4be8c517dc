"""Phi-3 / Phi-4 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj, LongRoPE, optional partial rotary.

The fused tensors are loaded as one projection each and their outputs split ([q; k; v] and
[gate; up]); Linear checks each fused tensor's shape against the sizes the config implies.
"""
from __future__ import annotations

import trellm
from trellm.config import DecoderConfig, sliding_on_every_layer
from trellm.modules.decoder import DecoderOptions, decoder_family

SPEC = decoder_family(
    "phi3",
    ("Phi3ForCausalLM",),
    DecoderOptions(fused_qkv="qkv_proj", fused_gate_up="gate_up_proj"),
    read_config=lambda raw: sliding_on_every_layer(DecoderConfig.from_hf(raw)),
    description="Phi-3, Phi-3.5, Phi-4, Phi-4-mini: fused projections, LongRoPE",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
