"""Sampling every row of a step at once, on the logits' device.

Each row is one position a job samples (a decode step's next token, or one of a draft's positions). Its
job's sampler stack arrives as a :class:`~trellm.samplers.RowSampling` (numbers, not step objects), and
the whole batch goes through the same steps the per-row stack applies, in the same order and with the
same float32 arithmetic: logit bias and banned tokens, repetition / presence / frequency penalties over
the row's history, temperature (first or last), top-k, top-p, min-p, the excluded ids of this position
(banned-string rewinds, stop ids before ``min_new_tokens``), then the argmax (greedy rows) or a draw at
the row's uniform number (:func:`trellm.samplers.draw`). A row whose every token was excluded falls back
to its raw logits, as the per-row stack does.

Every per-row number and sparse list (bias, bans, exclusions, penalty histories) is written into one
host buffer (pinned on CUDA) and sent with one non-blocking copy; nothing here reads the device back.
Two such buffers take turns: a step's upload is queued behind its forward, so with async scheduling the
next step (prepared while that forward runs) writes the other one instead of waiting for the forward.
"""
from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np
import torch

from ..samplers import NEG_INF, RowSampling, draw

_PER_ROW = 10  # temperature, temperature_last, top_k, top_p, min_p, repetition, presence, frequency, uniform, greedy


@attrs.define
class SampleRow:
    """One position to sample: the job's settings, its uniform number, the token history its penalties
    count (None: no penalties) and the ids excluded at this position."""

    settings: RowSampling
    u: float
    history: Sequence[int] | None = None
    exclude: Sequence[int] = ()


class DeviceSampler:
    """Samples the rows of a step in one batch of tensor ops (see the module docstring)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._staging = [_Staging(self.device), _Staging(self.device)]  # used in turn (see the module docstring)
        self._turn = 0

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow],
               unseen: tuple[torch.Tensor, Sequence[tuple[int, int]]] | None = None) -> torch.Tensor:
        """int64 [len(rows)] token ids (on the logits' device) for the float logits rows [len(rows), vocab].

        ``unseen`` = (token ids on the device, (row, index) pairs): the penalties of ``row`` also count token
        ``ids[index]``, chosen by a step the host has not read back yet (async scheduling); that row's
        ``history`` holds a negative id in its place."""
        n, vocab = logits.shape
        settings = [r.settings for r in rows]
        bias = [(i, t, b) for i, s in enumerate(settings) for t, b in s.logit_bias if 0 <= t < vocab]
        banned = [(i, t) for i, s in enumerate(settings) for t in s.banned_tokens if 0 <= t < vocab]
        excluded = [(i, t) for i, r in enumerate(rows) for t in r.exclude if 0 <= t < vocab]
        counted = [(i, np.asarray(r.history, dtype=np.float64)) for i, r in enumerate(rows) if r.history is not None and len(r.history)]
        history = np.empty((0, 2))  # (row, token) per counted token, built in numpy: a history may be the whole context
        if counted:
            history = np.stack([np.concatenate([np.full(len(h), i, dtype=np.float64) for i, h in counted]),
                                np.concatenate([h for _, h in counted])], axis=1)
            history = history[(history[:, 1] >= 0) & (history[:, 1] < vocab)]
        per_row = [(s.temperature, s.temperature_last, s.top_k if 0 < s.top_k < vocab else 0, s.top_p, s.min_p,
                    s.repetition_penalty, s.presence_penalty, s.frequency_penalty, r.u, s.greedy) for s, r in zip(settings, rows)]
        pairs = list(unseen[1]) if unseen is not None else []
        parts = self._upload([per_row, bias, banned, excluded, history, pairs], [_PER_ROW, 3, 2, 2, 2, 2])
        table, bias_t, banned_t, excluded_t, history_t, pairs_t = parts
        temperature, t_last, top_k, top_p, min_p = (table[:, j] for j in range(5))
        rep, presence, frequency, u, greedy = (table[:, j] for j in range(5, 10))
        minus_inf = logits.new_full((), NEG_INF, dtype=torch.float32)  # filled on the device: no upload

        scores = logits.float().clone()
        if bias:
            scores.index_put_((bias_t[:, 0].long(), bias_t[:, 1].long()), bias_t[:, 2].float(), accumulate=True)
        if banned:
            scores.index_put_((banned_t[:, 0].long(), banned_t[:, 1].long()), minus_inf)
        if len(history) or pairs:
            counts = torch.zeros_like(scores).index_put_(
                (history_t[:, 0].long(), history_t[:, 1].long()), scores.new_ones(()), accumulate=True)
            if pairs:
                counts.index_put_((pairs_t[:, 0].long(), unseen[0][pairs_t[:, 1].long()]), scores.new_ones(()), accumulate=True)
            seen = counts > 0
            r = rep.float()[:, None]
            scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
            scores = scores - seen.to(scores.dtype) * presence.float()[:, None] - counts * frequency.float()[:, None]
        first = (temperature != 1.0) & (t_last == 0)
        if bool_any(settings, lambda s: s.temperature != 1.0 and not s.temperature_last):
            scores = torch.where(first[:, None], scores / temperature.float()[:, None], scores)
        k_max = max((s.top_k for s in settings if 0 < s.top_k < vocab), default=0)
        candidates = None
        if k_max:
            candidates = torch.topk(scores, k_max, dim=-1)  # sorted, best first
            kth = candidates.values.gather(1, (top_k.long() - 1).clamp(min=0)[:, None])
            truncated = (top_k > 0)[:, None]
            scores = scores.masked_fill((scores < kth) & truncated, NEG_INF)
        if bool_any(settings, lambda s: s.top_p < 1.0):
            if candidates is not None and all(0 < s.top_k < vocab for s in settings if s.top_p < 1.0):
                # every top-p row keeps at most its top-k (and ties): sort those candidates, not the vocabulary
                ordered = candidates.values.masked_fill((candidates.values < kth) & truncated, NEG_INF)
                order = candidates.indices
            else:
                ordered, order = scores.sort(dim=-1, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            drop = (torch.cumsum(probs, dim=-1) - probs > top_p.float()[:, None]) & (top_p < 1.0)[:, None]
            drop[:, 0] = False
            scores = scores.masked_fill(torch.zeros_like(scores, dtype=torch.bool).scatter(1, order, drop), NEG_INF)
        if bool_any(settings, lambda s: s.min_p > 0.0):
            probs = torch.softmax(scores, dim=-1)
            floor = probs.max(dim=-1, keepdim=True).values * min_p.float()[:, None]
            scores = scores.masked_fill((probs < floor) & (min_p > 0)[:, None], NEG_INF)
        if bool_any(settings, lambda s: s.temperature != 1.0 and s.temperature_last):
            last = (temperature != 1.0) & (t_last != 0)
            scores = torch.where(last[:, None], scores / temperature.float()[:, None], scores)
        if excluded:
            scores.index_put_((excluded_t[:, 0].long(), excluded_t[:, 1].long()), minus_inf)
        nothing_left = ~torch.isfinite(scores).any(dim=-1, keepdim=True)  # every token excluded: the raw logits
        scores = torch.where(nothing_left, logits.float(), scores)
        if all(s.greedy for s in settings):
            return scores.argmax(dim=-1)
        drawn = draw(scores, u)
        if not any(s.greedy for s in settings):
            return drawn
        return torch.where(greedy != 0, scores.argmax(dim=-1), drawn)

    def _upload(self, blocks: list, widths: list[int]) -> list[torch.Tensor]:
        """Each block (rows of ``width`` numbers) as a float64 [rows, width] view of one device buffer, sent
        with one host->device copy (float64 holds every token id and setting exactly; float32 ones are the same
        numbers the per-row steps use)."""
        sizes = [len(b) * w for b, w in zip(blocks, widths)]
        staging = self._staging[self._turn]
        self._turn ^= 1
        host, dev = staging.claim(sum(sizes))
        at = 0
        for block, width, size in zip(blocks, widths, sizes):
            if size:
                host[at: at + size] = np.asarray(block, dtype=np.float64).reshape(-1)  # lists of tuples or arrays
            at += size
        staging.send(at)
        out, at = [], 0
        for block, width, size in zip(blocks, widths, sizes):
            out.append(dev[at: at + size].view(len(block), width))
            at += size
        return out


class _Staging:
    """A float64 host buffer (pinned on CUDA; on CPU it is the device buffer) and its device buffer."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host = torch.zeros(0, dtype=torch.float64)
        self.dev = self.host
        self.copied = None  # CUDA event after the last copy out of the host buffer, until waited for
        self.event = torch.cuda.Event() if device.type == "cuda" else None

    def claim(self, total: int) -> tuple[np.ndarray, torch.Tensor]:
        """(the host buffer as numpy, free to write once its last copy is done; the device buffer), ``total`` long at least."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None
        if total > self.host.numel():
            cuda = self.device.type == "cuda"
            self.host = torch.zeros(max(total, 2 * self.host.numel(), 1024), dtype=torch.float64, pin_memory=cuda)
            self.dev = self.host if not cuda else torch.zeros_like(self.host, device=self.device)
        return self.host.numpy(), self.dev

    def send(self, total: int) -> None:
        """Copy the first ``total`` numbers up without waiting."""
        if self.dev is not self.host:
            self.dev[:total].copy_(self.host[:total], non_blocking=True)
            self.event.record(torch.cuda.current_stream(self.dev.device))  # the copy's stream, not the thread's device's
            self.copied = self.event


def bool_any(settings: Sequence[RowSampling], test) -> bool:
    return any(test(s) for s in settings)
