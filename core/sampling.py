"""Token sampling for the simple generate loop, and stop-string matching for streamed text.

The sampler steps themselves live in :mod:`trellm.samplers`; ``sample_token`` is a shortcut into them.
"""
from __future__ import annotations

import torch

from .samplers import SamplerSettings, SamplingContext


def sample_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """Pick one token id from float32 logits [vocab]; ``temperature == 0`` is greedy (argmax).

    A shortcut into the sampler stack (:mod:`trellm.samplers`) for the simple generate loop.
    """
    settings = SamplerSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    return settings.build().sample(logits, SamplingContext(tokens=(), generator=generator))


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back a tail that could still become one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None  # the stop string that was found

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            idx, self.matched = min(hits)
            out, self.pending = self.pending[:idx], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
