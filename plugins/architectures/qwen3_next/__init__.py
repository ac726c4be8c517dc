"""Qwen3-Next (Qwen3NextForCausalLM): the Qwen hybrid stack (:func:`trellm.sdk.build_qwen_hybrid`) with
MoE layers every ``decoder_sparse_step`` layers (except ``mlp_only_layers``), fused GatedDeltaNet
projections and an optional MTP head."""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    DecoderConfig,
    HybridCausalLM,
    build_qwen_hybrid,
    build_qwen_mtp_head,
    qwen_moe_mlp,
)


def build(cfg: DecoderConfig) -> HybridCausalLM:
    moe = cfg.moe
    norm = True if moe is None or moe.normalize_topk is None else moe.normalize_topk

    def moe_layer(i: int, key: str):
        return qwen_moe_mlp(cfg, key, norm) if moe is not None and moe.is_moe_layer(i) else None

    model = build_qwen_hybrid(cfg, "model", "fused", moe_layer)
    mtp_mlp = qwen_moe_mlp(cfg, "mtp.layers.0.mlp", norm) if moe is not None else None
    model.mtp = build_qwen_mtp_head(cfg, mtp_mlp)  # loads only if the checkpoint has mtp.* tensors
    return model


SPEC = ArchitectureSpec(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="Qwen3-Next: gated delta net + gated attention hybrid, MoE with shared expert",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
