"""Qwen2.5-VL (``qwen2_5_vl_vision``) and Qwen3-VL vision towers with the Qwen-VL image processor.

The Qwen2.5-VL tower and the processor are the Qwen-VL recipe in :mod:`trellm.sdk.qwen_vl` (GLM 4.1V
builds on them too); the Qwen3-VL tower below swaps RMSNorm / gated MLP blocks for LayerNorm / plain
MLP ones, adds resampled learned positions, and taps a few layers for DeepStack features.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

import trellm
from trellm.sdk import (
    MLP,
    ConfigError,
    LayerNorm,
    Linear,
    LoadContext,
    Module,
    QwenVisionBlock,
    QwenVisionConfig,
    QwenVisionTower,
    QwenVLProcessor,
    VisionTowerSpec,
    frame_lengths,
    rope_inv_freq,
)


class Qwen3VisionBlock(QwenVisionBlock):
    """Qwen3-VL block: LayerNorms, 2D-RoPE attention over the whole image, ungated MLP."""

    def __init__(self, key: str, cfg: QwenVisionConfig):
        d = cfg.hidden_size
        self.key, self.num_heads, self.head_dim = key, cfg.num_heads, cfg.head_dim
        self.norm1 = LayerNorm(f"{key}.norm1", d, 1e-6)
        self.norm2 = LayerNorm(f"{key}.norm2", d, 1e-6)
        self.qkv = Linear(f"{key}.attn.qkv", d, 3 * d, True)
        self.proj = Linear(f"{key}.attn.proj", d, d, True)
        self.mlp = MLP(f"{key}.mlp", d, cfg.intermediate_size, cfg.hidden_act, True, "linear_fc1", "linear_fc2")


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
    model_types=("qwen3_vl_vision", "qwen3_vl_moe_vision", "qwen3_5_vision", "qwen3_5_moe_vision", "qwen4_exp_vision"),
    build=build_qwen3,
    processor=QwenVLProcessor.from_config,
    description="Qwen3-VL ViT: resampled learned positions + 2D RoPE, full attention, deepstack features",
)


@trellm.hookimpl
def trellm_register_vision_towers(register):
    register(SPEC)
    register(QWEN3_SPEC)
