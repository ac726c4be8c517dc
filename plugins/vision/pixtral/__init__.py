"""Pixtral vision tower (``pixtral``) and its image processor (Mistral 3, Pixtral).

Images keep their aspect ratio: scaled down to fit ``longest_edge`` when larger, then each side is
rounded up to a multiple of the token size (patch size times the merge size of the model using
the tower). The tower embeds patches with a convolution, normalises them (RMSNorm), rotates q/k
with a 2D RoPE (row frequencies and column frequencies taken alternately from one table) and
attends within each image; the output is the hidden state of every patch (no final norm), per layer.
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
    Linear,
    LoadContext,
    Module,
    PixelSteps,
    RMSNorm,
    VisionTowerSpec,
    attention_within_segments,
    ops,
    rope_2d,
    rope_inv_freq,
)



@attrs.frozen
class PixtralProcessor:
    """PIL image -> pixels [3, H, W] with H and W multiples of ``token_size``, at most ``longest_edge`` before rounding."""

    token_size: int
    longest_edge: int = 1024
    steps: PixelSteps = PixelSteps(resample=3, image_mean=CLIP_MEAN, image_std=CLIP_STD)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], vision_config: dict[str, Any], merge: int = 1) -> "PixtralProcessor":
        patch = cfg.get("patch_size") or vision_config.get("patch_size", 16)
        patch = int(patch["height"] if isinstance(patch, dict) else patch)
        size = cfg.get("size") or {}
        steps = PixelSteps.from_config({"resample": 3, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, **cfg})
        return cls(patch * merge, int(size.get("longest_edge", 1024)), steps)

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        t = self.token_size
        return -(-height // t) * t, -(-width // t) * t

    def __call__(self, img) -> torch.Tensor:
        h, w = self.target_size(img.size[1], img.size[0])
        return torch.from_numpy(self.steps.to_array(self.steps.resize(img, h, w)))


@attrs.frozen
class PixtralConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    patch_size: int
    num_channels: int = 3
    hidden_act: str = "gelu"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "PixtralConfig":
        try:
            heads = int(raw["num_attention_heads"])
            return cls(
                hidden_size=int(raw["hidden_size"]), intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=heads,
                head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads), patch_size=int(raw["patch_size"]),
                num_channels=int(raw.get("num_channels", 3)), hidden_act=str(raw.get("hidden_act", "gelu")),
                rope_theta=float((raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0))),
            )
        except KeyError as e:
            raise ConfigError(f"config.json: vision_config is missing {e.args[0]!r}") from None


class PixtralLayer(Module):
    def __init__(self, key: str, cfg: PixtralConfig):
        d, inner = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        self.key, self.num_heads, self.head_dim = key, cfg.num_attention_heads, cfg.head_dim
        self.attention_norm = RMSNorm(f"{key}.attention_norm", d, 1e-5)
        self.ffn_norm = RMSNorm(f"{key}.ffn_norm", d, 1e-5)
        self.q_proj = Linear(f"{key}.attention.q_proj", d, inner)
        self.k_proj = Linear(f"{key}.attention.k_proj", d, inner)
        self.v_proj = Linear(f"{key}.attention.v_proj", d, inner)
        self.o_proj = Linear(f"{key}.attention.o_proj", inner, d)
        self.feed_forward = GatedMLP(f"{key}.feed_forward", d, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        h = self.attention_norm.forward(x)
        heads = lambda t: t.view(n, self.num_heads, self.head_dim)  # noqa: E731
        q = ops.rotary_embedding(heads(self.q_proj(h)), cos, sin)
        k = ops.rotary_embedding(heads(self.k_proj(h)), cos, sin)
        v = heads(self.v_proj(h))
        out = attention_within_segments(q, k, v, lengths)  # each image attends to itself only
        x = x + self.o_proj(out.reshape(n, -1))
        return x + self.feed_forward.forward(self.ffn_norm.forward(x))


class PixtralVisionTower(Module):
    """pixels of each image [3, H, W] -> hidden states after every layer, patches of all images concatenated."""

    def __init__(self, key: str, cfg: PixtralConfig):
        self.key, self.cfg = key, cfg
        self.patch_weight = None
        self.ln_pre = RMSNorm(f"{key}.ln_pre", cfg.hidden_size, 1e-5)
        self.layers = [PixtralLayer(f"{key}.transformer.layers.{i}", cfg) for i in range(cfg.num_hidden_layers)]
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
        self.row_freq, self.col_freq = inv[0::2], inv[1::2]

    def load(self, ctx: LoadContext) -> None:
        c = self.cfg
        shape = (c.hidden_size, c.num_channels, c.patch_size, c.patch_size)
        self.patch_weight = ctx.store.get(f"{self.key}.patch_conv.weight", shape=shape, dtype=ctx.dtype, device=ctx.device)
        super().load(ctx)

    def unload(self) -> None:
        self.patch_weight = None
        super().unload()

    def forward(self, images: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """(hidden states [P, D] after the patch norm and after each layer, (rows, cols) of patches per image)."""
        p = self.cfg.patch_size
        w = self.patch_weight
        patches, grids, rows, cols = [], [], [], []
        for img in images:
            emb = F.conv2d(img[None].to(device=w.device, dtype=w.dtype), w, stride=p)[0]  # [D, gh, gw]
            gh, gw = emb.shape[1:]
            patches.append(emb.flatten(1).T)
            grids.append((gh, gw))
            rows.append(torch.arange(gh).repeat_interleave(gw))
            cols.append(torch.arange(gw).repeat(gh))
        x = self.ln_pre.forward(torch.cat(patches))
        positions = torch.stack([torch.cat(rows), torch.cat(cols)], dim=-1)
        cos, sin = rope_2d(positions, self.row_freq, self.col_freq, w.device)
        lengths = [gh * gw for gh, gw in grids]
        states = [x]
        for layer in self.layers:
            x = layer.forward(x, cos, sin, lengths)
            states.append(x)
        return states, grids


def build(vision_config: dict[str, Any], key: str) -> PixtralVisionTower:
    return PixtralVisionTower(key, PixtralConfig.from_hf(vision_config))


SPEC = VisionTowerSpec(
    name="pixtral",
    model_types=("pixtral",),
    build=build,
    processor=PixtralProcessor.from_config,
    description="Pixtral ViT: any aspect ratio, 2D RoPE, per-image attention",
)


@trellm.hookimpl
def trellm_register_vision_towers(register):
    register(SPEC)
