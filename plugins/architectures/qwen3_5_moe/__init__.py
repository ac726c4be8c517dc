"""Qwen3.5 MoE: the text path of Qwen3_5MoeForConditionalGeneration (and Qwen3_5MoeForCausalLM).

The Qwen hybrid decoder (gated delta net + gated attention, 1 + w norms) with a normalised softmax
top-k MoE and a sigmoid-gated shared expert in every layer. The vision tower's tensors are ignored.
The multi-token-prediction head (``mtp.*``, MoE MLP too) loads as ``model.mtp`` when the checkpoint
has it (``trellm.generator.mtp``: a speculative draft).
"""
from __future__ import annotations

import trellm
from trellm.sdk import ArchitectureSpec, DecoderConfig, build_qwen3_5_moe

SPEC = ArchitectureSpec(
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    read_config=DecoderConfig.from_hf,
    build=build_qwen3_5_moe,
    description="Qwen3.5 MoE (text): gated delta net hybrid with routed + shared experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
