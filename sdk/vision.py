"""Pieces vision towers share: CLIP pixel statistics, 2D RoPE tables and per-image attention."""
from __future__ import annotations

import warnings
from typing import Sequence

import torch
import torch.nn.functional as F

from trellm.batch import ForwardBatch
from trellm.capabilities import has_dense_pages
from trellm.ops.attention import gather_pages

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


_warned_quantized = False


def attend_image_blocks(o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, layer,
                        scale: float, sliding_window: int = 0, softcap: float = 0.0, window_cuts_images: bool = True) -> None:
    """Recompute, in place, the rows of ``o`` [T, H, D] that are image rows (runs of ``batch.embed_mask``) so that
    each also sees the later rows of its own image (Gemma 3, Gemma 4's sliding layers); other pairs stay causal.

    ``q`` [T, H, D] and ``k``, ``v`` [T, Hkv, D] are the chunk's, q/k rotated; a sequence with a cached prefix
    reads its keys and values from the pages of the cache ``layer``. An image must arrive whole in one chunk.
    ``window_cuts_images``: the sliding window applies to pairs inside an image too (Gemma 3, Gemma 4); else only
    to causal pairs (Gemma 4 Unified).
    """
    global _warned_quantized
    bounds = batch.cu_seqlens.tolist()
    for b, (a, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        mask = batch.embed_mask[a:e]
        if not bool(mask.any()):
            continue
        offset = 0 if layer is None else int(batch.context_lens[b]) - (e - a)
        if offset == 0:
            keys, values = k[a:e], v[a:e]
        elif has_dense_pages(layer):
            keys = gather_pages(layer.k_pages, batch.block_table[b], offset + e - a)
            values = gather_pages(layer.v_pages, batch.block_table[b], offset + e - a)
        else:
            if not _warned_quantized:
                warnings.warn("image rows after a cached prefix in a quantized KV cache attend causally only")
                _warned_quantized = True
            continue
        o[a:e][mask] = _image_block_attention(q[a:e][mask], keys, values, mask, offset, scale, sliding_window, softcap,
                                              window_cuts_images)


def _image_block_attention(q, keys, values, mask, offset: int, scale: float, sliding_window: int, softcap: float,
                           window_cuts_images: bool) -> torch.Tensor:
    """Image-row queries over all keys of the sequence with the causal-or-same-image mask."""
    n = mask.shape[0]
    block = torch.full((offset + n,), -1, dtype=torch.long, device=mask.device)
    starts = mask & ~torch.cat([mask.new_zeros(1), mask[:-1]])
    block[offset:] = torch.where(mask, torch.cumsum(starts.long(), 0) - 1, -1)
    kpos = torch.arange(offset + n, device=mask.device)
    qpos = kpos[offset:][mask]
    qblock = block[offset:][mask]
    causal = kpos[None, :] <= qpos[:, None]
    same_image = block[None, :] == qblock[:, None]
    in_window = qpos[:, None] - kpos[None, :] < sliding_window if sliding_window > 0 else torch.ones_like(causal)
    allowed = ((causal | same_image) & in_window) if window_cuts_images else ((causal & in_window) | same_image)
    groups = q.shape[1] // keys.shape[1]
    kf = keys.float().transpose(0, 1).repeat_interleave(groups, 0)
    vf = values.float().transpose(0, 1).repeat_interleave(groups, 0)
    s = torch.matmul(q.float().transpose(0, 1), kf.transpose(1, 2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vf).transpose(0, 1).to(q.dtype)
