"""Speculative decoding: proposers guess the next tokens; the generator verifies them in one forward.

A proposer only guesses. The generator feeds ``[last token] + draft`` for a job, samples the target
at every position with the job's own sampler and keeps draft tokens while they equal what the target
drew; the first disagreement is replaced by the target's own token. Every kept token is therefore a
draw from the target model, so under greedy sampling the output is identical to plain decoding.
Rejected positions are rolled back by truncating the sequence length (their cache slots are simply
overwritten later).
"""
from __future__ import annotations

from typing import Any, Hashable, Protocol, Sequence

import attrs
import torch

from ..batch import ForwardBatch
from ..cache import CacheFullError, KVCache, SequenceState


@attrs.define
class DraftRequest:
    key: Hashable  # stable per job; the proposer may keep state under it until release(key)
    tokens: Sequence[int]  # the job's committed tokens (prompt + generated)
    max_tokens: int  # propose at most this many


class Proposer(Protocol):
    """Guesses continuations for several jobs at once.

    A proposer that drafts from the target's hidden states (``trellm.generator.mtp.MTPProposer``) has
    ``observe_hidden(key, start, hidden, tokens)`` (:class:`trellm.capabilities.DraftsFromHiddenStates`): after every
    step the generator passes, per job, the decoder's output rows (before the final norm) for the fed
    positions ``start, start + 1, ...`` that hold committed tokens, and the job's committed tokens.
    """

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        ...

    def release(self, key: Hashable) -> None:
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens and copy what followed.

    Tries n from ``max_ngram`` down to ``min_ngram``, within the last ``window`` tokens. Costs no model call;
    pays off on repetitive text (code edits, quoting the prompt, lists). Each job's n-grams are indexed as its
    tokens grow (their latest start), so a step looks up ``max_ngram - min_ngram + 1`` keys per job instead of
    scanning the window.
    """

    def __init__(self, num_tokens: int = 4, max_ngram: int = 4, min_ngram: int = 1, window: int = 4096):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram, self.window = num_tokens, max_ngram, min_ngram, window
        self._index: dict[Hashable, _NgramIndex] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            k = min(r.max_tokens, self.num_tokens)
            index = self._index.get(r.key)
            if index is None or not index.extends_to(r.tokens):
                index = self._index[r.key] = _NgramIndex(self.min_ngram, self.max_ngram)
            index.extend(r.tokens)
            out.append(index.lookup(r.tokens, k, self.window) if k > 0 else [])
        return out

    def release(self, key: Hashable) -> None:
        self._index.pop(key, None)


class _NgramIndex:
    """The latest start of every n-gram (n in [lo, hi]) of a token list that ends before its last token, kept
    as the list grows: the n-gram ending at the last token is the one looked up, so it is added one token later."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.tokens: list[int] = []  # the tokens indexed so far (a copy)
        self.latest: dict[tuple[int, ...], int] = {}

    def extends_to(self, tokens: Sequence[int]) -> bool:
        """``tokens`` continue what was indexed (not a rewound or another list)."""
        n = len(self.tokens)
        return n <= len(tokens) and list(tokens[:n]) == self.tokens

    def extend(self, tokens: Sequence[int]) -> None:
        seen = self.tokens
        for t in tokens[len(seen):]:
            end = len(seen)  # n-grams ending at the previous last token (now followed by t) become findable
            for n in range(self.lo, min(self.hi, end) + 1):
                self.latest[tuple(seen[end - n:end])] = end - n
            seen.append(t)

    def lookup(self, tokens: Sequence[int], k: int, window: int) -> list[int]:
        count = len(tokens)
        first = max(0, count - window)  # the window: the last ``window`` tokens
        for n in range(min(self.hi, count - first - 1), self.lo - 1, -1):
            start = self.latest.get(tuple(tokens[count - n:]))
            if start is not None and start >= first:
                return list(tokens[start + n:start + n + k])
        return []


class DraftModelProposer:
    """A small model drafts greedily; it keeps its own paged cache per job and reuses what still matches.

    On CUDA (``cuda_graphs``) its one-token draft steps (all but the first of a proposal, which catches each job
    up on the tokens it has not seen) replay captured decode graphs of its own (:class:`~trellm.graph.GraphRunner`
    over its cache, which keeps one scratch page for them; :meth:`close` gives it back).
    """

    def __init__(self, draft_model: Any, num_tokens: int = 4, cache_tokens: int = 8192, page_size: int = 256,
                 cache: KVCache | None = None, cuda_graphs: bool = True):
        self.model = getattr(draft_model, "model", draft_model)
        self.num_tokens = num_tokens
        self.cache = cache if cache is not None else KVCache.for_model(self.model, max_tokens=cache_tokens, page_size=page_size)
        if self.cache.state_layers():
            raise ValueError("a draft model with recurrent layers cannot roll back rejected drafts; use an attention-only draft")
        self._seqs: dict[Hashable, tuple[SequenceState, list[int]]] = {}
        self.graphs = None
        if cuda_graphs and self.cache.device.type == "cuda" and getattr(self.model, "capturable", True):
            from ..graph import GraphRunner

            self.graphs = GraphRunner(self.model, self.cache)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        live = []  # (index, seq, cached tokens, k)
        feeds = []
        for i, r in enumerate(requests):
            k = min(r.max_tokens, self.num_tokens)
            if k <= 0:
                continue
            seq, cached = self._seqs.get(r.key) or (SequenceState(self.cache), [])
            common = _common_prefix(cached, r.tokens, limit=len(r.tokens) - 1)
            del cached[common:]
            seq.length = common
            try:
                seq.reserve(len(r.tokens) + k)
            except CacheFullError:
                self._seqs[r.key] = (seq, cached)
                continue
            self._seqs[r.key] = (seq, cached)
            live.append((i, seq, cached, k))
            feeds.append(list(r.tokens[common:]))
        for step in range(max((k for *_, k in live), default=0)):
            active = [(item, feed) for item, feed in zip(live, feeds) if len(out[item[0]]) < item[3]]
            if not active:
                break
            logits = self._forward([feed for _, feed in active], [seq.length for (_, seq, _, _), _ in active],
                                   [seq.pages for (_, seq, _, _), _ in active])
            tokens = logits.argmax(dim=-1).tolist()  # one device->host copy for every job's next draft token
            for row, ((i, seq, cached, k), feed) in enumerate(active):
                seq.length += len(feed)
                cached += feed
                out[i].append(tokens[row])
            feeds = [[out[item[0]][-1]] if out[item[0]] else [] for item in live]
        return out

    def _forward(self, feeds: list[list[int]], cached: list[int], pages: list[list[int]]) -> torch.Tensor:
        """Logits after each job's last fed token: a captured decode graph when every job feeds one token."""
        graphs = self.graphs
        if graphs is not None and all(len(f) == 1 for f in feeds) and graphs.fits(pages):
            size = graphs.graph_size(len(feeds))
            if size is not None:
                graphs.stage(size, feeds, cached, pages)
                return graphs.replay(size, len(feeds))
        return self.model.forward(ForwardBatch.with_cache(feeds, cached, pages, self.cache))

    def release(self, key: Hashable) -> None:
        entry = self._seqs.pop(key, None)
        if entry is not None:
            entry[0].release()

    def close(self) -> None:
        """Drop the draft model's decode graphs and give their scratch page back."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
