"""Qwen3.5 (dense): the text path of Qwen3_5ForConditionalGeneration (and Qwen3_5ForCausalLM).

The Qwen hybrid decoder (gated delta net + gated attention, 1 + w norms) with dense SwiGLU MLPs.
The multi-token-prediction head (``mtp.*``) loads as ``model.mtp`` when the checkpoint has it
(``trellm.generator.mtp``: a speculative draft).
"""
from __future__ import annotations

import trellm
from trellm.sdk import ArchitectureSpec, DecoderConfig, build_qwen3_5

SPEC = ArchitectureSpec(
    name="qwen3_5",
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    read_config=DecoderConfig.from_hf,
    build=build_qwen3_5,
    description="Qwen3.5 dense (text): gated delta net + gated attention hybrid",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
