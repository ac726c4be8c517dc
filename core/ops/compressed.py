"""Compressed attention ops (DeepSeek V4): every ``rate`` tokens of a sequence fold into one compressed
key/value entry, a softmax-gated sum over the window; attention sees a sliding window of plain tokens plus
the compressed entries the query has passed (all of them, or an indexer's top k). Torch references.

A window is folded once, when its last token arrives (:func:`fold_windows` over the rows of the windows a
batch completes); the entries then live in pages under the sequence's block table
(:class:`~trellm.cache.indexed.EntryPages`), where :func:`compressed_attention` reads them.
"""
from __future__ import annotations

import torch

from . import op
from .attention import _attend, gather_pages, token_indices


@op
def fold_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, overlap: bool) -> torch.Tensor:
    """The entries [N, D] of N windows of ``rate`` tokens from their rows ``kv``, ``gate`` [N, rate, C], float32:
    entry n is ``sum_j softmax_j(gate_j + position_bias_j) * kv_j`` per feature over its window's tokens (C = D,
    ``position_bias`` [rate, C]). ``overlap`` (C = 2D, rows [N, 2 * rate, C]: the window before, then the window):
    the first halves of the window before and the second halves of the window itself, 2 * rate slots in one
    softmax (a window before the sequence start has gate -inf: it contributes nothing)."""
    width = kv.shape[-1]
    bias = position_bias.float().repeat(2 if overlap else 1, 1)
    kv, gate = kv.float(), gate.float() + bias
    if overlap:
        rate, d = kv.shape[1] // 2, width // 2
        kv = torch.cat([kv[:, :rate, :d], kv[:, rate:, d:]], dim=1)
        gate = torch.cat([gate[:, :rate, :d], gate[:, rate:, d:]], dim=1)
    return (kv * gate.softmax(dim=1)).sum(dim=1)


@op
def compressed_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    entry_pages: torch.Tensor | None,
    entry_table: torch.Tensor | None,
    scale: float,
    sliding_window: int,
    rate: int,
    sinks: torch.Tensor | None = None,
    selection: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each new token over its sequence's last ``sliding_window`` tokens (K = V, one head in
    ``k_pages``) and the compressed entries it may see: sequence b's ``context_lens[b] // rate`` entries lie in
    ``entry_pages`` [P, per_page, D] through ``entry_table[b]`` (None: no entries, a sliding-window layer); entry
    w is seen once the query is at or past its window's last token (``w < (pos + 1) // rate``), or, with
    ``selection`` [T, k], only the entries listed there (-1: none), and then only those are read. ``sinks`` [H]:
    per-head logits that take softmax mass and give nothing.

    A few tokens (decode, a draft verification: up to :data:`WINDOW_ENTRIES_MAX_PAIRS` (token, key) pairs) gather
    their own window and entries without reading anything on the host (:func:`_attend_window_entries`); a
    prefill chunk gathers each sequence's window pages and entries once for all its tokens and masks."""
    entry_slots = 0 if entry_pages is None else (
        selection.shape[1] if selection is not None else entry_table.shape[1] * entry_pages.shape[1])
    if q.shape[0] * (sliding_window + entry_slots) <= WINDOW_ENTRIES_MAX_PAIRS:
        return _attend_window_entries(q, k_pages, block_table, cu_seqlens, context_lens, entry_pages, entry_table, scale,
                                      sliding_window, rate, sinks, selection)
    out = q.new_empty(q.shape[0], q.shape[1], k_pages.shape[-1])
    bounds, ctx = cu_seqlens.tolist(), context_lens.tolist()
    page_size = k_pages.shape[1]
    for b, (s0, s1) in enumerate(zip(bounds[:-1], bounds[1:])):
        if s1 == s0:
            continue
        # only the pages holding some new token's window: a decode step reads ~sliding_window tokens, not the context
        first_page = max(0, ctx[b] - (s1 - s0) - sliding_window + 1) // page_size
        window = gather_pages(k_pages, block_table[b, first_page:], ctx[b] - first_page * page_size)
        qpos = torch.arange(s1 - s0, device=q.device)[:, None] + ctx[b] - (s1 - s0)
        kpos = torch.arange(first_page * page_size, ctx[b], device=q.device)[None]
        keep_tokens = (kpos <= qpos) & (kpos > qpos - sliding_window)
        if entry_pages is None:
            out[s0:s1] = _attend(q[s0:s1], window, window, scale, 0, 0, 0.0, sinks, causal=False, keep=keep_tokens)
            continue
        if selection is None:
            n = ctx[b] // rate
            entries = gather_pages(entry_pages, entry_table[b], n)
            keep_entries = torch.arange(n, device=q.device)[None] < (qpos + 1) // rate
        else:  # only the entries some token chose
            chosen = selection[s0:s1]
            picked = chosen[(chosen >= 0) & (chosen < ctx[b] // rate)].unique()
            per_page = entry_pages.shape[1]
            entries = entry_pages[entry_table[b, picked // per_page].long(), picked % per_page]
            keep_entries = (chosen[:, :, None] == picked[None, None]).any(1)
        kv = torch.cat([window, entries.to(k_pages.dtype)[:, None]])
        keep = torch.cat([keep_tokens, keep_entries], dim=1)
        out[s0:s1] = _attend(q[s0:s1], kv, kv, scale, 0, 0, 0.0, sinks, causal=False, keep=keep)
    return out


WINDOW_ENTRIES_MAX_PAIRS = 64 * 2048  # (token, key) pairs up to which tokens gather their own window and entries (as DSA)


def _attend_window_entries(q: torch.Tensor, k_pages: torch.Tensor, block_table: torch.Tensor, cu_seqlens: torch.Tensor,
                           context_lens: torch.Tensor, entry_pages: torch.Tensor | None, entry_table: torch.Tensor | None,
                           scale: float, sliding_window: int, rate: int, sinks: torch.Tensor | None,
                           selection: torch.Tensor | None) -> torch.Tensor:
    """:func:`compressed_attention` with each token's keys gathered on their own, no host read: its window's
    ``sliding_window`` tokens (those before the sequence start masked), then its chosen entries (sorted, one
    named twice masked after the first) or every entry slot of its table row (masked to those it has passed);
    float32 math as ``_attend``'s, sinks included."""
    t = q.shape[0]
    page_size = k_pages.shape[1]
    seq, pos = token_indices(cu_seqlens, t, context_lens)  # each token's sequence and index in it
    kpos = pos[:, None] - torch.arange(sliding_window - 1, -1, -1, device=q.device)
    seen = kpos >= 0
    kpos = kpos.clamp_min(0)
    keys = k_pages[block_table[seq[:, None], kpos // page_size].long(), kpos % page_size, 0]  # [T, window, D]
    slots = 0 if entry_pages is None else entry_table.shape[1] * entry_pages.shape[1]
    if slots:  # (a batch without a cache whose sequences have no complete window has an empty entry table)
        per_page = entry_pages.shape[1]
        if selection is not None:
            chosen, _ = selection.sort(dim=-1)
            valid = (chosen >= 0) & (chosen < (context_lens.long()[seq] // rate)[:, None])
            valid[:, 1:] &= chosen[:, 1:] != chosen[:, :-1]
        else:
            chosen = torch.arange(slots, device=q.device)[None].expand(t, -1)
            valid = chosen < ((pos + 1) // rate)[:, None]
        chosen = chosen.clamp(0, slots - 1)
        entries = entry_pages[entry_table[seq[:, None], chosen // per_page].long(), chosen % per_page]
        keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
        seen = torch.cat([seen, valid], dim=1)
    kv = keys.float()
    s = torch.einsum("thd,tjd->thj", q.float(), kv) * scale
    s = s.masked_fill(~seen[:, None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, -1, 1).expand(t, -1, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("thj,tjd->thd", p, kv).to(q.dtype)
