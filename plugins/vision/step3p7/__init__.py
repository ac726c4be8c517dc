"""Step 3.7 Flash vision tower (``step3p7_vision``, vision_config ``step3p5_vision``) and its image processor.

Each image becomes one global view (resized to ``size``, a square) and, when it is large or elongated, local
crops: the image is resized so that its sides are whole multiples of a window chosen from its aspect ratio,
cut into windows row by row, and each window resized to ``patch_size`` (:meth:`Step3p7ImageProcessor.plan`).
Every view goes through the tower on its own: a bias-free patch convolution plus the learned position table
(bilinearly resized when the view is not the table's size), a LayerNorm, pre-norm layers with layer scale
(``ls_1``, ``ls_2``) whose attention rotates q/k with a 2D RoPE, and two stride-2 3x3 convolutions that halve
the grid twice and quadruple the width. All patches of a view attend to each other.

The 2D RoPE turns each head by ``head_dim / 2`` angles, the first half from the patch's column, the second
from its row, over the same frequencies. StepFun's checkpoints store q/k rows in interleaved pairs (what
transformers permutes into halves at load), so trellm rotates adjacent pairs of the stored rows.

Tensors as ``save_pretrained`` (and StepFun) write them: ``conv1``, ``positional_embedding``, ``ln_pre``,
``transformer.resblocks.{i}.{ln_1,attn.in_proj_weight,attn.in_proj_bias,attn.out_proj,ls_1.gamma,ln_2,
mlp.c_fc,mlp.c_proj,ls_2.gamma}``, ``vit_downsampler1``, ``vit_downsampler2``.
"""
from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import trellm
from trellm.sdk import (
    CLIP_MEAN,
    CLIP_STD,
    ConfigError,
    ImageError,
    LayerNorm,
    Linear,
    LoadContext,
    Module,
    PixelSteps,
    VisionTowerSpec,
    activation_fn,
    ops,
    rope_2d,
    rope_inv_freq,
)


@attrs.frozen
class CropPlan:
    """How one image is cut: the size its global view starts from, the size it is resized to before cutting
    (``crop_size``), the window side (0: no crops), the window grid, and whether it is first padded to a square."""

    view_size: tuple[int, int]  # (width, height)
    crop_size: tuple[int, int]  # (width, height)
    window: int
    rows: int
    cols: int
    pad_to_square: bool

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of crops; (0, 0) without crops."""
        return self.rows, self.cols


@attrs.frozen
class CroppedImage:
    """A preprocessed image: its global view [3, S, S] and its crops [n, 3, P, P] (n may be 0)."""

    global_view: torch.Tensor
    crops: torch.Tensor
    plan: CropPlan


@attrs.frozen
class Step3p7ImageProcessor:
    """PIL image -> :class:`CroppedImage`, as transformers' Step3p7ImageProcessor cuts and normalises it."""

    image_size: int = 728
    crop_size: int = 504
    max_image_size: int = 3024
    steps: PixelSteps = PixelSteps(image_mean=CLIP_MEAN, image_std=CLIP_STD)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], vision_config: dict[str, Any]) -> "Step3p7ImageProcessor":
        size = cfg.get("size") or {}
        side = int(size.get("height", 728))
        if int(size.get("width", side)) != side:
            raise ConfigError(f"preprocessor_config.json: size {size} must be square (height == width)")
        steps = PixelSteps.from_config({"resample": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, **cfg})
        return cls(side, int(cfg.get("patch_size", 504)), int(cfg.get("max_image_size", 3024)), steps)

    def plan(self, width: int, height: int) -> CropPlan:
        """Very small elongated images are padded to a square; images over ``max_image_size`` are scaled down. One
        that fits the global view is cut only when elongated (ratio > 1.5, windows of its short side); a larger one
        into ``crop_size`` windows, or short-side ones when very elongated (ratio > 4). Each side is then rounded
        to whole windows, up when the remainder is more than a fifth of a window."""
        given = f"{width}x{height}"
        pad = min(width, height) < 32 and max(width / height, height / width) > 4
        if pad:
            width = height = max(width, height)
        if max(width, height) > self.max_image_size:
            scale = self.max_image_size / max(width, height)
            width, height = int(width * scale), int(height * scale)
            if min(width, height) == 0:
                raise ImageError(f"an image of {given} pixels scaled down to fit {self.max_image_size} keeps no pixels "
                                 "across; its aspect ratio is too extreme")
        short, long = min(width, height), max(width, height)
        if long <= self.image_size:
            window = short if long / short > 1.5 else 0
        elif long / short > 4:
            window = min(short, self.crop_size)
        else:
            window = self.crop_size
        if window == 0:
            return CropPlan((width, height), (width, height), 0, 0, 0, pad)
        snap = lambda side: window * (side // window + (side % window > 0.2 * window)) if side >= window else side  # noqa: E731
        crop_w, crop_h = snap(width), snap(height)
        return CropPlan((width, height), (crop_w, crop_h), window, max(1, crop_h // window), max(1, crop_w // window), pad)

    def __call__(self, img) -> CroppedImage:
        plan = self.plan(img.width, img.height)
        if plan.pad_to_square:
            side = max(img.width, img.height)
            square = Image.new("RGB", (side, side))
            square.paste(img, (0, 0))
            img = square
        resize, s, c = self.steps.resize, self.image_size, self.crop_size
        view = resize(resize(img, plan.view_size[1], plan.view_size[0]), s, s)
        crops = []
        if plan.window:
            cut, w = resize(img, plan.crop_size[1], plan.crop_size[0]), plan.window
            for top in range(0, plan.crop_size[1], w):
                for left in range(0, plan.crop_size[0], w):
                    box = (left, top, min(left + w, cut.width), min(top + w, cut.height))
                    crops.append(self.steps.to_array(resize(cut.crop(box), c, c)))
        stacked = np.stack(crops) if crops else np.zeros((0, 3, c, c), dtype=np.float32)
        return CroppedImage(torch.from_numpy(self.steps.to_array(view)), torch.from_numpy(stacked), plan)


@attrs.frozen
class Step3p7VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int
    eps: float
    rope_theta: float
    activation: str

    @classmethod
    def from_hf(cls, v: dict[str, Any]) -> "Step3p7VisionConfig":
        """Transformers' keys, or StepFun's (``width``, ``layers``, ``heads``); the MLP is ``hidden * mlp_ratio`` wide
        (``intermediate_size`` is ignored, as transformers ignores it)."""
        hidden = int(v.get("hidden_size", v.get("width", 1536)))
        heads = int(v.get("num_attention_heads", v.get("heads", 16)))
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"config.json: vision_config rope_type {rope.get('rope_type')!r}; the Step 3.7 tower uses 'axial'")
        cfg = cls(
            hidden_size=hidden, intermediate_size=int(hidden * float(v.get("mlp_ratio", 8960 / 1536))),
            num_layers=int(v.get("num_hidden_layers", v.get("layers", 47))), num_heads=heads,
            patch_size=int(v.get("patch_size", 14)), image_size=int(v.get("image_size", 728)),
            eps=float(v.get("layer_norm_eps", 1e-5)), rope_theta=float(rope.get("rope_theta", 10000.0)),
            activation=str(v.get("hidden_act", "quick_gelu")),
        )
        if hidden % heads or (hidden // heads) % 4:
            raise ConfigError(f"config.json: vision_config hidden_size {hidden} / heads {heads} must give a head size "
                              "divisible by 4 (the 2D RoPE turns column and row pairs)")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class Step3p7VisionLayer(Module):
    """x + ls_1 * attn(ln_1(x)); x + ls_2 * c_proj(act(c_fc(ln_2(x)))), q/k/v from one fused in_proj."""

    def __init__(self, key: str, c: Step3p7VisionConfig):
        self.key, self.c = key, c
        d = c.hidden_size
        self.ln_1, self.ln_2 = LayerNorm(f"{key}.ln_1", d, c.eps), LayerNorm(f"{key}.ln_2", d, c.eps)
        self.out_proj = Linear(f"{key}.attn.out_proj", d, d, True)
        self.c_fc = Linear(f"{key}.mlp.c_fc", d, c.intermediate_size, True)
        self.c_proj = Linear(f"{key}.mlp.c_proj", c.intermediate_size, d, True)
        self.act = activation_fn(c.activation)
        self.in_proj_weight = self.in_proj_bias = self.ls_1 = self.ls_2 = None

    def load(self, ctx: LoadContext) -> None:
        d, get = self.c.hidden_size, ctx.store.get
        place = dict(dtype=ctx.dtype, device=ctx.device)
        self.in_proj_weight = get(f"{self.key}.attn.in_proj_weight", shape=(3 * d, d), **place)
        self.in_proj_bias = get(f"{self.key}.attn.in_proj_bias", shape=(3 * d,), **place)
        self.ls_1 = get(f"{self.key}.ls_1.gamma", shape=(d,), **place)
        self.ls_2 = get(f"{self.key}.ls_2.gamma", shape=(d,), **place)
        super().load(ctx)

    def unload(self) -> None:
        self.in_proj_weight = self.in_proj_bias = self.ls_1 = self.ls_2 = None
        super().unload()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [views, patches, hidden]; cos, sin [views * patches, head_dim / 2]."""
        n, p, d = x.shape
        heads, hd = self.c.num_heads, self.c.head_dim
        qkv = F.linear(self.ln_1.forward(x), self.in_proj_weight, self.in_proj_bias).view(n * p, 3, heads, hd)
        q, k = (ops.rotary_embedding(qkv[:, i], cos, sin, interleaved=True) for i in (0, 1))
        split = lambda t: t.reshape(n, p, heads, hd).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(split(q), split(k), split(qkv[:, 2]))
        x = x + self.ls_1 * self.out_proj(o.transpose(1, 2).reshape(n, p, d))
        return x + self.ls_2 * self.c_proj(self.act(self.c_fc(self.ln_2.forward(x))))


def _halved(side: int) -> int:
    """Grid side after one 3x3, stride-2, padding-1 convolution."""
    return (side + 1) // 2


class Step3p7VisionTower(Module):
    """views [N, 3, S, S] (one size per call) -> features [N, (S / patch / 4)², 4 * hidden], row-major."""

    def __init__(self, key: str, c: Step3p7VisionConfig):
        self.key, self.c = key, c
        self.ln_pre = LayerNorm(f"{key}.ln_pre", c.hidden_size, c.eps)
        self.layers = [Step3p7VisionLayer(f"{key}.transformer.resblocks.{i}", c) for i in range(c.num_layers)]
        self.inv_freq = rope_inv_freq(c.head_dim // 2, c.rope_theta)
        self.out_features = 4 * c.hidden_size
        self.table_side = c.image_size // c.patch_size
        self.conv1 = self.positional_embedding = None
        self.down1_weight = self.down1_bias = self.down2_weight = self.down2_bias = None

    def load(self, ctx: LoadContext) -> None:
        c, get, key = self.c, ctx.store.get, self.key
        place = dict(dtype=ctx.dtype, device=ctx.device)
        d = c.hidden_size
        self.conv1 = get(f"{key}.conv1.weight", shape=(d, 3, c.patch_size, c.patch_size), **place)
        self.positional_embedding = get(f"{key}.positional_embedding", shape=(self.table_side**2, d), **place)
        self.down1_weight = get(f"{key}.vit_downsampler1.weight", shape=(2 * d, d, 3, 3), **place)
        self.down1_bias = get(f"{key}.vit_downsampler1.bias", shape=(2 * d,), **place)
        self.down2_weight = get(f"{key}.vit_downsampler2.weight", shape=(4 * d, 2 * d, 3, 3), **place)
        self.down2_bias = get(f"{key}.vit_downsampler2.bias", shape=(4 * d,), **place)
        super().load(ctx)

    def unload(self) -> None:
        self.conv1 = self.positional_embedding = None
        self.down1_weight = self.down1_bias = self.down2_weight = self.down2_bias = None
        super().unload()

    def num_tokens(self, side: int) -> int:
        """Features of one square view ``side`` pixels wide."""
        return _halved(_halved(side // self.c.patch_size)) ** 2

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """The learned position table [rows * cols, hidden], bilinearly resized (corners not aligned) to the grid."""
        table, s = self.positional_embedding, self.table_side
        if (rows, cols) == (s, s):
            return table
        grid = table.float().T.reshape(1, -1, s, s)
        return F.interpolate(grid, size=(rows, cols), mode="bilinear", align_corners=False)[0].flatten(1).T.to(table.dtype)

    def rope(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [rows * cols, head_dim / 2] of the 2D RoPE: column angles, then row angles."""
        ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        return rope_2d(torch.stack([xs.reshape(-1), ys.reshape(-1)], -1), self.inv_freq, self.inv_freq, self.conv1.device)

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        c, w = self.c, self.conv1
        if views.dim() != 4 or views.shape[1] != 3 or views.shape[2] != views.shape[3]:
            raise ValueError(f"{self.key}: views of shape {list(views.shape)}, expected [N, 3, S, S]")
        x = F.conv2d(views.to(device=w.device, dtype=w.dtype), w, stride=c.patch_size)  # [N, D, g, g]
        n, d, rows, cols = x.shape
        x = self.ln_pre.forward(x.flatten(2).transpose(1, 2) + self.positions(rows, cols))
        cos, sin = self.rope(rows, cols)
        cos, sin = cos.repeat(n, 1), sin.repeat(n, 1)
        for layer in self.layers:
            x = layer.forward(x, cos, sin)
        grid = x.transpose(1, 2).reshape(n, d, rows, cols)
        grid = F.conv2d(grid, self.down1_weight, self.down1_bias, stride=2, padding=1)
        grid = F.conv2d(grid, self.down2_weight, self.down2_bias, stride=2, padding=1)
        return grid.flatten(2).transpose(1, 2)


def build(vision_config: dict[str, Any], key: str) -> Step3p7VisionTower:
    return Step3p7VisionTower(key, Step3p7VisionConfig.from_hf(vision_config))


SPEC = VisionTowerSpec(
    name="step3p7_vision",
    model_types=("step3p5_vision",),
    build=build,
    processor=Step3p7ImageProcessor.from_config,
    description="Step 3.7 ViT: global view + local crops, 2D RoPE, layer scale, two stride-2 convolutions",
)


@trellm.hookimpl
def trellm_register_vision_towers(register):
    register(SPEC)
