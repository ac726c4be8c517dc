"""Phi-3 / Phi-4 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj, LongRoPE, optional partial rotary.

The fused tensors are split at load into q/k/v and gate/up projections (checked against the
sizes the config implies); checkpoints that store the parts apart (quantized ones) load as they are.
"""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderConfig, DecoderOptions, decoder_family, sliding_on_every_layer

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
