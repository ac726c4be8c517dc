"""The paged KV cache: fixed-size pages shared by all sequences, one page pool per attention layer.

Pages are handed out by a :class:`PageAllocator` with reference counts, so several sequences can
point at the same prefix pages. A cache layer (:class:`KVCacheLayer`) stores new keys/values at
flat slots and attends through the sequence's block table; quantized layers implement the same two
methods, so attention never knows how the cache stores its numbers.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .. import ops
from ..capabilities import MakesCacheLayer, implements, is_paged_layer, is_state_layer

DEFAULT_PAGE_SIZE = 256


class CacheFullError(RuntimeError):
    """No free page is left; callers wait for pages rather than crash."""


class PageAllocator:
    """Free list + reference counts over ``num_pages`` page ids."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"a cache needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(f"need {n} cache pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self.refcount[p] += 1

    def decref(self, pages: Sequence[int]) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        freed = []
        for p in pages:
            if self.refcount[p] <= 0:
                raise ValueError(f"page {p} released more often than it was taken")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)
                freed.append(p)
        return freed


class KVCacheLayer:
    """Unquantized pages [num_pages, page_size, num_kv_heads, head_dim] for K and for V."""

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, v_head_dim: int, dtype, device):
        self.k_pages = torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_pages = torch.zeros(num_pages, page_size, num_kv_heads, v_head_dim, dtype=dtype, device=device)

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        ops.write_kv_pages(k, v, self.k_pages, self.v_pages, slots)

    def attend(self, q: torch.Tensor, batch, scale: float, sliding_window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        return ops.paged_attention(
            q, self.k_pages, self.v_pages, batch.block_table, batch.cu_seqlens, batch.context_lens,
            scale, sliding_window, softcap, sinks,
        )

    def copy_page(self, src: int, dst: int) -> None:
        self.k_pages[dst].copy_(self.k_pages[src])
        self.v_pages[dst].copy_(self.v_pages[src])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_pages, self.v_pages))


class KVCache:
    """Page pools for every attention layer of a model plus the shared page allocator."""

    def __init__(self, layers: list, page_size: int, device: torch.device):
        self.layers = layers  # index = decoder layer index; None for layers without attention
        self.page_size = page_size
        self.device = torch.device(device)
        paged = [l for l in layers if is_paged_layer(l)]
        num_pages = paged[0].num_pages if paged else 1
        self.allocator = PageAllocator(num_pages)
        self._prefix = None
        self.made_with: dict | None = None  # KVCache.for_model's arguments, when it made this cache
        # (src, dst) recurrent-state slot copies not yet sent to the other tensor-parallel ranks (None: not logged)
        self.state_copies: list[tuple[int, int]] | None = None

    @classmethod
    def for_model(
        cls,
        model,
        max_tokens: int = 8192,
        page_size: int = DEFAULT_PAGE_SIZE,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        layer_factory=None,
    ) -> "KVCache":
        """A cache able to hold ``max_tokens`` tokens (rounded up to whole pages) for ``model``.

        ``layer_factory(num_pages, page_size, kv_heads, head_dim, v_head_dim, dtype, device)`` makes each
        layer; the default stores K/V unquantized in ``dtype``. Without ``device``, each layer goes where its
        decoder layer is (a layer split spreads them); the cache's own ``device`` (where batches are built) is
        the embedding's.
        """
        num_pages = max(1, -(-max_tokens // page_size))
        place = layer_placement(model, device)
        device = torch.device(device) if device is not None else model.embed.weight.device
        dtype = dtype or model.embed.weight.dtype
        factory = layer_factory or KVCacheLayer
        layers = []
        for i, attn in enumerate(model.attention_layers()):
            if attn is None:
                layers.append(None)
                continue
            heads, dim, vdim = attn.kv_shape()
            layer = factory(num_pages, page_size, heads, dim, vdim, dtype, place(i))
            layers.append(attn.cache_layer(layer) if implements(attn, MakesCacheLayer) else layer)
        cache = cls(layers, page_size, device)
        # how to make the same cache for another model of this shape (a tensor-parallel rank: its own heads)
        cache.made_with = dict(max_tokens=max_tokens, page_size=page_size, dtype=dtype, layer_factory=layer_factory)
        return cache

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def prefix_cache(self):
        """The :class:`~trellm.cache.prefix.PrefixCache` over this cache's pages (made on first use)."""
        if self._prefix is None:
            from .prefix import PrefixCache

            self._prefix = PrefixCache(self.allocator, self.page_size)
        return self._prefix

    def state_layers(self) -> list:
        """Layers holding per-sequence recurrent state (they offer ``alloc_slot``/``free_slot``)."""
        return [l for l in self.layers if is_state_layer(l)]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def nbytes(self) -> int:
        return sum(l.nbytes() for l in self.layers if l is not None)


def layer_placement(model, device: torch.device | str | None):
    """The device of cache layer ``i``: ``device`` when given, else decoder layer ``i``'s (``model.layer_split``),
    else the embedding's."""
    split = getattr(model, "layer_split", None)
    if device is None and split is not None:
        return split.layer_device
    fixed = torch.device(device) if device is not None else model.embed.weight.device
    return lambda i: fixed


class SequenceState:
    """One sequence's place in the cache: its pages and how many tokens they hold."""

    def __init__(self, cache: KVCache, with_state_slot: bool = False):
        self.cache = cache
        self.pages: list[int] = []
        self.length = 0
        # hybrid models: one recurrent-state slot in every layer that keeps state (None otherwise)
        self.state_slot: int | None = None
        if with_state_slot and any(is_state_layer(layer) for layer in cache.layers):
            from .recurrent import alloc_state_slot

            self.state_slot = alloc_state_slot(cache)

    def reserve(self, total_tokens: int) -> None:
        """Make sure the pages can hold ``total_tokens`` tokens (raises CacheFullError)."""
        need = self.cache.pages_for(total_tokens) - len(self.pages)
        if need > 0:
            self.pages += self.cache.allocator.alloc(need)

    def release(self) -> None:
        if self.pages:
            self.cache.allocator.decref(self.pages)
        self.pages, self.length = [], 0
        if self.state_slot is not None:
            from .recurrent import free_state_slot

            free_state_slot(self.cache, self.state_slot)
            self.state_slot = None
