"""Gemma 4 with images (Gemma4ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration): the Gemma 4
language model (:mod:`trellm.sdk.gemma4`) and the ``gemma4_vision`` tower (Unified: the encoder-free
``gemma4_unified_vision`` embedder), whose features are RMS-normalised (no weight) and projected to the text
width by ``embed_vision.embedding_projection``. The processor writes each image as
``<boi><image>*N<eoi>``, N the image's pooled patches; the per-layer inputs of image rows use ``pad_token_id``.

``use_bidirectional_attention: "vision"`` (the larger models): on sliding layers the rows of one image also see
that image's later rows, within the window; full layers stay causal. Unified: on every layer, and the window does
not cut an image. Audio and video inputs are not supported.
"""
from __future__ import annotations

from typing import Sequence

import attrs
import torch

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    Linear,
    LoadContext,
    Module,
    RMSNorm,
    VisionInput,
    VisionLanguageConfig,
    VisionLanguageModel,
    image_digest,
    load_image_processor,
    read_vision_config,
    vision_tower_spec,
)
from trellm.sdk.gemma4 import build_gemma4_text, read_gemma4_config


@attrs.frozen
class Gemma4VLConfig(VisionLanguageConfig):
    boi_token_id: int
    eoi_token_id: int


def read_config(raw: dict) -> Gemma4VLConfig:
    cfg = Gemma4VLConfig(
        text=read_gemma4_config(raw),
        vision=read_vision_config(raw, (raw.get("architectures") or ["Gemma4ForConditionalGeneration"])[0]),
        image_token_id=int(raw.get("image_token_id", 258880)),
        boi_token_id=int(raw.get("boi_token_id", 255999)),
        eoi_token_id=int(raw.get("eoi_token_id", 258882)),
    )
    return cfg


TOWER_KEYS = {"gemma4_vision": "model.vision_tower", "gemma4_unified_vision": "model.vision_embedder"}


class Gemma4Vision(Module):
    """Tower + weightless RMSNorm + projection to the text width; its image processor comes from the model dir."""

    def __init__(self, cfg: Gemma4VLConfig):
        self.key = "model.embed_vision"
        v = cfg.vision
        self.tower_spec = vision_tower_spec(v, "gemma4_vision")
        self.tower = self.tower_spec.build(v, TOWER_KEYS.get(self.tower_spec.name, "model.vision_tower"))
        width = int(v.get("output_proj_dims") or v.get("hidden_size", 768))
        self.norm = RMSNorm("model.embed_vision.embedding_pre_projection_norm", width, float(v.get("rms_norm_eps", 1e-6)),
                            has_weight=False)
        self.projection = Linear("model.embed_vision.embedding_projection", width, cfg.hidden_size)
        self.vision_config, self.processor = v, None

    def load(self, ctx: LoadContext) -> None:
        self.processor = load_image_processor(ctx.store.model_dir, self.tower_spec, self.vision_config)
        super().load(ctx)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        return self.projection(self.norm.forward(self.tower.forward(patches, grid)))


class Gemma4VisionLanguageModel(VisionLanguageModel):
    def __init__(self, cfg: Gemma4VLConfig):
        super().__init__(build_gemma4_text(cfg.text, prefix="model.language_model"), Gemma4Vision(cfg))
        self.vl_config = cfg
        self.image_token_id = self.marker_id = cfg.image_token_id

    def preprocess(self, image) -> VisionInput:
        patches, grid = self.image_processor()(image)
        return VisionInput(patches, self.vision.tower.num_tokens(grid), image_digest(image), grid)

    def expansion_ids(self, item: VisionInput) -> list[int]:
        c = self.vl_config
        return [c.boi_token_id] + [c.image_token_id] * item.num_tokens + [c.eoi_token_id]

    def expansion_text(self, item: VisionInput, tokenizer) -> str:
        return tokenizer.decode(self.expansion_ids(item))

    def encode(self, items: Sequence[VisionInput]) -> list[torch.Tensor]:
        dtype = self.language.embed.weight.dtype
        return [self.vision.forward(it.pixels, it.grid).to(dtype) for it in items]


SPEC = ArchitectureSpec(
    name="gemma4_vl",
    architectures=("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration"),
    read_config=read_config,
    build=Gemma4VisionLanguageModel,
    description="Gemma 4 with images: aspect-kept patches, 2D-RoPE tower and pooled soft tokens (Unified: no tower)",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
