"""Constrained decoding: a job's output held to a JSON schema, a regex, a Lark grammar or a list of choices.

Built on llguidance (the engine ExLlamaV3 uses). Chosen over xgrammar on SmolLM2's tokenizer (49,152
tokens, a nested schema with enums, arrays, numeric bounds and a pattern; benchmarks/bench_grammar.py
``--engines``): compiling the schema takes ~1 ms against xgrammar's 10-29 ms, which matters when
every request brings its own schema or tool list; its Lark grammars embed JSON schemas (``%json{}``),
which is how forced tool calls are written; it reads ``tokenizer.json`` directly (xgrammar needs a
transformers tokenizer) and installs as one wheel without torch, triton or TVM. A mask costs ~15 µs
per token against xgrammar's ~4 µs, which the overlap below hides.

How the generator uses it (``Job(grammar=Grammar.json_schema(...))``): at enqueue the grammar is
compiled for the model's tokenizer (errors raise :class:`GrammarError` there). Each step computes the
token masks of every grammar job's sampled rows while the forward runs (llguidance's executor spreads
the jobs over threads, its Rust code without the GIL). On CUDA the generator's thread fills them
(:meth:`GrammarEngine.fill_masks`) once the forward is queued: under async scheduling a step's forward
is queued before the previous step is read back and its masks are filled as soon as that step's
tokens are committed to the matchers, so they hide behind the whole forward; no thread hand-off, no
second thread contending for the GIL. On CPU, where the forward runs on the generator's thread, a
worker thread fills them beside it (:meth:`GrammarEngine.start_masks`). The masks are applied to the
logits on their device, after a captured CUDA graph replays, and before sampling or the argmax.
Speculative drafts are cut at the first token the grammar refuses before they are verified, and each
draft position gets the mask of the state after the draft tokens before it.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import os
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .errors import TrellmError

# Whitespace between JSON tokens: room for indented output, but a model cannot loop on blanks forever.
JSON_WHITESPACE = r"[\n\t ]{0,20}"
MASK_THREADS = 8  # the most threads llguidance's executor spreads one step's masks over
COMPILED_GRAMMARS = 64  # compiled grammars an engine keeps, the least recently used dropped first
StepMasks = tuple[list[int], torch.Tensor]  # (logits rows masked, the step's int32 bitmask): what apply_masks takes


class GrammarError(TrellmError, ValueError):
    """A grammar, regex or schema the engine cannot compile (the message names the problem)."""


def _llguidance():
    try:
        import llguidance
        import llguidance.torch  # noqa: F401 (bitmask helpers)
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise GrammarError("constrained decoding needs the llguidance package (pip install llguidance)") from exc
    return llguidance


class Grammar:
    """What a job's output must match; build it with one of the class methods.

    Grammars are plain values: one may serve many jobs (each job gets its own matcher); the engine
    keeps the compiled form by grammar text (see :class:`GrammarEngine`).
    """

    def __init__(self, kind: str, source: Any, spec: str):
        self.kind = kind  # json_schema | json_object | regex | lark | choice
        self.source = source
        self.spec = spec  # llguidance's grammar text
        problem = _llguidance().LLMatcher.validate_grammar(spec)
        if problem and not problem.startswith("WARNING"):
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {problem.strip()}")

    def __repr__(self) -> str:
        return f"Grammar.{self.kind}({str(self.source)[:60]!r})"

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> "Grammar":
        """JSON text valid under ``schema`` (a dict or its JSON text); at most 20 blanks between tokens
        (a schema's ``x-guidance`` options override that)."""
        llg = _llguidance()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, Mapping):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            spec = llg.LLMatcher.grammar_from_json_schema(dict(schema), defaults={"whitespace_pattern": JSON_WHITESPACE})
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
        return cls("json_schema", schema, spec)

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (OpenAI's ``response_format: json_object``)."""
        grammar = cls.json_schema({"type": "object"})
        grammar.kind = "json_object"
        return grammar

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """Text matching ``pattern`` as a whole (Rust regex syntax, no look-around or back-references)."""
        return cls("regex", pattern, _llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def lark(cls, grammar: str) -> "Grammar":
        """A Lark grammar (llguidance's dialect: ``start`` rule, ``%json{schema}``, special tokens as ``<|name|>``).
        GBNF (llama.cpp's EBNF) is converted first when the text uses ``::=``."""
        llg = _llguidance()
        if "::=" in grammar:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                grammar = gbnf_to_lark(grammar)
            except Exception as exc:
                raise GrammarError(f"invalid GBNF grammar: {exc}") from None
        return cls("lark", grammar, llg.LLMatcher.grammar_from_lark(grammar))

    @classmethod
    def choice(cls, options: Sequence[str]) -> "Grammar":
        """Exactly one of ``options``."""
        options = list(options)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError(f"choice needs a non-empty list of non-empty strings, got {options!r}")
        lark = "start: " + " | ".join(lark_literal(o) for o in options)
        return cls("choice", options, _llguidance().LLMatcher.grammar_from_lark(lark))


def lark_literal(text: str) -> str:
    """``text`` as a quoted Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class GrammarState:
    """One job's position in its grammar (an llguidance matcher)."""

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def consume(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar refuses it (the state is then broken)."""
        return bool(self.matcher.consume_token(token))

    def rollback(self, count: int) -> None:
        if count > 0:
            self.matcher.rollback(count)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from here."""
        return int(self.matcher.validate_tokens(list(tokens))) if tokens else 0

    @property
    def accepting(self) -> bool:
        """The output so far is complete (the job may stop here)."""
        return bool(self.matcher.is_accepting())

    @property
    def finished(self) -> bool:
        """Nothing more can follow: the job ends here."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarEngine:
    """Compiles grammars for one tokenizer and computes a step's token masks next to the forward.

    ``vocab_size`` is the logits' width (models often pad it past the tokenizer's); ``stop_ids`` are
    the tokens a complete output may end with. Building the engine reads the whole vocabulary
    (~0.3-0.9 s for 49k tokens), so a generator builds it once, on its first grammar job.

    Compiled grammars are kept by their text (the last :data:`COMPILED_GRAMMARS`), and every job's
    matcher is a copy of one: the copies share the lexer states llguidance builds as jobs first meet them
    (3-8 ms each for a bounded string's positions on SmolLM2's vocabulary), so requests that bring the
    same schema or tool list pay for those once, not once per request.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]):
        llg = _llguidance()
        if tokenizer is None:
            raise GrammarError("a grammar needs the model's tokenizer")
        backend = getattr(tokenizer, "backend", tokenizer)
        self.vocab_size = max(int(vocab_size), int(backend.get_vocab_size(with_added_tokens=True)))
        self.stop_ids = sorted(stop_ids)
        self.tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.stop_ids or None)
        self.words = (self.vocab_size + 31) // 32
        self.executor_threads = max(1, min(os.cpu_count() or 1, MASK_THREADS))
        self.executor = llg.LLExecutor(num_threads=self.executor_threads)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trellm-grammar")
        # two pinned buffers, used in turn: a step's copy to the device never races the next step's fill
        self._host_masks = [torch.empty(0, self.words, dtype=torch.int32) for _ in range(2)]
        self._turn = 0
        self._bits: dict[torch.device, torch.Tensor] = {}
        self._stop_set = set(self.stop_ids)
        ids = np.array(self.stop_ids, dtype=np.int64)
        self._stop_words = (ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)).astype(np.uint32))
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()  # grammar text -> matcher to copy
        # masks: rows filled; fill_s: time spent filling them (on the worker or the generator's thread);
        # wait_s: time a step still waited for the worker after its forward (the part the overlap did not hide)
        self.stats = {"masks": 0, "fill_s": 0.0, "wait_s": 0.0}

    def compile(self, grammar: Grammar) -> GrammarState:
        """A fresh state for ``grammar`` (compiled once per grammar text, then copied); GrammarError when it
        cannot compile."""
        with self._lock:
            template = self._compiled.get(grammar.spec)
            if template is None:
                template = _llguidance().LLMatcher(self.tokenizer, grammar.spec, log_level=0)
                if template.is_error():
                    raise GrammarError(f"invalid {grammar.kind.replace('_', ' ')}: {template.get_error().strip()}")
                self._compiled[grammar.spec] = template
                while len(self._compiled) > COMPILED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar.spec)
            return GrammarState(template.deep_copy())

    def start_masks(self, rows: list[tuple[GrammarState, int, list[int]]], num_rows: int,
                    stop_ids: list[Sequence[int] | None]) -> concurrent.futures.Future:
        """Begin computing masks on the worker thread (see :meth:`fill_masks`), beside the forward this
        thread then launches; resolve with :meth:`apply_masks`."""
        return self._worker.submit(self._fill, rows, self._next_buffer(num_rows), stop_ids)

    def fill_masks(self, rows: list[tuple[GrammarState, int, list[int]]], num_rows: int,
                   stop_ids: list[Sequence[int] | None]) -> StepMasks:
        """The masks of ``num_rows`` logits rows, computed on this thread: for each (state, first logits row,
        draft tokens), the row's mask and one per draft token after it; other rows allow every token.
        ``stop_ids[i]`` (None = the engine's) replaces the engine's stop tokens in entry i's rows. The
        generator calls this while the device runs the step's forward: no thread hand-off, no GIL to share."""
        return self._fill(rows, self._next_buffer(num_rows), stop_ids)

    def _next_buffer(self, num_rows: int) -> torch.Tensor:
        self._turn ^= 1
        if self._host_masks[self._turn].shape[0] < num_rows:
            self._host_masks[self._turn] = torch.empty(max(num_rows, 64), self.words, dtype=torch.int32,
                                                       pin_memory=torch.cuda.is_available())
        return self._host_masks[self._turn][:num_rows]

    def _fill(self, rows, masks: torch.Tensor, stop_ids: list[Sequence[int] | None]) -> StepMasks:
        import llguidance.torch as llt

        started = time.perf_counter()
        plain = [(state.matcher, row) for state, row, draft in rows if not draft]
        drafted = [(state.matcher, row, list(draft)) for state, row, draft in rows if draft]
        used = [r for _, row, draft in rows for r in range(row, row + len(draft) + 1)]
        if len(used) < masks.shape[0]:
            with torch.inference_mode():  # the buffer was made under the generator's inference mode
                masks.fill_(-1)  # rows of jobs without a grammar allow every token
        if plain:
            llt.fill_next_token_bitmask_par(self.executor, plain, masks)
        if drafted:
            llt.fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafted, masks)
        swaps = [(row, len(draft) + 1, stops) for (_, row, draft), stops in zip(rows, stop_ids)
                 if stops is not None and set(stops) != self._stop_set]
        if swaps:
            self._swap_stops(masks.numpy().view("uint32"), swaps)
        self.stats["masks"] += len(used)
        self.stats["fill_s"] += time.perf_counter() - started
        return used, masks

    def _swap_stops(self, words: np.ndarray, swaps: list[tuple[int, int, Sequence[int]]]) -> None:
        """In each (first row, rows, job's stop ids): where the engine's stop tokens are allowed (the output
        is complete), allow the job's instead. ``words``: the masks as a uint32 array. The complete rows of
        every job are found with one gather; only those are rewritten."""
        stop_words, stop_bits = self._stop_words
        rows = [row for first, count, _ in swaps for row in range(first, first + count)]
        owners = [stops for _, count, stops in swaps for _ in range(count)]
        complete = (words[np.array(rows)[:, None], stop_words] & stop_bits).any(axis=1)
        for row, stops in zip(itertools.compress(rows, complete), itertools.compress(owners, complete)):
            for t in self.stop_ids:
                words[row, t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF
            for t in stops:
                if 0 <= t < self.vocab_size:
                    words[row, t >> 5] |= 1 << (t & 31)

    def apply_masks(self, logits: torch.Tensor, masks: StepMasks | concurrent.futures.Future) -> None:
        """Set every refused token's logit to -inf (in place, on the logits' device); ``masks`` from
        :meth:`fill_masks`, or :meth:`start_masks`' future, waited for here."""
        if isinstance(masks, concurrent.futures.Future):
            started = time.perf_counter()
            masks = masks.result()
            self.stats["wait_s"] += time.perf_counter() - started
        used, words = masks
        if not used:
            return
        device = logits.device
        bits = self._bits.get(device)
        if bits is None:  # bit i of a word as an int32 (bit 31 is the sign)
            bits = self._bits[device] = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32,
                                                     device=device)
        words = words.to(device, non_blocking=True)  # pinned on CUDA: queued behind the forward, no wait here
        refused = torch.eq(words.unsqueeze(-1) & bits, 0).view(words.shape[0], -1)
        width = min(logits.shape[-1], refused.shape[-1])
        logits[:, :width].masked_fill_(refused[:, :width], float("-inf"))
        if logits.shape[-1] > width:  # logits wider than the engine's vocabulary: the rest is refused
            logits[:, width:] = float("-inf")

    def close(self) -> None:
        self._worker.shutdown(wait=False)
