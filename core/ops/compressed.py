"""Compressed attention ops (DeepSeek V4): every ``rate`` tokens of a sequence fold into one compressed
key/value entry, a softmax-gated sum over the window; attention sees a sliding window of plain tokens plus
the compressed entries the query has passed (all of them, or an indexer's top k). Torch references."""
from __future__ import annotations

import torch

from . import op
from .attention import _attend, gather_pages


@op
def compress_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, rate: int, overlap: bool) -> torch.Tensor:
    """The entries [n, D] of one sequence's complete windows of ``rate`` tokens (``kv``, ``gate`` [S, C]),
    ``n = S // rate``, float32: entry w is ``sum_j softmax_j(gate_j + position_bias) * kv_j`` per feature
    over window w's tokens (C = D). ``overlap`` (C = 2D): entry w mixes window w's second halves with window
    w - 1's first halves, 2 * rate slots in one softmax (window -1 contributes nothing)."""
    n, width = kv.shape[0] // rate, kv.shape[-1]
    kv = kv[: n * rate].float().view(n, rate, width)
    gate = gate[: n * rate].float().view(n, rate, width) + position_bias.float()
    if overlap:
        d = kv.shape[-1] // 2
        prev_kv = torch.cat([kv.new_zeros(1, rate, d), kv[:-1, :, :d]])[:n]
        prev_gate = torch.cat([gate.new_full((1, rate, d), float("-inf")), gate[:-1, :, :d]])[:n]
        kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
        gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
    return (kv * gate.softmax(dim=1)).sum(dim=1)


@op
def compressed_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    entries: list[torch.Tensor],
    scale: float,
    sliding_window: int,
    rate: int,
    sinks: torch.Tensor | None = None,
    selection: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each new token over its sequence's last ``sliding_window`` tokens (K = V, one head in
    ``k_pages``) and the compressed entries ``entries[b]`` [n_b, D] it may see: entry w once the query is at
    or past its window's last token (``w < (pos + 1) // rate``), or, with ``selection`` [T, k], only the
    entries listed there (-1: none). ``sinks`` [H]: per-head logits that take softmax mass and give nothing."""
    out = q.new_empty(q.shape[0], q.shape[1], k_pages.shape[-1])
    bounds, ctx = cu_seqlens.tolist(), context_lens.tolist()
    page_size = k_pages.shape[1]
    for b, (s0, s1) in enumerate(zip(bounds[:-1], bounds[1:])):
        if s1 == s0:
            continue
        # only the pages holding some new token's window: a decode step reads ~sliding_window tokens, not the context
        first_page = max(0, ctx[b] - (s1 - s0) - sliding_window + 1) // page_size
        window = gather_pages(k_pages, block_table[b, first_page:], ctx[b] - first_page * page_size)
        kv = torch.cat([window, entries[b].to(k_pages.dtype)[:, None]])
        n = entries[b].shape[0]
        qpos = torch.arange(s1 - s0, device=q.device)[:, None] + ctx[b] - (s1 - s0)
        kpos = torch.arange(first_page * page_size, ctx[b], device=q.device)[None]
        keep_tokens = (kpos <= qpos) & (kpos > qpos - sliding_window)
        if selection is None:
            keep_entries = torch.arange(n, device=q.device)[None] < (qpos + 1) // rate
        else:
            chosen = selection[s0:s1]
            keep_entries = torch.zeros(s1 - s0, n + 1, dtype=torch.bool, device=q.device)
            keep_entries.scatter_(1, torch.where(chosen >= 0, chosen, n), True)
            keep_entries = keep_entries[:, :n]
        keep = torch.cat([keep_tokens, keep_entries], dim=1)
        out[s0:s1] = _attend(q[s0:s1], kv, kv, scale, 0, 0, 0.0, sinks, causal=False, keep=keep)
    return out
