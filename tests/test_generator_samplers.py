"""Sampler edge cases the generator meets in long jobs (tests/test_samplers.py covers the steps themselves)."""
from __future__ import annotations

import torch

from trellm.samplers import DRY, SamplerSettings, SamplingContext


def test_dry_penalty_of_a_very_long_repeat_is_finite():
    tokens = [5] * 600  # every earlier 5 starts a match; the longest is ~600 long: 10 ** 597 overflows a float
    logits = torch.zeros(8)
    out = DRY(multiplier=1.0, base=10.0, allowed_length=2)(logits, SamplingContext(tokens=tokens))
    assert out[5] == -DRY.MAX_PENALTY and torch.isfinite(out).all()
    assert (out[torch.arange(8) != 5] == 0).all()
    assert DRY(multiplier=2.0, base=2.0, allowed_length=2).penalty(5) == 16.0  # below the cap: unchanged


def test_dry_every_candidate_repeating_still_samples():
    tokens = [2, 0, 2, 1] * 300 + [2]  # after the last 2, both tokens of a 2-logit vocabulary extend a repeat
    out = DRY(multiplier=1.0, base=50.0, allowed_length=1)(torch.zeros(2), SamplingContext(tokens=tokens))
    assert out[0] == -DRY.MAX_PENALTY and out[1] < 0  # 0 extends a ~1200-token repeat, 1 a short one
    stack = SamplerSettings(temperature=1.0, dry_multiplier=1.0, dry_base=50.0, dry_allowed_length=1).build()
    token = stack.sample(torch.zeros(2), SamplingContext(tokens=tokens, generator=torch.Generator().manual_seed(0)), [])
    assert token in (0, 1)
