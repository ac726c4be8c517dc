"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): Qwen2 text with multimodal RoPE + the Qwen-VL tower.

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

from typing import Any, Sequence

import attrs
import torch

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    ConfigError,
    DecoderConfig,
    DecoderOptions,
    LoadContext,
    Module,
    MultimodalPrompt,
    VisionInput,
    VisionLanguageModel,
    build_decoder,
    image_digest,
    load_image_processor,
    read_vision_config,
    vision_tower_spec,
)
from trellm.plugins.architectures.qwen2 import read_config as read_qwen2_text

ALIASES = (
    ("model.", ("model.language_model.",)),
    ("visual.", ("model.visual.",)),
)
TEXT_OPTIONS = DecoderOptions(qkv_bias=True, o_bias=False)
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
class QwenVLConfig:
    text: DecoderConfig
    vision: dict[str, Any] = attrs.field(hash=False)
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, ...]

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size


def read_config(raw: dict, read_text=read_qwen2_text) -> QwenVLConfig:
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

    def __init__(self, cfg: QwenVLConfig, key: str):
        self.key = key
        self.spec, self.vision_config = vision_tower_spec(cfg.vision, "qwen2_5_vl_vision"), cfg.vision
        self.tower = self.spec.build(cfg.vision, key)
        self.processor = None

    def load(self, ctx: LoadContext) -> None:
        self.processor = load_image_processor(ctx.store.model_dir, self.spec, self.vision_config)
        super().load(ctx)


class QwenVisionLanguageModel(VisionLanguageModel):
    """Qwen-VL family glue: ``<|vision_start|><|image_pad|>*N<|vision_end|>`` and M-RoPE positions."""

    interleaved_sections = False
    text_options = TEXT_OPTIONS
    aliases = ALIASES
    vision_key = "visual"

    def __init__(self, cfg: QwenVLConfig):
        language = self.build_language(cfg)
        rotary_dim = int(cfg.text.head_dim * cfg.text.rope.partial_rotary_factor)
        rope = MRotaryEmbedding(rotary_dim, cfg.text.rope.theta, cfg.mrope_section, self.interleaved_sections,
                                self.text_options.rope_interleaved)
        for attn in language.attention_layers():
            if attn is not None:
                attn.rope = rope
        super().__init__(language, QwenVision(cfg, self.vision_key), self.aliases)
        self.vl_config = cfg
        self.image_token_id = self.marker_id = cfg.image_token_id
        self.merge = int(cfg.vision.get("spatial_merge_size", 2))

    def build_language(self, cfg: QwenVLConfig) -> Module:
        return build_decoder(cfg.text, self.text_options)

    def preprocess(self, image) -> VisionInput:
        patches, grid = self.image_processor()(image)
        return VisionInput(patches, patches.shape[0] // self.merge**2, image_digest(image), grid)

    def expansion_ids(self, item: VisionInput) -> list[int]:
        return [self.image_token_id] * item.num_tokens

    def expansion_text(self, item: VisionInput, tokenizer) -> str:
        return tokenizer.decode([self.image_token_id]) * item.num_tokens

    def encode(self, items: Sequence[VisionInput]) -> list[torch.Tensor]:
        feats = self.vision.tower.forward(torch.cat([it.pixels for it in items]), [it.grid for it in items])
        return list(feats.to(self.language.embed.weight.dtype).split([it.num_tokens for it in items]))

    def finish_prompt(self, prompt: MultimodalPrompt, items: Sequence[VisionInput]) -> None:
        thw = mrope_positions(prompt.input_ids, self.image_token_id, [it.grid for it in items], self.merge)
        prompt.extra["positions"] = pack_positions(thw)
        prompt.extra["position_delta"] = int(thw.max()) + 1 - len(prompt.input_ids) if len(prompt.input_ids) else 0


SPEC = ArchitectureSpec(
    name="qwen2_5_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    read_config=read_config,
    build=QwenVisionLanguageModel,
    description="Qwen2.5-VL: Qwen2 text with M-RoPE, dynamic-resolution windowed ViT",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
