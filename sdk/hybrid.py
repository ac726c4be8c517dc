"""The Qwen hybrid stack (Qwen3-Next, Qwen3.5 dense and MoE, and Qwen3.5 with images).

Layers alternate gated-delta-net linear attention (``linear_attn``) and gated full attention
(``self_attn``, q_proj also yields a sigmoid output gate) as ``layer_types`` says; every RMSNorm
scales by 1 + w; MLPs are dense or MoE with a sigmoid-gated shared expert. Qwen3.5 checkpoints
may carry a multi-token-prediction head (``mtp.*``), loaded as ``model.mtp`` when present.
"""
from __future__ import annotations

from typing import Callable

from trellm.config import DecoderConfig
from trellm.errors import ConfigError
from trellm.generator.mtp import build_qwen_mtp_head
from trellm.modules.base import Module
from trellm.modules.decoder import DecoderLayer
from trellm.modules.layers import GatedMLP, RMSNorm, RotaryEmbedding
from trellm.modules.linear import Linear
from trellm.modules.moe import Experts, MoE, Router, SoftmaxTopK
from trellm.modules.recurrent import GatedAttention, GatedDeltaNet, HybridCausalLM

QWEN3_5_MULTIMODAL = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def hybrid_layer_types(cfg: DecoderConfig) -> list[str]:
    """``linear_attention`` / ``full_attention`` per layer: ``layer_types``, else every
    ``full_attention_interval``-th layer full."""
    types = list(cfg.layer_types)
    if not types:
        interval = cfg.require_linear_attention().full_attention_interval
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(cfg.num_hidden_layers)]
    if len(types) != cfg.num_hidden_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ConfigError(f"config.json: layer_types {types} must list 'linear_attention'/'full_attention' per layer")
    return types


def qwen_moe_mlp(cfg: DecoderConfig, key: str, normalize: bool) -> MoE:
    """Softmax top-k routed experts plus a sigmoid-gated shared expert (when ``shared_expert_intermediate_size``)."""
    moe = cfg.require_moe()
    shared_size = moe.shared_expert_size
    return MoE(
        key,
        Router(f"{key}.gate", cfg.hidden_size, moe.num_experts, SoftmaxTopK(moe.experts_per_token, normalize)),
        Experts(f"{key}.experts", moe.num_experts, cfg.hidden_size, moe.expert_width(), cfg.hidden_act),
        GatedMLP(f"{key}.shared_expert", cfg.hidden_size, shared_size, cfg.hidden_act) if shared_size else None,
        Linear(f"{key}.shared_expert_gate", cfg.hidden_size, 1) if shared_size else None,
    )


def build_qwen_hybrid(cfg: DecoderConfig, prefix: str, projection: str,
                      moe_layer: Callable[[int, str], Module | None]) -> HybridCausalLM:
    """The Qwen3-Next / Qwen3.5 hybrid decoder under ``prefix``. ``moe_layer(i, mlp_key)`` gives layer i's
    MoE (None: a dense MLP); ``projection`` is GatedDeltaNet's q/k/v/z layout ("fused" or "split")."""
    eps = cfg.rms_norm_eps
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    layers: list[Module] = []
    for i, kind in enumerate(hybrid_layer_types(cfg)):
        key = f"{prefix}.layers.{i}"
        if kind == "linear_attention":
            mixer = GatedDeltaNet.from_config(f"{key}.linear_attn", i, cfg.hidden_size, cfg.require_linear_attention(), eps,
                                              projection)
        else:
            mixer = GatedAttention(
                f"{key}.self_attn", i, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                rope, eps, norm_unit_offset=True, bias=cfg.attention_bias,
            )
        mlp = moe_layer(i, f"{key}.mlp") or GatedMLP(f"{key}.mlp", cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        layers.append(
            DecoderLayer(key, RMSNorm(f"{key}.input_layernorm", cfg.hidden_size, eps, unit_offset=True), mixer,
                         RMSNorm(f"{key}.post_attention_layernorm", cfg.hidden_size, eps, unit_offset=True), mlp)
        )
    return HybridCausalLM.from_layers(cfg, layers, f"{prefix}.embed_tokens", f"{prefix}.norm", norm_unit_offset=True)


def _qwen3_5_prefix(cfg: DecoderConfig) -> str:
    return "model.language_model" if cfg.architecture in QWEN3_5_MULTIMODAL else "model"


def build_qwen3_5(cfg: DecoderConfig) -> HybridCausalLM:
    """Qwen3.5 dense: the hybrid decoder with SwiGLU MLPs, plus the MTP head when the checkpoint has one."""
    model = build_qwen_hybrid(cfg, _qwen3_5_prefix(cfg), "split", lambda i, key: None)
    model.mtp = build_qwen_mtp_head(cfg)  # loads only if the checkpoint has mtp.* tensors
    return model


def build_qwen3_5_moe(cfg: DecoderConfig) -> HybridCausalLM:
    """Qwen3.5 MoE: normalised top-k experts and a shared expert in every layer (the MTP head's MLP too)."""
    model = build_qwen_hybrid(cfg, _qwen3_5_prefix(cfg), "split", lambda i, key: qwen_moe_mlp(cfg, key, normalize=True))
    model.mtp = build_qwen_mtp_head(cfg, qwen_moe_mlp(cfg, "mtp.layers.0.mlp", normalize=True))  # only if mtp.* exist
    return model
