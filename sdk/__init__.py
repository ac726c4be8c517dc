"""trellm.sdk: everything a model-family or vision-tower plugin needs, in one import.

    import trellm
    from trellm.sdk import DecoderOptions, decoder_family

    SPEC = decoder_family("helium", ("HeliumForCausalLM",), DecoderOptions(rope_interleaved=True))

    @trellm.hookimpl
    def trellm_register_architectures(register):
        register(SPEC)

Plugins (built-in ones included) import from ``trellm.sdk`` and ``trellm`` only, never from core
internals or from each other: the names below are the stable surface, and what several families
share (the Llama-like stack, DeepSeek-style MoE, the Qwen hybrid stack, the MTP head, vision-tower
helpers) lives here rather than in one family that others borrow from. The parity kit is
:mod:`trellm.sdk.testing` (and its pytest fixtures, :mod:`trellm.sdk.pytest_plugin`).
"""
from __future__ import annotations

from trellm import ops
from trellm.batch import ForwardBatch
from trellm.cache.indexed import (ExtraRowsKVCacheLayer, WindowEntries, completed_windows, token_indices, window_entry_pages,
                                  window_rows)
from trellm.capabilities import (
    DenseKVPages,
    HasMTPHead,
    HasRecurrentState,
    PagedKVLayer,
    SplitsOverRanks,
    StateSlots,
    SupportsImages,
    has_dense_pages,
    implements,
    is_hybrid,
    is_paged_layer,
    is_state_layer,
    mtp_head,
    supports_images,
)
from trellm.config import (
    DecoderConfig,
    LinearAttentionConfig,
    MoEConfig,
    RopeConfig,
    config_int,
    layer_types_from_pattern,
    read_keys,
    sliding_on_every_layer,
    text_config,
)
from trellm.distributed.sharding import (
    rank_range,
    shard_attention,
    shard_gated_delta_net,
    shard_mlp,
    split_columns,
    split_rows,
)
from trellm.errors import ConfigError
from trellm.generator.mtp import MTPHead, MTPLayout, build_qwen_mtp_head
from trellm.hookspecs import hookimpl
from trellm.modules.base import LoadContext, Module
from trellm.modules.decoder import CausalLM, DecoderLayer, DecoderOptions, build_decoder, decoder_family
from trellm.modules.latent import LatentAttention, SparseIndexer, SparseLatentAttention, pool_tokens
from trellm.modules.compressed import CompressedAttention, CompressedIndexer, WindowCompressor
from trellm.modules.hyper import (
    HybridHyperCausalLM,
    HyperCausalLM,
    HyperConnection,
    HyperDecoderLayer,
    HyperHead,
    HyperMix,
    expand_streams,
)
from trellm.modules.layers import (
    MLP,
    Attention,
    Embedding,
    GatedMLP,
    LayerNorm,
    OutputGate,
    OutputGatedAttention,
    RMSNorm,
    RotaryEmbedding,
)
from trellm.modules.linear import Linear, LinearGroup
from trellm.modules.moe import ExpertList, ExpertMLP, Experts, MoE, Router, ScoreTopK, SoftmaxTopK, TopKSoftmax, clamped_swiglu, dispatch_experts, limited_swiglu
from trellm.modules.recurrent import (
    GatedAttention,
    GatedDeltaNet,
    HybridCausalLM,
    KimiDeltaAttention,
    Mamba2Mixer,
    ResidualBlock,
    ShortConv,
    state_cache_inputs,
)
from trellm.multimodal import (
    FixedSizeProcessor,
    ImageError,
    MultimodalPrompt,
    PixelSteps,
    VisionInput,
    VisionLanguageConfig,
    VisionLanguageModel,
    config_token,
    image_digest,
    load_image_processor,
    read_vision_config,
    vision_tower_spec,
)
from trellm.ops.attention import gather_pages
from trellm.ops.dense import activation_fn
from trellm.registry import ArchitectureClaim, find_architecture
from trellm.spec import ArchitectureSpec, VisionTowerSpec
from trellm.sdk.families import (
    COHERE_OPTIONS,
    GEMMA2_OPTIONS,
    GEMMA3_OPTIONS,
    GEMMA_OPTIONS,
    GLM4_OPTIONS,
    GLM_OPTIONS,
    OLMO_OPTIONS,
    configure_cohere,
    configure_gemma,
    configure_gemma2,
    configure_gemma3,
    configure_granite,
    configure_hyperclovax,
    read_gemma2_config,
    read_gemma3_config,
    read_qwen2_config,
)
from trellm.sdk.moe import deepseek_moe, mlp_layer_types, replace_mlps, use_deepseek_moe_layers, use_qwen3_moe_layers
from trellm.sdk.hybrid import build_qwen3_5, build_qwen3_5_moe, build_qwen_hybrid, hybrid_layer_types, qwen_moe_mlp
from trellm.sdk.qwen_vl import (
    QwenVisionBlock,
    QwenVisionConfig,
    QwenTowerLanguageModel,
    QwenVision,
    QwenVisionLanguageModel,
    QwenVisionTower,
    QwenVLConfig,
    QwenVLProcessor,
    patch_positions,
    read_qwen_vl_config,
)
from trellm.sdk.vision import (
    CLIP_MEAN,
    CLIP_STD,
    attend_image_blocks,
    attention_within_segments,
    frame_lengths,
    rope_2d,
    rope_inv_freq,
)

__all__ = [
    # registering a plugin
    "hookimpl", "ArchitectureSpec", "VisionTowerSpec", "find_architecture", "ArchitectureClaim",
    # configs
    "DecoderConfig", "RopeConfig", "text_config", "layer_types_from_pattern", "sliding_on_every_layer",
    "ConfigError", "config_int", "read_keys", "MoEConfig", "LinearAttentionConfig",
    # modules and the Llama-like stack
    "Module", "LoadContext", "ForwardBatch", "Linear", "LinearGroup", "Embedding", "RMSNorm", "LayerNorm", "RotaryEmbedding",
    "Attention", "OutputGate", "OutputGatedAttention", "GatedMLP", "MLP", "DecoderLayer", "CausalLM", "DecoderOptions", "build_decoder", "decoder_family",
    # multi-head latent attention, dense or with a DSA sparse-attention indexer (trellm.modules.latent)
    "LatentAttention", "SparseIndexer", "SparseLatentAttention", "pool_tokens",
    # DeepSeek V4's sliding + compressed attention (trellm.modules.compressed)
    "CompressedAttention", "CompressedIndexer", "WindowCompressor",
    # the text families others build on (trellm.sdk.families)
    "GEMMA_OPTIONS", "configure_gemma", "GEMMA2_OPTIONS", "configure_gemma2", "read_gemma2_config",
    "GEMMA3_OPTIONS", "configure_gemma3", "read_gemma3_config", "COHERE_OPTIONS", "configure_cohere",
    "OLMO_OPTIONS", "GLM_OPTIONS", "GLM4_OPTIONS", "configure_granite", "configure_hyperclovax", "read_qwen2_config",
    # mixture of experts
    "MoE", "Router", "Experts", "ExpertList", "ExpertMLP", "SoftmaxTopK", "TopKSoftmax", "ScoreTopK", "clamped_swiglu", "limited_swiglu",
    "dispatch_experts", "replace_mlps", "mlp_layer_types", "deepseek_moe", "use_deepseek_moe_layers", "use_qwen3_moe_layers",
    # recurrent and hybrid stacks, multi-token prediction
    "GatedDeltaNet", "KimiDeltaAttention", "GatedAttention", "ShortConv", "Mamba2Mixer", "ResidualBlock", "HybridCausalLM", "state_cache_inputs",
    "MTPHead", "MTPLayout", "build_qwen_mtp_head",
    # hyper-connections: a residual stream of N parallel streams (trellm.modules.hyper)
    "HyperConnection", "HyperMix", "HyperHead", "expand_streams", "HyperDecoderLayer", "HyperCausalLM",
    "HybridHyperCausalLM",
    # the Qwen hybrid stack (trellm.sdk.hybrid)
    "hybrid_layer_types", "qwen_moe_mlp", "build_qwen_hybrid", "build_qwen3_5", "build_qwen3_5_moe",
    # images
    "VisionLanguageModel", "VisionInput", "MultimodalPrompt", "PixelSteps", "FixedSizeProcessor", "ImageError",
    "VisionLanguageConfig", "config_token", "image_digest", "read_vision_config", "vision_tower_spec", "load_image_processor",
    # vision-tower helpers (trellm.sdk.vision) and the Qwen-VL recipe (trellm.sdk.qwen_vl)
    "CLIP_MEAN", "CLIP_STD", "rope_inv_freq", "rope_2d", "frame_lengths", "attention_within_segments", "attend_image_blocks",
    "QwenVLProcessor", "QwenVisionConfig", "QwenVisionBlock", "QwenVisionTower", "patch_positions",
    "QwenVLConfig", "read_qwen_vl_config", "QwenVision", "QwenTowerLanguageModel", "QwenVisionLanguageModel",
    # capabilities (trellm.capabilities): what a model or cache layer can do
    "HasRecurrentState", "SupportsImages", "HasMTPHead", "PagedKVLayer", "DenseKVPages", "StateSlots", "implements",
    # a cache layer keeping more per token than K/V (an indexer's keys, positions) and per window (pooled keys)
    "ExtraRowsKVCacheLayer", "WindowEntries", "completed_windows", "token_indices", "window_rows", "window_entry_pages",
    "is_hybrid", "supports_images", "mtp_head", "is_paged_layer", "has_dense_pages", "is_state_layer",
    # tensor parallel: a module that splits itself (SplitsOverRanks) cuts its projections with these, or splits as
    # the attention / MLP / gated delta net it extends
    "SplitsOverRanks", "rank_range", "split_columns", "split_rows", "shard_attention", "shard_mlp", "shard_gated_delta_net",
    # numeric ops
    "ops", "activation_fn", "gather_pages",
]
