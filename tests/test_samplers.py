"""The sampler stack: each step on hand-made logits, presets, seeding, and a plugin-registered step."""
from __future__ import annotations

import math

import pytest
import torch

import trellm
from trellm import registry
from trellm.sampling import StopStringMatcher, sample_token
from trellm.samplers import (
    DRY,
    XTC,
    BannedTokens,
    Greedy,
    LogitBias,
    MinP,
    Penalties,
    PRESETS,
    SamplerSettings,
    SamplerStack,
    SamplingContext,
    Temperature,
    TopK,
    TopP,
    TypicalP,
    make_step,
)

NEG = float("-inf")


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).nonzero().flatten().tolist()


def probs_logits(*p: float) -> torch.Tensor:
    return torch.log(torch.tensor(p))


CTX = SamplingContext(tokens=[])


def test_truncation_steps():
    logits = probs_logits(0.5, 0.25, 0.15, 0.07, 0.03)
    assert kept(TopK(2)(logits, CTX)) == [0, 1]
    assert kept(TopK(0)(logits, CTX)) == [0, 1, 2, 3, 4]
    assert kept(TopP(0.7)(logits, CTX)) == [0, 1]  # 0.5 + 0.25 reaches 0.7
    assert kept(TopP(0.1)(logits, CTX)) == [0]  # the top token always stays
    assert kept(MinP(0.2)(logits, CTX)) == [0, 1, 2]  # >= 0.1
    # entropy ~1.27 nats; surprise closest to it: token 1 (1.39), then 0 (0.69), then 2 (1.90)
    assert kept(TypicalP(0.2)(logits, CTX)) == [1]
    assert kept(TypicalP(0.3)(logits, CTX)) == [0, 1]
    assert Temperature(2.0)(logits, CTX).allclose(logits / 2)


def test_temperature_first_or_last_differs():
    logits = probs_logits(0.6, 0.3, 0.06, 0.04)
    first = SamplerSettings(temperature=3.0, min_p=0.2).build().process(logits, CTX)
    last = SamplerSettings(temperature=3.0, min_p=0.2, temperature_last=True).build().process(logits, CTX)
    assert kept(last) == [0, 1]  # min-p sees the sharp distribution
    assert len(kept(first)) > 2  # min-p sees the flattened one


def test_penalties_with_range():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    ctx = SamplingContext(tokens=[0, 1, 1, 3], prompt_len=0)
    out = Penalties(repetition_penalty=2.0)(logits, ctx)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.25]
    out = Penalties(presence_penalty=0.5, frequency_penalty=0.25)(logits, ctx)
    assert out.tolist() == pytest.approx([2.0 - 0.75, -2.0 - 1.0, 1.0, 0.5 - 0.75])
    out = Penalties(repetition_penalty=2.0, penalty_range=1)(logits, ctx)  # only the last token (3)
    assert out.tolist() == [2.0, -2.0, 1.0, 0.25]
    out = Penalties(presence_penalty=1.0, include_prompt=False)(logits, SamplingContext(tokens=[0, 1, 3], prompt_len=2))
    assert out.tolist() == [2.0, -2.0, 1.0, -0.5]


def test_dry_penalizes_continuing_a_repeat():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3]  # "1 2 3" repeats: continuing with 4 extends a length-3 match
    out = DRY(multiplier=1.0, base=2.0, allowed_length=2)(torch.zeros(10), SamplingContext(tokens=tokens))
    assert out[4] == pytest.approx(-2.0)  # 1 * 2 ** (3 - 2)
    assert (out[torch.arange(10) != 4] == 0).all()
    out = DRY(multiplier=1.0, base=2.0, allowed_length=2, sequence_breakers=[2])(torch.zeros(10), SamplingContext(tokens=tokens))
    assert out[4] == 0.0  # the match may not cross token 2


def test_xtc_bias_bans_greedy():
    logits = probs_logits(0.4, 0.3, 0.2, 0.1)
    gen = torch.Generator().manual_seed(0)
    out = XTC(threshold=0.15, probability=1.0)(logits, SamplingContext(tokens=[], generator=gen))
    assert kept(out) == [2, 3]  # 0 and 1 are dropped; 2 is the least likely above the threshold
    assert XTC(threshold=0.5, probability=1.0)(logits, CTX).equal(logits)  # fewer than two above
    assert LogitBias({3: 10.0})(logits, CTX).argmax() == 3
    assert kept(BannedTokens([0, 2])(logits, CTX)) == [1, 3]
    stack = SamplerStack([BannedTokens([0]), Greedy()])
    assert stack.greedy and stack.sample(logits, CTX) == 1
    assert SamplerSettings.greedy().build().sample(logits, CTX, exclude=[0, 1]) == 2


def test_seeded_draws_repeat_and_follow_the_distribution():
    logits = probs_logits(0.7, 0.2, 0.1)
    stack = SamplerSettings(temperature=1.0).build()

    def draws(seed, n=400):
        gen = torch.Generator().manual_seed(seed)
        return [stack.sample(logits, SamplingContext(tokens=[], generator=gen)) for _ in range(n)]

    a, b = draws(1), draws(1)
    assert a == b
    assert abs(a.count(0) / len(a) - 0.7) < 0.08


def test_presets_and_errors():
    for name in PRESETS:
        assert isinstance(SamplerSettings.preset(name).build(), SamplerStack)
    assert SamplerSettings.preset("default", top_k=5).top_k == 5
    with pytest.raises(ValueError, match="unknown sampler preset"):
        SamplerSettings.preset("nope")
    with pytest.raises(ValueError, match="top_p"):
        TopP(1.5)
    with pytest.raises(ValueError, match="unknown sampler step 'nope'"):
        make_step("nope")
    assert SamplerSettings.greedy().build().greedy


def test_simple_api_still_works():
    logits = probs_logits(0.1, 0.6, 0.3)
    assert sample_token(logits) == 1
    assert sample_token(logits, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0)) == 1
    m = StopStringMatcher(["</s>"])
    assert m.feed("hello </") == ("hello ", False)
    assert m.feed("s> tail") == ("", True) and m.matched == "</s>"


class AlwaysToken:
    """A throwaway sampler plugin: registers a step forcing one token id."""

    class Step:
        name = "always"
        greedy = True

        def __init__(self, token: int = 0):
            self.token = token

        def __call__(self, logits, ctx):
            out = torch.full_like(logits, NEG)
            out[self.token] = 0.0
            return out

    @trellm.hookimpl
    def trellm_register_samplers(self, register):
        register("always", self.Step)


def test_sampler_plugin_through_the_registry():
    pm = registry.load_plugins()
    plugin = AlwaysToken()
    pm.register(plugin, name="test-always-sampler")
    try:
        assert "always" in registry.samplers() and "top_k" in registry.samplers()
        stack = SamplerStack([("top_k", {"top_k": 2}), ("always", {"token": 3})])
        assert stack.sample(probs_logits(0.4, 0.3, 0.2, 0.1), CTX) == 3
        settings = SamplerSettings(temperature=0.7, extra_steps=(("always", {"token": 2}),))
        assert settings.build().sample(probs_logits(0.4, 0.3, 0.2, 0.1), CTX) == 2
        infos = {i.name: i for i in registry.plugin_infos()}
        assert infos["test-always-sampler"].registers["samplers"] == ["always"]
    finally:
        pm.unregister(plugin)
    assert "always" not in registry.samplers()


def test_typical_p_keeps_mass():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 2
    out = TypicalP(0.9)(logits, CTX)
    p = torch.softmax(logits, -1)
    assert p[torch.isfinite(out)].sum() >= 0.9 - 1e-6
    assert math.isfinite(out.max().item())
