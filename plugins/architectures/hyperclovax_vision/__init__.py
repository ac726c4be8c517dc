"""HyperCLOVA X SEED with images (HCXVisionV2ForCausalLM): HyperCLOVA X text + the Qwen2.5-VL tower.

The tower's merged tokens go through one linear projector to the text width and fill the image-pad
run (one token per merged 2x2 patch block) of each image; positions stay plain 1D (no M-RoPE). The
text model is HyperCLOVA X's (muP multipliers, Peri-LN when ``use_post_norm``).

Checkpoints spell the text model ``model.language_model.model.*`` with its head at
``model.language_model.lm_head`` and the projector ``model.mm_projector`` (NAVER's upload), or
``model.language_model.*``, ``lm_head`` and ``model.vision_projector`` (transformers' save_pretrained):
both load.
"""
from __future__ import annotations

from typing import Sequence

import torch

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    DecoderConfig,
    DecoderOptions,
    Linear,
    QwenTowerLanguageModel,
    QwenVision,
    VisionLanguageConfig,
    build_decoder,
    configure_hyperclovax,
    read_vision_config,
)

ARCHITECTURES = ("HCXVisionV2ForCausalLM", "HyperCLOVAXVisionV2ForConditionalGeneration")
ALIASES = (
    ("model.language_model.", ("model.language_model.model.",)),
    ("lm_head.", ("model.language_model.lm_head.",)),
    ("model.vision_projector.", ("model.mm_projector.", "model.projector.")),
)
TEXT_OPTIONS = DecoderOptions(
    embed_key="model.language_model.embed_tokens",
    layer_prefix="model.language_model.layers",
    final_norm_key="model.language_model.norm",
)


def read_config(raw: dict) -> VisionLanguageConfig:
    return VisionLanguageConfig(
        text=DecoderConfig.from_hf(raw),
        vision=read_vision_config(raw, raw.get("architectures", ARCHITECTURES)[0]),
        image_token_id=int(raw.get("image_token_id", 128060)),
    )


class HCXVision(QwenVision):
    """The Qwen2.5-VL tower followed by the linear projector to the text width.

    The text model multiplies its input rows by ``embedding_multiplier`` after the image rows are
    placed, so the image rows are scaled here (trellm places them after the embedding's own scale).
    """

    def __init__(self, cfg: VisionLanguageConfig, embed_scale: float):
        super().__init__(cfg.vision, "model.vision_model")
        self.projector = Linear("model.vision_projector", int(cfg.vision["out_hidden_size"]), cfg.hidden_size, bias=True)
        self.embed_scale = embed_scale

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        return self.projector(self.tower.forward(patches, grids)) * self.embed_scale


class HCXVisionLanguageModel(QwenTowerLanguageModel):
    def __init__(self, cfg: VisionLanguageConfig):
        options = configure_hyperclovax(cfg.text, TEXT_OPTIONS)
        language = build_decoder(cfg.text, options)
        super().__init__(language, HCXVision(cfg, options.embed_scale or 1.0), ALIASES, cfg.image_token_id)


SPEC = ArchitectureSpec(
    name="hyperclovax_vision",
    architectures=ARCHITECTURES,
    read_config=read_config,
    build=HCXVisionLanguageModel,
    description="HyperCLOVA X SEED with images: HyperCLOVA X text, Qwen2.5-VL tower, linear projector",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
