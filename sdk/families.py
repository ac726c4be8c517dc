"""Options and config readers of the text families that other families build on.

Gemma 2 starts from Gemma, Gemma 3 from Gemma 2 and Gemma 3 with images from Gemma 3; Cohere 2
from Cohere, EXAONE 4 from OLMo 2, GLM-4V from GLM 4, HyperCLOVA X from Granite, Qwen3, SmolLM3 and
Qwen2.5-VL from Qwen2's config reader. What is shared lives here, so each family's plugin imports
it from :mod:`trellm.sdk` instead of from another plugin.
"""
from __future__ import annotations

import math

import attrs

from trellm.config import DecoderConfig, RopeConfig, layer_types_from_pattern, read_keys, text_config
from trellm.errors import ConfigError
from trellm.modules.decoder import DecoderOptions

# ---- Gemma 1 / 2 / 3 -----------------------------------------------------------------------------

GEMMA_OPTIONS = DecoderOptions(norm_unit_offset=True)
"""Gemma: Llama with 1 + w RMSNorms (GeGLU comes from the config's activation)."""


def configure_gemma(cfg: DecoderConfig, opts: DecoderOptions) -> DecoderOptions:
    """Gemma scales token embeddings by sqrt(hidden_size)."""
    return attrs.evolve(opts, embed_scale=math.sqrt(cfg.hidden_size))


GEMMA2_OPTIONS = attrs.evolve(
    GEMMA_OPTIONS,
    input_norm_name="input_layernorm",
    attn_out_norm_name="post_attention_layernorm",
    post_attn_norm_name="pre_feedforward_layernorm",
    mlp_out_norm_name="post_feedforward_layernorm",
)
"""Gemma 2: Gemma with sandwich norms (one before and one after each sub-layer)."""


def read_gemma2_config(raw: dict, default_pattern: int = 2) -> DecoderConfig:
    """Older configs give ``sliding_window_pattern`` (every n-th layer full) instead of ``layer_types``."""
    c = text_config(raw)
    if c.get("layer_types") or not c.get("sliding_window"):
        return DecoderConfig.from_hf(raw)
    pattern = int(c.get("sliding_window_pattern") or default_pattern)
    return DecoderConfig.from_hf(raw, layer_types=layer_types_from_pattern(int(c["num_hidden_layers"]), pattern))


@attrs.frozen
class Gemma2Keys:
    """The config keys Gemma 2 and 3 read beyond :class:`DecoderConfig`."""

    query_pre_attn_scalar: float = attrs.field(default=0.0, converter=float)  # 0: the default head_dim ** -0.5
    attn_logit_softcapping: float = attrs.field(default=0.0, converter=float)
    final_logit_softcapping: float = attrs.field(default=0.0, converter=float)


def configure_gemma2(cfg: DecoderConfig, opts: DecoderOptions) -> DecoderOptions:
    """Softmax scale ``query_pre_attn_scalar ** -0.5``; tanh softcaps on attention and final logits."""
    keys = read_keys(Gemma2Keys, cfg)
    return attrs.evolve(
        configure_gemma(cfg, opts),
        attn_scale=keys.query_pre_attn_scalar ** -0.5 if keys.query_pre_attn_scalar else None,
        attn_softcap=keys.attn_logit_softcapping,
        final_logit_softcap=keys.final_logit_softcapping,
    )


GEMMA3_OPTIONS = attrs.evolve(GEMMA2_OPTIONS, qk_norm=True)
"""Gemma 3: Gemma 2's block with 1 + w QK-norm."""


def read_gemma3_config(raw: dict) -> DecoderConfig:
    """Gemma 2's reader with every 6th layer global, and a separate RoPE base for local layers
    (``rope_parameters["sliding_attention"]``, older configs ``rope_local_base_freq``)."""
    if text_config(raw).get("use_bidirectional_attention"):
        raise ConfigError("config.json: use_bidirectional_attention=true (EmbeddingGemma) is an encoder; trellm serves causal LMs")
    cfg = read_gemma2_config(raw, default_pattern=6)
    local_base = text_config(raw).get("rope_local_base_freq")
    if "sliding_attention" not in cfg.layer_ropes and local_base:
        cfg = attrs.evolve(cfg, layer_ropes={"sliding_attention": RopeConfig(theta=float(local_base))})
    return cfg


def configure_gemma3(cfg: DecoderConfig, opts: DecoderOptions) -> DecoderOptions:
    """Gemma 3 keeps ``attn_logit_softcapping`` in its config but does not apply it (HF neither)."""
    return attrs.evolve(configure_gemma2(cfg, opts), attn_softcap=0.0)


# ---- Cohere, OLMo 2, GLM 4, Granite, Qwen2 ---------------------------------------------------------

COHERE_OPTIONS = DecoderOptions(norm="layer_nobias", parallel_block=True, rope_interleaved=True, qk_norm_kind="layer_head")
"""Cohere: parallel attention + MLP under one weight-only LayerNorm, GPT-J RoPE, per-head LayerNorm QK-norm."""


@attrs.frozen
class CohereKeys:
    """The config keys Cohere and Cohere 2 read beyond :class:`DecoderConfig`."""

    logit_scale: float = attrs.field(default=1.0, converter=float)
    use_qk_norm: bool = attrs.field(default=False, converter=bool)


def configure_cohere(cfg: DecoderConfig, opts: DecoderOptions) -> DecoderOptions:
    """Logits multiplied by ``logit_scale``; QK-norm only when ``use_qk_norm``."""
    keys = read_keys(CohereKeys, cfg)
    return attrs.evolve(opts, logit_scale=keys.logit_scale, qk_norm=keys.use_qk_norm)


OLMO_OPTIONS = DecoderOptions(
    input_norm_name=None,
    post_attn_norm_name=None,
    attn_out_norm_name="post_attention_layernorm",
    mlp_out_norm_name="post_feedforward_layernorm",
    qk_norm=True,
    qk_norm_kind="full",
)
"""OLMo 2 / 3: post-norm blocks (each sub-layer's output normalised), QK-norm over the whole projection."""

GLM_OPTIONS = DecoderOptions(fused_gate_up="gate_up_proj", rope_interleaved=True, o_bias=False)
"""GLM (2024): fused gate_up_proj, partial interleaved RoPE, no o_proj bias."""

GLM4_OPTIONS = attrs.evolve(GLM_OPTIONS, attn_out_norm_name="post_self_attn_layernorm", mlp_out_norm_name="post_mlp_layernorm")
"""GLM 4 (0414): GLM with sandwich norms on the sub-layer outputs."""


@attrs.frozen
class GraniteKeys:
    """Granite's muP multipliers (HyperCLOVA X uses the same keys)."""

    embedding_multiplier: float = attrs.field(default=1.0, converter=float)
    residual_multiplier: float = attrs.field(default=1.0, converter=float)
    attention_multiplier: float | None = attrs.field(default=None, converter=attrs.converters.optional(float))
    logits_scaling: float = attrs.field(default=1.0, converter=float)


def configure_granite(cfg: DecoderConfig, opts: DecoderOptions, divide_logits: bool = True) -> DecoderOptions:
    """Granite's muP multipliers: embeddings, residuals, softmax scale (``attention_multiplier``) and
    logits (divided by ``logits_scaling``, or multiplied when ``divide_logits`` is false)."""
    keys = read_keys(GraniteKeys, cfg)
    return attrs.evolve(
        opts,
        embed_scale=keys.embedding_multiplier,
        embed_scale_rounded=False,
        residual_multiplier=keys.residual_multiplier,
        attn_scale=keys.attention_multiplier,
        logit_scale=1.0 / keys.logits_scaling if divide_logits else keys.logits_scaling,
    )


def configure_hyperclovax(cfg: DecoderConfig, opts: DecoderOptions) -> DecoderOptions:
    """HyperCLOVA X SEED: Granite's multipliers with logits *multiplied* by ``logits_scaling``, and
    Peri-LN (``use_post_norm``, default on): each sub-layer's output normalised (``post_norm1``,
    ``post_norm2``) before the scaled residual add."""
    opts = configure_granite(cfg, opts, divide_logits=False)
    if cfg.extra.get("use_post_norm", True):
        opts = attrs.evolve(opts, attn_out_norm_name="post_norm1", mlp_out_norm_name="post_norm2")
    return opts


def read_qwen2_config(raw: dict) -> DecoderConfig:
    """Qwen configs keep ``sliding_window`` even when ``use_sliding_window`` is false: honour the flag
    (sliding layers start at ``max_window_layers``)."""
    c = text_config(raw)
    if c.get("layer_types"):
        return DecoderConfig.from_hf(raw)
    if not c.get("use_sliding_window", False) or not c.get("sliding_window"):
        return DecoderConfig.from_hf(raw, sliding_window=0)
    first = int(c.get("max_window_layers", 0))
    n = int(c["num_hidden_layers"])
    return DecoderConfig.from_hf(raw, layer_types=tuple("sliding_attention" if i >= first else "full_attention" for i in range(n)))
