"""Qwen2.5-VL vision tower (``qwen2_5_vl_vision``) and the Qwen-VL image processor.

Dynamic resolution: each image is resized (keeping its aspect ratio) to multiples of
``patch_size * merge_size`` within [min_pixels, max_pixels], cut into patches and flattened in
merge-block order, each patch repeated ``temporal_patch_size`` times (an image is a one-frame video).
The tower embeds patches with one linear map, rotates q/k with a 2D RoPE (row, column), attends
inside windows of ``window_size`` pixels except in ``fullatt_block_indexes`` layers (whole image),
and the merger turns every ``merge_size ** 2`` neighbouring patches into one language-model token.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import attrs
import numpy as np
import torch
import torch.nn.functional as F

import trellm
from trellm.sdk import (
    MLP,
    ConfigError,
    GatedMLP,
    ImageError,
    LayerNorm,
    Linear,
    LoadContext,
    Module,
    PixelSteps,
    RMSNorm,
    VisionTowerSpec,
    ops,
)
from trellm.plugins.vision.common import CLIP_MEAN, CLIP_STD, attention_within_segments, frame_lengths, rope_2d, rope_inv_freq



# ---- image processor --------------------------------------------------------------------------------


def fit_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor`` with the pixel count brought into [min, max]."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image of {width}x{height} pixels: aspect ratio above 200 is not supported")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


@attrs.frozen
class QwenVLProcessor:
    """PIL image -> (flattened patches [gh * gw, C * T * p * p], grid (1, gh, gw))."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    steps: PixelSteps = PixelSteps(resample=3, image_mean=CLIP_MEAN, image_std=CLIP_STD)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], vision_config: dict[str, Any]) -> "QwenVLProcessor":
        size = cfg.get("size") or {}
        steps = PixelSteps.from_config({"resample": 3, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, **cfg})
        return cls(
            patch_size=int(cfg.get("patch_size") or vision_config.get("patch_size", 14)),
            merge_size=int(cfg.get("merge_size") or vision_config.get("spatial_merge_size", 2)),
            temporal_patch_size=int(cfg.get("temporal_patch_size") or vision_config.get("temporal_patch_size", 2)),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
            steps=steps,
        )

    def fit(self, height: int, width: int) -> tuple[int, int]:
        """The resized (height, width) of an image."""
        return fit_size(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def __call__(self, img) -> tuple[torch.Tensor, tuple[int, int, int]]:
        w0, h0 = img.size
        h, w = self.fit(h0, w0)
        x = self.steps.to_array(self.steps.resize(img, h, w))  # [C, h, w]
        p, m, c = self.patch_size, self.merge_size, x.shape[0]
        gh, gw = h // p, w // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # blocks, in-block, C, p, p
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], self.temporal_patch_size, p, p))
        return torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, -1)), (1, gh, gw)


# ---- tower ------------------------------------------------------------------------------------------


@attrs.frozen
class QwenVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "QwenVisionConfig":
        try:
            return cls(
                depth=int(raw["depth"]), hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]), num_heads=int(raw["num_heads"]),
                out_hidden_size=int(raw["out_hidden_size"]), patch_size=int(raw.get("patch_size", 14)),
                spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
                temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
                in_channels=int(raw.get("in_channels", raw.get("in_chans", 3))),
                window_size=int(raw.get("window_size", 112)),
                fullatt_block_indexes=tuple(int(i) for i in raw.get("fullatt_block_indexes") or ()),
                hidden_act=str(raw.get("hidden_act", "silu")),
                rope_theta=float((raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            )
        except KeyError as e:
            raise ConfigError(f"config.json: vision_config is missing {e.args[0]!r}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def patch_positions(grids: Sequence[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch [P, 2], patches listed in merge-block order as the processor flattens them."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        blocks = lambda g: g.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).reshape(-1)  # noqa: E731
        out.append(torch.stack([blocks(rows), blocks(cols)], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(grids: Sequence[tuple[int, int, int]], merge: int, units_per_window: int) -> tuple[torch.Tensor, list[int]]:
    """Merge units reordered window by window, and the window lengths (in merge units).

    A window is a ``units_per_window`` square of merge units (smaller at the right / bottom edge).
    """
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    base = 0
    for t, h, w in grids:
        lh, lw = h // merge, w // merge
        units = torch.arange(t * lh * lw).reshape(t, lh, lw) + base
        for frame in range(t):
            for r in range(0, lh, units_per_window):
                for c in range(0, lw, units_per_window):
                    win = units[frame, r: r + units_per_window, c: c + units_per_window].reshape(-1)
                    order.append(win)
                    lengths.append(win.numel())
        base += t * lh * lw
    return torch.cat(order), lengths


class QwenVisionBlock(Module):
    """x + proj(attn(norm1(x))) with 2D RoPE, then x + mlp(norm2(x)) (gated, with biases)."""

    def __init__(self, key: str, cfg: QwenVisionConfig):
        d = cfg.hidden_size
        self.key, self.num_heads, self.head_dim = key, cfg.num_heads, cfg.head_dim
        self.norm1 = RMSNorm(f"{key}.norm1", d, 1e-6)
        self.norm2 = RMSNorm(f"{key}.norm2", d, 1e-6)
        self.qkv = Linear(f"{key}.attn.qkv", d, 3 * d, True)
        self.proj = Linear(f"{key}.attn.proj", d, d, True)
        self.mlp = GatedMLP(f"{key}.mlp", d, cfg.intermediate_size, cfg.hidden_act, True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1.forward(x)).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = ops.rotary_embedding(q, cos, sin), ops.rotary_embedding(k, cos, sin)
        out = attention_within_segments(q, k, v, segments)  # attention stays inside each window (or image)
        x = x + self.proj(out.reshape(n, -1))
        return x + self.mlp.forward(self.norm2.forward(x))


class QwenVisionTower(Module):
    """patches [P, C * T * p * p] of images with grids (t, h, w) -> tokens [P / merge**2, out_hidden_size]."""

    def __init__(self, key: str, cfg: QwenVisionConfig):
        self.key, self.cfg = key, cfg
        self.patch_weight = None
        self.blocks = [QwenVisionBlock(f"{key}.blocks.{i}", cfg) for i in range(cfg.depth)]
        unit = cfg.hidden_size * cfg.spatial_merge_size**2
        self.merger_norm = RMSNorm(f"{key}.merger.ln_q", cfg.hidden_size, 1e-6)
        self.merger_fc1 = Linear(f"{key}.merger.mlp.0", unit, unit, True)
        self.merger_fc2 = Linear(f"{key}.merger.mlp.2", unit, cfg.out_hidden_size, True)
        self.inv_freq = rope_inv_freq(cfg.head_dim // 2, cfg.rope_theta)

    def load(self, ctx: LoadContext) -> None:
        c = self.cfg
        shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.patch_weight = ctx.store.get(f"{self.key}.patch_embed.proj.weight", shape=shape, dtype=ctx.dtype, device=ctx.device)
        super().load(ctx)

    def unload(self) -> None:
        self.patch_weight = None
        super().unload()

    def rope(self, grids) -> tuple[torch.Tensor, torch.Tensor]:
        """2D RoPE cos, sin of every patch, half the rotated dims per axis."""
        pos = patch_positions(grids, self.cfg.spatial_merge_size)
        return rope_2d(pos, self.inv_freq, self.inv_freq, self.patch_weight.device)

    def segments(self, grids) -> tuple[torch.Tensor, list[int], list[int]]:
        """Patch permutation into window order, window lengths and whole-image lengths (in patches)."""
        c = self.cfg
        unit = c.spatial_merge_size**2
        units_per_window = max(1, c.window_size // c.spatial_merge_size // c.patch_size)
        order, windows = window_order(grids, c.spatial_merge_size, units_per_window)
        perm = (order[:, None] * unit + torch.arange(unit)[None, :]).reshape(-1)
        return perm, [n * unit for n in windows], frame_lengths(grids)

    def blocks_forward(self, x: torch.Tensor, grids) -> tuple[torch.Tensor, torch.Tensor]:
        """Patch embedding and all blocks, in window order; returns (hidden, permutation)."""
        x = x.to(self.patch_weight.dtype) @ self.patch_weight.reshape(self.cfg.hidden_size, -1).T
        cos, sin = self.rope(grids)
        perm, windows, images = self.segments(grids)
        perm = perm.to(x.device)
        x, cos, sin = x[perm], cos[perm], sin[perm]
        for i, block in enumerate(self.blocks):
            x = block.forward(x, cos, sin, images if i in self.cfg.fullatt_block_indexes else windows)
        return x, perm

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        unit = self.cfg.spatial_merge_size**2
        h = self.merger_norm.forward(x).reshape(-1, unit * self.cfg.hidden_size)
        return self.merger_fc2(F.gelu(self.merger_fc1(h)))

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        x, perm = self.blocks_forward(patches.to(self.patch_weight.device), grids)
        merged = self.merge(x)
        unit = self.cfg.spatial_merge_size**2
        inverse = torch.argsort(perm.reshape(-1, unit)[:, 0] // unit)
        return merged[inverse]


class Qwen3VisionBlock(Module):
    """Qwen3-VL block: LayerNorms, 2D-RoPE attention over the whole image, ungated MLP."""

    def __init__(self, key: str, cfg: QwenVisionConfig):
        d = cfg.hidden_size
        self.key, self.num_heads, self.head_dim = key, cfg.num_heads, cfg.head_dim
        self.norm1 = LayerNorm(f"{key}.norm1", d, 1e-6)
        self.norm2 = LayerNorm(f"{key}.norm2", d, 1e-6)
        self.qkv = Linear(f"{key}.attn.qkv", d, 3 * d, True)
        self.proj = Linear(f"{key}.attn.proj", d, d, True)
        self.mlp = MLP(f"{key}.mlp", d, cfg.intermediate_size, cfg.hidden_act, True, "linear_fc1", "linear_fc2")

    forward = QwenVisionBlock.forward


class Qwen3Merger(Module):
    """norm -> fc1 -> GELU -> fc2 over each merge unit; the deepstack mergers norm after grouping."""

    def __init__(self, key: str, cfg: QwenVisionConfig, norm_after_grouping: bool):
        unit = cfg.hidden_size * cfg.spatial_merge_size**2
        self.key, self.unit, self.norm_after_grouping = key, unit, norm_after_grouping
        self.norm = LayerNorm(f"{key}.norm", unit if norm_after_grouping else cfg.hidden_size, 1e-6)
        self.linear_fc1 = Linear(f"{key}.linear_fc1", unit, unit, True)
        self.linear_fc2 = Linear(f"{key}.linear_fc2", unit, cfg.out_hidden_size, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm.forward(x.reshape(-1, self.unit)) if self.norm_after_grouping else self.norm.forward(x).reshape(-1, self.unit)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(Module):
    """Qwen3-VL tower: learned positions resampled to each grid plus 2D RoPE, full attention, deepstack taps.

    ``forward`` returns [P / merge**2, out_hidden_size * (1 + len(deepstack_visual_indexes))]: the
    merged tokens followed by the deepstack features of each tapped layer (added to the language
    model's hidden states after its first layers).
    """

    def __init__(self, key: str, cfg: QwenVisionConfig, num_positions: int, deepstack: tuple[int, ...]):
        self.key, self.cfg, self.deepstack = key, cfg, deepstack
        self.side = int(round(num_positions**0.5))
        if self.side * self.side != num_positions:
            raise ConfigError(f"config.json: vision_config.num_position_embeddings {num_positions} is not a square")
        self.patch_weight = self.patch_bias = self.pos_embed = None
        self.blocks = [Qwen3VisionBlock(f"{key}.blocks.{i}", cfg) for i in range(cfg.depth)]
        self.merger = Qwen3Merger(f"{key}.merger", cfg, False)
        self.deepstack_mergers = [Qwen3Merger(f"{key}.deepstack_merger_list.{i}", cfg, True) for i in range(len(deepstack))]
        self.inv_freq = rope_inv_freq(cfg.head_dim // 2, cfg.rope_theta)

    def load(self, ctx: LoadContext) -> None:
        c, get = self.cfg, ctx.store.get
        shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.patch_weight = get(f"{self.key}.patch_embed.proj.weight", shape=shape, dtype=ctx.dtype, device=ctx.device)
        self.patch_bias = get(f"{self.key}.patch_embed.proj.bias", shape=(c.hidden_size,), dtype=ctx.dtype, device=ctx.device)
        self.pos_embed = get(f"{self.key}.pos_embed.weight", shape=(self.side**2, c.hidden_size), dtype=ctx.dtype, device=ctx.device)
        super().load(ctx)

    def unload(self) -> None:
        self.patch_weight = self.patch_bias = self.pos_embed = None
        super().unload()

    rope = QwenVisionTower.rope

    def positions(self, grids) -> torch.Tensor:
        """The learned position table bilinearly resampled (corners aligned) to each grid, in merge-block order."""
        m, d = self.cfg.spatial_merge_size, self.cfg.hidden_size
        table = self.pos_embed.float().T.reshape(1, d, self.side, self.side)
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [d, h, w]
            grid = grid.reshape(d, h // m, m, w // m, m).permute(1, 3, 2, 4, 0).reshape(h * w, d)
            out.append(grid.repeat(t, 1))
        return torch.cat(out).to(self.pos_embed.dtype)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        w = self.patch_weight
        x = patches.to(device=w.device, dtype=w.dtype) @ w.reshape(self.cfg.hidden_size, -1).T + self.patch_bias
        x = x + self.positions(grids)
        cos, sin = self.rope(grids)
        images = frame_lengths(grids)
        taps = []
        for i, block in enumerate(self.blocks):
            x = block.forward(x, cos, sin, images)
            if i in self.deepstack:
                taps.append(self.deepstack_mergers[self.deepstack.index(i)].forward(x))
        return torch.cat([self.merger.forward(x)] + taps, dim=-1)


def build(vision_config: dict[str, Any], key: str) -> QwenVisionTower:
    return QwenVisionTower(key, QwenVisionConfig.from_hf(vision_config))


SPEC = VisionTowerSpec(
    name="qwen_vl",
    model_types=("qwen2_5_vl_vision", "qwen2_5_vl"),
    build=build,
    processor=QwenVLProcessor.from_config,
    description="Qwen2.5-VL ViT: dynamic resolution, 2D RoPE, window attention, 2x2 patch merger",
)


def build_qwen3(vision_config: dict[str, Any], key: str) -> Qwen3VisionTower:
    deepstack = tuple(int(i) for i in vision_config.get("deepstack_visual_indexes") or ())
    return Qwen3VisionTower(key, QwenVisionConfig.from_hf(vision_config), int(vision_config.get("num_position_embeddings", 2304)), deepstack)


QWEN3_SPEC = VisionTowerSpec(
    name="qwen3_vl",
    model_types=("qwen3_vl_vision", "qwen3_5_vision", "qwen3_5_moe_vision"),
    build=build_qwen3,
    processor=QwenVLProcessor.from_config,
    description="Qwen3-VL ViT: resampled learned positions + 2D RoPE, full attention, deepstack features",
)


@trellm.hookimpl
def trellm_register_vision_towers(register):
    register(SPEC)
    register(QWEN3_SPEC)
