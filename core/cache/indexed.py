"""A paged K/V layer that also keeps one extra row per token (a sparse-attention indexer's key (DSA), or a
compressor's inputs (DeepSeek V4's compressed attention)) and, per window of ``rate`` tokens, the entry folded
from the window's rows once it is complete (a pooled indexer key, a compressed K/V entry).

Rows and entries live in pages of their own indexed by the attention's block table: token ``i`` of a sequence
sits at ``block_table[b, i // page_size]``, offset ``i % page_size``, and window ``w``'s entry at
``block_table[b, w * rate // page_size]``, offset ``(w * rate % page_size) // rate`` (the page of the window's
tokens; ``rate`` divides the page size, so a window never straddles two pages). A forward pass folds only the
windows of its new tokens (:func:`completed_windows`): a large prefill chunk those it completes, a cached batch
of few tokens (decode, a draft verification, a short chunk) each token's window, complete or not (no host read),
whatever the context. Prefix-shared pages carry
their entries with their tokens, and a window's entry is rewritten whenever its last token is (a rejected
draft's entry is overwritten when the sequence gets there again, and nothing reads it before: a sequence of
``n`` tokens reads its first ``n // rate`` entries). Sparse and compressed attention read K/V rows directly,
so the K/V layer must keep plain pages.
"""
from __future__ import annotations

from typing import Sequence

import attrs
import torch

from ..capabilities import has_dense_pages
from ..errors import ConfigError
from ..ops import attention
from ..ops.sparse import varlen_as_pages


def require_dense_pages(kv):
    """``kv`` itself when its K/V pages are plain tensors, which sparse attention reads directly; else a ConfigError."""
    if not has_dense_pages(kv):
        raise ConfigError(
            f"sparse attention (DSA) reads its selected K/V rows from plain pages; a {type(kv).__name__} "
            "cache cannot serve it: use an unquantized KV cache for this model"
        )
    return kv


@attrs.frozen
class WindowEntries:
    """One kind of per-window entry a layer caches: ``width`` values for each complete window of ``rate`` tokens,
    in ``dtype`` (None: the cache's)."""

    name: str
    rate: int
    width: int
    dtype: torch.dtype | None = None


@attrs.frozen
class CompletedWindows:
    """The windows of ``rate`` tokens a batch folds: each one's sequence ``seq`` [N], its window index in that
    sequence ``window`` [N] and a batch row of one of its tokens, ``end`` [N] (its last token's when it is
    complete). Every window a new token completes is among them; see :func:`completed_windows` for the others."""

    rate: int
    seq: torch.Tensor
    window: torch.Tensor
    end: torch.Tensor

    @property
    def count(self) -> int:
        return self.seq.shape[0]


def token_indices(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(each new token's sequence [T], its index in that sequence [T]) of ``batch``
    (:func:`trellm.ops.attention.token_indices`)."""
    return attention.token_indices(batch.cu_seqlens, batch.input_ids.shape[0],
                                   None if batch.cache is None else batch.context_lens)


FOLD_EVERY_TOKEN_MAX = 1 << 19  # values a cached batch may read to fold a window for each new token (1 MB in bf16)


def completed_windows(batch, rate: int, fold_values: int) -> CompletedWindows:
    """The windows of ``rate`` tokens whose last token is among ``batch``'s new tokens, found on the host.

    A cached batch whose tokens' folds read at most :data:`FOLD_EVERY_TOKEN_MAX` values (``fold_values``: what one
    window's fold reads; a decode step, a draft verification) takes no host read instead, so it can be captured in
    a CUDA graph: every new token's window is folded, complete or not. The tokens of one complete window all fold
    it from the same cached rows (the batch's were stored first) and write the same entry; an incomplete window's
    entry is written where nothing reads it before the window completes and is folded again."""
    seq, index = token_indices(batch)
    if batch.cache is not None and index.shape[0] * fold_values <= FOLD_EVERY_TOKEN_MAX:
        return CompletedWindows(rate, seq, index // rate, torch.arange(index.shape[0], device=index.device))
    end = torch.nonzero((index + 1) % rate == 0).flatten()
    return CompletedWindows(rate, seq[end], index[end] // rate, end)


def window_rows(windows: CompletedWindows, span: int, rows: torch.Tensor, batch,
                row_pages: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the ``span`` tokens ending each window's last token ([N, span, width]), and which exist
    ([N, span] bool: a span longer than the window reaches before the sequence start for its first windows).

    With a cache they are read from ``row_pages`` through the block table (they may come from earlier chunks);
    without one, from ``rows`` [T, width], this batch's (whole sequences)."""
    back = torch.arange(span - 1, -1, -1, device=windows.end.device)  # tokens before the last one
    index = (windows.window[:, None] + 1) * windows.rate - 1 - back  # [N, span] token index in its sequence
    valid = index >= 0
    index = index.clamp_min(0)
    if batch.cache is None:
        return rows[windows.end[:, None] - ((windows.window[:, None] + 1) * windows.rate - 1 - index)], valid
    page_size = row_pages.shape[1]
    slots = batch.block_table[windows.seq[:, None], index // page_size].long() * page_size + index % page_size
    return row_pages.view(-1, row_pages.shape[-1])[slots], valid


class EntryPages:
    """Pages [num_pages, page_size // rate, width] of one kind of window entry, under the tokens' block table."""

    def __init__(self, spec: WindowEntries, num_pages: int, page_size: int, dtype: torch.dtype, device):
        if spec.rate < 1 or page_size % spec.rate:
            raise ConfigError(f"cache page size {page_size} is not a multiple of {spec.rate}, the window of the "
                              f"{spec.name!r} entries a layer caches: use a page size that {spec.rate} divides")
        self.spec = spec
        self.pages = torch.zeros(num_pages, page_size // spec.rate, spec.width, dtype=spec.dtype or dtype, device=device)

    def store(self, values: torch.Tensor, windows: CompletedWindows, block_table: torch.Tensor) -> None:
        """Write ``values`` [N, width], the entries of ``windows``, at their slots."""
        per_page = self.pages.shape[1]
        pages = block_table[windows.seq, windows.window // per_page].long()
        self.pages[pages, windows.window % per_page] = values.to(self.pages.dtype)


class ExtraRowsKVCacheLayer:
    """``kv`` (an unquantized paged K/V layer) plus ``row_pages`` [num_pages, page_size, width]; with ``positions``,
    also ``position_pages`` [num_pages, page_size] int64: each token's position value (M-RoPE's packed one), for an
    indexer that rotates pooled cached keys at the position of their block's first token (Qwen 3.8); ``entries``:
    the window entries it keeps (:class:`EntryPages` in ``self.entries`` by name)."""

    def __init__(self, kv, width: int, positions: bool = False, entries: Sequence[WindowEntries] = ()):
        self.kv = require_dense_pages(kv)
        pages = kv.k_pages
        num_pages, page_size = pages.shape[:2]
        self.row_pages = torch.zeros(num_pages, page_size, width, dtype=pages.dtype, device=pages.device)
        self.position_pages = torch.zeros(pages.shape[:2], dtype=torch.long, device=pages.device) if positions else None
        self.entries = {spec.name: EntryPages(spec, num_pages, page_size, pages.dtype, pages.device) for spec in entries}

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def k_pages(self) -> torch.Tensor:
        return self.kv.k_pages

    @property
    def v_pages(self) -> torch.Tensor:
        return self.kv.v_pages

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.kv.store(k, v, slots)

    def store_rows(self, rows: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Write new tokens' rows [T, width] (and, in a layer keeping them, their ``positions`` [T]) at flat ``slots``."""
        self.row_pages.view(-1, self.row_pages.shape[-1])[slots] = rows.to(self.row_pages.dtype)
        if self.position_pages is not None:
            self.position_pages.view(-1)[slots] = positions

    def attend(self, q: torch.Tensor, batch, scale: float, sliding_window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        return self.kv.attend(q, batch, scale, sliding_window, softcap, sinks)

    def copy_page(self, src: int, dst: int) -> None:
        self.kv.copy_page(src, dst)
        for pages in self._extra():
            pages[dst].copy_(pages[src])

    def nbytes(self) -> int:
        return self.kv.nbytes() + sum(t.numel() * t.element_size() for t in self._extra())

    def _extra(self) -> list[torch.Tensor]:
        """Every per-page tensor beside the K/V pages."""
        positions = [self.position_pages] if self.position_pages is not None else []
        return [self.row_pages, *positions, *(e.pages for e in self.entries.values())]


def window_entry_pages(batch, layer_idx: int, name: str, windows: CompletedWindows,
                       values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every complete window's entry of each sequence as (pages [P, per_page, width], block table [B, n],
    entries per sequence [B] int32), given ``values`` [N, width], the entries of the windows this batch completes.

    With a cache they are stored in layer ``layer_idx``'s ``name`` entry pages, which hold the earlier ones, and
    read through the batch's block table; without one (whole sequences) they are all of them, as pages of one."""
    rate = windows.rate
    if batch.cache is None:
        counts = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]) // rate
        cu = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        return varlen_as_pages(values, cu)
    entries = batch.cache.layers[layer_idx].entries[name]
    if windows.count:
        entries.store(values, windows, batch.block_table)
    return entries.pages, batch.block_table, (batch.context_lens // rate).to(torch.int32)
