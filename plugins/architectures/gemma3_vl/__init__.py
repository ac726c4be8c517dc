"""Gemma 3 with vision (Gemma3ForConditionalGeneration): Gemma 3 text + a SigLIP tower.

Each image is resized to the tower's size, encoded to patch features, average-pooled to
``mm_tokens_per_image`` tokens (a square grid), RMS-normalised (Gemma's 1 + w) and projected to the
text width by ``mm_input_projection_weight``. Those rows replace the ``<image_soft_token>`` run that
the processor writes for each ``<start_of_image>`` marker (``\\n\\n<boi><img>*N<eoi>\\n\\n``).

Attention: as in the reference implementation, the tokens of one image attend to each other in
both directions during prefill (a query in an image block also sees the later tokens of that
block; every other pair stays causal, and the sliding window still applies on local layers).
:class:`ImageBlockAttention` recomputes the image rows with that mask; an image run must therefore
arrive whole in one prefill chunk (``MultimodalPrompt.safe_chunk_end`` picks such chunk ends).
"""
from __future__ import annotations

from typing import Sequence

import attrs
import torch

import trellm
from trellm.sdk import (
    GEMMA3_OPTIONS,
    ArchitectureSpec,
    Attention,
    ConfigError,
    LoadContext,
    Module,
    RMSNorm,
    VisionInput,
    VisionLanguageConfig,
    VisionLanguageModel,
    attend_image_blocks,
    build_decoder,
    config_token,
    configure_gemma3,
    image_digest,
    load_image_processor,
    read_gemma3_config,
    read_vision_config,
    vision_tower_spec,
)

# One spelling of the tensor names (the hub uploads'); other transformers versions' names are aliases.
ALIASES = (
    ("language_model.model.", ("model.language_model.",)),
    ("language_model.lm_head", ("lm_head",)),
    ("vision_tower.vision_model.", ("vision_tower.", "model.vision_tower.vision_model.", "model.vision_tower.")),
    ("multi_modal_projector.", ("model.multi_modal_projector.",)),
)
TEXT_OPTIONS = attrs.evolve(
    GEMMA3_OPTIONS,
    embed_key="language_model.model.embed_tokens",
    layer_prefix="language_model.model.layers",
    final_norm_key="language_model.model.norm",
    lm_head_key="language_model.lm_head",
)


@attrs.frozen
class Gemma3VLConfig(VisionLanguageConfig):
    mm_tokens_per_image: int
    boi_token_id: int
    eoi_token_id: int


def read_config(raw: dict) -> Gemma3VLConfig:
    vision = read_vision_config(raw, "Gemma3ForConditionalGeneration")

    cfg = Gemma3VLConfig(
        text=read_gemma3_config(raw),
        vision=vision,
        mm_tokens_per_image=int(raw.get("mm_tokens_per_image", 256)),
        image_token_id=config_token(raw, "image_token_id", "image_token_index", default=262144),
        boi_token_id=config_token(raw, "boi_token_id", "boi_token_index", default=255999),
        eoi_token_id=config_token(raw, "eoi_token_id", "eoi_token_index", default=256000),
    )
    side = int(round(cfg.mm_tokens_per_image**0.5))
    patches = int(vision.get("image_size", 896)) // int(vision.get("patch_size", 14))
    if side * side != cfg.mm_tokens_per_image or patches % side:
        raise ConfigError(f"config.json: mm_tokens_per_image {cfg.mm_tokens_per_image} must be a square whose side divides "
                          f"the tower's {patches} patches per side")
    return cfg


class ImageBlockAttention(Attention):
    """Gemma 3 attention in which the rows of one image block also see that block's later rows.

    Every row is first computed causally (which also stores K/V in the cache); rows of image blocks
    (runs of ``batch.embed_mask``) are then recomputed with the causal-or-same-block mask.
    """

    def attention(self, x, batch) -> torch.Tensor:
        """Attention's own fused path for batches without image rows (every decode step), else causal then
        the image rows again."""
        if batch.embed_mask is None:
            return super().attention(x, batch)
        q, k, v = self.project_qkv(x)
        o = self.attend(q, k, v, batch)
        if bool(batch.embed_mask.any()):
            layer = batch.cache.layers[self.layer_idx] if batch.cache is not None else None
            attend_image_blocks(o, self.rotate(q, batch), self.rotate(k, batch), v, batch, layer, self.scale,
                                self.sliding_window, self.softcap)
        return o.reshape(x.shape[0], self.num_heads * self.head_dim)


class Gemma3Vision(Module):
    """SigLIP tower + pooling + soft-embedding norm + projection; its image processor comes from the model dir."""

    def __init__(self, cfg: Gemma3VLConfig):
        self.key = "multi_modal_projector"
        v = cfg.vision
        self.tower_spec = vision_tower_spec(v, "siglip_vision_model")
        self.tower = self.tower_spec.build(v, "vision_tower.vision_model")
        self.vision_hidden, self.text_hidden = int(v["hidden_size"]), cfg.hidden_size
        self.patches_per_side = int(v["image_size"]) // int(v["patch_size"])
        self.tokens_per_side = int(round(cfg.mm_tokens_per_image**0.5))
        self.soft_emb_norm = RMSNorm("multi_modal_projector.mm_soft_emb_norm", self.vision_hidden,
                                     float(v.get("layer_norm_eps", 1e-6)), unit_offset=True)
        self.projection = None
        self.processor = None
        self.vision_config = v

    def load(self, ctx: LoadContext) -> None:
        self.projection = ctx.store.get("multi_modal_projector.mm_input_projection_weight",
                                        shape=(self.vision_hidden, self.text_hidden), dtype=ctx.dtype, device=ctx.device)
        self.processor = load_image_processor(ctx.store.model_dir, self.tower_spec, self.vision_config)
        super().load(ctx)

    def unload(self) -> None:
        self.projection = None
        super().unload()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] -> [N, mm_tokens_per_image, text hidden]."""
        feats = self.tower.forward(pixels.to(self.projection.device))
        n, p, d = feats.shape
        grid = feats.transpose(1, 2).reshape(n, d, self.patches_per_side, self.patches_per_side)
        k = self.patches_per_side // self.tokens_per_side
        pooled = torch.nn.functional.avg_pool2d(grid, kernel_size=k, stride=k).flatten(2).transpose(1, 2)
        return torch.matmul(self.soft_emb_norm.forward(pooled), self.projection)


class Gemma3VisionLanguageModel(VisionLanguageModel):
    def __init__(self, cfg: Gemma3VLConfig):
        language = build_decoder(cfg.text, configure_gemma3(cfg.text, TEXT_OPTIONS))
        for layer in language.layers:
            if type(layer.attn) is Attention:
                layer.attn.__class__ = ImageBlockAttention  # same state, image-block-aware forward
        super().__init__(language, Gemma3Vision(cfg), ALIASES)
        self.vl_config = cfg
        self.image_token_id, self.marker_id = cfg.image_token_id, cfg.boi_token_id

    def preprocess(self, image) -> VisionInput:
        return VisionInput(self.image_processor()(image), self.vl_config.mm_tokens_per_image, image_digest(image))

    def expansion_ids(self, item: VisionInput) -> list[int]:
        c = self.vl_config
        return [c.boi_token_id] + [c.image_token_id] * item.num_tokens + [c.eoi_token_id]

    def expansion_text(self, item: VisionInput, tokenizer) -> str:
        c = self.vl_config
        boi, img, eoi = (tokenizer.decode([t]) for t in (c.boi_token_id, c.image_token_id, c.eoi_token_id))
        return f"\n\n{boi}{img * item.num_tokens}{eoi}\n\n"

    def encode(self, items: Sequence[VisionInput]) -> list[torch.Tensor]:
        pixels = torch.stack([it.pixels for it in items])
        return list(self.vision.forward(pixels).to(self.language.embed.weight.dtype))


SPEC = ArchitectureSpec(
    name="gemma3_vl",
    architectures=("Gemma3ForConditionalGeneration",),
    read_config=read_config,
    build=Gemma3VisionLanguageModel,
    description="Gemma 3 with vision: SigLIP tower, pooled soft tokens, bidirectional image blocks",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
