"""Sparse attention ops (DeepSeek Sparse Attention, DSA): a lightning indexer scores every cached token
for each query and keeps the top k; attention then runs over those tokens only. Torch references over the
paged layout of :mod:`trellm.ops.attention` (``cu_seqlens`` marks each sequence's new tokens, which are
the last of its ``context_lens[b]`` tokens); a batch without a cache is given as pages of one token
(:func:`varlen_as_pages`)."""
from __future__ import annotations

import torch

from . import op
from .attention import _attend, gather_pages


def varlen_as_pages(x: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cacheless varlen batch x [T, ...] seen as a paged one: (pages [T, 1, ...] of one token each, the
    block table [B, longest] listing each sequence's tokens, context lengths [B])."""
    bounds = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    table = torch.zeros(len(lens), max(lens, default=0), dtype=torch.int32, device=x.device)
    for b, (start, n) in enumerate(zip(bounds[:-1], lens)):
        table[b, :n] = torch.arange(start, start + n, dtype=torch.int32, device=x.device)
    return x.unsqueeze(1), table, torch.tensor(lens, dtype=torch.int32, device=x.device)


@op
def sparse_index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """The tokens each query attends to: [T, topk] positions in its sequence, -1 where fewer are visible.

    Token s scores ``sum_h weights[t, h] * relu(scale * q[t, h] . key[s])`` for query t (``q`` [T, H, D],
    ``weights`` [T, H], ``key_pages`` [pages, page_size, D]), float32; the ``topk`` best among the tokens at
    or before the query's position are kept (all of them while there are no more than ``topk``).
    """
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    bounds, ctx = cu_seqlens.tolist(), context_lens.tolist()
    for b, (s0, s1) in enumerate(zip(bounds[:-1], bounds[1:])):
        if s1 == s0:
            continue
        keys = gather_pages(key_pages, block_table[b], ctx[b]).float()  # [S, D]
        scores = torch.relu(torch.einsum("thd,sd->ths", q[s0:s1].float(), keys) * scale)
        index = torch.einsum("th,ths->ts", weights[s0:s1].float(), scores)
        qpos = torch.arange(s1 - s0, device=q.device)[:, None] + ctx[b] - (s1 - s0)
        index = index.masked_fill(torch.arange(ctx[b], device=q.device)[None] > qpos, float("-inf"))
        k = min(topk, ctx[b])
        chosen = index.topk(k, dim=-1).indices
        out[s0:s1, :k] = torch.where(chosen <= qpos, chosen, -1)
    return out


@op
def sparse_paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each new token over the cached tokens ``indices`` [T, k] names (positions in its sequence,
    -1: none), as :func:`~trellm.ops.paged_attention` with every other token masked out."""
    out = q.new_empty(q.shape[0], q.shape[1], v_pages.shape[-1])
    bounds, ctx = cu_seqlens.tolist(), context_lens.tolist()
    for b, (s0, s1) in enumerate(zip(bounds[:-1], bounds[1:])):
        if s1 == s0:
            continue
        k = gather_pages(k_pages, block_table[b], ctx[b])
        v = gather_pages(v_pages, block_table[b], ctx[b])
        chosen = indices[s0:s1]
        keep = torch.zeros(s1 - s0, ctx[b] + 1, dtype=torch.bool, device=q.device)
        keep.scatter_(1, torch.where(chosen >= 0, chosen, ctx[b]), True)
        out[s0:s1] = _attend(q[s0:s1], k, v, scale, ctx[b] - (s1 - s0), 0, 0.0, None, keep=keep[:, :-1])
    return out
