"""The sampler stack: logits pass through a list of steps, then one token is drawn.

Each step is a small object ``step(logits, ctx) -> logits`` over one sequence's float32 logits
[vocab]; a step removes tokens by setting their logit to ``-inf``. The stack ends with a draw
(:func:`draw`: the inverse CDF at one uniform number, from the job's ``torch.Generator`` or, in the
generator, :func:`uniform_for` the job's seed and the token's index) unless a step made the choice greedy.

Steps are looked up by name in a table that plugins extend through the
``trellm_register_samplers(register)`` hook (``register(name, factory)``; ``factory(**settings)``
returns a step). :class:`SamplerSettings` is the flat, user-facing record (what an OpenAI request
carries); :meth:`SamplerSettings.build` turns it into a :class:`SamplerStack` in the usual order:
biases and bans, penalties, DRY, then truncation (top-k, top-p, min-p, typical-p, XTC) with
temperature first or last.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import attrs
import torch

NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a 64-bit integer scrambled into another."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform_for(seed: int, index: int) -> float:
    """The uniform number in [0, 1) that draws the token at generated position ``index`` of a job seeded
    ``seed``. Counter-based, not a stream: the same whatever else shares the batch, however many draft
    positions were verified and after a rewind, so seeded output repeats on every path."""
    return (_mix64(_mix64(seed & _MASK64) ^ index) >> 11) * 2.0**-53


def draw(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids drawn from ``softmax(scores)`` (float32 [..., vocab], ``-inf`` for excluded tokens) at the
    uniforms ``u`` [...]: the first token whose cumulative probability passes ``u``. One draw per row, all
    rows at once, on the scores' device."""
    cdf = torch.cumsum(torch.softmax(scores, dim=-1), dim=-1)
    x = (u.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=scores.shape[-1] - 1)


@attrs.define
class SamplingContext:
    """What a step may look at: the sequence so far and the job's random generator."""

    tokens: Sequence[int]  # prompt + generated tokens, in order
    prompt_len: int = 0
    generator: torch.Generator | None = None

    @property
    def generated(self) -> Sequence[int]:
        return self.tokens[self.prompt_len:]


class SamplerStep:
    """Base class of a step; subclasses set ``name`` and implement ``__call__``."""

    name = "step"
    greedy = False  # a step with greedy=True makes the stack pick the argmax

    def __call__(self, logits: torch.Tensor, ctx: SamplingContext) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


# ---- steps ----------------------------------------------------------------------------------------


class Temperature(SamplerStep):
    name = "temperature"

    def __init__(self, temperature: float = 1.0):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature = float(temperature)
        self.greedy = self.temperature == 0.0

    def __call__(self, logits, ctx):
        if self.temperature in (0.0, 1.0):
            return logits
        return logits / self.temperature


class Greedy(SamplerStep):
    name = "greedy"
    greedy = True

    def __call__(self, logits, ctx):
        return logits


class TopK(SamplerStep):
    name = "top_k"

    def __init__(self, top_k: int = 0):
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.top_k = int(top_k)

    def __call__(self, logits, ctx):
        if self.top_k <= 0 or self.top_k >= logits.shape[-1]:
            return logits
        kth = torch.topk(logits, self.top_k).values[-1]
        return logits.masked_fill(logits < kth, NEG_INF)


class TopP(SamplerStep):
    """Keep the smallest set of most likely tokens whose probability mass reaches ``top_p``."""

    name = "top_p"

    def __init__(self, top_p: float = 1.0):
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.top_p = float(top_p)

    def __call__(self, logits, ctx):
        if self.top_p >= 1.0:
            return logits
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = torch.cumsum(probs, dim=-1) - probs > self.top_p
        drop[0] = False
        return logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), NEG_INF)


class MinP(SamplerStep):
    """Drop tokens whose probability is below ``min_p`` times the top token's."""

    name = "min_p"

    def __init__(self, min_p: float = 0.0):
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        self.min_p = float(min_p)

    def __call__(self, logits, ctx):
        if self.min_p <= 0.0:
            return logits
        probs = torch.softmax(logits, dim=-1)
        return logits.masked_fill(probs < probs.max() * self.min_p, NEG_INF)


class TypicalP(SamplerStep):
    """Locally typical sampling: keep tokens whose surprise is closest to the entropy, up to mass ``typical_p``."""

    name = "typical_p"

    def __init__(self, typical_p: float = 1.0):
        if not 0.0 < typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1], got {typical_p}")
        self.typical_p = float(typical_p)

    def __call__(self, logits, ctx):
        if self.typical_p >= 1.0:
            return logits
        logp = torch.log_softmax(logits, dim=-1)
        p = logp.exp()
        entropy = -torch.nansum(p * logp)
        deviation = (-logp - entropy).abs()
        sorted_dev, order = torch.sort(deviation)
        cum = torch.cumsum(p[order], dim=-1)
        drop = cum - p[order] >= self.typical_p
        drop[0] = False
        return logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), NEG_INF)


class Penalties(SamplerStep):
    """Repetition (multiplicative), presence and frequency (additive) penalties over the last ``penalty_range`` tokens.

    ``penalty_range`` 0 means the whole context; ``include_prompt=False`` counts generated tokens only.
    """

    name = "penalties"

    def __init__(self, repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 penalty_range: int = 0, include_prompt: bool = True):
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        self.repetition_penalty, self.presence_penalty = float(repetition_penalty), float(presence_penalty)
        self.frequency_penalty, self.penalty_range = float(frequency_penalty), int(penalty_range)
        self.include_prompt = include_prompt

    def __call__(self, logits, ctx):
        history = penalty_window(ctx.tokens, ctx.prompt_len, self.include_prompt, self.penalty_range)
        if not history:
            return logits
        ids = torch.tensor(list(history), dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        seen = counts > 0
        out = logits
        if self.repetition_penalty != 1.0:
            penalized = torch.where(out > 0, out / self.repetition_penalty, out * self.repetition_penalty)
            out = torch.where(seen, penalized, out)
        if self.presence_penalty != 0.0:
            out = out - seen.to(out.dtype) * self.presence_penalty
        if self.frequency_penalty != 0.0:
            out = out - counts * self.frequency_penalty
        return out


def penalty_window(tokens: Sequence[int], prompt_len: int, include_prompt: bool, penalty_range: int) -> Sequence[int]:
    """The tokens penalties count: the whole context or the generated part, its last ``penalty_range`` (0: all)."""
    history = tokens if include_prompt else tokens[prompt_len:]
    return history[-penalty_range:] if penalty_range > 0 else history


class DRY(SamplerStep):
    """"Don't repeat yourself": penalize a token that would extend a repeat of an earlier sequence.

    If the context ends with a run that already occurred earlier followed by token t, t's logit drops
    by ``multiplier * base ** (match_len - allowed_length)`` once ``match_len >= allowed_length``.
    Matches do not extend across ``sequence_breakers`` tokens. The penalty is capped at
    ``MAX_PENALTY`` (a long repeat would overflow a float); that still bans the token, and the
    logits stay finite, so a context where every candidate repeats still samples.
    """

    name = "dry"
    MAX_PENALTY = 1e9

    def __init__(self, multiplier: float = 0.0, base: float = 1.75, allowed_length: int = 2,
                 sequence_breakers: Sequence[int] = (), penalty_range: int = 0):
        self.multiplier, self.base, self.allowed_length = float(multiplier), float(base), int(allowed_length)
        self.sequence_breakers = frozenset(int(t) for t in sequence_breakers)
        self.penalty_range = int(penalty_range)

    def __call__(self, logits, ctx):
        if self.multiplier <= 0.0:
            return logits
        tokens = list(ctx.tokens[-self.penalty_range:] if self.penalty_range > 0 else ctx.tokens)
        n = len(tokens)
        if n < 2 or tokens[-1] in self.sequence_breakers:
            return logits
        longest: dict[int, int] = {}
        last = tokens[-1]
        for i in range(n - 2, -1, -1):  # i: an earlier occurrence of the last token
            if tokens[i] != last:
                continue
            nxt = tokens[i + 1]
            if nxt in self.sequence_breakers:
                continue
            length = 1
            while length <= i and tokens[i - length] == tokens[n - 1 - length] and tokens[i - length] not in self.sequence_breakers:
                length += 1
            if length > longest.get(nxt, 0):
                longest[nxt] = length
        out = logits.clone()
        for token, length in longest.items():
            if length >= self.allowed_length and token < out.shape[-1]:
                out[token] -= self.penalty(length)
        return out

    def penalty(self, match_len: int) -> float:
        try:
            return min(self.multiplier * self.base ** (match_len - self.allowed_length), self.MAX_PENALTY)
        except OverflowError:  # base ** exponent beyond the float range
            return self.MAX_PENALTY


class XTC(SamplerStep):
    """Exclude top choices: with ``probability``, drop every token above ``threshold`` but the least likely of them."""

    name = "xtc"

    def __init__(self, threshold: float = 0.1, probability: float = 0.0):
        self.threshold, self.probability = float(threshold), float(probability)

    def __call__(self, logits, ctx):
        if self.probability <= 0.0:
            return logits
        if torch.rand((), generator=ctx.generator).item() >= self.probability:
            return logits
        probs = torch.softmax(logits, dim=-1)
        above = probs >= self.threshold
        if int(above.sum()) < 2:
            return logits
        keep = torch.where(above, probs, torch.full_like(probs, 2.0)).argmin()
        above[keep] = False
        return logits.masked_fill(above, NEG_INF)


class LogitBias(SamplerStep):
    """Add a fixed bias per token id (OpenAI ``logit_bias``)."""

    name = "logit_bias"

    def __init__(self, logit_bias: Mapping[int, float] | None = None):
        self.logit_bias = {int(k): float(v) for k, v in (logit_bias or {}).items()}

    def __call__(self, logits, ctx):
        if not self.logit_bias:
            return logits
        out = logits.clone()
        for token, bias in self.logit_bias.items():
            if 0 <= token < out.shape[-1]:
                out[token] += bias
        return out


class BannedTokens(SamplerStep):
    name = "banned_tokens"

    def __init__(self, banned_tokens: Sequence[int] = ()):
        self.banned_tokens = sorted({int(t) for t in banned_tokens})

    def __call__(self, logits, ctx):
        if not self.banned_tokens:
            return logits
        out = logits.clone()
        ids = [t for t in self.banned_tokens if 0 <= t < out.shape[-1]]
        out[ids] = NEG_INF
        return out


BUILTIN_STEPS: dict[str, Callable[..., SamplerStep]] = {
    cls.name: cls
    for cls in (Temperature, Greedy, TopK, TopP, MinP, TypicalP, Penalties, DRY, XTC, LogitBias, BannedTokens)
}


def step_factories() -> dict[str, Callable[..., SamplerStep]]:
    """Every registered step factory by name (built-ins plus plugins through the registry hook)."""
    from . import registry

    return {**BUILTIN_STEPS, **registry.samplers()}  # built-ins come through the hook too; kept here for safety


def make_step(name: str, **settings: Any) -> SamplerStep:
    factories = step_factories()
    if name not in factories:
        raise ValueError(f"unknown sampler step {name!r}; registered steps: {', '.join(sorted(factories))}")
    return factories[name](**settings)


# ---- the stack ------------------------------------------------------------------------------------


class SamplerStack:
    """Steps applied in order, then a draw. ``steps`` may hold step objects or ``(name, settings)`` pairs."""

    def __init__(self, steps: Sequence[SamplerStep | tuple[str, Mapping[str, Any]]] = ()):
        self.steps: list[SamplerStep] = [s if not isinstance(s, tuple) else make_step(s[0], **dict(s[1])) for s in steps]

    @property
    def greedy(self) -> bool:
        return any(s.greedy for s in self.steps)

    @property
    def is_argmax(self) -> bool:
        """The draw is the argmax of the raw logits: greedy, and every step leaves the scores as they are
        (so a batch's tokens may be picked on the device at once, with identical results)."""
        return self.greedy and all(
            type(s) is Greedy or (type(s) is Temperature and s.temperature in (0.0, 1.0)) for s in self.steps
        )

    def process(self, logits: torch.Tensor, ctx: SamplingContext) -> torch.Tensor:
        """The final scores (float32 [vocab], ``-inf`` for excluded tokens) before the draw."""
        out = logits.float()
        for step in self.steps:
            out = step(out, ctx)
        return out

    def sample(self, logits: torch.Tensor, ctx: SamplingContext, exclude: Sequence[int] = (), u: float | None = None) -> int:
        """One token id. ``exclude`` bans extra ids for this draw only (banned strings use it); ``u``: the draw's
        uniform number (None: one from ``ctx.generator``)."""
        scores = self.process(logits, ctx)
        if exclude:
            scores = scores.clone()
            scores[list(exclude)] = NEG_INF
        if not torch.isfinite(scores).any():
            scores = logits.float()  # every token excluded: fall back to the raw distribution
        if self.greedy:
            return int(torch.argmax(scores))
        if u is None:
            u = float(torch.rand((), generator=ctx.generator))
        return int(draw(scores, torch.tensor(u, dtype=torch.float64, device=scores.device)))

    def row_sampling(self) -> "RowSampling | None":
        """These steps as one :class:`RowSampling` (what the generator's batched device sampler runs), or None
        when a step is not one it knows (DRY, XTC, typical-p, a plugin's) or the order differs from
        bias/bans, penalties, temperature, top-k, top-p, min-p (temperature first or last)."""
        fields: dict[str, Any] = {}
        rank = 0
        for step in self.steps:
            kind = type(step)
            if kind is Greedy or (kind is Temperature and step.temperature in (0.0, 1.0)):  # no change to the scores
                fields["greedy"] = fields.get("greedy", False) or step.greedy
                continue
            if kind is Temperature:
                if "temperature" in fields:
                    return None
                last = rank > _RANKS[Penalties]  # after a truncation step: temperature last
                fields.update(temperature=step.temperature, temperature_last=last)
                rank = _TEMPERATURE_LAST if last else _RANKS[Penalties] + 1
                continue
            r = _RANKS.get(kind)
            if r is None or r < rank or kind.__name__ in fields:
                return None
            fields[kind.__name__] = step
            rank = r
        bias, banned, pen = fields.get("LogitBias"), fields.get("BannedTokens"), fields.get("Penalties")
        top_k, top_p, min_p = fields.get("TopK"), fields.get("TopP"), fields.get("MinP")
        return RowSampling(
            greedy=fields.get("greedy", False),
            temperature=fields.get("temperature", 1.0),
            temperature_last=fields.get("temperature_last", False),
            top_k=top_k.top_k if top_k else 0, top_p=top_p.top_p if top_p else 1.0, min_p=min_p.min_p if min_p else 0.0,
            repetition_penalty=pen.repetition_penalty if pen else 1.0, presence_penalty=pen.presence_penalty if pen else 0.0,
            frequency_penalty=pen.frequency_penalty if pen else 0.0, penalty_range=pen.penalty_range if pen else 0,
            penalty_prompt=pen.include_prompt if pen else True,
            logit_bias=tuple(bias.logit_bias.items()) if bias else (), banned_tokens=tuple(banned.banned_tokens) if banned else (),
        )

    def __repr__(self) -> str:
        return f"SamplerStack({self.steps!r})"


# the order the batched sampler applies steps in (Temperature goes first, before TopK, or last)
_RANKS: dict[type, int] = {LogitBias: 0, BannedTokens: 0, Penalties: 1, TopK: 3, TopP: 4, MinP: 5}
_TEMPERATURE_LAST = 6


@attrs.frozen
class RowSampling:
    """One job's sampler stack as numbers, for sampling every row of a batch at once on the device
    (``trellm.generator.sampling``); neutral values switch a part off."""

    greedy: bool = False
    temperature: float = 1.0
    temperature_last: bool = False
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_range: int = 0
    penalty_prompt: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    banned_tokens: tuple[int, ...] = ()

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) != (1.0, 0.0, 0.0)

    def counted(self, tokens: Sequence[int], prompt_len: int) -> list[int] | None:
        """The tokens the penalties count in a context of ``tokens`` (None: no penalties)."""
        if not self.penalized:
            return None
        return list(penalty_window(tokens, prompt_len, self.penalty_prompt, self.penalty_range))


@attrs.define
class SamplerSettings:
    """Flat sampler settings (what an API request carries); neutral values switch a step off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    temperature_last: bool = False  # apply temperature after truncation instead of before
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_range: int = 0  # last N tokens; 0 = all
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[int, ...] = ()
    dry_range: int = 0
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    logit_bias: dict[int, float] = attrs.field(factory=dict)
    banned_tokens: tuple[int, ...] = ()
    extra_steps: tuple = ()  # (name, settings) pairs or step objects appended after truncation

    @classmethod
    def greedy(cls, **kwargs: Any) -> "SamplerSettings":
        return cls(temperature=0.0, **kwargs)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "SamplerSettings":
        if name not in PRESETS:
            raise ValueError(f"unknown sampler preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
        return attrs.evolve(PRESETS[name], **overrides)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def build(self) -> SamplerStack:
        steps: list[SamplerStep] = []
        if self.logit_bias:
            steps.append(LogitBias(self.logit_bias))
        if self.banned_tokens:
            steps.append(BannedTokens(self.banned_tokens))
        if (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) != (1.0, 0.0, 0.0):
            steps.append(Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.penalty_range))
        if self.dry_multiplier > 0:
            steps.append(DRY(self.dry_multiplier, self.dry_base, self.dry_allowed_length, self.dry_sequence_breakers, self.dry_range))
        if self.temperature == 0.0:
            steps.append(Greedy())
            return SamplerStack(steps)
        temperature = Temperature(self.temperature)
        if not self.temperature_last:
            steps.append(temperature)
        if self.top_k > 0:
            steps.append(TopK(self.top_k))
        if self.top_p < 1.0:
            steps.append(TopP(self.top_p))
        if self.min_p > 0.0:
            steps.append(MinP(self.min_p))
        if self.typical_p < 1.0:
            steps.append(TypicalP(self.typical_p))
        if self.xtc_probability > 0.0:
            steps.append(XTC(self.xtc_threshold, self.xtc_probability))
        if self.temperature_last:
            steps.append(temperature)
        stack = SamplerStack(steps)
        stack.steps += SamplerStack(self.extra_steps).steps
        return stack


PRESETS: dict[str, SamplerSettings] = {
    "greedy": SamplerSettings(temperature=0.0),
    "default": SamplerSettings(temperature=0.8, top_k=50, top_p=0.95),
    "precise": SamplerSettings(temperature=0.3, top_p=0.9, repetition_penalty=1.05),
    "creative": SamplerSettings(temperature=1.1, min_p=0.05, temperature_last=True, dry_multiplier=0.8),
    "min_p": SamplerSettings(temperature=1.0, min_p=0.1),
}
