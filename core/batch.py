"""ForwardBatch: the typed record every module receives.

Tokens of all sequences are concatenated along dim 0 (the varlen layout), so prefill chunks and
decode steps of different jobs share one forward pass. With a KV cache, each sequence also carries
its page list (a row of ``block_table``) and its total context length after this step.
"""
from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch


@attrs.define
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    cu_seqlens: torch.Tensor  # [B+1] int32, start of each sequence's new tokens in the flat layout
    logits_indices: torch.Tensor | None = None  # [L] token rows to compute logits for; None = all
    cache: Any = None  # a trellm.cache.KVCache or None (attention over the chunk only)
    block_table: torch.Tensor | None = None  # [B, max_pages] int32
    context_lens: torch.Tensor | None = None  # [B] int32: cached + new tokens per sequence
    slots: torch.Tensor | None = None  # [T] int64: flat cache slot (page * page_size + offset) of each token
    input_embeds: torch.Tensor | None = None  # [T, hidden] replaces the embedding lookup (multimodal)
    embed_mask: torch.Tensor | None = None  # [T] bool: rows of input_embeds to use; None = all rows
    max_seq_len: int = 0  # longest sequence (incl. cache) in the batch: dynamic RoPE variants read it
    state_slots: torch.Tensor | None = None  # [B] int64: recurrent-state slot of each sequence (hybrid models)
    cached_lens: torch.Tensor | None = None  # [B] int32: tokens already in the cache before this step

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @classmethod
    def no_cache(
        cls, sequences: Sequence[Sequence[int]], device: torch.device | str = "cpu", all_logits: bool = True
    ) -> "ForwardBatch":
        """A batch of whole sequences attending only to themselves (no KV cache)."""
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("every sequence needs at least one token")
        lens = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        pos = torch.cat([torch.arange(n, device=device) for n in lens])
        cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=device)
        last = None if all_logits else (cu[1:] - 1).long()
        return cls(input_ids=ids, positions=pos, cu_seqlens=cu, logits_indices=last, max_seq_len=max(lens))

    @classmethod
    def with_cache(
        cls,
        new_tokens: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        page_lists: Sequence[Sequence[int]],
        cache: Any,
        all_logits: bool = False,
        state_slots: Sequence[int] | None = None,
    ) -> "ForwardBatch":
        """New tokens of each sequence appended after ``cached_lens`` tokens already in ``cache``.

        ``state_slots``: each sequence's recurrent-state slot, for models with recurrent layers.
        """
        device = cache.device
        page_size = cache.page_size
        lens = [len(s) for s in new_tokens]
        ctx = [c + n for c, n in zip(cached_lens, lens)]
        for pages, total in zip(page_lists, ctx):
            if len(pages) * page_size < total:
                raise ValueError(f"sequence needs {total} cache slots but holds only {len(pages)} pages of {page_size}")
        positions = [p for c, n in zip(cached_lens, lens) for p in range(c, c + n)]
        slots = []
        for pages, c, n in zip(page_lists, cached_lens, lens):
            slots += [pages[p // page_size] * page_size + p % page_size for p in range(c, c + n)]
        width = max(1, max(len(p) for p in page_lists))
        table = torch.zeros(len(page_lists), width, dtype=torch.int32)
        for i, pages in enumerate(page_lists):
            table[i, : len(pages)] = torch.tensor(list(pages), dtype=torch.int32)
        cu = [0] + list(_cumsum(lens))
        last = None if all_logits else torch.tensor([e - 1 for e in cu[1:]], dtype=torch.long, device=device)
        return cls(
            input_ids=torch.tensor([t for s in new_tokens for t in s], dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            logits_indices=last,
            cache=cache,
            block_table=table.to(device),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            max_seq_len=max(ctx) if ctx else 0,
            cached_lens=torch.tensor(list(cached_lens), dtype=torch.int32, device=device),
            state_slots=None if state_slots is None else torch.tensor(list(state_slots), dtype=torch.long, device=device),
        )


def _cumsum(xs: Sequence[int]):
    total = 0
    for x in xs:
        total += x
        yield total
