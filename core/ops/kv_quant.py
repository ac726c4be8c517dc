"""Quantized KV cache numbers (exl3_format.md section 6): torch references.

Each token's flattened K (or V) vector is cut into groups of 32 values. A group is rotated by the
32-point Sylvester Hadamard matrix (scaled by 1/sqrt(32)), which spreads outliers over the group,
then quantized to ``bits`` on a midpoint grid against its absmax (stored as one fp16 scale per
group). Codes are packed in power-of-two bit planes: bits b split into planes of width 8/4/2/1
(7 -> 4,2,1), most significant bits first; a plane of width w takes w int32 words per group, value
j's w bits at bit offset j*w (little-endian across the plane's words).
"""
from __future__ import annotations

import functools
import math

import torch

from . import op

GROUP = 32


@functools.lru_cache(maxsize=None)
def _hadamard32(device: str) -> torch.Tensor:
    """The natural-order Sylvester Hadamard matrix of size 32 (entries +-1), float32."""
    h = torch.ones(1, 1)
    while h.shape[0] < GROUP:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


def bit_planes(bits: int) -> list[int]:
    """Plane widths for ``bits``, most significant plane first (7 -> [4, 2, 1])."""
    if not 2 <= bits <= 8:
        raise ValueError(f"KV cache bits must be in 2..8, got {bits}")
    planes, left = [], bits
    for w in (8, 4, 2, 1):
        if left >= w:
            planes.append(w)
            left -= w
    return planes


def _check_groups(x: torch.Tensor, what: str) -> None:
    if x.shape[-1] % GROUP:
        raise ValueError(f"{what}: last dim {x.shape[-1]} is not a multiple of {GROUP} (KV quantization groups)")


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes int64 [N, 32] in [0, 2^bits) -> int32 [N, bits] words."""
    words = []
    shift = bits
    for w in bit_planes(bits):
        shift -= w
        plane = (codes >> shift) & ((1 << w) - 1)  # [N, 32]
        per_word = GROUP // w
        plane = plane.view(-1, w, per_word) << (torch.arange(per_word, device=codes.device) * w)
        words.append(plane.sum(-1))  # [N, w], < 2^32
    packed = torch.cat(words, dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [N, bits] -> codes int64 [N, 32]."""
    words = words.long() & 0xFFFFFFFF
    codes = torch.zeros(words.shape[0], GROUP, dtype=torch.long, device=words.device)
    shift, col = bits, 0
    for w in bit_planes(bits):
        shift -= w
        per_word = GROUP // w
        plane = words[:, col:col + w, None] >> (torch.arange(per_word, device=words.device) * w)
        codes |= (plane & ((1 << w) - 1)).reshape(-1, GROUP) << shift
        col += w
    return codes


@op
def kv_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (D a multiple of 32) -> (packed int32 [T, D/32*bits], scales fp16 [T, D/32])."""
    _check_groups(x, "kv_quantize input")
    t, d = x.shape
    groups = x.float().reshape(-1, GROUP) @ _hadamard32(str(x.device)) / math.sqrt(GROUP)
    scale = groups.abs().amax(dim=-1, keepdim=True) + 1e-10
    scale = scale.half().float()  # quantize against the scale that is stored
    half = 1 << (bits - 1)
    codes = torch.clamp(torch.floor(groups / scale * half + half), 0, (1 << bits) - 1).long()
    return _pack(codes, bits).view(t, d // GROUP * bits), scale.half().view(t, d // GROUP)


@op
def kv_dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Inverse of :func:`kv_quantize`: (packed [T, D/32*bits], scales [T, D/32]) -> [T, D] in ``dtype``."""
    t, n_groups = scales.shape
    if packed.shape != (t, n_groups * bits):
        raise ValueError(f"kv_dequantize: packed shape {tuple(packed.shape)} does not match scales {tuple(scales.shape)} at {bits} bits")
    codes = _unpack(packed.reshape(-1, bits), bits).float()
    half = 1 << (bits - 1)
    groups = (codes - (half - 0.5)) * (scales.float().reshape(-1, 1) / (math.sqrt(GROUP) * half))
    return (groups @ _hadamard32(str(packed.device))).reshape(t, n_groups * GROUP).to(dtype)


@op
def kv_quantize_store(x: torch.Tensor, bits: int, packed_pages: torch.Tensor, scale_pages: torch.Tensor,
                      slots: torch.Tensor) -> None:
    """:func:`kv_quantize` of x [T, D] written in place to the flat cache rows ``slots`` (page * page_size +
    offset) of packed_pages [P, S, D/32*bits] and scale_pages [P, S, D/32]."""
    packed, scales = kv_quantize(x, bits)
    packed_pages.view(-1, packed_pages.shape[-1])[slots] = packed
    scale_pages.view(-1, scale_pages.shape[-1])[slots] = scales


@op
def kv_dequantize_pages(packed_pages: torch.Tensor, scale_pages: torch.Tensor, pages: torch.Tensor, bits: int,
                        dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The rows of cache pages ``pages`` (int [n]) dequantized: [n, page_size, D] in ``dtype``."""
    n, page_size = pages.shape[0], packed_pages.shape[1]
    rows = n * page_size
    out = kv_dequantize(packed_pages[pages].view(rows, -1), scale_pages[pages].view(rows, -1), bits, dtype)
    return out.view(n, page_size, -1)
