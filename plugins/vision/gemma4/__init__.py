"""Gemma 4 vision tower (``gemma4_vision``), the encoder-free embedder of Gemma 4 Unified
(``gemma4_unified_vision``) and their image processor.

Images keep their aspect ratio: resized (bicubic) to the largest size whose patches fit the budget of
``max_soft_tokens`` x pooling_kernel_size² patches with both sides multiples of patch x kernel, scaled to
[0, 1] and cut into patches (rows of pixels, channels last). The tower maps pixels to [-1, 1], projects each
patch and adds a learned embedding of its column and of its row; its layers are Gemma 4's sandwich-normed
blocks with q/k/v RMS-normed per head (v without a weight), softmax scale 1 and a 2D RoPE (the first half of
each head turns with the column, the second with the row), all patches of an image attending to each other.
The output is average-pooled over kernel x kernel patches, times sqrt(hidden), and optionally standardised
(``std_bias``, ``std_scale``). Linears may clamp their inputs and outputs to stored bounds
(``use_clipped_linears``).

The unified embedder has no layers: each kernel x kernel block of patches is one token, its pixels
LayerNorm-ed, projected (with bias) and LayerNorm-ed again, plus learned column and row embeddings, LayerNorm-ed.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F

import trellm
from trellm.sdk import (
    ConfigError,
    LayerNorm,
    Linear,
    LoadContext,
    Module,
    PixelSteps,
    RMSNorm,
    VisionTowerSpec,
    activation_fn,
    ops,
    rope_inv_freq,
)

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


@attrs.frozen
class Gemma4ImageProcessor:
    """PIL image -> (patches [N, 3 * patch²] in [0, 1], the (rows, columns) of its patch grid); ``merged``: one
    patch per kernel x kernel block (the unified embedder's tokens)."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280
    steps: PixelSteps = PixelSteps(resample=3, do_normalize=False)
    merged: bool = False

    @classmethod
    def from_config(cls, cfg: dict[str, Any], vision_config: dict[str, Any], merged: bool = False) -> "Gemma4ImageProcessor":
        budget = int(cfg.get("max_soft_tokens", 280))
        if budget not in SOFT_TOKEN_BUDGETS:
            raise ConfigError(f"preprocessor_config.json: max_soft_tokens={budget}; must be one of {SOFT_TOKEN_BUDGETS}")
        steps = PixelSteps.from_config({"resample": 3, "do_normalize": False, **cfg})
        return cls(int(cfg.get("patch_size", vision_config.get("patch_size", 16))),
                   int(cfg.get("pooling_kernel_size", vision_config.get("pooling_kernel_size", 3))), budget, steps, merged)

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """The largest (height, width) within the patch budget, both multiples of patch x kernel, aspect kept."""
        max_patches = self.max_soft_tokens * self.pooling_kernel_size**2
        side = self.pooling_kernel_size * self.patch_size
        factor = math.sqrt(max_patches * self.patch_size**2 / (height * width))
        h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
        longest = (max_patches // self.pooling_kernel_size**2) * side
        if h == 0 and w == 0:
            raise ConfigError(f"an image of {width}x{height} pixels cannot be resized to whole {side}-pixel tiles")
        if h == 0:
            h, w = side, min(int(math.floor(width / height)) * side, longest)
        elif w == 0:
            h, w = min(int(math.floor(height / width)) * side, longest), side
        return h, w

    def __call__(self, img) -> tuple[torch.Tensor, tuple[int, int]]:
        h, w = self.target_size(img.height, img.width)
        x = self.steps.to_array(self.steps.resize(img, h, w))  # [3, H, W]
        p = self.patch_size * (self.pooling_kernel_size if self.merged else 1)
        rows, cols = h // p, w // p
        patches = x.reshape(3, rows, p, cols, p).transpose(1, 3, 2, 4, 0).reshape(rows * cols, -1)
        return torch.from_numpy(np.ascontiguousarray(patches)), (rows, cols)


class ClippableLinear(Module):
    """``{key}.linear``, its input and output clamped to the stored ``{key}.input_min`` ... bounds when ``clipped``."""

    def __init__(self, key: str, in_features: int, out_features: int, clipped: bool):
        self.key, self.clipped = key, clipped
        self.linear = Linear(f"{key}.linear", in_features, out_features)
        self.bounds: tuple[float, float, float, float] | None = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        if self.clipped:
            names = ("input_min", "input_max", "output_min", "output_max")
            self.bounds = tuple(float(ctx.store.get(f"{self.key}.{n}", dtype=torch.float32).reshape(-1)[0]) for n in names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bounds is None:
            return self.linear(x)
        lo, hi, out_lo, out_hi = self.bounds
        return self.linear(x.clamp(lo, hi)).clamp(out_lo, out_hi)

    __call__ = forward


@attrs.frozen
class Gemma4VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    eps: float
    rope_theta: float
    activation: str
    clipped: bool
    standardize: bool

    @classmethod
    def from_hf(cls, v: dict[str, Any]) -> "Gemma4VisionConfig":
        heads = int(v.get("num_attention_heads", 12))
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"config.json: vision_config rope_type {rope.get('rope_type')!r}; the Gemma 4 tower uses 'axial'")
        return cls(
            hidden_size=int(v.get("hidden_size", 768)), intermediate_size=int(v.get("intermediate_size", 3072)),
            num_layers=int(v.get("num_hidden_layers", 16)), num_heads=heads,
            num_kv_heads=int(v.get("num_key_value_heads", heads)), head_dim=int(v.get("head_dim", 64)),
            patch_size=int(v.get("patch_size", 16)), pooling_kernel_size=int(v.get("pooling_kernel_size", 3)),
            position_embedding_size=int(v.get("position_embedding_size", 10240)), eps=float(v.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 100.0)), activation=str(v.get("hidden_activation", "gelu_pytorch_tanh")),
            clipped=bool(v.get("use_clipped_linears", False)), standardize=bool(v.get("standardize", False)),
        )


class VisionBlock(Module):
    """One encoder layer: sandwich norms, normed q/k/v with the 2D RoPE, scale 1, a gated MLP."""

    def __init__(self, key: str, c: Gemma4VisionConfig):
        self.key, self.c = key, c
        norm = lambda name, dim=c.hidden_size: RMSNorm(f"{key}.{name}", dim, c.eps)
        self.input_norm, self.post_attn_norm = norm("input_layernorm"), norm("post_attention_layernorm")
        self.pre_ff_norm, self.post_ff_norm = norm("pre_feedforward_layernorm"), norm("post_feedforward_layernorm")
        a, q_size, kv_size = f"{key}.self_attn", c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = ClippableLinear(f"{a}.q_proj", c.hidden_size, q_size, c.clipped)
        self.k_proj = ClippableLinear(f"{a}.k_proj", c.hidden_size, kv_size, c.clipped)
        self.v_proj = ClippableLinear(f"{a}.v_proj", c.hidden_size, kv_size, c.clipped)
        self.o_proj = ClippableLinear(f"{a}.o_proj", q_size, c.hidden_size, c.clipped)
        self.q_norm, self.k_norm = norm("self_attn.q_norm", c.head_dim), norm("self_attn.k_norm", c.head_dim)
        self.v_norm = RMSNorm(f"{a}.v_norm", c.head_dim, c.eps, has_weight=False)
        m = f"{key}.mlp"
        self.gate_proj = ClippableLinear(f"{m}.gate_proj", c.hidden_size, c.intermediate_size, c.clipped)
        self.up_proj = ClippableLinear(f"{m}.up_proj", c.hidden_size, c.intermediate_size, c.clipped)
        self.down_proj = ClippableLinear(f"{m}.down_proj", c.intermediate_size, c.hidden_size, c.clipped)
        self.act = activation_fn(c.activation)

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        c, n = self.c, x.shape[0]
        q = self.q_norm.forward(self.q_proj(x).view(n, c.num_heads, c.head_dim))
        k = self.k_norm.forward(self.k_proj(x).view(n, c.num_kv_heads, c.head_dim))
        v = self.v_norm.forward(self.v_proj(x).view(n, c.num_kv_heads, c.head_dim))
        q, k = rotate_2d(q, rope), rotate_2d(k, rope)
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0)
        return self.o_proj(o.transpose(0, 1).reshape(n, -1))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = x + self.post_attn_norm.forward(self.attention(self.input_norm.forward(x), rope))
        h = self.pre_ff_norm.forward(x)
        return x + self.post_ff_norm.forward(self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h)))


def rotate_2d(x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The first half of each head rotated by the column angles, the second half by the row angles."""
    cos_x, sin_x, cos_y, sin_y = rope
    half = x.shape[-1] // 2
    return torch.cat([ops.rotary_embedding(x[..., :half], cos_x, sin_x), ops.rotary_embedding(x[..., half:], cos_y, sin_y)], -1)


class Gemma4VisionTower(Module):
    """patches [N, 3 * patch²] of one image with its (rows, columns) grid -> pooled features [N / kernel², hidden]."""

    def __init__(self, vision_config: dict[str, Any], key: str):
        self.key = key
        self.c = c = Gemma4VisionConfig.from_hf(vision_config)
        self.input_proj = Linear(f"{key}.patch_embedder.input_proj", 3 * c.patch_size**2, c.hidden_size)
        self.blocks = [VisionBlock(f"{key}.encoder.layers.{i}", c) for i in range(c.num_layers)]
        self.inv_freq = rope_inv_freq(c.head_dim // 2, c.rope_theta)
        self.position_table = self.std_bias = self.std_scale = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        c, get = self.c, ctx.store.get
        self.position_table = get(f"{self.key}.patch_embedder.position_embedding_table",
                                  shape=(2, c.position_embedding_size, c.hidden_size), dtype=ctx.dtype, device=ctx.device)
        if c.standardize:
            self.std_bias = get(f"{self.key}.std_bias", shape=(c.hidden_size,), dtype=torch.float32, device=ctx.device)
            self.std_scale = get(f"{self.key}.std_scale", shape=(c.hidden_size,), dtype=torch.float32, device=ctx.device)

    def unload(self) -> None:
        super().unload()
        self.position_table = self.std_bias = self.std_scale = None

    def num_tokens(self, grid: tuple[int, int]) -> int:
        return grid[0] * grid[1] // self.c.pooling_kernel_size**2

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        c, (rows, cols) = self.c, grid
        if max(rows, cols) > c.position_embedding_size:
            raise ConfigError(f"an image of {rows}x{cols} patches exceeds the tower's {c.position_embedding_size} positions per side")
        dev = self.position_table.device
        ys, xs = torch.meshgrid(torch.arange(rows, device=dev), torch.arange(cols, device=dev), indexing="ij")
        xs, ys = xs.reshape(-1), ys.reshape(-1)
        x = self.input_proj(2 * (patches.to(dev, self.position_table.dtype) - 0.5))
        x = x + self.position_table[0][xs] + self.position_table[1][ys]
        fx, fy = xs[:, None].float() * self.inv_freq.to(dev), ys[:, None].float() * self.inv_freq.to(dev)
        rope = (fx.cos(), fx.sin(), fy.cos(), fy.sin())
        for block in self.blocks:
            x = block.forward(x, rope)
        k = c.pooling_kernel_size
        grid_x = x.float().T.reshape(1, c.hidden_size, rows, cols)
        pooled = F.avg_pool2d(grid_x, k).reshape(c.hidden_size, -1).T * c.hidden_size**0.5
        if c.standardize:
            pooled = (pooled - self.std_bias) * self.std_scale
        return pooled.to(x.dtype)


class Gemma4UnifiedEmbedder(Module):
    """merged patches [N, 3 * (kernel x patch)²] with their (rows, columns) grid -> tokens [N, mm_embed_dim]."""

    def __init__(self, vision_config: dict[str, Any], key: str):
        self.key = key
        width = int(vision_config.get("mm_embed_dim", 3840))
        side = int(vision_config.get("patch_size", 16)) * int(vision_config.get("pooling_kernel_size", 3))
        self.width, self.positions = width, int(vision_config.get("mm_posemb_size", 1120))
        self.patch_ln1 = LayerNorm(f"{key}.patch_ln1", 3 * side**2, 1e-5)
        self.patch_dense = Linear(f"{key}.patch_dense", 3 * side**2, width, bias=True)
        self.patch_ln2 = LayerNorm(f"{key}.patch_ln2", width, 1e-5)
        self.pos_norm = LayerNorm(f"{key}.pos_norm", width, 1e-5)
        self.pos_embedding = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        self.pos_embedding = ctx.store.get(f"{self.key}.pos_embedding", shape=(self.positions, 2, self.width),
                                           dtype=ctx.dtype, device=ctx.device)

    def unload(self) -> None:
        super().unload()
        self.pos_embedding = None

    def num_tokens(self, grid: tuple[int, int]) -> int:
        return grid[0] * grid[1]

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        rows, cols = grid
        if max(rows, cols) > self.positions:
            raise ConfigError(f"an image of {rows}x{cols} tokens exceeds the embedder's {self.positions} positions per side")
        x = self.patch_ln2.forward(self.patch_dense(self.patch_ln1.forward(patches.to(self.pos_embedding))))
        dev = self.pos_embedding.device
        ys, xs = torch.meshgrid(torch.arange(rows, device=dev), torch.arange(cols, device=dev), indexing="ij")
        return self.pos_norm.forward(x + self.pos_embedding[xs.reshape(-1), 0] + self.pos_embedding[ys.reshape(-1), 1])


SPEC = VisionTowerSpec(
    name="gemma4_vision",
    model_types=("gemma4_vision",),
    build=Gemma4VisionTower,
    description="Gemma 4 vision: aspect-kept patches, 2D RoPE, pooled soft tokens",
    processor=Gemma4ImageProcessor.from_config,
)
UNIFIED_SPEC = VisionTowerSpec(
    name="gemma4_unified_vision",
    model_types=("gemma4_unified_vision",),
    build=Gemma4UnifiedEmbedder,
    description="Gemma 4 Unified: encoder-free, one normed projection per kernel x kernel block of patches",
    processor=functools.partial(Gemma4ImageProcessor.from_config, merged=True),
)


@trellm.hookimpl
def trellm_register_vision_towers(register):
    register(SPEC)
    register(UNIFIED_SPEC)
