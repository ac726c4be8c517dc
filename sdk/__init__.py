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
from trellm.config import DecoderConfig, RopeConfig, layer_types_from_pattern, sliding_on_every_layer, text_config
from trellm.errors import ConfigError
from trellm.generator.mtp import MTPHead, MTPLayout, build_qwen_mtp_head
from trellm.hookspecs import hookimpl
from trellm.modules.base import LoadContext, Module
from trellm.modules.decoder import CausalLM, DecoderLayer, DecoderOptions, build_decoder, decoder_family
from trellm.modules.layers import MLP, Attention, Embedding, GatedMLP, LayerNorm, RMSNorm, RotaryEmbedding
from trellm.modules.linear import Linear
from trellm.modules.moe import (
    ExpertMLP,
    Experts,
    MoE,
    Router,
    ScoreTopK,
    SoftmaxTopK,
    TopKSoftmax,
    clamped_swiglu,
    config_int,
    deepseek_moe,
    dispatch_experts,
    replace_mlps,
    use_deepseek_moe_layers,
)
from trellm.modules.recurrent import GatedAttention, GatedDeltaNet, HybridCausalLM, Mamba2Mixer, ResidualBlock, ShortConv
from trellm.multimodal import (
    FixedSizeProcessor,
    ImageError,
    MultimodalPrompt,
    PixelSteps,
    VisionInput,
    VisionLanguageModel,
    image_digest,
    load_image_processor,
    read_vision_config,
    vision_tower_spec,
)
from trellm.ops.attention import gather_pages
from trellm.ops.dense import activation_fn
from trellm.registry import find_architecture
from trellm.spec import ArchitectureSpec, VisionTowerSpec

__all__ = [
    # registering a plugin
    "hookimpl", "ArchitectureSpec", "VisionTowerSpec", "find_architecture",
    # configs
    "DecoderConfig", "RopeConfig", "text_config", "layer_types_from_pattern", "sliding_on_every_layer",
    "ConfigError", "config_int",
    # modules and the Llama-like stack
    "Module", "LoadContext", "ForwardBatch", "Linear", "Embedding", "RMSNorm", "LayerNorm", "RotaryEmbedding",
    "Attention", "GatedMLP", "MLP", "DecoderLayer", "CausalLM", "DecoderOptions", "build_decoder", "decoder_family",
    # mixture of experts
    "MoE", "Router", "Experts", "ExpertMLP", "SoftmaxTopK", "TopKSoftmax", "ScoreTopK", "clamped_swiglu",
    "dispatch_experts", "replace_mlps", "deepseek_moe", "use_deepseek_moe_layers",
    # recurrent and hybrid stacks, multi-token prediction
    "GatedDeltaNet", "GatedAttention", "ShortConv", "Mamba2Mixer", "ResidualBlock", "HybridCausalLM",
    "MTPHead", "MTPLayout", "build_qwen_mtp_head",
    # images
    "VisionLanguageModel", "VisionInput", "MultimodalPrompt", "PixelSteps", "FixedSizeProcessor", "ImageError",
    "image_digest", "read_vision_config", "vision_tower_spec", "load_image_processor",
    # numeric ops
    "ops", "activation_fn", "gather_pages",
]
