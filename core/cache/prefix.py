"""Prefix sharing: full cache pages found again by chained page hashes.

Page i of a sequence is named by ``hash(name of page i-1, token ids of page i)``, so a name stands
for the whole prefix up to the end of that page. A new job whose prompt starts with the same tokens
finds the same names and reuses those pages instead of prefilling them. Only full pages are shared
and a job never writes into a page it reuses (its first new token goes to a page of its own), so no
copy-on-write is needed.

The index keeps one reference on every page it names, so pages of finished jobs stay cached. When
the free list runs dry, :meth:`PrefixCache.alloc` evicts cached pages nobody else holds: least
recently used first and, among pages used at the same time, the deepest first, so the shared short
prefixes (system prompts) outlive the long tails hanging off them.

Hybrid models also need the recurrent state after a page's last token: the generator stores it in a
state slot and names it here (:meth:`PrefixCache.set_checkpoint`); the slot is handed back through
``free_checkpoint`` when its page is evicted or the checkpoint alone is dropped to make room.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterable, Sequence

import numpy as np

from . import CacheFullError, PageAllocator

ROOT_HASH = b"trellm-prefix-root"


def page_hashes(tokens: Sequence[int], page_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Chained names of the full pages of ``tokens`` (a trailing partial page gets no name)."""
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        chunk = np.asarray(tokens[start:start + page_size], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


class PrefixCache:
    """Maps page names to cached pages on top of a :class:`PageAllocator`; evicts LRU when short of pages."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.page_of: dict[bytes, int] = {}
        self.name_of: dict[int, bytes] = {}
        self.depth: dict[int, int] = {}
        self.last_used: dict[int, int] = {}
        self._clock = 0
        self.evictions = 0  # pages dropped to make room, for statistics
        self.checkpoint_of: dict[int, int] = {}  # page -> recurrent-state slot holding the state after it
        self.free_checkpoint: Callable[[int], None] | None = None  # hands a checkpoint slot back

    def __len__(self) -> int:
        return len(self.page_of)

    def _touch(self, page: int) -> None:
        self.last_used[page] = self._clock

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached prefix of ``names`` (touched as used; the caller increfs them)."""
        self._clock += 1
        pages = []
        for name in names:
            page = self.page_of.get(name)
            if page is None:
                break
            self._touch(page)
            pages.append(page)
        return pages

    def insert(self, name: bytes, page: int, depth: int) -> None:
        """Name a full page; the index takes a reference. A name already held keeps its page."""
        if name in self.page_of or page in self.name_of:
            return
        self.allocator.incref([page])
        self.page_of[name], self.name_of[page], self.depth[page] = page, name, depth
        self._touch(page)

    def evictable(self, excluding: Iterable[int] = ()) -> int:
        skip = set(excluding)
        return sum(1 for p in self.name_of if self.allocator.refcount[p] == 1 and p not in skip)

    def available(self, excluding: Iterable[int] = ()) -> int:
        """Pages an allocation could get: free ones plus cached ones only the index holds."""
        return self.allocator.free_pages + self.evictable(excluding)

    def evict(self, n: int) -> int:
        """Drop up to ``n`` cached pages that only the index holds; returns how many were freed."""
        candidates = [p for p in self.name_of if self.allocator.refcount[p] == 1]
        candidates.sort(key=lambda p: (self.last_used[p], -self.depth[p]))
        for page in candidates[:n]:
            self._drop(page)
            self.evictions += 1
        return min(n, len(candidates))

    def set_checkpoint(self, page: int, slot: int) -> bool:
        """Attach a state slot to a named page; False (the caller keeps the slot) when the page is not named or has one."""
        if page not in self.name_of or page in self.checkpoint_of:
            return False
        self.checkpoint_of[page] = slot
        return True

    def drop_checkpoint(self, excluding: Iterable[int | None] = ()) -> bool:
        """Hand back the slot of the least recently used checkpoint (its page stays cached); False when there is none."""
        skip = set(excluding)
        candidates = [p for p in self.checkpoint_of if p not in skip]
        if not candidates:
            return False
        page = min(candidates, key=lambda p: (self.last_used[p], -self.depth[p]))
        self._free_checkpoint(page)
        return True

    def _free_checkpoint(self, page: int) -> None:
        slot = self.checkpoint_of.pop(page, None)
        if slot is not None and self.free_checkpoint is not None:
            self.free_checkpoint(slot)

    def _drop(self, page: int) -> None:
        self._free_checkpoint(page)
        name = self.name_of.pop(page)
        del self.page_of[name], self.depth[page], self.last_used[page]
        self.allocator.decref([page])

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh pages, evicting cached ones as needed (raises CacheFullError when even that is not enough)."""
        short = n - self.allocator.free_pages
        if short > 0 and self.evict(short) < short:
            raise CacheFullError(f"need {n} cache pages, {self.allocator.free_pages} free of {self.allocator.num_pages} after eviction")
        return self.allocator.alloc(n)

    def clear(self) -> None:
        for page in list(self.name_of):
            self._drop(page)

    def verify(self, owners: Iterable[Sequence[int]]) -> None:
        """Check page accounting: every refcount equals its holders (sequences + the index); the free list is exact."""
        alloc = self.allocator
        expected = [0] * alloc.num_pages
        for pages in owners:
            for p in pages:
                expected[p] += 1
        for p in self.name_of:
            expected[p] += 1
        problems = [f"page {p}: refcount {alloc.refcount[p]}, holders {e}" for p, e in enumerate(expected) if alloc.refcount[p] != e]
        free = list(alloc._free)
        if len(set(free)) != len(free):
            problems.append("free list holds a page twice")
        if set(free) != {p for p in range(alloc.num_pages) if alloc.refcount[p] == 0}:
            problems.append("free list differs from the pages with refcount 0")
        if problems:
            raise AssertionError("cache page accounting broken: " + "; ".join(problems[:10]))
