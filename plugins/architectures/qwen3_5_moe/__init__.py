"""Qwen3.5 MoE: the text path of Qwen3_5MoeForConditionalGeneration (and Qwen3_5MoeForCausalLM).

The Qwen hybrid decoder (gated delta net + gated attention, 1 + w norms) with a normalised softmax
top-k MoE and a sigmoid-gated shared expert in every layer. The vision tower's tensors are ignored.
The multi-token-prediction head (``mtp.*``, MoE MLP too) loads as ``model.mtp`` when the checkpoint
has it (``trellm.generator.mtp``: a speculative draft).
"""
from __future__ import annotations

import trellm
from trellm.sdk import ArchitectureSpec, DecoderConfig, build_qwen_mtp_head
from trellm.plugins.architectures.qwen3_next import build_qwen_hybrid, qwen_moe_mlp

MULTIMODAL = "Qwen3_5MoeForConditionalGeneration"


def build(cfg: DecoderConfig):
    prefix = "model.language_model" if cfg.architecture == MULTIMODAL else "model"
    model = build_qwen_hybrid(cfg, prefix, "split", lambda i, key: qwen_moe_mlp(cfg, key, normalize=True))
    model.mtp = build_qwen_mtp_head(cfg, qwen_moe_mlp(cfg, "mtp.layers.0.mlp", normalize=True))  # only if mtp.* exist
    return model


SPEC = ArchitectureSpec(
    name="qwen3_5_moe",
    architectures=(MULTIMODAL, "Qwen3_5MoeForCausalLM"),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="Qwen3.5 MoE (text): gated delta net hybrid with routed + shared experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
