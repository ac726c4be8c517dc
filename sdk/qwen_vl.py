"""The Qwen-VL recipe: image processor, ViT and M-RoPE language model, shared by Qwen2.5-VL,
Qwen3-VL, Qwen3.5 and Qwen 3.8 with images, GLM 4.1V and GLM 5.3.

Dynamic resolution: each image is resized (keeping its aspect ratio) to multiples of
``patch_size * merge_size`` within [min_pixels, max_pixels], cut into patches and flattened in
merge-block order, each patch repeated ``temporal_patch_size`` times (an image is a one-frame video).
The Qwen2.5-VL tower embeds patches with one linear map, rotates q/k with a 2D RoPE (row, column),
attends inside windows of ``window_size`` pixels except in ``fullatt_block_indexes`` layers (whole
image), and the merger turns every ``merge_size ** 2`` neighbouring patches into one language-model token.

Multimodal RoPE (M-RoPE): every token has three positions (time, row, column). Text tokens have
all three equal; the tokens of an image start at the running position p and take (p, p + row,
p + column) on the merged grid, after which the running position continues from p + max(rows,
columns). The rotary frequencies are split in ``mrope_section`` parts fed by the three positions.
Since generated tokens then sit at ``index + delta`` (delta = last position + 1 - prompt length),
:class:`~trellm.multimodal.MultimodalPrompt` carries the per-row positions of the prompt and the delta;
:func:`~trellm.multimodal.attach_images` writes them into ``batch.positions`` (image rows as packed
3D values, see :func:`pack_positions`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from trellm import ops
from trellm.config import DecoderConfig
from trellm.errors import ConfigError
from trellm.modules.base import LoadContext, Module
from trellm.modules.decoder import DecoderOptions, build_decoder
from trellm.modules.layers import GatedMLP, RMSNorm
from trellm.modules.linear import Linear
from trellm.multimodal import (
    ImageError,
    MultimodalPrompt,
    PixelSteps,
    VisionInput,
    VisionLanguageConfig,
    VisionLanguageModel,
    image_digest,
    load_image_processor,
    read_vision_config,
    vision_tower_spec,
)
from trellm.sdk.families import read_qwen2_config
from trellm.sdk.vision import CLIP_MEAN, CLIP_STD, attention_within_segments, frame_lengths, rope_2d, rope_inv_freq

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

    def canvas(self, img):
        """The PIL image the patches are cut from: ``img`` resized to :meth:`fit` (a multiple of patch * merge)."""
        w0, h0 = img.size
        h, w = self.fit(h0, w0)
        return self.steps.resize(img, h, w)

    def __call__(self, img) -> tuple[torch.Tensor, tuple[int, int, int]]:
        x = self.steps.to_array(self.canvas(img))  # [C, h, w]
        h, w = x.shape[1:]
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
    """x + proj(attn(norm1(x))) with 2D RoPE, then x + mlp(norm2(x)) (gated, with biases). A block that sets
    ``q_norm`` / ``k_norm`` norms each head's q and k before the RoPE (GLM 5.3)."""

    q_norm: Module | None = None
    k_norm: Module | None = None

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
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
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


# ---- language model: M-RoPE -------------------------------------------------------------------

QWEN_VL_ALIASES = (
    ("model.", ("model.language_model.",)),
    ("visual.", ("model.visual.",)),
)
QWEN_VL_TEXT_OPTIONS = DecoderOptions(qkv_bias=True, o_bias=False)
AXIS_BITS = 20  # packed positions: each of (t, h, w) below 2**20


def pack_positions(thw: torch.Tensor) -> torch.Tensor:
    """[3, L] (t, h, w) positions -> [L] int64: the plain position where all three agree, else a packed negative value."""
    t, h, w = thw.long()
    packed = -1 - (t | (h << AXIS_BITS) | (w << (2 * AXIS_BITS)))
    return torch.where((t == h) & (h == w), t, packed)


def unpack_positions(positions: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_positions`: [L] -> [3, L]."""
    v = -1 - positions
    mask = (1 << AXIS_BITS) - 1
    packed = torch.stack([v & mask, (v >> AXIS_BITS) & mask, v >> (2 * AXIS_BITS)])
    return torch.where(positions < 0, packed, positions.expand(3, -1))


class MRotaryEmbedding:
    """RoPE whose frequency bands read the time / row / column position (``sections`` bands each).

    ``interleaved_sections``: bands assigned t, h, w, t, h, w, ... (Qwen3-VL) instead of in blocks.
    Only the first ``rotary_dim`` dims of each head rotate (GLM 4.1V: half of them).
    Drop-in for :class:`trellm.modules.layers.RotaryEmbedding` (``cos_sin(positions, max_seq_len)``).
    """

    def __init__(self, rotary_dim: int, theta: float, sections: Sequence[int], interleaved_sections: bool = False,
                 interleaved: bool = False):
        half = rotary_dim // 2
        if sum(sections) != half:
            raise ConfigError(f"config.json: mrope_section {list(sections)} must add up to the rotary dim / 2 = {half}")
        self.interleaved = interleaved  # GPT-J pairing of dims (GLM) instead of NeoX halves
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        if interleaved_sections:
            axis = torch.zeros(half, dtype=torch.long)
            for a in (1, 2):
                axis[a: sections[a] * 3: 3] = a
        else:
            axis = torch.cat([torch.full((n,), a, dtype=torch.long) for a, n in enumerate(sections)])
        self.axis = axis  # which of (t, h, w) feeds each frequency band
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        dev = positions.device
        if dev not in self._on_device:  # copied once, before any CUDA-graph capture (which forbids copies)
            self._on_device[dev] = (self.axis.to(dev), self.inv_freq.to(dev))
        axis, inv_freq = self._on_device[dev]
        chosen = unpack_positions(positions).float()[axis]  # [half, L]: each band's position
        freqs = chosen.T * inv_freq
        return freqs.cos(), freqs.sin()


def mrope_positions(ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[3, L] M-RoPE positions of a prompt whose image runs follow ``grids`` in order."""
    out = torch.zeros(3, len(ids), dtype=torch.long)
    pos, i, k = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out[:, i] = pos
            pos, i = pos + 1, i + 1
            continue
        t, h, w = grids[k]
        lh, lw = h // merge, w // merge
        n = t * lh * lw
        grid_t = torch.arange(t).repeat_interleave(lh * lw)
        grid_h = torch.arange(lh).repeat_interleave(lw).repeat(t)
        grid_w = torch.arange(lw).repeat(t * lh)
        out[:, i: i + n] = torch.stack([grid_t, grid_h, grid_w]) + pos
        pos += max(lh, lw)
        i, k = i + n, k + 1
    return out


@attrs.frozen
class QwenVLConfig(VisionLanguageConfig):
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, ...]


def read_qwen_vl_config(raw: dict, read_text: Callable[[dict], DecoderConfig] = read_qwen2_config) -> QwenVLConfig:
    """The text config (read by ``read_text``), the vision config and the image / M-RoPE keys."""
    vision = read_vision_config(raw, raw.get("architectures", ["?"])[0])
    text = read_text(raw)
    tc = text.extra
    rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not section:
        raise ConfigError("config.json: text_config.rope_parameters.mrope_section is missing (multimodal RoPE bands)")
    return QwenVLConfig(
        text=text, vision=vision,
        image_token_id=int(raw.get("image_token_id", 151655)),
        vision_start_token_id=int(raw.get("vision_start_token_id", raw.get("image_start_token_id", 151652))),
        vision_end_token_id=int(raw.get("vision_end_token_id", raw.get("image_end_token_id", 151653))),
        mrope_section=tuple(int(s) for s in section),
    )


class QwenVision(Module):
    """The tower plus its image processor (read from the model directory at load)."""

    def __init__(self, vision_config: dict[str, Any], key: str):
        self.key = key
        self.spec, self.vision_config = vision_tower_spec(vision_config, "qwen2_5_vl_vision"), vision_config
        self.tower = self.spec.build(vision_config, key)
        self.processor = None

    def load(self, ctx: LoadContext) -> None:
        self.processor = load_image_processor(ctx.store.model_dir, self.spec, self.vision_config)
        super().load(ctx)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """Image tokens [P / merge**2, out_hidden_size] of the patches of images with these grids."""
        return self.tower.forward(patches, grids)


class QwenTowerLanguageModel(VisionLanguageModel):
    """A language model fed by the Qwen-VL tower over plain positions: each image marker becomes a run
    of image-pad tokens, one per merged patch block, whose embeddings are the tower's output."""

    def __init__(self, language: Module, vision: QwenVision, aliases: Sequence[tuple[str, Sequence[str]]], image_token_id: int):
        super().__init__(language, vision, aliases)
        self.image_token_id = self.marker_id = image_token_id
        self.merge = int(vision.vision_config.get("spatial_merge_size", 2))

    def preprocess(self, image) -> VisionInput:
        patches, grid = self.image_processor()(image)
        return VisionInput(patches, patches.shape[0] // self.merge**2, image_digest(image), grid)

    def expansion_ids(self, item: VisionInput) -> list[int]:
        return [self.image_token_id] * item.num_tokens

    def expansion_text(self, item: VisionInput, tokenizer) -> str:
        return tokenizer.decode([self.image_token_id]) * item.num_tokens

    def encode(self, items: Sequence[VisionInput]) -> list[torch.Tensor]:
        feats = self.vision.forward(torch.cat([it.pixels for it in items]), [it.grid for it in items])
        return list(feats.to(self.language.embed.weight.dtype).split([it.num_tokens for it in items]))


class QwenVisionLanguageModel(QwenTowerLanguageModel):
    """Qwen-VL family glue: ``<|vision_start|><|image_pad|>*N<|vision_end|>`` and M-RoPE positions."""

    interleaved_sections = False
    text_options = QWEN_VL_TEXT_OPTIONS
    aliases = QWEN_VL_ALIASES
    vision_key = "visual"

    def __init__(self, cfg: QwenVLConfig):
        language = self.build_language(cfg)
        rotary_dim = int(cfg.text.head_dim * cfg.text.rope.partial_rotary_factor)
        rope = MRotaryEmbedding(rotary_dim, cfg.text.rope.theta, cfg.mrope_section, self.interleaved_sections,
                                self.text_options.rope_interleaved)
        for attn in language.attention_layers():
            if attn is not None:
                attn.rope = rope
        super().__init__(language, QwenVision(cfg.vision, self.vision_key), self.aliases, cfg.image_token_id)
        self.vl_config = cfg

    def build_language(self, cfg: QwenVLConfig) -> Module:
        return build_decoder(cfg.text, self.text_options)

    def finish_prompt(self, prompt: MultimodalPrompt, items: Sequence[VisionInput]) -> None:
        thw = mrope_positions(prompt.input_ids, self.image_token_id, [it.grid for it in items], self.merge)
        prompt.own_positions = pack_positions(thw)
        prompt.position_delta = int(thw.max()) + 1 - len(prompt.input_ids) if len(prompt.input_ids) else 0

