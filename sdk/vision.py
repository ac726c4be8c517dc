"""Pieces vision towers share: CLIP pixel statistics, 2D RoPE tables and per-image attention."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """RoPE inverse frequencies of a ``dim``-wide rotation: theta ** (-2i / dim), i < dim / 2."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rope_2d(positions: torch.Tensor, row_freq: torch.Tensor, col_freq: torch.Tensor,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of a 2D RoPE on ``device``: row bands then column bands, from (row, col) ``positions`` [P, 2]."""
    pos = positions.float()
    freqs = torch.cat([pos[:, :1] * row_freq, pos[:, 1:] * col_freq], dim=-1)
    return freqs.cos().to(device), freqs.sin().to(device)


def frame_lengths(grids: Sequence[tuple[int, int, int]]) -> list[int]:
    """Patches per frame of each (t, h, w) grid, one entry per frame: the spans full attention stays inside."""
    return [h * w for t, h, w in grids for _ in range(t)]


def attention_within_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """q, k, v [N, heads, head_dim] -> [N, heads, head_dim], each run of ``lengths`` rows attending only to itself."""
    out = torch.empty_like(q)
    start = 0
    for length in lengths:
        sl = slice(start, start + length)
        out[sl] = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1)).transpose(0, 1)
        start += length
    return out
