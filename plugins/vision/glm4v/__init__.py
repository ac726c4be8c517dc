"""GLM vision towers and their image processors: GLM 4.1V / 4.5V (``glm4v_vision``) and GLM 5.3-Flash
(``glm5_next_vision``, the GLM-OCR tower).

Patches are cut and flattened as for Qwen-VL (dynamic resolution, merge-block order). The tower:
patch embedding, full-attention RMSNorm blocks with 2D RoPE and a gated MLP, a final RMSNorm, a strided
convolution that merges each ``merge x merge`` block, and a projection + LayerNorm + GELU + gated MLP merger.

- GLM 4.1V adds an RMSNorm after the patch embedding and a learned position table resampled bicubically to
  each image's grid; its block MLPs are ``out_hidden_size`` wide, without biases.
- GLM 5.3 has no position table; it RMS-norms each head's q and k before the RoPE, its block MLPs
  (``intermediate_size`` wide, biased as the attention) and its merger (``projection_intermediate_size``) clamp
  their SwiGLU inputs at ``swiglu_limit``. Its processor shrinks an image only past the token budget and pads
  the resized content with black to the patch grid instead of stretching it.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F

import trellm
from trellm.sdk import (
    CLIP_MEAN,
    CLIP_STD,
    ConfigError,
    ExpertMLP,
    GatedMLP,
    ImageError,
    LayerNorm,
    Linear,
    LoadContext,
    Module,
    PixelSteps,
    QwenVLProcessor,
    QwenVisionBlock,
    QwenVisionTower,
    RMSNorm,
    VisionTowerSpec,
    frame_lengths,
    limited_swiglu,
    patch_positions,
    rope_inv_freq,
)


@attrs.frozen
class Glm4vProcessor(QwenVLProcessor):
    """Qwen-VL patching with GLM's sizing: small images scaled up to one token, pixel budget counted over both frames."""

    def fit(self, height: int, width: int) -> tuple[int, int]:
        factor, frames = self.patch_size * self.merge_size, self.temporal_patch_size
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > 200:
            raise ImageError(f"image of {width}x{height} pixels: aspect ratio above 200 is not supported")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if frames * h * w > self.max_pixels:
            beta = math.sqrt(frames * height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif frames * h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (frames * height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    @classmethod
    def from_config(cls, cfg: dict[str, Any], vision_config: dict[str, Any]) -> "Glm4vProcessor":
        size = cfg.get("size") or {}
        steps = PixelSteps.from_config({"resample": 3, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, **cfg})
        return cls(
            patch_size=int(cfg.get("patch_size") or vision_config.get("patch_size", 14)),
            merge_size=int(cfg.get("merge_size") or vision_config.get("spatial_merge_size", 2)),
            temporal_patch_size=int(cfg.get("temporal_patch_size") or vision_config.get("temporal_patch_size", 2)),
            min_pixels=int(size.get("shortest_edge") or 112 * 112),
            max_pixels=int(size.get("longest_edge") or 28 * 28 * 15000),
            steps=steps,
        )


@attrs.frozen
class Glm5NextProcessor(QwenVLProcessor):
    """Qwen-VL patching of GLM 5.3's canvas: the image, scaled (aspect kept) to fit a budget of
    [min_image_tokens, max_image_tokens] merged tokens over both frames, padded with black to whole merge blocks."""

    min_tokens: int = 16
    max_tokens: int = 8000

    @property
    def pixels_per_token(self) -> int:
        return self.temporal_patch_size * (self.patch_size * self.merge_size) ** 2

    def fit(self, height: int, width: int) -> tuple[int, int]:
        """The padded canvas (height, width): the image rounded up to whole merge blocks, grown to the minimum
        budget or cut down to the largest canvas of its aspect within the maximum."""
        factor, frames, per_token = self.patch_size * self.merge_size, self.temporal_patch_size, self.pixels_per_token
        up = lambda v: math.ceil(v / factor) * factor  # noqa: E731
        h, w = up(height), up(width)
        if frames * h * w < self.min_tokens * per_token:
            scale = math.sqrt(self.min_tokens * per_token / (frames * height * width))
            h, w = up(max(1, math.ceil(height * scale))), up(max(1, math.ceil(width * scale)))
        if frames * h * w > self.max_tokens * per_token:
            h, w = factor, factor
            low, high = 1, height  # the tallest content height whose canvas stays within the budget
            while low <= high:
                content = (low + high) // 2
                ch, cw = up(content), up(max(1, math.floor(width * content / height)))
                if frames * ch * cw <= self.max_tokens * per_token:
                    h, w, low = ch, cw, content + 1
                else:
                    high = content - 1
        return h, w

    def canvas(self, img):
        """The image resized to its content size (shrunk only beyond the minimum budget), black below and right."""
        from PIL import Image

        w0, h0 = img.size
        h, w = self.fit(h0, w0)
        scale = min(h / h0, w / w0)
        if self.temporal_patch_size * h0 * w0 >= self.min_tokens * self.pixels_per_token:  # grown only when too small
            scale = min(1.0, scale)
        ch, cw = max(1, min(h, math.floor(h0 * scale))), max(1, min(w, math.floor(w0 * scale)))
        out = Image.new(img.mode, (w, h))
        out.paste(self.steps.resize(img, ch, cw), (0, 0))
        return out

    @classmethod
    def from_config(cls, cfg: dict[str, Any], vision_config: dict[str, Any]) -> "Glm5NextProcessor":
        base = Glm4vProcessor.from_config(cfg, vision_config)
        min_tokens, max_tokens = int(cfg.get("min_image_tokens", 16)), int(cfg.get("max_image_tokens", 8000))
        if not 1 <= min_tokens <= max_tokens:
            raise ConfigError(f"preprocessor_config.json: min_image_tokens={min_tokens}, max_image_tokens={max_tokens}; "
                              "need 1 <= min <= max")
        return cls(patch_size=base.patch_size, merge_size=base.merge_size, temporal_patch_size=base.temporal_patch_size,
                   steps=base.steps, min_tokens=min_tokens, max_tokens=max_tokens)


@attrs.frozen
class GlmVisionConfig:
    """The GLM tower's shape; ``from_hf`` reads GLM 4.1V's layout, ``from_hf(raw, ocr=True)`` GLM 5.3's."""

    depth: int
    hidden_size: int
    num_heads: int
    out_hidden_size: int
    mlp_width: int  # the blocks' gated MLPs
    merger_width: int  # the merger's gated MLP
    image_size: int = 0  # with learned positions: the table covers (image_size / patch_size)**2 patches
    learned_positions: bool = True
    qk_norm: bool = False
    block_bias: bool = False  # biases on the attention output and the block MLPs
    swiglu_limit: float = 0.0  # 0: plain SwiGLU
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    attention_bias: bool = False
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, raw: dict[str, Any], ocr: bool = False) -> "GlmVisionConfig":
        try:
            common = dict(
                depth=int(raw["depth"]), hidden_size=int(raw["hidden_size"]), num_heads=int(raw["num_heads"]),
                out_hidden_size=int(raw["out_hidden_size"]),
                patch_size=int(raw.get("patch_size", 14)), spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
                temporal_patch_size=int(raw.get("temporal_patch_size", 2)), in_channels=int(raw.get("in_channels", 3)),
                hidden_act=str(raw.get("hidden_act", "silu")), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=float((raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            )
            if ocr:
                bias = bool(raw.get("attention_bias", True))
                return cls(**common, mlp_width=int(raw["intermediate_size"]),
                           merger_width=int(raw.get("projection_intermediate_size", 10240)), learned_positions=False,
                           qk_norm=True, attention_bias=bias, block_bias=bias,
                           swiglu_limit=float(raw.get("swiglu_limit", 10.0)))
            return cls(**common, mlp_width=int(raw["out_hidden_size"]), merger_width=int(raw["intermediate_size"]),
                       image_size=int(raw["image_size"]), attention_bias=bool(raw.get("attention_bias", False)))
        except KeyError as e:
            raise ConfigError(f"config.json: vision_config is missing {e.args[0]!r}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def gated_mlp(key: str, width_in: int, width: int, cfg: GlmVisionConfig, bias: bool) -> Module:
    """SwiGLU of ``width``, its inputs clamped at ``swiglu_limit`` when it is set."""
    if cfg.swiglu_limit:
        return ExpertMLP(key, width_in, width, limited_swiglu(cfg.swiglu_limit), bias)
    return GatedMLP(key, width_in, width, cfg.hidden_act, bias)


class GlmVisionBlock(QwenVisionBlock):
    """RMSNorm blocks: 2D-RoPE attention over the image (qkv bias per config), gated MLP."""

    def __init__(self, key: str, cfg: GlmVisionConfig):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.key, self.num_heads, self.head_dim = key, cfg.num_heads, cfg.head_dim
        self.norm1 = RMSNorm(f"{key}.norm1", d, eps)
        self.norm2 = RMSNorm(f"{key}.norm2", d, eps)
        self.qkv = Linear(f"{key}.attn.qkv", d, 3 * d, cfg.attention_bias)
        self.proj = Linear(f"{key}.attn.proj", d, d, cfg.block_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(f"{key}.attn.q_norm", cfg.head_dim, eps)
            self.k_norm = RMSNorm(f"{key}.attn.k_norm", cfg.head_dim, eps)
        self.mlp = gated_mlp(f"{key}.mlp", d, cfg.mlp_width, cfg, cfg.block_bias)


class GlmVisionTower(Module):
    """patches [P, C * T * p * p] with grids (t, h, w) -> tokens [P / merge**2, out_hidden_size]."""

    def __init__(self, key: str, cfg: GlmVisionConfig):
        self.key, self.cfg = key, cfg
        self.patch_weight = self.patch_bias = self.pos_table = None
        self.downsample_weight = self.downsample_bias = None
        self.post_conv_layernorm = RMSNorm(f"{key}.post_conv_layernorm", cfg.hidden_size, cfg.rms_norm_eps) \
            if cfg.learned_positions else None
        self.blocks = [GlmVisionBlock(f"{key}.blocks.{i}", cfg) for i in range(cfg.depth)]
        self.post_layernorm = RMSNorm(f"{key}.post_layernorm", cfg.hidden_size, cfg.rms_norm_eps)
        out = cfg.out_hidden_size
        self.merger_proj = Linear(f"{key}.merger.proj", out, out, False)
        self.merger_norm = LayerNorm(f"{key}.merger.post_projection_norm", out, 1e-5)
        self.merger_mlp = gated_mlp(f"{key}.merger", out, cfg.merger_width, cfg, False)
        self.inv_freq = rope_inv_freq(cfg.head_dim // 2, cfg.rope_theta)
        self.side = cfg.image_size // cfg.patch_size

    def load(self, ctx: LoadContext) -> None:
        c, get, k = self.cfg, ctx.store.get, self.key
        kw = dict(dtype=ctx.dtype, device=ctx.device)
        self.patch_weight = get(f"{k}.patch_embed.proj.weight", shape=(c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size), **kw)
        self.patch_bias = get(f"{k}.patch_embed.proj.bias", shape=(c.hidden_size,), **kw)
        if c.learned_positions:
            self.pos_table = get(f"{k}.embeddings.position_embedding.weight", shape=(self.side**2, c.hidden_size), **kw)
        m = c.spatial_merge_size
        self.downsample_weight = get(f"{k}.downsample.weight", shape=(c.out_hidden_size, c.hidden_size, m, m), **kw)
        self.downsample_bias = get(f"{k}.downsample.bias", shape=(c.out_hidden_size,), **kw)
        super().load(ctx)

    def unload(self) -> None:
        self.patch_weight = self.patch_bias = self.pos_table = self.downsample_weight = self.downsample_bias = None
        super().unload()

    rope = QwenVisionTower.rope

    def positions(self, grids) -> torch.Tensor:
        """The learned table sampled bicubically (border padding) at every patch centre, patches in merge-block order."""
        rc = patch_positions(grids, self.cfg.spatial_merge_size).float()
        sizes = torch.cat([torch.tensor([[h, w]], dtype=torch.float32).expand(t * h * w, 2) for t, h, w in grids])
        norm = (rc + 0.5) / sizes * 2 - 1  # (row, col) in [-1, 1]
        grid = norm.flip(-1)[None, :, None, :].to(self.pos_table.device)  # grid_sample wants (x=col, y=row)
        table = self.pos_table.float().T.reshape(1, -1, self.side, self.side)
        sampled = F.grid_sample(table, grid, mode="bicubic", align_corners=False, padding_mode="border")
        return sampled[0, :, :, 0].T.to(self.pos_table.dtype)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        c, w = self.cfg, self.patch_weight
        x = patches.to(device=w.device, dtype=w.dtype) @ w.reshape(c.hidden_size, -1).T + self.patch_bias
        if c.learned_positions:
            x = self.post_conv_layernorm.forward(x) + self.positions(grids)
        cos, sin = self.rope(grids)
        images = frame_lengths(grids)
        for block in self.blocks:
            x = block.forward(x, cos, sin, images)
        x = self.post_layernorm.forward(x)
        m = c.spatial_merge_size
        blocks = x.reshape(-1, m, m, c.hidden_size).permute(0, 3, 1, 2)
        x = F.conv2d(blocks, self.downsample_weight, self.downsample_bias).reshape(-1, c.out_hidden_size)
        return self.merger_mlp.forward(F.gelu(self.merger_norm.forward(self.merger_proj(x))))


def build(vision_config: dict[str, Any], key: str) -> GlmVisionTower:
    return GlmVisionTower(key, GlmVisionConfig.from_hf(vision_config))


def build_glm5_next(vision_config: dict[str, Any], key: str) -> GlmVisionTower:
    return GlmVisionTower(key, GlmVisionConfig.from_hf(vision_config, ocr=True))


SPEC = VisionTowerSpec(
    name="glm4v",
    model_types=("glm4v_vision", "glm4v_moe_vision"),
    build=build,
    processor=Glm4vProcessor.from_config,
    description="GLM 4.1V ViT: resampled learned positions + 2D RoPE, conv merge, gated merger",
)


GLM5_NEXT_SPEC = VisionTowerSpec(
    name="glm5_next",
    model_types=("glm5_next_vision",),
    build=build_glm5_next,
    processor=Glm5NextProcessor.from_config,
    description="GLM 5.3 ViT (GLM-OCR): 2D RoPE over q/k-normed heads, conv merge, clamped SwiGLU merger",
)


@trellm.hookimpl
def trellm_register_vision_towers(register):
    register(SPEC)
    register(GLM5_NEXT_SPEC)
