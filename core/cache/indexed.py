"""A paged K/V layer that also keeps one extra row per token: a sparse-attention indexer's key (DSA), or a
compressor's inputs (DeepSeek V4's compressed attention).

The indexer scores all cached tokens at every step, and a compressor folds the tokens of each complete window,
so what they read lives in the cache beside the attention's own K/V (for MLA: the latent), in pages of
their own indexed by the same block table and slots. Sparse and compressed attention read K/V rows directly,
so the K/V layer must keep plain pages.
"""
from __future__ import annotations

import torch

from ..capabilities import has_dense_pages
from ..errors import ConfigError


def require_dense_pages(kv):
    """``kv`` itself when its K/V pages are plain tensors, which sparse attention reads directly; else a ConfigError."""
    if not has_dense_pages(kv):
        raise ConfigError(
            f"sparse attention (DSA) reads its selected K/V rows from plain pages; a {type(kv).__name__} "
            "cache cannot serve it: use an unquantized KV cache for this model"
        )
    return kv


class ExtraRowsKVCacheLayer:
    """``kv`` (an unquantized paged K/V layer) plus ``row_pages`` [num_pages, page_size, width]; with ``positions``,
    also ``position_pages`` [num_pages, page_size] int64: each token's position value (M-RoPE's packed one), for an
    indexer that rotates pooled cached keys at the position of their block's first token (Qwen 3.8)."""

    def __init__(self, kv, width: int, positions: bool = False):
        self.kv = require_dense_pages(kv)
        pages = kv.k_pages
        self.row_pages = torch.zeros(pages.shape[0], pages.shape[1], width, dtype=pages.dtype, device=pages.device)
        self.position_pages = torch.zeros(pages.shape[:2], dtype=torch.long, device=pages.device) if positions else None

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
        self.row_pages[dst].copy_(self.row_pages[src])
        if self.position_pages is not None:
            self.position_pages[dst].copy_(self.position_pages[src])

    def nbytes(self) -> int:
        extra = [self.row_pages] + ([self.position_pages] if self.position_pages is not None else [])
        return self.kv.nbytes() + sum(t.numel() * t.element_size() for t in extra)
