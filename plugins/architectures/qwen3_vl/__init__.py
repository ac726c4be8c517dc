"""Qwen3-VL (Qwen3VLForConditionalGeneration): Qwen3 text with interleaved M-RoPE and DeepStack; Qwen3-VL MoE
(Qwen3VLMoeForConditionalGeneration) is the same with Qwen3 MoE text layers (:func:`~trellm.sdk.use_qwen3_moe_layers`).

:data:`QWEN3_5_VISION_SPEC` serves Qwen3.5 / Qwen3.5 MoE with images the same way (their hybrid text
models, the same tower without DeepStack); it is not registered by default (see its comment).

Differences from Qwen2.5-VL: the M-RoPE bands are interleaved (t, h, w, t, h, w, ...); the tower
is :class:`~trellm.plugins.vision.qwen_vl.Qwen3VisionTower`; and DeepStack: features taken from
a few tower layers are added to the language model's hidden states at the image rows after its
first layers (one tapped tower layer per language layer). The image rows' embeddings therefore
carry ``1 + len(deepstack_visual_indexes)`` blocks of width ``hidden_size``; the first replaces the
token embedding, the others are the DeepStack additions (only prefill rows carry them).
"""
from __future__ import annotations

import attrs
import torch

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    DecoderConfig,
    DecoderOptions,
    QwenVLConfig,
    QwenVisionLanguageModel,
    build_decoder,
    build_qwen3_5,
    build_qwen3_5_moe,
    read_qwen2_config,
    read_qwen_vl_config,
    use_qwen3_moe_layers,
)

ALIASES = (
    ("model.language_model.", ("model.",)),
    ("model.visual.", ("visual.",)),
)


def read_config(raw: dict) -> QwenVLConfig:
    return read_qwen_vl_config(raw, read_qwen2_config)


class Qwen3VisionLanguageModel(QwenVisionLanguageModel):
    interleaved_sections = True
    aliases = ALIASES
    text_options = DecoderOptions(
        qk_norm=True,
        embed_key="model.language_model.embed_tokens",
        layer_prefix="model.language_model.layers",
        final_norm_key="model.language_model.norm",
    )
    vision_key = "model.visual"

    def __init__(self, cfg: QwenVLConfig):
        super().__init__(cfg)
        self.num_deepstack = len(cfg.vision.get("deepstack_visual_indexes") or ())

    def forward(self, batch) -> torch.Tensor:
        lm, hidden = self.language, self.language.config.hidden_size
        extra = None
        if batch.input_embeds is not None and batch.input_embeds.shape[-1] > hidden:
            extra = batch.input_embeds[:, hidden:].split(hidden, dim=-1)
            batch = attrs.evolve(batch, input_embeds=batch.input_embeds[:, :hidden])
        x = lm.embed_tokens(batch)
        for i, layer in enumerate(lm.layers):
            x = layer.forward(x, batch)
            if extra is not None and i < len(extra):
                rows = batch.embed_mask
                x = x.clone()
                x[rows] = x[rows] + extra[i][rows].to(x.dtype)
        return lm.logits_from_hidden(x, batch)


class Qwen3MoeVisionLanguageModel(Qwen3VisionLanguageModel):
    """Qwen3-VL MoE: the Qwen3-VL model whose text layers carry Qwen3 MoE blocks (top-k weights always
    renormalised, whatever ``norm_topk_prob`` says)."""

    def build_language(self, cfg: QwenVLConfig):
        language = build_decoder(cfg.text, self.text_options)
        use_qwen3_moe_layers(language, cfg.text, normalize=True)
        return language


class Qwen35VisionLanguageModel(QwenVisionLanguageModel):
    """Qwen3.5 / Qwen3.5 MoE with vision: the hybrid text model of the qwen3_5 plugins (:func:`trellm.sdk.build_qwen3_5`), the Qwen3-VL tower
    (without DeepStack) and interleaved M-RoPE over the rotated part of each attention head."""

    interleaved_sections = True
    aliases = ALIASES
    vision_key = "model.visual"

    def build_language(self, cfg: QwenVLConfig):
        moe = cfg.text.architecture == "Qwen3_5MoeForConditionalGeneration"
        return (build_qwen3_5_moe if moe else build_qwen3_5)(cfg.text)


def read_qwen3_5_config(raw: dict) -> QwenVLConfig:
    return read_qwen_vl_config(raw, DecoderConfig.from_hf)


# Not registered by default: the qwen3_5 / qwen3_5_moe plugins serve these architectures text-only.
# Registering QWEN3_5_VISION_SPEC (a plugin registered after them wins) adds image input.
QWEN3_5_VISION_SPEC = ArchitectureSpec(
    name="qwen3_5_vl",
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
    read_config=read_qwen3_5_config,
    build=Qwen35VisionLanguageModel,
    description="Qwen3.5 (dense / MoE) with vision: hybrid text with interleaved M-RoPE, Qwen3-VL tower",
)


SPEC = ArchitectureSpec(
    name="qwen3_vl",
    architectures=("Qwen3VLForConditionalGeneration",),
    read_config=read_config,
    build=Qwen3VisionLanguageModel,
    description="Qwen3-VL: Qwen3 text with interleaved M-RoPE and DeepStack, Qwen3-VL ViT",
)


MOE_SPEC = ArchitectureSpec(
    name="qwen3_vl_moe",
    architectures=("Qwen3VLMoeForConditionalGeneration",),
    read_config=read_config,
    build=Qwen3MoeVisionLanguageModel,
    description="Qwen3-VL MoE (30B-A3B, 235B-A22B): Qwen3-VL with Qwen3 MoE text layers",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
    register(MOE_SPEC)
