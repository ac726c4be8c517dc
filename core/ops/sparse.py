"""Sparse attention ops (DeepSeek Sparse Attention, DSA): a lightning indexer scores every cached token
for each query and keeps the top k; attention then runs over those tokens only. Torch references over the
paged layout of :mod:`trellm.ops.attention` (``cu_seqlens`` marks each sequence's new tokens, which are
the last of its ``context_lens[b]`` tokens); a batch without a cache is given as pages of one token
(:func:`varlen_as_pages`)."""
from __future__ import annotations

import torch

from . import op, route_from_env
from .attention import _attend, gather_pages, token_sequences


def varlen_as_pages(x: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cacheless varlen batch x [T, ...] seen as a paged one: (pages [T, 1, ...] of one token each, the
    block table [B, longest] listing each sequence's tokens, context lengths [B])."""
    bounds = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    table = torch.zeros(len(lens), max(lens, default=0), dtype=torch.int32, device=x.device)
    for b, (start, n) in enumerate(zip(bounds[:-1], lens)):
        table[b, :n] = torch.arange(start, start + n, dtype=torch.int32, device=x.device)
    return x.unsqueeze(1), table, torch.tensor(lens, dtype=torch.int32, device=x.device)


SPARSE_INDEX_ENV = "TRELLM_SPARSE_INDEX"
SPARSE_INDEX_ROUTES = ("reference", "kernel")


def sparse_index_route() -> str:
    """``TRELLM_SPARSE_INDEX``, how :func:`sparse_index_topk` scores the keys of a decode step or a draft
    verification on CUDA: "kernel" (default), the logits in one launch at any context (kernels_cuda/indexer.cu) and
    torch's top-k; "reference", the torch ops (sync-free up to ``INDEX_GATHER_MAX_PAIRS`` (token, key) pairs, so
    such steps capture in a CUDA graph; longer contexts loop over the sequences on the host). On the H200
    (2026-12-05, ``bench_indexer.py``) the kernel route is 1.7-4.7x the reference up to 4096 keys and 30-87x
    where the reference loops on the host."""
    return route_from_env(SPARSE_INDEX_ENV, SPARSE_INDEX_ROUTES, "kernel")


# (token, key slot) pairs up to which the torch reference scores every token against its whole block-table row at
# once ([T, W, D] keys gathered, [T, H, W] scores): batch 64 at 4096 keys, and any prefill of that size
INDEX_GATHER_MAX_PAIRS = 64 * 4096


@op
def sparse_index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    key_counts: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    scale: float,
    rate: int = 1,
) -> torch.Tensor:
    """The keys each query attends to: [T, topk] indices into its sequence's keys, -1 where fewer are visible.

    Sequence b has ``key_counts[b]`` keys in ``key_pages`` [pages, page_size, D] (through its block table row);
    key s scores ``sum_h weights[t, h] * relu(scale * q[t, h] . key[s])`` for query t (``q`` [T, H, D],
    ``weights`` [T, H]), float32. A key stands for ``rate`` tokens (1: one token; DeepSeek V4 indexes
    compressed windows) and is visible once the query at ``positions[t]`` has passed them all,
    ``s < (pos + 1) // rate``; the ``topk`` best visible keys are kept (all while there are no more; of equal
    scores the earlier key), in no promised order (callers use them as a set).

    Up to ``INDEX_GATHER_MAX_PAIRS`` (token, key slot) pairs, every token scores the whole width of the block table
    (:func:`index_logits`: no host read, so decode steps capture in a CUDA graph); a larger prefill scores each
    sequence's own keys in a loop (:func:`index_topk_by_sequence`).
    """
    if q.shape[0] * block_table.shape[1] * key_pages.shape[1] <= INDEX_GATHER_MAX_PAIRS:
        return top_visible(index_logits(q, weights, key_pages, block_table, cu_seqlens, key_counts, positions, scale, rate),
                           topk)
    return index_topk_by_sequence(q, weights, key_pages, block_table, cu_seqlens, key_counts, positions, topk, scale, rate)


def index_topk_by_sequence(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, block_table: torch.Tensor,
                           cu_seqlens: torch.Tensor, key_counts: torch.Tensor, positions: torch.Tensor, topk: int,
                           scale: float, rate: int = 1) -> torch.Tensor:
    """:func:`sparse_index_topk` one sequence at a time, over that sequence's own keys (host reads of
    ``cu_seqlens`` and ``key_counts``): a prefill's route."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    bounds, counts = cu_seqlens.tolist(), key_counts.tolist()
    for b, (s0, s1) in enumerate(zip(bounds[:-1], bounds[1:])):
        if s1 == s0 or counts[b] == 0:
            continue
        keys = gather_pages(key_pages, block_table[b], counts[b]).float()  # [S, D]
        scores = torch.relu(torch.einsum("thd,sd->ths", q[s0:s1].float(), keys) * scale)
        index = torch.einsum("th,ths->ts", weights[s0:s1].float(), scores)
        visible = (positions[s0:s1, None] + 1) // rate  # keys before this are visible
        out[s0:s1] = top_visible(index.masked_fill(torch.arange(counts[b], device=q.device)[None] >= visible,
                                                   float("-inf")), topk)
    return out


def index_logits(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, block_table: torch.Tensor,
                 cu_seqlens: torch.Tensor, key_counts: torch.Tensor, positions: torch.Tensor, scale: float,
                 rate: int = 1) -> torch.Tensor:
    """Every query's scores over the whole width ``W = block_table.shape[1] * page_size`` of its sequence's block
    table row: [T, W] float32, -inf where the query cannot see the key (``s >= (pos + 1) // rate``, or past its
    sequence's ``key_counts``). No host read and shapes that do not depend on the data (a CUDA graph captures it);
    the torch form of kernels_cuda/indexer.cu, gathering [T, W, D] keys."""
    t, page_size = q.shape[0], key_pages.shape[1]
    seq, visible = _visible_keys(cu_seqlens, key_counts, positions, rate, t)
    slot = torch.arange(block_table.shape[1] * page_size, device=q.device)
    seen = slot[None] < visible[:, None]  # [T, W]
    pages = torch.where(seen, block_table[seq[:, None], slot // page_size].long(), 0)  # unseen slots read page 0
    keys = key_pages[pages, slot % page_size].float()  # [T, W, D]
    scores = torch.relu(torch.einsum("thd,twd->thw", q.float(), keys) * scale)
    return torch.einsum("th,thw->tw", weights.float(), scores).masked_fill(~seen, float("-inf"))


def _visible_keys(cu_seqlens: torch.Tensor, key_counts: torch.Tensor, positions: torch.Tensor, rate: int,
                  tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's sequence [T], how many of its sequence's keys it sees [T]), on the device; a token past
    ``cu_seqlens[-1]`` sees none."""
    batch = cu_seqlens.shape[0] - 1
    seq = token_sequences(cu_seqlens, tokens)
    inside = seq < batch
    seq = seq.clamp_max(max(batch - 1, 0))
    counts = key_counts.long()[seq] if batch else torch.zeros_like(seq)
    return seq, torch.where(inside, torch.minimum((positions.long() + 1) // rate, counts), 0)


def top_visible(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """The columns of each row's ``topk`` best finite logits (``logits`` [T, N] float32; -inf: not visible), -1 past
    the visible ones, in no set order. Of equal logits the earlier column wins, on every device and route: each
    logit becomes an int64 rank (its float order above, its column's reverse below), unique in its row, so torch's
    top-k has no tie to break its own way."""
    t, n = logits.shape
    out = torch.full((t, topk), -1, dtype=torch.long, device=logits.device)
    k = min(topk, n)
    if k == 0:
        return out
    bits = logits.float().contiguous().view(torch.int32).long()
    order = torch.where(bits < 0, -(2**31) - bits, bits)  # sorts as the floats do; -0.0 and 0.0 both 0
    rank = torch.add(torch.arange(n - 1, -1, -1, device=logits.device), order, alpha=2**32)
    chosen = rank.topk(k, dim=-1, sorted=False).indices
    out[:, :k] = torch.where(logits.gather(1, chosen) > float("-inf"), chosen, -1)
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
    -1: none; a position named twice counts once), as :func:`~trellm.ops.paged_attention` with every other
    token masked out; a token that names none reads zeros (a pooled indexer's query before its first whole
    pool, without its tail).

    A few tokens (decode, a draft verification) gather only the keys they name (:func:`_attend_chosen`: bytes
    and work grow with k, not with the context, and no host sync); a prefill chunk gathers each sequence's
    context once for all its tokens and masks."""
    if q.shape[0] * indices.shape[1] <= CHOSEN_MAX_PAIRS:
        return _attend_chosen(q, k_pages, v_pages, block_table, cu_seqlens, indices, scale)
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
        out[s0:s1][(chosen < 0).all(-1)] = 0
    return out


CHOSEN_MAX_PAIRS = 64 * 2048  # (token, chosen key) pairs up to which tokens gather their own keys: batch 64 at top-2048


def _attend_chosen(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                   cu_seqlens: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`sparse_paged_attention` with each token's named keys gathered from the pages ([T, k, Hkv, D]), float32
    math as ``_attend``'s: one batched softmax over every token's own keys."""
    t, hq, d = q.shape
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    seq = token_sequences(cu_seqlens, t)
    chosen, _ = indices.sort(dim=-1)  # a position named twice is masked after its first
    unseen = chosen < 0
    unseen[:, 1:] |= chosen[:, 1:] == chosen[:, :-1]
    pos = chosen.clamp_min(0)
    pages, offsets = block_table[seq[:, None], pos // page_size].long(), pos % page_size
    k = k_pages[pages, offsets].float()  # [T, k, Hkv, D]
    v = v_pages[pages, offsets].float()
    qg = q.float().view(t, hkv, hq // hkv, d)
    s = torch.einsum("thgd,tjhd->thgj", qg, k) * scale
    s = s.masked_fill(unseen[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(unseen.all(-1)[:, None, None, None], 0.0)  # a token naming none reads zeros
    out = torch.einsum("thgj,tjhd->thgd", p, v).reshape(t, hq, v.shape[-1])
    return out.to(q.dtype)
