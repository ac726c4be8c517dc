"""GLM 4.1V / 4.5V vision tower (``glm4v_vision``) and its image processor.

Patches are cut and flattened as for Qwen-VL (dynamic resolution, merge-block order). The tower:
patch embedding, RMSNorm, a learned position table resampled bicubically to each image's grid
(added after the norm), 2D RoPE, full-attention RMSNorm blocks with a gated MLP, a final RMSNorm,
a strided convolution that merges each ``merge x merge`` block, and a projection + LayerNorm +
GELU + gated MLP merger.
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
class Glm4vVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    image_size: int
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    attention_bias: bool = False
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Glm4vVisionConfig":
        try:
            return cls(
                depth=int(raw["depth"]), hidden_size=int(raw["hidden_size"]), intermediate_size=int(raw["intermediate_size"]),
                num_heads=int(raw["num_heads"]), out_hidden_size=int(raw["out_hidden_size"]), image_size=int(raw["image_size"]),
                patch_size=int(raw.get("patch_size", 14)), spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
                temporal_patch_size=int(raw.get("temporal_patch_size", 2)), in_channels=int(raw.get("in_channels", 3)),
                attention_bias=bool(raw.get("attention_bias", False)), hidden_act=str(raw.get("hidden_act", "silu")),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=float((raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            )
        except KeyError as e:
            raise ConfigError(f"config.json: vision_config is missing {e.args[0]!r}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class Glm4vBlock(Module):
    """RMSNorm blocks: 2D-RoPE attention over the image (qkv bias per config, no proj bias), gated MLP of width out_hidden_size."""

    def __init__(self, key: str, cfg: Glm4vVisionConfig):
        d = cfg.hidden_size
        self.key, self.num_heads, self.head_dim = key, cfg.num_heads, cfg.head_dim
        self.norm1 = RMSNorm(f"{key}.norm1", d, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(f"{key}.norm2", d, cfg.rms_norm_eps)
        self.qkv = Linear(f"{key}.attn.qkv", d, 3 * d, cfg.attention_bias)
        self.proj = Linear(f"{key}.attn.proj", d, d, False)
        self.mlp = GatedMLP(f"{key}.mlp", d, cfg.out_hidden_size, cfg.hidden_act, False)

    forward = QwenVisionBlock.forward


class Glm4vVisionTower(Module):
    """patches [P, C * T * p * p] with grids (t, h, w) -> tokens [P / merge**2, out_hidden_size]."""

    def __init__(self, key: str, cfg: Glm4vVisionConfig):
        self.key, self.cfg = key, cfg
        self.patch_weight = self.patch_bias = self.pos_table = None
        self.downsample_weight = self.downsample_bias = None
        self.post_conv_layernorm = RMSNorm(f"{key}.post_conv_layernorm", cfg.hidden_size, cfg.rms_norm_eps)
        self.blocks = [Glm4vBlock(f"{key}.blocks.{i}", cfg) for i in range(cfg.depth)]
        self.post_layernorm = RMSNorm(f"{key}.post_layernorm", cfg.hidden_size, cfg.rms_norm_eps)
        out = cfg.out_hidden_size
        self.merger_proj = Linear(f"{key}.merger.proj", out, out, False)
        self.merger_norm = LayerNorm(f"{key}.merger.post_projection_norm", out, 1e-5)
        self.merger_mlp = GatedMLP(f"{key}.merger", out, cfg.intermediate_size, cfg.hidden_act, False)
        self.inv_freq = rope_inv_freq(cfg.head_dim // 2, cfg.rope_theta)
        self.side = cfg.image_size // cfg.patch_size

    def load(self, ctx: LoadContext) -> None:
        c, get, k = self.cfg, ctx.store.get, self.key
        kw = dict(dtype=ctx.dtype, device=ctx.device)
        self.patch_weight = get(f"{k}.patch_embed.proj.weight", shape=(c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size), **kw)
        self.patch_bias = get(f"{k}.patch_embed.proj.bias", shape=(c.hidden_size,), **kw)
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


def build(vision_config: dict[str, Any], key: str) -> Glm4vVisionTower:
    return Glm4vVisionTower(key, Glm4vVisionConfig.from_hf(vision_config))


SPEC = VisionTowerSpec(
    name="glm4v",
    model_types=("glm4v_vision", "glm4v_moe_vision"),
    build=build,
    processor=Glm4vProcessor.from_config,
    description="GLM 4.1V ViT: resampled learned positions + 2D RoPE, conv merge, gated merger",
)


@trellm.hookimpl
def trellm_register_vision_towers(register):
    register(SPEC)
