"""Attention ops over ragged (varlen) batches and the paged KV cache: torch references.

Layout: tokens of all sequences are concatenated along dim 0; ``cu_seqlens`` [B+1] marks where
each sequence's new tokens start. With the paged cache, sequence b has ``context_lens[b]`` tokens
in total (cached + new), stored in pages listed by ``block_table[b]``; its new tokens are the last
ones, so query i of sequence b sits at absolute position ``context_lens[b] - q_len + i``.
"""
from __future__ import annotations

import math

import torch

from . import op


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_offset: int,
    sliding_window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    causal: bool = True,
) -> torch.Tensor:
    """One sequence: q [Tq,Hq,D], k/v [Tk,Hkv,D] -> [Tq,Hq,Dv], float32 math."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    groups = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq,Tq,D]
    kf = k.float().transpose(0, 1).repeat_interleave(groups, 0)
    vf = v.float().transpose(0, 1).repeat_interleave(groups, 0)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if causal:
        qpos = torch.arange(tq, device=q.device)[:, None] + q_offset
        kpos = torch.arange(tk, device=q.device)[None, :]
        mask = kpos > qpos
        if sliding_window > 0:
            mask |= kpos <= qpos - sliding_window
        s = s.masked_fill(mask[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(hq, 1, 1).expand(hq, tq, 1)
        s = torch.cat([s, sink], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vf).transpose(0, 1).to(q.dtype)


@op
def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Causal self-attention of each sequence over its own tokens (no cache)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a:b] = _attend(q[a:b], k[a:b], v[a:b], scale, 0, sliding_window, softcap, sinks, causal)
    return out


@op
def write_kv_pages(
    k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store new keys/values [T,Hkv,D] at flat slot indices (page * page_size + offset), in place."""
    pages, page_size = k_pages.shape[:2]
    k_pages.view(pages * page_size, *k_pages.shape[2:])[slots] = k.to(k_pages.dtype)
    v_pages.view(pages * page_size, *v_pages.shape[2:])[slots] = v.to(v_pages.dtype)


def gather_pages(pages: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous [length, ...] view of one sequence's cached rows."""
    page_size = pages.shape[1]
    n = (length + page_size - 1) // page_size
    return pages[block_row[:n].long()].flatten(0, 1)[:length]


@op
def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over each sequence's cached context (prefill chunks and decode)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = q.new_empty(q.shape[0], q.shape[1], v_pages.shape[-1])
    bounds = cu_seqlens.tolist()
    ctx = context_lens.tolist()
    for b, (s0, s1) in enumerate(zip(bounds[:-1], bounds[1:])):
        if s1 == s0:
            continue
        k = gather_pages(k_pages, block_table[b], ctx[b])
        v = gather_pages(v_pages, block_table[b], ctx[b])
        out[s0:s1] = _attend(q[s0:s1], k, v, scale, ctx[b] - (s1 - s0), sliding_window, softcap, sinks)
    return out
