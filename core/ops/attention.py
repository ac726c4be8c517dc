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


def token_sequences(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each of the batch's ``tokens`` new tokens' sequence [T] (int64), found on the device (no host read, so a
    captured step may use it); a token past ``cu_seqlens[-1]`` gets B, the number of sequences."""
    return _sequence_of(torch.arange(tokens, device=cu_seqlens.device), cu_seqlens)


def token_indices(cu_seqlens: torch.Tensor, tokens: int,
                  context_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each new token's sequence [T], its index in that sequence [T]), on the device: a sequence's new tokens
    are the last of its ``context_lens[b]`` tokens (None, a batch without a cache: they are the whole sequence).
    Counted from the sequence's first token, not read from positions (M-RoPE packs those)."""
    rows = torch.arange(tokens, device=cu_seqlens.device)
    seq = _sequence_of(rows, cu_seqlens)
    ends = cu_seqlens[1:].long()[seq]
    total = ends - cu_seqlens[:-1].long()[seq] if context_lens is None else context_lens.long()[seq]
    return seq, total - (ends - rows)


def _sequence_of(rows: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)


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
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence: q [Tq,Hq,D], k/v [Tk,Hkv,D] -> [Tq,Hq,Dv], float32 math; ``keep`` [Tq, Tk]: the only
    keys each query may see (sparse attention), on top of the causal and sliding masks."""
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
    if keep is not None:
        s = s.masked_fill(~keep[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(hq, 1, 1).expand(hq, tq, 1)
        s = torch.cat([s, sink], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vf).transpose(0, 1).to(q.dtype)


def _attend_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int, sliding_window: int,
                  softcap: float, sinks: torch.Tensor | None, causal: bool = True) -> torch.Tensor:
    """:func:`_attend` through torch's ``scaled_dot_product_attention`` (on CPU its flash kernel: the scores
    matrix is never stored, and a causal prefill computes half of it). Softcap and sinks take :func:`_attend`."""
    if softcap > 0 or sinks is not None:
        return _attend(q, k, v, scale, q_offset, sliding_window, softcap, sinks, causal)
    tq, tk = q.shape[0], k.shape[0]
    mask, top_left = None, False
    if causal and (sliding_window > 0 or (q_offset > 0 and tq > 1)):
        qpos = torch.arange(tq, device=q.device)[:, None] + q_offset
        kpos = torch.arange(tk, device=q.device)[None, :]
        mask = kpos <= qpos
        if sliding_window > 0:
            mask &= kpos > qpos - sliding_window
    elif causal:
        top_left = q_offset == 0 and tq > 1  # else one query at the end: it sees every key
    heads = lambda t: t.to(q.dtype).transpose(0, 1).unsqueeze(0)  # noqa: E731  [1, H, T, D] views, 4-D: the flash kernel
    y = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask,
                                                         is_causal=top_left, scale=scale, enable_gqa=True)
    return y[0].transpose(0, 1)


def _varlen(attend, q, k, v, cu_seqlens, scale, sliding_window, softcap, sinks, causal) -> torch.Tensor:
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a:b] = attend(q[a:b], k[a:b], v[a:b], scale, 0, sliding_window, softcap, sinks, causal)
    return out


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
    return _varlen(_attend, q, k, v, cu_seqlens, scale, sliding_window, softcap, sinks, causal)


@attention_varlen.register("cpu")
def _attention_varlen_cpu(q, k, v, cu_seqlens, scale=None, sliding_window=0, softcap=0.0, sinks=None, causal=True):
    return _varlen(_attend_fused, q, k, v, cu_seqlens, scale, sliding_window, softcap, sinks, causal)


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
    return _paged(_attend, q, k_pages, v_pages, block_table, cu_seqlens, context_lens, scale, sliding_window, softcap, sinks)


@paged_attention.register("cpu")
def _paged_attention_cpu(q, k_pages, v_pages, block_table, cu_seqlens, context_lens, scale=None, sliding_window=0,
                         softcap=0.0, sinks=None):
    return _paged(_attend_fused, q, k_pages, v_pages, block_table, cu_seqlens, context_lens, scale, sliding_window,
                  softcap, sinks)


def _paged(attend, q, k_pages, v_pages, block_table, cu_seqlens, context_lens, scale, sliding_window, softcap,
           sinks) -> torch.Tensor:
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = q.new_empty(q.shape[0], q.shape[1], v_pages.shape[-1])
    bounds = cu_seqlens.tolist()
    ctx = context_lens.tolist()
    for b, (s0, s1) in enumerate(zip(bounds[:-1], bounds[1:])):
        if s1 == s0:
            continue
        k = gather_pages(k_pages, block_table[b], ctx[b])
        v = gather_pages(v_pages, block_table[b], ctx[b])
        out[s0:s1] = attend(q[s0:s1], k, v, scale, ctx[b] - (s1 - s0), sliding_window, softcap, sinks)
    return out


def _head_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, unit_offset: bool) -> torch.Tensor:
    if weight is None:
        return x
    from .dense import rms_norm

    return rms_norm.reference(x, weight, eps, unit_offset)


@op
def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool = False,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    norm_unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [T, Hq, D] and k [T, Hkv, D] in one op, each head optionally RMS-normed first.

    ``cos_table``/``sin_table`` are the whole float32 tables [max_pos, rotary_dim/2]; each token's row
    is looked up at ``positions`` [T] inside the op, so a decode step needs no per-layer gather.
    ``q_norm``/``k_norm`` [D] are per-head RMSNorm weights (Qwen3 / Gemma 3 QK-norm), applied and
    rounded to the dtype before the rotation, as separate ops would.
    """
    from .dense import rotary_embedding

    cos, sin = cos_table[positions], sin_table[positions]
    q = _head_rms_norm(q, q_norm, norm_eps, norm_unit_offset)
    k = _head_rms_norm(k, k_norm, norm_eps, norm_unit_offset)
    return rotary_embedding.reference(q, cos, sin, interleaved), rotary_embedding.reference(k, cos, sin, interleaved)


@op
def rotary_qk_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slots: torch.Tensor,
    interleaved: bool = False,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    norm_unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_qk`, then the rotated keys and ``v`` stored at ``slots`` (as :func:`write_kv_pages`).

    One launch instead of four on the GPU (rotate q, rotate k, gather cos/sin, write the pages).
    Returns the rotated (q, k).
    """
    q, k = rotary_qk.reference(q, k, cos_table, sin_table, positions, interleaved, q_norm, k_norm, norm_eps, norm_unit_offset)
    write_kv_pages.reference(k, v, k_pages, v_pages, slots)
    return q, k
