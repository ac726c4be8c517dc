"""A generation request (:class:`Job`) and the results the generator reports about it."""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import attrs

from ..grammar import Grammar, GrammarState
from ..samplers import SamplerSettings, SamplerStack

_job_ids = itertools.count(1)

# Why a job ended (``JobFinished.eos_reason``).
EOS_STOP_TOKEN = "stop_token"
EOS_STOP_STRING = "stop_string"
EOS_MAX_NEW_TOKENS = "max_new_tokens"
EOS_GRAMMAR_END = "grammar_end"  # the grammar admits nothing more (a closed JSON object, a whole choice)
EOS_CANCELLED = "cancelled"
EOS_ERROR = "error"


class Job:
    """One generation request. Build it, hand it to ``Generator.enqueue``, read its results.

    ``prompt`` is text (needs the model's tokenizer) or token ids. ``stop_token_ids=None`` means the
    model's EOS ids. ``sampler`` is :class:`SamplerSettings`, a :class:`SamplerStack`, or None for
    greedy. ``banned_strings`` never appear in the output: text that could still grow into one is
    held back, and when one completes the job rewinds to where the held text began and bans the
    token it took there (needs the tokenizer). ``logprobs`` returns each sampled token's log-probability under the model
    (raw logits); ``top_logprobs=k`` also returns the k most likely tokens at each step.
    ``identifier`` is any value; it is echoed in every result. ``images`` (multimodal models): one
    per image marker of the prompt, as paths, bytes, data URLs or PIL images, or a prepared
    ``trellm.multimodal.MultimodalPrompt``; they are decoded and encoded at enqueue. ``lora`` names a LoRA
    adapter loaded into the model (``load_lora``) that this job runs with; None: the model's default
    adapter (``trellm.load(..., lora=DIR)``) or none; ``""``: the base model even when there is a default.
    ``grammar`` (a :class:`trellm.grammar.Grammar`: JSON schema, regex, Lark grammar, choice) holds the output to it:
    other tokens are masked out before sampling, stop tokens are allowed only where the output is
    complete, and the job ends by itself when nothing more can follow. It is compiled at enqueue
    (``GrammarError`` there).
    """

    def __init__(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        *,
        min_new_tokens: int = 0,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] | None = None,
        sampler: SamplerSettings | SamplerStack | None = None,
        seed: int | None = None,
        banned_strings: Sequence[str] = (),
        logprobs: bool = False,
        top_logprobs: int = 0,
        identifier: Any = None,
        decode_special_tokens: bool = False,
        images: Any = None,
        lora: str | None = None,
        grammar: Grammar | None = None,
    ):
        if isinstance(prompt, str):
            self.prompt_text: str | None = prompt
            self.prompt_ids: list[int] | None = None
        else:
            self.prompt_text = None
            self.prompt_ids = [int(t) for t in prompt]
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if min_new_tokens < 0 or min_new_tokens > max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens}")
        if top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {top_logprobs}")
        self.max_new_tokens = int(max_new_tokens)
        self.min_new_tokens = int(min_new_tokens)
        self.stop_strings = [s for s in stop if s]
        self.stop_token_ids = None if stop_token_ids is None else {int(t) for t in stop_token_ids}
        self.sampler = sampler if sampler is not None else SamplerSettings.greedy()
        self.seed = seed
        self.banned_strings = [s for s in banned_strings if s]
        self.logprobs = bool(logprobs or top_logprobs)
        self.top_logprobs = int(top_logprobs)
        self.identifier = identifier
        self.decode_special_tokens = decode_special_tokens
        self.images = images if images is None or not isinstance(images, (list, tuple)) else list(images)
        self.multimodal = None  # the MultimodalPrompt, set at enqueue when the job has images
        self.lora = lora
        if grammar is not None and not isinstance(grammar, Grammar):
            raise TypeError(f"grammar must be a trellm.grammar.Grammar, got {type(grammar).__name__}")
        self.grammar = grammar
        self.grammar_state: GrammarState | None = None  # the job's matcher, set at enqueue
        self.job_id = next(_job_ids)
        self.time_enqueued: float | None = None
        self.finished = False
        self.cancel_requested = False

    def __repr__(self) -> str:
        return f"<Job {self.job_id} identifier={self.identifier!r} max_new_tokens={self.max_new_tokens}>"


@attrs.define(kw_only=True)
class Result:
    """Base of every result; ``identifier`` echoes the job's."""

    job: Job = attrs.field(repr=False)
    identifier: Any = None


@attrs.define(kw_only=True)
class JobStarted(Result):
    """The job got its cache pages and starts prefilling."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache (not prefilled again)


@attrs.define(kw_only=True)
class PrefillProgress(Result):
    """A prefill chunk went through: ``prefilled`` of ``total`` prompt tokens are in the cache."""

    prefilled: int
    total: int


@attrs.define(kw_only=True)
class TokenChunk(Result):
    """Newly generated tokens and the text that became final with them (held-back text comes later)."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # per token in token_ids
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob) best first


@attrs.define(kw_only=True)
class JobFinished(Result):
    """The job ended. ``text``/``token_ids`` are the whole completion (stop string and stop token excluded)."""

    eos_reason: str  # stop_token | stop_string | grammar_end | max_new_tokens | cancelled | error
    text: str
    token_ids: list[int]
    stop_token: int | None = None
    stop_string: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    time_enqueued: float = 0.0
    time_started: float | None = None  # admitted (pages granted)
    time_first_token: float | None = None
    time_finished: float = attrs.field(factory=time.time)
    draft_proposed: int = 0  # speculative decoding: tokens proposed / accepted
    draft_accepted: int = 0

    @property
    def finish_reason(self) -> str:
        """OpenAI's spelling: "stop", "length", "cancelled" or "error"."""
        return {EOS_STOP_TOKEN: "stop", EOS_STOP_STRING: "stop", EOS_GRAMMAR_END: "stop", EOS_MAX_NEW_TOKENS: "length"}.get(self.eos_reason, self.eos_reason)

    @property
    def queue_time(self) -> float:
        return (self.time_started or self.time_finished) - self.time_enqueued

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.time_first_token is None else self.time_first_token - self.time_enqueued

    @property
    def decode_tokens_per_second(self) -> float:
        if self.time_first_token is None or self.generated_tokens < 2:
            return 0.0
        return (self.generated_tokens - 1) / max(self.time_finished - self.time_first_token, 1e-9)

    @property
    def acceptance_rate(self) -> float:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0
