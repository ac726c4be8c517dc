"""Nemotron (NemotronForCausalLM, Minitron): LayerNorm1P (1 + w, with bias), ungated ReLU² MLP, partial RoPE."""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderOptions, decoder_family

SPEC = decoder_family(
    "nemotron",
    ("NemotronForCausalLM",),
    DecoderOptions(norm="layer", norm_unit_offset=True, mlp_gated=False),
    description="NVIDIA Nemotron-3 / Minitron: LayerNorm1P, relu2 MLP, partial rotary",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
