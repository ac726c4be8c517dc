"""The continuous-batching generator: jobs in, results out, one batched forward per ``iterate()``.

Each step (:meth:`Generator.iterate`):

1. finish cancelled jobs (their pages go back at once);
2. admit waiting jobs in FIFO order while the batch has room and the cache holds the job's prompt
   (pages for generated tokens are taken as they are needed, so a job asking for many tokens holds
   only what it has written); a job that does not fit waits; later jobs that fit may pass it for
   ``max_overtake_steps`` steps, then nobody passes it until it is in (aging), so a big job is never
   starved. When a running job needs a page and none is free, the most recently admitted job is
   preempted: its pages go back and it waits, first in line, to be recomputed from its tokens
   (vLLM's preemption by recompute), so the oldest job always progresses;
3. plan one token budget (``max_chunk_tokens``): every decoding job gets its next token (plus
   speculative draft tokens), prefilling jobs share what is left in admission order;
4. run one forward over the mixed batch, then sample, verify drafts, stream text, check stops.

Prompts share cache pages through the prefix cache (``cache.prefix_cache``): full pages of a prompt
that another job (running or finished) already computed are reused and not prefilled again.

Hybrid models (recurrent-state layers) keep one state slot per job. Prefill chunks end at page
boundaries, so when a page is named the job's state is the state after its last token; it is copied
into a checkpoint slot the prefix cache owns, and a later job sharing those pages starts from a copy
of the deepest checkpoint. Speculative decoding snapshots the state before verifying drafts; on
partial acceptance it restores the snapshot and re-feeds only the accepted tokens next step.
"""
from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import attrs
import torch

from ..batch import StepBuffers
from ..cache import CacheFullError, KVCache, SequenceState
from ..cache.prefix import ROOT_HASH, page_hashes
from ..cache.recurrent import alloc_state_slot, copy_state_slot, free_state_slot, slots_in_use
from ..capabilities import HasDefaultStopIds, config_stop_ids, implements, is_hybrid, supports_images, wants_hidden_states
from ..errors import TrellmError
from ..grammar import GrammarEngine
from ..model import prompt_too_long
from ..lora import adapter_root, lora_set
from ..multimodal import attach_images
from ..samplers import RowSampling, SamplerSettings, SamplerStack, SamplingContext, uniform_for
from ..sampling import StopStringMatcher
from .job import (
    EOS_CANCELLED,
    EOS_ERROR,
    EOS_GRAMMAR_END,
    EOS_MAX_NEW_TOKENS,
    EOS_STOP_STRING,
    EOS_STOP_TOKEN,
    Job,
    JobFinished,
    JobStarted,
    PrefillProgress,
    Result,
    TokenChunk,
)
from .sampling import DeviceSampler, SampleRow
from .speculative import DraftRequest, Proposer

ADMIT_SCAN = 64
_ARGMAX = RowSampling(greedy=True)  # a row nobody samples from goes through the device sampler as a plain argmax
MAX_REWINDS = 256  # banned strings: rewinds per job before they are no longer enforced  # how deep into the queue admission looks for jobs that fit


class JobTooLargeError(TrellmError, ValueError):
    """A job needs more cache than the whole cache holds, or its prompt is empty or out of vocabulary."""


class _Running:
    """A job's live state inside the generator."""

    def __init__(self, job: Job, prompt_ids: list[int], seq: SequenceState, tokenizer, stop_ids: set[int]):
        self.job = job
        self.mm = job.multimodal  # MultimodalPrompt or None
        # Prefix-cache page names hash these ids: image rows carry their image's digest, not the placeholder id.
        self.prompt_hash_ids = self.mm.hash_ids() if self.mm is not None else prompt_ids
        self.prompt_len = len(prompt_ids)
        self.tokens = list(prompt_ids)  # prompt + committed generated tokens
        self.generated: list[int] = []
        self.seq = seq
        self.state_len = seq.length  # tokens the recurrent state has absorbed (hybrid models)
        self.snapshot_slot: int | None = None  # state before a draft verification (hybrid + speculative)
        self.verify_slots: list[int] = []  # state after each token of a captured verification (hybrid + speculative)
        self.stop_ids = stop_ids
        self.grammar = job.grammar_state  # GrammarState or None
        stack = job.sampler.build() if isinstance(job.sampler, SamplerSettings) else job.sampler
        self.sampler: SamplerStack = stack
        # the token is the raw logits' argmax (no step changes scores, no logprobs): the whole batch's
        # are taken on the device at once and only the ids come back
        self.argmax_sampling = stack.is_argmax and not job.logprobs
        # the stack as numbers for the batched device sampler; None: sampled row by row on the host
        self.row_sampling = stack.row_sampling()
        self.seed = job.seed if job.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.rng = torch.Generator()  # for steps that draw on their own (XTC)
        self.rng.manual_seed(self.seed)
        self.decoder = tokenizer.stream(skip_special_tokens=not job.decode_special_tokens) if tokenizer else None
        # Banned strings are matched like stop strings (text that may still become one is held back),
        # but a match rewinds the job instead of ending it. They need text, so a tokenizer.
        self.banned = list(job.banned_strings) if tokenizer is not None else []
        self.matcher = StopStringMatcher(job.stop_strings + self.banned)
        self.text_parts: list[str] = []  # released text
        self.held_ids: list[int] = []  # generated but not yet released (see Generator._accept)
        self.held_logprobs: list[float] = []
        self.held_tops: list[list[tuple[int, float]]] = []
        self.held_text = ""
        self.released = 0  # generated tokens up to here are streamed and final
        self.bans: dict[int, set[int]] = {}  # generated position -> token ids banned there
        self.rewinds = 0
        self.cached_tokens = 0
        self.named_pages = 0  # leading pages entered in the prefix cache
        self.lora: str | None = None  # the LoRA adapter this job runs with (set at admission)
        self.lora_uid = 0  # which load of it (0: the base model)
        self.last_name = ROOT_HASH
        self.time_started = time.time()
        self.time_first_token: float | None = None
        self.draft_proposed = 0
        self.draft_accepted = 0

    @property
    def state_slot(self) -> int | None:
        return self.seq.state_slot

    @property
    def prefilling(self) -> bool:
        return self.seq.length < len(self.tokens) - 1

    @property
    def remaining(self) -> int:
        return self.job.max_new_tokens - len(self.generated)

    def argmax_now(self, ahead: int = 0) -> bool:
        """This step's tokens are plain argmaxes: no token is excluded at the positions it samples
        (``ahead``: tokens chosen on the device that the host has not seen yet)."""
        return self.argmax_sampling and not self.bans and len(self.generated) + ahead >= self.job.min_new_tokens


class _Readback:
    """A pinned host buffer that a step's chosen tokens are copied into without waiting (CUDA), and the
    event that says they have landed; on CPU the values are simply kept."""

    def __init__(self):
        self.host: torch.Tensor | None = None
        self.event: Any = None

    def start(self, values: torch.Tensor) -> Callable[[], list]:
        """Queue the copy of ``values``; returns the call that waits for it and gives them as a list."""
        if values.device.type != "cuda":
            return values.tolist
        n = values.numel()
        if self.host is None or self.host.numel() < n:
            self.host = torch.empty(max(n, 256), dtype=torch.float64, pin_memory=True)
            self.event = torch.cuda.Event()
        host = self.host[:n].view(torch.int64) if values.dtype == torch.int64 else self.host[:n]
        host.copy_(values, non_blocking=True)
        self.event.record(torch.cuda.current_stream(values.device))  # the copy's stream, not the thread's device's
        event = self.event

        def wait() -> list:
            event.synchronize()
            return host.tolist()
        return wait


@attrs.define
class _Launched:
    """A step whose forward and token choice are queued on the device, not yet read back."""

    plan: list  # (job, tokens fed, draft tokens among them)
    cu: list[int]  # token offsets of the plan's jobs in the batch
    row_start: list[int]  # each job's first logits row
    ids: torch.Tensor | None  # the chosen token of every logits row, on the device
    readback: Callable[[], list] | None
    top: int  # top log-probabilities per row in the read-back (-1: none)
    full: dict  # plan index -> CPU logits rows of jobs sampled on the host
    hidden: torch.Tensor | None  # hidden states for the proposer
    width: int = 0  # tokens per row of a captured verification (0: none)
    sampled: list[int] = attrs.Factory(list)  # plan indices of the jobs that get logits
    # the forward's logits while the tokens wait to be chosen: a grammar step queued ahead is masked and
    # sampled only once its predecessor is committed (see Generator._choose_after_commit)
    logits: torch.Tensor | None = None

    def tokens(self) -> tuple[list[int] | None, list[tuple[float, list]] | None]:
        """(ids per logits row, (logprob, top logprobs) per row or None); waits for the copy."""
        if self.readback is None:
            return None, None
        host = self.readback()
        if self.top < 0:
            return host, None
        n, k = self.ids.shape[0], self.top
        values, indices = host[2 * n: 2 * n + n * k], host[2 * n + n * k:]
        tops = [[(int(t), v) for t, v in zip(indices[j * k:(j + 1) * k], values[j * k:(j + 1) * k])] for j in range(n)]
        return [int(t) for t in host[:n]], list(zip(host[n: 2 * n], tops))


def _feed_on_device(batch, feed_from: tuple[torch.Tensor, list[int]] | None) -> None:
    """Write the token ids a previous step chose (still on the device) into ``batch``'s first input ids."""
    if feed_from is None:
        return
    ids, rows = feed_from
    n = len(rows)
    if rows == list(range(n)):
        batch.input_ids[:n].copy_(ids[:n])
        return
    # jobs that finished left gaps: gather. The row list goes up without waiting (torch.tensor(rows, device=...)
    # would wait for the whole queue, the step before included, to drain).
    index = torch.tensor(rows, dtype=torch.int64)
    if ids.device.type == "cuda":
        index = index.pin_memory()
    batch.input_ids[:n].copy_(ids.index_select(0, index.to(ids.device, non_blocking=True)))


class Generator:
    """Continuous batching over a paged KV cache. See the package docstring for the API."""

    def __init__(
        self,
        model: Any,
        cache: KVCache | None = None,
        *,
        tokenizer: Any = None,
        max_batch_size: int = 16,
        max_chunk_tokens: int = 512,
        cache_tokens: int = 8192,
        page_size: int = 256,
        proposer: Proposer | None = None,
        num_draft_tokens: int = 4,
        prefix_caching: bool = True,
        max_overtake_steps: int = 16,
        cuda_graphs: bool = True,
        state_checkpoints: int | None = None,
        async_scheduling: bool | None = None,
    ):
        if max_batch_size < 1 or max_chunk_tokens < 1:
            raise ValueError(f"max_batch_size and max_chunk_tokens must be >= 1, got {max_batch_size}, {max_chunk_tokens}")
        self.model = getattr(model, "model", model)  # a LoadedModel or its module tree
        self._loaded = model if self.model is not model else None  # the LoadedModel, for trellm.multimodal.prepare_prompt
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        if cache is None:  # a model with recurrent layers knows how to build its hybrid cache
            # state slots: one per job, with a proposer one draft snapshot per job (with CUDA graphs, one per draft
            # position: see _verify_in_graph), plus prefix checkpoints (max_batch_size by default)
            checkpoints = (max_batch_size if state_checkpoints is None else state_checkpoints) if prefix_caching else 0
            per_draft = max(num_draft_tokens, 1) if cuda_graphs and torch.cuda.is_available() else 1
            # (+1: the CUDA graphs' padding rows run in a scratch slot)
            slots = max_batch_size * (1 + (per_draft if proposer is not None else 0)) + checkpoints + 1
            cache = (self.model.make_cache(max_tokens=cache_tokens, page_size=page_size, max_slots=slots) if is_hybrid(self.model)
                     else KVCache.for_model(self.model, max_tokens=cache_tokens, page_size=page_size))
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_chunk_tokens = max_chunk_tokens
        self.max_overtake_steps = max_overtake_steps  # 0 = strict FIFO admission
        self._head_waited = 0
        self.proposer = proposer
        self.num_draft_tokens = num_draft_tokens
        # a proposer that drafts from the target's hidden states (MTP) gets them after every step
        self.hidden_sink = proposer.observe_hidden if wants_hidden_states(proposer) else None
        self.state_layers = self.cache.state_layers()
        # a hybrid model whose every recurrent mixer can take a captured verification token by token
        mixers = getattr(self.model, "recurrent_layers", lambda: [object()])()
        self._verifies_in_steps = all(m is None or getattr(m, "verifies_in_steps", False) for m in mixers) and not any(
            layer.extra for layer in self.state_layers)
        self.prefix_caching = prefix_caching
        if self.state_layers:  # evicting a page hands its state checkpoint back
            self.cache.prefix_cache.free_checkpoint = lambda slot: free_state_slot(self.cache, slot)
        self.graph_runner = self._graph_runner() if cuda_graphs else None
        self.step_buffers = StepBuffers(self.cache.device, capacity=8 * (max_chunk_tokens + max_batch_size) + 1024)
        self.device_sampler = DeviceSampler(self.cache.device)
        # step n+1 queued on the device before step n is read back (default: on CUDA, where it hides the host's work)
        self.async_scheduling = self.cache.device.type == "cuda" if async_scheduling is None else async_scheduling
        self._inflight: _Launched | None = None  # a step running on the device, read back by the next iterate()
        self._readback = [_Readback(), _Readback()]  # one per step in flight: step n is read while n+1 lands
        self._launches = 0
        self.vocab_size = int(getattr(getattr(self.model, "config", None), "vocab_size", 0) or 0)
        self.default_stop_ids = self._default_stop_ids(model)
        self.default_lora: str | None = getattr(model, "default_lora", None)  # trellm.load(..., lora=DIR)
        self.pending: deque[tuple[Job, list[int]]] = deque()
        self.active: list[_Running] = []  # in admission order
        self.preempted: list[_Running] = []  # oldest first; resumed before any pending job is admitted
        self.stats = {"prefilled_tokens": 0, "reused_tokens": 0, "decoded_tokens": 0, "steps": 0, "forward_tokens": 0,
                      "preempted": 0, "draft_proposed": 0, "draft_accepted": 0, "steps_ahead": 0,
                      "readback_wait_s": 0.0}  # seconds iterate() waited for the device to hand tokens back
        self._grammar_engine: GrammarEngine | None = None  # built on the first grammar job
        self._grammar_lock = threading.Lock()

    # ---- public API -------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """The most tokens (prompt + max_new_tokens) one job may ask for."""
        reserved = self.cache.page_size if self.graph_runner is not None else 0  # the graphs' scratch page
        return self.cache.capacity_tokens - reserved

    @property
    def num_pending(self) -> int:
        return len(self.pending) + len(self.preempted)

    @property
    def num_active(self) -> int:
        return len(self.active)

    def has_work(self) -> bool:
        return bool(self.pending or self.active or self.preempted or self._inflight)

    def enqueue(self, job: Job | Sequence[Job]) -> Job | list[Job]:
        """Queue one job or several (raises JobTooLargeError for a job that can never fit)."""
        if not isinstance(job, Job):
            return [self.enqueue(j) for j in job]
        return self.add_prepared(job, self.prepare(job))

    def add_prepared(self, job: Job, prompt_ids: list[int]) -> Job:
        """Queue a job that :meth:`prepare` accepted (``prompt_ids`` is what it returned)."""
        self.pending.append((job, prompt_ids))
        return job

    def prepare(self, job: Job) -> list[int]:
        """Check ``job`` and return its prompt ids (images decoded and encoded); raises for a job that can
        never run. Touches no generator state, so another thread may call it while ``iterate()`` runs."""
        if job.time_enqueued is not None:
            raise ValueError(f"{job!r} was already enqueued; make a new Job")
        if job.images is not None and (job.images or not isinstance(job.images, list)):
            job.multimodal = self._prepare_images(job)  # ImageError here, before any page is touched
        prompt_ids = self._prompt_ids(job)
        if (why := prompt_too_long(len(prompt_ids), getattr(self.model, "config", None))) is not None:
            raise JobTooLargeError(f"job {job.identifier!r}: {why}")
        self._adapter_of(job)  # LoraError for an adapter that is not loaded
        if job.grammar is not None:
            job.grammar_state = self.grammar_engine.compile(job.grammar)  # GrammarError here
        total = len(prompt_ids) + job.max_new_tokens
        if total > self.capacity_tokens:
            raise JobTooLargeError(
                f"job {job.identifier!r}: prompt ({len(prompt_ids)} tokens) + max_new_tokens ({job.max_new_tokens}) = "
                f"{total} tokens, but the cache holds only {self.capacity_tokens}; shorten the prompt or lower max_new_tokens"
            )
        job.time_enqueued = time.time()
        return prompt_ids

    @property
    def grammar_engine(self) -> GrammarEngine:
        """The engine that compiles grammars for this model's tokenizer (built on first use, ~0.5 s)."""
        with self._grammar_lock:
            if self._grammar_engine is None:
                self._grammar_engine = GrammarEngine(self.tokenizer, self.vocab_size, self.default_stop_ids)
            return self._grammar_engine

    def cancel(self, job: Job) -> None:
        """Stop ``job``; the next ``iterate()`` reports it finished with eos_reason "cancelled" and frees its pages."""
        job.cancel_requested = True

    @torch.inference_mode()
    def iterate(self) -> list[Result]:
        """Run one scheduling step (at most one forward); return what happened, in order."""
        results: list[Result] = []
        step, self._inflight = self._inflight, None
        if step is None:  # a scheduling step: cancellations, admissions, pages, preemption
            self._finish_cancelled(results)
            self._finish_unloaded_adapters(results)
            self._admit(results)
            self._grow()
            if not self.active:
                return results
            step = self._launch(self._plan(), results)
            if step is None:
                return results
        if self.async_scheduling:
            self._inflight = self._launch_next(step, results)  # queued behind ``step``: the device works while we read it
        self._complete(step, results)
        if self._inflight is not None and self._inflight.logits is not None:
            self._inflight = self._choose_after_commit(self._inflight, results)
        return results

    def stream(self) -> Iterator[Result]:
        """Iterate until every queued job has finished, yielding results as they come."""
        while self.has_work():
            yield from self.iterate()

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        *,
        return_results: bool = False,
        **job_kwargs: Any,
    ) -> Any:
        """Blocking: complete one prompt (text or ids) or a list of prompts; returns text(s) or JobFinished(s).

        It drives ``iterate()`` itself, so jobs enqueued by others advance too, but their results are
        not returned anywhere: do not mix it with your own ``iterate()`` loop.
        """
        single = isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], int))
        prompts = [prompt] if single else list(prompt)
        jobs = [Job(p, max_new_tokens, identifier=i, **job_kwargs) for i, p in enumerate(prompts)]
        self.enqueue(jobs)
        finished: dict[int, JobFinished] = {}
        while len(finished) < len(jobs):
            if not self.has_work():
                raise RuntimeError("generator went idle before every job finished")
            for r in self.iterate():
                if isinstance(r, JobFinished) and r.job in jobs:
                    finished[r.identifier] = r
        out = [finished[i] if return_results else finished[i].text for i in range(len(jobs))]
        return out[0] if single else out

    def abort(self, error: str = "aborted") -> list[Result]:
        """Fail every running and waiting job (frees all their pages); returns their JobFinished results."""
        results: list[Result] = []
        step, self._inflight = self._inflight, None
        if step is not None:
            self._complete(step, results)
        for r in self.active + self.preempted:
            self._finish(r, EOS_ERROR, results, error=error)
        for job, ids in self.pending:
            job.finished = True
            results.append(JobFinished(job=job, identifier=job.identifier, eos_reason=EOS_ERROR, text="", token_ids=[],
                                       prompt_tokens=len(ids), time_enqueued=job.time_enqueued or 0.0, error=error))
        self.pending.clear()
        return results

    @torch.inference_mode()
    def capture_graphs(self) -> list[int]:
        """Capture the decode graph of every batch size now (a no-op without graphs); returns the sizes that
        replay. Else each is captured the first time a step needs it, when a batch first grows or shrinks to
        that size: tens of milliseconds that every running job waits. Draft-verification graphs stay lazy
        (their widths depend on the drafts). In inference mode, as ``iterate``: a capture's warm-up step writes
        into buffers that earlier steps made as inference tensors (on the H200 every size failed to capture
        when a second Generator on the same model captured outside it)."""
        runner = self.graph_runner
        if runner is None:
            return []
        return [size for size in runner.batch_sizes if runner.graph_size(size) is not None]

    def verify_pages(self) -> None:
        """Raise AssertionError when page refcounts or recurrent-state slots differ from their holders (jobs, prefix cache, graph scratch page)."""
        scratch = getattr(self.graph_runner, "_scratch_page", None)
        self.cache.prefix_cache.verify([r.seq.pages for r in self.active] + ([[scratch]] if scratch is not None else []))
        holders = [s for r in self.active for s in (r.state_slot, r.snapshot_slot, *r.verify_slots) if s is not None]
        holders += list(self.cache.prefix_cache.checkpoint_of.values())
        if getattr(self.graph_runner, "_scratch_slot", None) is not None:
            holders.append(self.graph_runner._scratch_slot)
        used = slots_in_use(self.cache)
        if len(set(holders)) != len(holders) or set(holders) != used:
            raise AssertionError(f"recurrent-state slot accounting broken: allocated {sorted(used)}, holders {holders}")

    def clear_prefix_cache(self) -> None:
        self.cache.prefix_cache.clear()

    # ---- admission --------------------------------------------------------------------------------

    def _graph_runner(self) -> Any:
        """A GraphRunner replaying captured decode and draft-verification steps, on CUDA only (models with
        recurrent layers too: the graph reads each row's state slot, padding rows run in a scratch slot; with an
        MTP proposer the graphs also return the hidden states it drafts from); batches with prefill chunks or
        images run eagerly."""
        if self.cache.device.type != "cuda":
            return None
        from ..graph import DEFAULT_BATCH_SIZES, GraphRunner

        sizes = sorted({b for b in DEFAULT_BATCH_SIZES if b < self.max_batch_size} | {self.max_batch_size})
        return GraphRunner(self.model, self.cache, batch_sizes=sizes, max_context=self.cache.capacity_tokens,
                           hidden_states=self.hidden_sink is not None,
                           max_width=1 + self.num_draft_tokens if self.proposer is not None else 1)

    def _default_stop_ids(self, model: Any) -> set[int]:
        if implements(model, HasDefaultStopIds):
            return set(model.default_stop_ids())
        ids = config_stop_ids(getattr(self.model, "config", None))
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return ids

    def _prepare_images(self, job: Job) -> Any:
        """The job's MultimodalPrompt: its images decoded, checked and encoded, its markers expanded."""
        from ..multimodal import ImageError, MultimodalPrompt, prepare_prompt

        if isinstance(job.images, MultimodalPrompt):
            return job.images
        prompt = job.prompt_text if job.prompt_text is not None else job.prompt_ids
        if self._loaded is not None:
            return prepare_prompt(self._loaded, prompt, job.images)
        if not supports_images(self.model):
            raise ImageError(f"job {job.identifier!r}: {type(self.model).__name__} takes no image input")
        return self.model.prepare(prompt, job.images, self.tokenizer)

    def _adapter_of(self, job: Job) -> str | None:
        """The LoRA adapter ``job`` runs with (None: the base model); raises LoraError when it is not loaded."""
        name = self.default_lora if job.lora is None else (job.lora or None)
        if name is not None:
            adapters = lora_set(self.model, create=False)
            if adapters is None or name not in adapters:
                from ..lora import LoraError

                loaded = sorted(adapters.names()) if adapters is not None else []
                raise LoraError(f"job {job.identifier!r}: no LoRA adapter named {name!r} is loaded; loaded: {loaded or 'none'}")
        return name

    def _lora_slots(self, plan) -> list[int] | None:
        """Each planned job's adapter slot (-1: base), or None when the model has no adapters."""
        adapters = lora_set(self.model, create=False)
        if adapters is None:
            return None
        return [adapters.slot(r.lora) for r, _, _ in plan]

    def _prompt_ids(self, job: Job) -> list[int]:
        if job.multimodal is not None:
            ids = job.multimodal.input_ids
        elif job.prompt_ids is not None:
            ids = job.prompt_ids
        else:
            if self.tokenizer is None:
                raise JobTooLargeError(f"job {job.identifier!r}: a text prompt needs a tokenizer; pass token ids")
            ids = self.tokenizer.encode(job.prompt_text)
        if not ids:
            raise JobTooLargeError(f"job {job.identifier!r}: the prompt is empty")
        if self.vocab_size and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
            raise JobTooLargeError(f"job {job.identifier!r}: prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return list(ids)

    def _admit(self, results: list[Result]) -> None:
        """Admit waiting jobs in FIFO order. A job that does not fit yet may be overtaken by later ones
        that do, but only for ``max_overtake_steps`` steps; after that nobody passes it (aging)."""
        while self.preempted and len(self.active) < self.max_batch_size:
            if not self._resume(self.preempted[0]):
                return  # nobody passes a preempted job
            self.preempted.pop(0)
        i = 0
        head_blocked = False
        while i < len(self.pending) and i < ADMIT_SCAN and len(self.active) < self.max_batch_size:
            job, prompt_ids = self.pending[i]
            if self._try_admit(job, prompt_ids, results):
                del self.pending[i]
                if i == 0:
                    self._head_waited = 0
                continue
            if i == 0:
                head_blocked = True
                if self._head_waited >= self.max_overtake_steps:
                    break
            i += 1
        if head_blocked:
            self._head_waited += 1

    def _try_admit(self, job: Job, prompt_ids: list[int], results: list[Result]) -> bool:
        """Give ``job`` its pages (reusing cached prefix pages) and a state slot; False when they are not free."""
        try:
            lora = self._adapter_of(job)
        except TrellmError as exc:  # unloaded while the job waited
            job.finished = True
            results.append(JobFinished(job=job, identifier=job.identifier, eos_reason=EOS_ERROR, text="", token_ids=[],
                                       prompt_tokens=len(prompt_ids), time_enqueued=job.time_enqueued or 0.0, error=str(exc)))
            return True
        adapters = lora_set(self.model, create=False)
        lora_uid = adapters.uid(lora) if adapters is not None else 0
        hash_ids = job.multimodal.hash_ids() if job.multimodal is not None else prompt_ids
        # headroom: a page for each running job's next tokens, so new jobs do not cause preemptions at once
        claim = self._claim(hash_ids, self._pages_needed(len(prompt_ids), len(prompt_ids) + job.max_new_tokens),
                            headroom=len(self.active), root=adapter_root(lora_uid))
        if claim is None:
            return False
        seq, names, reused = claim
        stop_ids = job.stop_token_ids if job.stop_token_ids is not None else self.default_stop_ids
        run = _Running(job, prompt_ids, seq, self.tokenizer, stop_ids)
        run.cached_tokens = run.state_len = seq.length
        run.named_pages = len(reused)
        run.lora, run.lora_uid = lora, lora_uid
        run.last_name = names[len(reused) - 1] if reused else adapter_root(lora_uid)
        self.stats["reused_tokens"] += seq.length
        self.active.append(run)
        results.append(JobStarted(job=job, identifier=job.identifier, prompt_tokens=run.prompt_len, cached_tokens=run.cached_tokens))
        return True

    def _pages_needed(self, tokens: int, total: int) -> int:
        """Pages a job with ``tokens`` tokens needs for its next step (its draft tokens included), at most its whole length."""
        lookahead = self.num_draft_tokens if self.proposer is not None else 0
        return self.cache.pages_for(min(tokens + lookahead, total))

    def _claim(self, hash_ids: Sequence[int], pages: int, headroom: int = 0,
               root: bytes = ROOT_HASH) -> tuple[SequenceState, list[bytes], list[int]] | None:
        """A sequence holding ``pages`` pages, the leading ones reused from the prefix cache (and a state slot,
        from the deepest checkpoint on a hybrid model); None when they are not free (``headroom`` more must be).
        ``root``: the page names' root (one per LoRA adapter load: pages computed with an adapter are its own)."""
        prefix = self.cache.prefix_cache
        names: list[bytes] = []
        reused: list[int] = []
        if self.prefix_caching:
            # The last token is always computed (its logits give the next token), so reuse stops before its page.
            names = page_hashes(hash_ids[: len(hash_ids) - 1], self.cache.page_size, root)
            reused = prefix.lookup(names)
            if self.state_layers:  # a hybrid job can only start where a state checkpoint was taken
                while reused and reused[-1] not in prefix.checkpoint_of:
                    reused.pop()
        if prefix.available(excluding=reused) < pages - len(reused) + headroom:
            return None
        try:
            seq = self._new_sequence(keep_checkpoint=reused[-1] if reused else None)
        except CacheFullError:
            return None
        if self.state_layers and reused:
            copy_state_slot(self.cache, prefix.checkpoint_of[reused[-1]], seq.state_slot)
        self.cache.allocator.incref(reused)
        seq.pages = reused + prefix.alloc(pages - len(reused))
        seq.length = len(reused) * self.cache.page_size
        return seq, names, reused

    def _resume(self, r: _Running) -> bool:
        """Readmit a preempted job: it prefills its prompt and generated tokens again (cached pages reused)."""
        root = adapter_root(r.lora_uid)
        claim = self._claim(r.prompt_hash_ids + r.tokens[r.prompt_len:],
                            self._pages_needed(len(r.tokens), r.prompt_len + r.job.max_new_tokens), root=root)
        if claim is None:
            return False
        r.seq, names, reused = claim
        r.state_len, r.named_pages = r.seq.length, len(reused)
        r.last_name = names[len(reused) - 1] if reused else root
        at = next((i for i, other in enumerate(self.active) if other.time_started > r.time_started), len(self.active))
        self.active.insert(at, r)  # back in its admission place: the oldest are preempted last
        return True

    def _grow(self) -> None:
        """Give every running job the pages its next step writes; when none are free, preempt the most
        recently admitted job (it is recomputed once pages are free again)."""
        prefix = self.cache.prefix_cache
        for r in list(self.active):
            while r in self.active:
                need = self._pages_needed(len(r.tokens), r.prompt_len + r.job.max_new_tokens) - len(r.seq.pages)
                if need <= 0:
                    break
                if prefix.available() >= need:
                    r.seq.pages += prefix.alloc(need)
                    break
                self._preempt(self.active[-1])

    def _preempt(self, r: _Running) -> None:
        """Free a running job's pages and state; it waits, keeping its tokens, streamed text and sampler state."""
        self._name_full_pages(r)  # its computed pages stay in the prefix cache: resuming may find them
        r.seq.release()
        self._drop_verify_slots(r)
        self.active.remove(r)
        self.preempted.append(r)
        self.preempted.sort(key=lambda run: run.time_started)
        self.stats["preempted"] += 1

    def _new_sequence(self, keep_checkpoint: int | None) -> SequenceState:
        """A SequenceState with its state slot (hybrid models); prefix checkpoints, least recently used
        first, give their slots up to a job (never the one on page ``keep_checkpoint``)."""
        prefix = self.cache.prefix_cache
        while True:
            try:
                return SequenceState(self.cache, with_state_slot=True)
            except CacheFullError:
                if not prefix.drop_checkpoint(excluding=[keep_checkpoint]):
                    raise

    def _spare_slot(self, reserve: int = 0) -> int | None:
        """A free state slot for a snapshot or checkpoint, or None when at most ``reserve`` are free (never fails)."""
        if min(layer.free_slots for layer in self.state_layers) <= reserve:
            return None
        return alloc_state_slot(self.cache)

    # ---- one step ---------------------------------------------------------------------------------

    def _plan(self) -> list[tuple[_Running, list[int], list[int]]]:
        """(job, tokens to feed, draft tokens among them) for each job in this step's batch."""
        decoding = [r for r in self.active if not r.prefilling]
        prefilling = [r for r in self.active if r.prefilling]
        drafts: list[list[int]] = [[] for _ in decoding]
        budget = self.max_chunk_tokens - len(decoding)
        if self.proposer is not None and decoding and budget > 0:
            per_job = min(self.num_draft_tokens, budget // len(decoding))
            requests = [DraftRequest(r.job.job_id, r.tokens, min(per_job, r.remaining - 1)) for r in decoding]
            drafts = [d[: q.max_tokens] for d, q in zip(self.proposer.propose(requests), requests)]
            # a draft is cut where its job's grammar refuses a token: the rest could never be kept
            drafts = [d[: r.grammar.valid_prefix(d)] if r.grammar is not None else d for r, d in zip(decoding, drafts)]
            if self.state_layers and (prefilling or not self._verify_in_graph(decoding, drafts)):
                drafts = [self._snapshot(r, d) for r, d in zip(decoding, drafts)]
        plan = []
        for r, d in zip(decoding, drafts):
            plan.append((r, [r.tokens[-1]] + d, d))
            budget -= len(d)
        for i, r in enumerate(prefilling):
            todo = len(r.tokens) - r.seq.length
            take = min(todo, budget if budget > 0 else (self.cache.page_size if i == 0 else 0))
            if take <= 0:
                break
            if self.state_layers and self.prefix_caching:  # end at a page boundary: the state there is a checkpoint
                boundary = (r.seq.length + take) // self.cache.page_size * self.cache.page_size
                if boundary > r.seq.length:
                    take = boundary - r.seq.length
            if r.mm is not None:
                take = self._image_safe_take(r, take)
            plan.append((r, r.tokens[r.seq.length: r.seq.length + take], []))
            budget -= take
        return plan

    def _verify_in_graph(self, decoding: list[_Running], drafts: list[list[int]]) -> bool:
        """Hybrid models: whether this step's drafts are verified by a captured graph, which runs the recurrent
        layers token by token and leaves each job's state after its token j in the job's ``verify_slots[j]``
        (taken here, kept until the job ends), so no snapshot is needed (see :meth:`_settle_verification`)."""
        if not self._verifies_in_steps or self.graph_runner is None or not any(drafts):
            return False
        need = max(map(len, drafts))
        admissible = max(0, self.max_batch_size - len(self.active))  # slots left for jobs that may still come in
        for r in decoding:
            while len(r.verify_slots) < need:
                slot = self._spare_slot(reserve=admissible)
                if slot is None:
                    return False
                r.verify_slots.append(slot)
        return self._verify_width([(r, [r.tokens[-1]] + d, d) for r, d in zip(decoding, drafts)]) > 0

    def _settle_verification(self, r: _Running, length_before: int) -> None:
        """After a captured verification (hybrid): the state slot took every token of the job's row, placeholders
        included; when fewer were kept, the slot holding the state after the last kept one becomes the job's
        state slot (the two swap)."""
        if r.job.finished or r.state_len == r.seq.length:  # all kept, or a rewind restarted the state
            return
        j = r.seq.length - length_before - 1
        r.seq.state_slot, r.verify_slots[j] = r.verify_slots[j], r.seq.state_slot
        r.state_len = r.seq.length

    def _drop_verify_slots(self, r: _Running) -> None:
        for slot in r.verify_slots:
            free_state_slot(self.cache, slot)
        r.verify_slots = []

    def _snapshot(self, r: _Running, draft: list[int]) -> list[int]:
        """Copy a hybrid job's state aside before its drafts are verified; no spare slot, no drafts."""
        if not draft:
            return draft
        slot = self._spare_slot()
        if slot is None:
            return []
        copy_state_slot(self.cache, r.state_slot, slot)
        r.snapshot_slot = slot
        return draft

    def _settle_snapshot(self, r: _Running, length_before: int) -> None:
        """After verification: when drafts were rejected the state ran past the accepted tokens, so restore
        the snapshot and let the next step re-feed the accepted tokens (the job reads as prefilling)."""
        if r.snapshot_slot is None:
            return
        if not r.job.finished and r.state_len != r.seq.length:
            copy_state_slot(self.cache, r.snapshot_slot, r.state_slot)
            r.seq.length = r.state_len = length_before
        free_state_slot(self.cache, r.snapshot_slot)
        r.snapshot_slot = None

    @staticmethod
    def _image_safe_take(r: _Running, take: int) -> int:
        """Shorten a prefill chunk so it does not cut an image run (Gemma 3 attends within an image in
        both directions, so each image must arrive whole); an image longer than the budget goes whole."""
        start = r.seq.length
        end = r.mm.safe_chunk_end(start, start + take)
        for span in r.mm.spans:
            first, stop = span.rows[0], span.rows[-1] + 1
            if first < end < stop:
                end = stop
        return end - start

    def _launch(self, plan: list[tuple[_Running, list[int], list[int]]], results: list[Result],
                feed_from: tuple[torch.Tensor, list[int]] | None = None, ahead: int = 0,
                masks_after_commit: bool = False) -> _Launched | None:
        """Run ``plan``'s forward and choose its tokens on the device; start copying them to the host.
        ``feed_from`` = (token ids on the device, the row of each job's next token in them): feed those
        instead of ``plan``'s (still unknown) tokens, ``ahead`` tokens past each job's committed ones.
        ``masks_after_commit``: only queue the forward; the tokens are chosen by :meth:`_choose_after_commit`
        once the grammar states have taken the tokens fed here."""
        width = self._verify_width(plan)
        # a captured verification: every job's fed tokens, then placeholders, fill ``width`` rows
        lens = [width or len(feed) for _, feed, _ in plan]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        # Logits for: the last token of a chunk that completes a prompt, every fed token of a decode with drafts.
        rows: list[int] = []
        row_start: list[int] = []
        sampled: list[int] = []  # plan indices of the jobs that get logits
        for i, (r, feed, draft) in enumerate(plan):
            row_start.append(len(rows) if not width else cu[i])
            if r.seq.length + len(feed) - len(draft) == len(r.tokens):
                rows += range(cu[i] + len(feed) - len(draft) - 1, cu[i] + len(feed))
                sampled.append(i)
        if width:
            rows = list(range(cu[-1]))  # the graph's logits: every row, placeholders included (never read)
        # On CUDA the forward is only queued here, so this thread fills the masks after it, while the device
        # runs it; a CPU forward runs on this thread, so the engine's worker fills them beside it.
        beside = self.cache.device.type != "cuda" and not masks_after_commit
        masks = self._grammar_masks(plan, row_start, sampled, len(rows)) if beside else None
        try:
            logits = self._forward(plan, rows, feed_from, ahead, width)
            hidden = None
            if self.hidden_sink is not None:
                hidden, logits = logits
            step = _Launched(plan, cu, row_start, None, None, -1, {}, hidden, width, sampled, logits)
            self._launches += 1
            self.stats["steps_ahead"] += ahead
            if not masks_after_commit:
                if not beside:
                    masks = self._grammar_masks(plan, row_start, sampled, len(rows), now=True)
                self._pick(step, sampled, masks, ahead, feed_from)
        except Exception as exc:  # keep serving: fail this batch's jobs, free their pages
            self._fail(plan, exc, results)
            return None
        return step

    def _pick(self, step: _Launched, sampled: list[int], masks: Any, ahead: int = 0,
              feed_from: tuple[torch.Tensor, list[int]] | None = None) -> None:
        """Mask ``step``'s logits with its grammar masks (if any), choose the tokens of the jobs ``sampled`` and
        start reading them back."""
        logits, step.logits = step.logits, None
        if masks is not None:
            self._grammar_engine.apply_masks(logits, masks)
        step.ids, packed, step.top, step.full = self._choose(step.plan, step.row_start, sampled, logits, ahead, feed_from)
        step.readback = self._readback[self._launches % 2].start(packed) if packed is not None else None

    def _choose_after_commit(self, step: _Launched, results: list[Result]) -> _Launched | None:
        """Async scheduling with grammars: ``step`` (queued ahead, its forward running on the device) gets its
        masks now that the step before it is committed, so the grammar states hold every token its jobs
        were fed; masking and sampling then queue behind the forward, which the mask computation overlapped.
        Jobs that finished meanwhile are not sampled. Chosen exactly as a synchronous step would be."""
        live = [i for i in step.sampled if not step.plan[i][0].job.finished]
        try:
            masks = self._grammar_masks(step.plan, step.row_start, live, step.logits.shape[0], now=True)
            self._pick(step, live, masks)
        except Exception as exc:  # keep serving: fail this batch's jobs, free their pages
            self._fail([step.plan[i] for i in live], exc, results)
            return None
        return step

    def _complete(self, step: _Launched, results: list[Result]) -> None:
        """Read ``step``'s tokens back and commit them: accept, stream, finish, name full pages. Jobs that
        finished while it ran (a step queued ahead of its predecessor's read-back) are skipped."""
        plan, cu, row_start = step.plan, step.cu, step.row_start
        waited = time.perf_counter()
        try:
            picked, logprobs = step.tokens()
        except Exception as exc:  # an error the device raised while running the step
            self._fail([entry for entry in plan if not entry[0].job.finished], exc, results)
            return
        self.stats["readback_wait_s"] += time.perf_counter() - waited
        self.stats["steps"] += 1
        self.stats["forward_tokens"] += cu[-1]
        for i, (r, feed, draft) in enumerate(plan):
            if r.job.finished:
                continue
            completes = r.seq.length + len(feed) - len(draft) == len(r.tokens)
            length_before = r.seq.length
            r.seq.length += len(feed)
            r.state_len = length_before + (step.width or len(feed))  # a verification graph's row: placeholders too
            if not r.generated:  # still in the prompt
                self.stats["prefilled_tokens"] += len(feed) - len(draft)
                results.append(PrefillProgress(job=r.job, identifier=r.job.identifier,
                                               prefilled=min(r.seq.length, r.prompt_len), total=r.prompt_len))
            if completes:
                a, b = row_start[i], row_start[i] + len(draft) + 1
                try:
                    if i in step.full:
                        self._accept(r, step.full[i], draft, results)
                    else:
                        self._accept(r, None, draft, results, picked[a:b], logprobs[a:b] if logprobs else None)
                except Exception as exc:  # e.g. a plugin sampler step failed: fail this job only
                    if not r.job.finished:
                        r.seq.length = min(r.seq.length, len(r.tokens) - 1)
                        self._finish(r, EOS_ERROR, results, error=repr(exc))
                    continue
            if step.width and self.state_layers:
                self._settle_verification(r, length_before)
            self._settle_snapshot(r, length_before)
            if not r.job.finished:
                self._name_full_pages(r)
                if step.hidden is not None:
                    self._hand_hidden(r, feed, length_before, step.hidden[cu[i]: cu[i + 1]])

    def _fail(self, plan, exc: Exception, results: list[Result]) -> None:
        warnings.warn(f"trellm generator: a step failed ({exc!r}); failing {len(plan)} jobs")
        for r, _, _ in plan:
            self._finish(r, EOS_ERROR, results, error=repr(exc))

    def _launch_next(self, step: _Launched, results: list[Result]) -> _Launched | None:
        """Async scheduling: the next decode step of ``step``'s jobs, queued on the device before ``step`` is
        read back, each job feeding the token ``step`` chose, which never leaves the device. The host then
        commits ``step`` while the device runs this one, so the device does not wait for the host's
        bookkeeping between steps. A job that finishes at ``step`` wastes its row here (skipped when read).
        Grammar jobs run ahead too, but their step's tokens are chosen after ``step`` is committed (the masks
        need the grammar states after ``step``'s tokens): see :meth:`_choose_after_commit`.
        None (the next iterate() schedules on the host's view) when the next step needs what only the host
        knows: waiting or cancelled jobs, drafts, host-side sampling, banned strings,
        images, a recurrent state checkpoint due, or pages that are not free without preempting."""
        live = [(i, entry) for i, entry in enumerate(step.plan) if not entry[0].job.finished]
        if (step.ids is None or self.proposer is not None or self.hidden_sink is not None
                or self.preempted or (self.pending and len(self.active) < self.max_batch_size)
                or len(live) != len(self.active)):
            return None
        if self.state_layers and self.prefix_caching and any(
                (r.seq.length + 1) % self.cache.page_size == 0 for _, (r, _, _) in live):
            return None  # committing ``step`` fills a page, whose state checkpoint must not include the next token
        adapters = lora_set(self.model, create=False)
        plan: list[tuple[_Running, list[int], list[int]]] = []
        rows: list[int] = []
        for i, (r, feed, draft) in live:
            settings = r.row_sampling
            if (draft or len(feed) != 1 or r.prefilling or r.job.cancel_requested
                    or r.mm is not None or r.banned or r.bans or settings is None):
                return None
            if r.lora is not None and (adapters is None or r.lora not in adapters or adapters.uid(r.lora) != r.lora_uid):
                return None
            if r.remaining > 1:  # else ``step`` gives its last token
                plan.append((r, [0], []))
                rows.append(step.row_start[i])
        if not plan:
            return None
        prefix = self.cache.prefix_cache
        need = [self._pages_needed(len(r.tokens) + 1, r.prompt_len + r.job.max_new_tokens) - len(r.seq.pages)
                for r, _, _ in plan]
        if sum(max(n, 0) for n in need) > prefix.available():
            return None
        for (r, _, _), n in zip(plan, need):
            if n > 0:
                r.seq.pages += prefix.alloc(n)
        grammars = any(r.grammar is not None for r, _, _ in plan)
        return self._launch(plan, results, feed_from=(step.ids, rows), ahead=1, masks_after_commit=grammars)

    def _grammar_masks(self, plan, row_start: list[int], sampled: list[int], num_rows: int, now: bool = False) -> Any:
        """The token masks of the grammar jobs ``sampled`` this step, or None when none is sampled: a future
        computed on the engine's worker while this thread runs the forward, or (``now``) computed here."""
        jobs = [i for i in sampled if plan[i][0].grammar is not None]
        if not jobs:
            return None
        entries = [(plan[i][0].grammar, row_start[i], plan[i][2]) for i in jobs]
        stops = [plan[i][0].stop_ids if plan[i][0].stop_ids is not self.default_stop_ids else None for i in jobs]
        engine = self._grammar_engine
        return (engine.fill_masks if now else engine.start_masks)(entries, num_rows, stops)

    def _verify_width(self, plan: list[tuple[_Running, list[int], list[int]]]) -> int:
        """Tokens per row of the captured verification graph that runs ``plan`` (k + 1, k its longest draft),
        captured now if need be; 0 when the step runs otherwise (no drafts, prefill chunks, images, no graph)."""
        runner = self.graph_runner
        if runner is None or not any(draft for _, _, draft in plan):
            return 0
        if any(r.mm is not None or len(feed) != len(draft) + 1 or r.seq.length != len(r.tokens) - 1 for r, feed, draft in plan):
            return 0
        width = 1 + max(len(draft) for _, _, draft in plan)
        if self.state_layers and any(len(r.verify_slots) < width - 1 or r.snapshot_slot is not None for r, _, _ in plan):
            return 0  # each row's state after each of its tokens needs a slot (see _verify_in_graph)
        if not runner.fits([r.seq.pages for r, _, _ in plan], width) or runner.graph_size(len(plan), width) is None:
            return 0
        return width

    def _forward(self, plan: list[tuple[_Running, list[int], list[int]]], rows: list[int],
                 feed_from: tuple[torch.Tensor, list[int]] | None = None, ahead: int = 0, width: int = 0) -> Any:
        """Build the step's batch (one host->device copy) and run it: a captured graph for a plain decode step
        or (``width``: see :meth:`_verify_width`) a draft verification on CUDA, else the model eagerly. Returns
        logits of ``rows`` (with a hidden-state sink: ``(hidden, logits)``). ``feed_from``, ``ahead``: see
        :meth:`_launch`."""
        feeds = [feed for _, feed, _ in plan]
        cached = [r.seq.length + ahead for r, _, _ in plan]
        pages = [r.seq.pages for r, _, _ in plan]
        runner = self.graph_runner
        states = [r.state_slot for r, _, _ in plan] if self.state_layers else None
        if width:
            size = runner.graph_size(len(plan), width)
            checkpoints = [r.verify_slots[: width - 1] for r, _, _ in plan] if self.state_layers else None
            runner.stage(size, feeds, cached, pages, self._lora_slots(plan), states, width=width, checkpoint_slots=checkpoints)
            return runner.replay(size, len(plan), width)
        if (runner is not None and len(rows) == len(plan) == sum(len(f) for f in feeds)
                and all(r.mm is None for r, _, _ in plan) and max(len(p) for p in pages) <= runner.max_pages):
            size = runner.graph_size(len(plan))
            if size is not None:
                staged = runner.stage(size, feeds, cached, pages, self._lora_slots(plan), states)
                _feed_on_device(staged, feed_from)
                return runner.replay(size, len(plan))
        batch = self.step_buffers.build(feeds, cached, pages, self.cache, rows, state_slots=states,
                                        lora_slots=self._lora_slots(plan))
        _feed_on_device(batch, feed_from)
        if any(r.mm is not None for r, _, _ in plan):  # image embeddings (prefill) and M-RoPE positions (every step)
            attach_images(batch, [(r.mm, r.seq.length) for r, _, _ in plan])
        if self.hidden_sink is not None:  # the same forward, split where the proposer reads the hidden states
            hidden = self.model.hidden_states(batch)
            return hidden, self.model.logits_from_hidden(hidden, batch)
        return self.model.forward(batch)

    def _choose(self, plan, row_start: list[int], sampled: list[int], logits: torch.Tensor, ahead: int = 0,
                feed_from: tuple[torch.Tensor, list[int]] | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, int, dict[int, torch.Tensor]]:
        """Tokens of the jobs ``sampled`` (plan indices), chosen on the logits' device for the whole batch:
        the argmax of every row when each job takes plain argmaxes, else every row through the
        :class:`DeviceSampler`. Returns (int64 ids per logits row on the device, what to read back: the ids and,
        when a job asks for them, each row's log-probability and best ``top`` tokens; ``top`` (-1: none);
        float32 CPU logits rows of each job whose stack only runs on the host)."""
        slow = {i for i in sampled if plan[i][0].row_sampling is None}
        fast = [i for i in sampled if i not in slow]
        ids, top = None, -1
        if fast and all(plan[i][0].argmax_now(ahead) for i in fast):
            ids = logits.argmax(dim=-1)
        elif fast:
            rows = [SampleRow(_ARGMAX, 0.0)] * logits.shape[0]
            for i in fast:
                rows[row_start[i]: row_start[i] + len(plan[i][2]) + 1] = self._sample_rows_of(*plan[i], ahead=ahead)
            unseen = None
            if feed_from is not None:  # penalties count the token each job was fed, still on the device
                unseen = (feed_from[0], [(row_start[i], feed_from[1][i]) for i in fast if rows[row_start[i]].history is not None])
            ids = self.device_sampler.sample(logits, rows, unseen)
            top = max((plan[i][0].job.top_logprobs for i in fast if plan[i][0].job.logprobs), default=-1)
        packed = ids
        if top >= 0:  # the model's raw log-probabilities of the chosen tokens, and the best ``top`` of each row
            lp = torch.log_softmax(logits.float(), dim=-1)
            values, indices = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
            packed = torch.cat([ids.double(), lp.gather(1, ids[:, None]).squeeze(1).double(), values.double().flatten(),
                                indices.double().flatten()])
            top = values.shape[-1]
        full = {}
        if slow:  # queued behind the device work above, so it runs while these rows copy
            every = logits.float().cpu() if not fast else None
            for i in slow:
                a, b = row_start[i], row_start[i] + len(plan[i][2]) + 1
                full[i] = every[a:b] if every is not None else logits[a:b].float().cpu()
        return ids, packed, top, full

    def _sample_rows_of(self, r: _Running, feed: list[int], draft: list[int], ahead: int = 0) -> list[SampleRow]:
        """The rows job ``r`` samples this step: one per draft position and one after the draft, position ``pos``
        drawing generated token ``len(r.generated) + ahead + pos`` as if the draft before it was accepted."""
        settings = r.row_sampling
        out = []
        for pos in range(len(draft) + 1):
            index = len(r.generated) + ahead + pos
            exclude = list(r.bans.get(index, ()))
            if index < r.job.min_new_tokens:
                exclude += r.stop_ids
            history = None
            if settings.penalized:  # (the context is copied only when the penalties count it: O(context) per row)
                # a token chosen ahead is not known here: -1 holds its place (the device sampler counts it)
                context = r.tokens + [-1] * ahead + draft[:pos] if ahead or pos else r.tokens
                history = settings.counted(context, r.prompt_len)
            out.append(SampleRow(settings, uniform_for(r.seed, index), history, exclude))
        return out

    def _hand_hidden(self, r: _Running, feed: list[int], start: int, hidden: torch.Tensor) -> None:
        """Give the proposer the hidden states of the fed positions that hold committed tokens (the leading
        run of ``feed`` the job kept: rejected draft tokens and rewound ones are left out)."""
        kept = 0
        while kept < len(feed) and start + kept < len(r.tokens) and feed[kept] == r.tokens[start + kept]:
            kept += 1
        if kept:
            self.hidden_sink(r.job.job_id, start, hidden[:kept], r.tokens)

    def _accept(self, r: _Running, logits: torch.Tensor | None, draft: list[int], results: list[Result],
                picked: list[int] | None = None, logprobs: list[tuple[float, list]] | None = None) -> None:
        """Sample at each fed position; keep draft tokens while the target agrees, then roll the cache back.

        ``picked``: the tokens already chosen at each position (on the device), with ``logprobs`` (each one's
        log-probability and top tokens) when the job asks for them; else ``logits`` rows are sampled here. New tokens and text go to the job's held buffer first. It is released as a TokenChunk at once,
        except for a job with banned strings while its text could still grow into one: if a banned
        string completes, the job rewinds to the last release point and bans the token taken there.
        """
        finish: tuple[str, dict] | None = None
        rewound = False
        r.draft_proposed += len(draft)
        self.stats["draft_proposed"] += len(draft)
        for pos in range(len(draft) + 1):
            token = picked[pos] if picked is not None else self._sample(r, logits[pos])
            if pos < len(draft) and token == draft[pos]:
                r.draft_accepted += 1
                self.stats["draft_accepted"] += 1
            if r.time_first_token is None:
                r.time_first_token = time.time()
            if token in r.stop_ids and len(r.generated) >= r.job.min_new_tokens:
                finish = (EOS_STOP_TOKEN, {"stop_token": token})
                break
            r.tokens.append(token)
            r.generated.append(token)
            r.held_ids.append(token)
            if r.grammar is not None and not r.grammar.consume(token):
                finish = (EOS_ERROR, {"error": f"token {token} breaks the job's grammar: {r.grammar.error}"})
                break
            if r.job.logprobs and logprobs is not None:
                r.held_logprobs.append(logprobs[pos][0])
                if r.job.top_logprobs:
                    r.held_tops.append(logprobs[pos][1][: r.job.top_logprobs])
            elif r.job.logprobs:
                lp = torch.log_softmax(logits[pos], dim=-1)
                r.held_logprobs.append(float(lp[token]))
                if r.job.top_logprobs:
                    v, ix = torch.topk(lp, min(r.job.top_logprobs, lp.shape[-1]))
                    r.held_tops.append([(int(a), float(b)) for a, b in zip(ix, v)])
            self.stats["decoded_tokens"] += 1
            emitted, stopped = r.matcher.feed(r.decoder.push(token) if r.decoder is not None else "")
            r.held_text += emitted
            if stopped and r.matcher.matched in r.banned:
                self._rewind(r)
                rewound = True
                break
            if stopped:
                finish = (EOS_STOP_STRING, {"stop_string": r.matcher.matched})
                break
            if r.grammar is not None and r.grammar.finished:
                finish = (EOS_GRAMMAR_END, {})
                break
            if r.remaining <= 0:
                finish = (EOS_MAX_NEW_TOKENS, {})
                break
            if pos >= len(draft) or token != draft[pos]:
                break
        r.seq.length = len(r.tokens) - 1  # drop cache entries of rejected draft tokens (and rewound ones)
        if rewound and self.state_layers:
            self._restart_state(r)
        if finish is not None or not r.banned or not r.matcher.pending:
            self._release(r, results)
        if finish is not None:
            self._finish(r, finish[0], results, **finish[1])

    def _restart_state(self, r: _Running) -> None:
        """After a rewind the recurrent state is ahead of the tokens: restart from the deepest checkpoint of
        the job's own pages (the prefill recomputes the rest), or from the zero state."""
        prefix, page_size = self.cache.prefix_cache, self.cache.page_size
        for i in range(min((len(r.tokens) - 1) // page_size, len(r.seq.pages)) - 1, -1, -1):
            slot = prefix.checkpoint_of.get(r.seq.pages[i])
            if slot is not None:
                copy_state_slot(self.cache, slot, r.state_slot)
                r.seq.length = r.state_len = (i + 1) * page_size
                return
        r.seq.length = r.state_len = 0

    def _release(self, r: _Running, results: list[Result]) -> None:
        """Stream the held tokens and text (a release point: nothing before it is ever rewound)."""
        if r.held_ids or r.held_text:
            r.text_parts.append(r.held_text)
            results.append(TokenChunk(
                job=r.job, identifier=r.job.identifier, text=r.held_text, token_ids=r.held_ids,
                logprobs=r.held_logprobs if r.job.logprobs else None,
                top_logprobs=r.held_tops if r.job.top_logprobs else None,
            ))
        r.held_ids, r.held_logprobs, r.held_tops, r.held_text = [], [], [], ""
        r.released = len(r.generated)

    def _rewind(self, r: _Running) -> None:
        """A banned string completed: drop what followed the last release point, ban the token chosen there."""
        keep = r.released
        r.bans.setdefault(keep, set()).add(r.generated[keep])
        if r.grammar is not None:
            r.grammar.rollback(len(r.generated) - keep)
        del r.generated[keep:]
        del r.tokens[r.prompt_len + keep:]
        r.held_ids, r.held_logprobs, r.held_tops, r.held_text = [], [], [], ""
        r.matcher = StopStringMatcher(r.job.stop_strings + r.banned)
        r.decoder = self.tokenizer.stream(skip_special_tokens=not r.job.decode_special_tokens)
        r.decoder.push_many(r.generated)
        r.rewinds += 1
        if r.rewinds >= MAX_REWINDS:  # give up on a string the model insists on rather than loop forever
            r.banned = []
            r.matcher = StopStringMatcher(r.job.stop_strings)

    def _sample(self, r: _Running, logits: torch.Tensor) -> int:
        """One token from a job's stack on the host (its stack has a step the device sampler lacks)."""
        ctx = SamplingContext(tokens=r.tokens, prompt_len=r.prompt_len, generator=r.rng)
        index = len(r.generated)
        exclude: list[int] = list(r.bans.get(index, ()))
        if index < r.job.min_new_tokens:
            exclude += [t for t in r.stop_ids if 0 <= t < logits.shape[-1]]
        return r.sampler.sample(logits, ctx, exclude, u=uniform_for(r.seed, index))

    def _name_full_pages(self, r: _Running) -> None:
        """Enter the job's newly completed pages into the prefix cache."""
        if not self.prefix_caching:
            return
        page_size = self.cache.page_size
        final = r.prompt_len + r.released if r.banned else len(r.tokens)  # a rewind may still rewrite the rest
        full = min(r.seq.length, len(r.tokens), final) // page_size
        while r.named_pages < full:
            i = r.named_pages
            page = r.tokens[i * page_size:(i + 1) * page_size]
            if r.mm is not None and i * page_size < r.prompt_len:
                page = (r.prompt_hash_ids + r.tokens[r.prompt_len:])[i * page_size:(i + 1) * page_size]
            r.last_name = page_hashes(page, page_size, r.last_name)[0]
            self.cache.prefix_cache.insert(r.last_name, r.seq.pages[i], i)
            r.named_pages += 1
            if self.state_layers and r.state_len == r.named_pages * page_size <= r.seq.length:
                self._checkpoint(r)

    def _checkpoint(self, r: _Running) -> None:
        """Keep a copy of the job's state (it just absorbed a named page's last token) for later prompts."""
        prefix = self.cache.prefix_cache
        page = prefix.page_of.get(r.last_name)
        if page is None or page in prefix.checkpoint_of:
            return
        # leave a slot free for each running job's draft snapshot
        slot = self._spare_slot(reserve=len(self.active) if self.proposer is not None else 0)
        if slot is not None:
            copy_state_slot(self.cache, r.state_slot, slot)
            prefix.set_checkpoint(page, slot)

    # ---- finishing --------------------------------------------------------------------------------

    def _finish_cancelled(self, results: list[Result]) -> None:
        for r in [r for r in self.active + self.preempted if r.job.cancel_requested]:
            self._finish(r, EOS_CANCELLED, results)
        if any(job.cancel_requested for job, _ in self.pending):
            keep = deque()
            for job, ids in self.pending:
                if job.cancel_requested:
                    job.finished = True
                    results.append(JobFinished(
                        job=job, identifier=job.identifier, eos_reason=EOS_CANCELLED, text="", token_ids=[],
                        prompt_tokens=len(ids), time_enqueued=job.time_enqueued or 0.0,
                    ))
                else:
                    keep.append((job, ids))
            self.pending = keep

    def _finish_unloaded_adapters(self, results: list[Result]) -> None:
        """Fail running jobs whose LoRA adapter was unloaded (or replaced) since they started."""
        adapters = lora_set(self.model, create=False)
        for r in [r for r in self.active if r.lora is not None]:
            if adapters is None or r.lora not in adapters or adapters.uid(r.lora) != r.lora_uid:
                self._finish(r, EOS_ERROR, results, error=f"LoRA adapter {r.lora!r} was unloaded while the job ran")

    def _finish(self, r: _Running, reason: str, results: list[Result], **extra: Any) -> None:
        self._release(r, results)  # held tokens are final now (cancelled, out of tokens ...)
        tail = ""
        if reason != EOS_STOP_STRING:
            if r.decoder is not None:
                tail, _ = r.matcher.feed(r.decoder.flush())
            tail += r.matcher.flush()
        if tail:
            r.text_parts.append(tail)
            results.append(TokenChunk(job=r.job, identifier=r.job.identifier, text=tail, token_ids=[]))
        if reason != EOS_ERROR:
            self._name_full_pages(r)  # finished jobs' pages stay cached for later prompts (multi-turn chat)
        r.seq.release()  # pages and state slot
        if r.snapshot_slot is not None:
            free_state_slot(self.cache, r.snapshot_slot)
            r.snapshot_slot = None
        self._drop_verify_slots(r)
        if self.proposer is not None:
            self.proposer.release(r.job.job_id)
        (self.active if r in self.active else self.preempted).remove(r)
        r.job.finished = True
        results.append(JobFinished(
            job=r.job, identifier=r.job.identifier, eos_reason=reason, text="".join(r.text_parts),
            token_ids=list(r.generated), prompt_tokens=r.prompt_len, cached_tokens=r.cached_tokens,
            generated_tokens=len(r.generated), time_enqueued=r.job.time_enqueued or 0.0, time_started=r.time_started,
            time_first_token=r.time_first_token, draft_proposed=r.draft_proposed, draft_accepted=r.draft_accepted, **extra,
        ))

