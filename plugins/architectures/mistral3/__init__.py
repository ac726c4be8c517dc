"""Mistral 3 (Mistral3ForConditionalGeneration): Mistral text + the Pixtral tower.

Each image's patch features (from ``vision_feature_layer``) are RMS-normalised, every
``spatial_merge_size`` x ``spatial_merge_size`` block of patches is merged by one linear map, and a
two-layer MLP projects them to the text width. In the prompt, each ``[IMG]`` marker becomes rows of
``[IMG]`` tokens, one per merged block, each row closed by ``[IMG_BREAK]`` and the last by ``[IMG_END]``.
"""
from __future__ import annotations

from typing import Sequence

import attrs
import torch
import torch.nn.functional as F

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    DecoderConfig,
    DecoderOptions,
    Linear,
    LoadContext,
    Module,
    RMSNorm,
    VisionInput,
    VisionLanguageConfig,
    VisionLanguageModel,
    activation_fn,
    build_decoder,
    image_digest,
    load_image_processor,
    read_vision_config,
    sliding_on_every_layer,
    vision_tower_spec,
)

ALIASES = (
    ("language_model.model.", ("model.language_model.",)),
    ("language_model.lm_head", ("lm_head",)),
    ("vision_tower.", ("model.vision_tower.",)),
    ("multi_modal_projector.", ("model.multi_modal_projector.",)),
)
TEXT_OPTIONS = DecoderOptions(
    embed_key="language_model.model.embed_tokens",
    layer_prefix="language_model.model.layers",
    final_norm_key="language_model.model.norm",
    lm_head_key="language_model.lm_head",
)
# Mistral's tekken ids, used when no tokenizer tells otherwise
DEFAULT_BREAK_ID, DEFAULT_END_ID = 12, 13


@attrs.frozen
class Mistral3Config(VisionLanguageConfig):
    spatial_merge_size: int
    feature_layers: tuple[int, ...]
    projector_act: str
    projector_bias: bool


def read_config(raw: dict) -> Mistral3Config:
    vision = read_vision_config(raw, "Mistral3ForConditionalGeneration")
    layers = raw.get("vision_feature_layer", -1)
    return Mistral3Config(
        text=sliding_on_every_layer(DecoderConfig.from_hf(raw)),
        vision=vision,
        image_token_id=int(raw.get("image_token_id", raw.get("image_token_index", 10))),
        spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
        feature_layers=tuple(int(i) for i in layers) if isinstance(layers, list) else (int(layers),),
        projector_act=str(raw.get("projector_hidden_act", "gelu")),
        projector_bias=bool(raw.get("multimodal_projector_bias", False)),
    )


class Mistral3Vision(Module):
    """Pixtral tower + norm, patch merger and MLP projector."""

    def __init__(self, cfg: Mistral3Config):
        self.key = "multi_modal_projector"
        self.spec, self.cfg = vision_tower_spec(cfg.vision, "pixtral"), cfg
        self.tower = self.spec.build(cfg.vision, "vision_tower")
        d, m, text = int(cfg.vision["hidden_size"]), cfg.spatial_merge_size, cfg.hidden_size
        feat = d * len(cfg.feature_layers)
        self.norm = RMSNorm("multi_modal_projector.norm", feat, cfg.text.rms_norm_eps)
        self.merging_layer = Linear("multi_modal_projector.patch_merger.merging_layer", feat * m * m, feat)
        self.linear_1 = Linear("multi_modal_projector.linear_1", feat, text, cfg.projector_bias)
        self.linear_2 = Linear("multi_modal_projector.linear_2", text, text, cfg.projector_bias)
        self._act = activation_fn(cfg.projector_act)
        self.processor = None

    def load(self, ctx: LoadContext) -> None:
        self.processor = load_image_processor(ctx.store.model_dir, self.spec, self.cfg.vision, self.cfg.spatial_merge_size)
        super().load(ctx)

    def forward(self, images: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        states, grids = self.tower.forward(images)
        feats = self.norm.forward(torch.cat([states[i] for i in self.cfg.feature_layers], dim=-1))
        m, out, start = self.cfg.spatial_merge_size, [], 0
        for gh, gw in grids:
            grid = feats[start: start + gh * gw].T.reshape(1, -1, gh, gw)
            blocks = F.unfold(grid, kernel_size=m, stride=m)[0].T  # [(gh/m)*(gw/m), d*m*m]
            out.append(self.linear_2(self._act(self.linear_1(self.merging_layer(blocks)))))
            start += gh * gw
        return out


class Mistral3VisionLanguageModel(VisionLanguageModel):
    def __init__(self, cfg: Mistral3Config):
        super().__init__(build_decoder(cfg.text, TEXT_OPTIONS), Mistral3Vision(cfg), ALIASES)
        self.vl_config = cfg
        self.image_token_id = self.marker_id = cfg.image_token_id
        self.break_id, self.end_id = DEFAULT_BREAK_ID, DEFAULT_END_ID

    def use_tokenizer(self, tokenizer) -> None:
        for name, attr in (("[IMG_BREAK]", "break_id"), ("[IMG_END]", "end_id")):
            if (token := tokenizer.token_to_id(name)) is not None:
                setattr(self, attr, token)

    def preprocess(self, image) -> VisionInput:
        processor = self.image_processor()
        pixels = processor(image)
        t = processor.token_size
        rows, cols = pixels.shape[1] // t, pixels.shape[2] // t
        return VisionInput(pixels, rows * cols, image_digest(image), (rows, cols))

    def expansion_ids(self, item: VisionInput) -> list[int]:
        rows, cols = item.grid
        ids = ([self.image_token_id] * cols + [self.break_id]) * rows
        ids[-1] = self.end_id
        return ids

    def expansion_text(self, item: VisionInput, tokenizer) -> str:
        return tokenizer.decode(self.expansion_ids(item))

    def encode(self, items: Sequence[VisionInput]) -> list[torch.Tensor]:
        dtype = self.language.embed.weight.dtype
        return [e.to(dtype) for e in self.vision.forward([it.pixels for it in items])]


SPEC = ArchitectureSpec(
    name="mistral3",
    architectures=("Mistral3ForConditionalGeneration",),
    read_config=read_config,
    build=Mistral3VisionLanguageModel,
    description="Mistral 3 (Small 3.1/3.2): Mistral text + Pixtral tower, 2x2 patch merger",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
