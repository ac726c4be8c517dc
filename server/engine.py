"""The served model: loading and unloading, the generator behind it, and the bounded job queue.

One :class:`ModelHost` lives for the server's lifetime. Loading runs in a worker thread so the event
loop keeps answering (``/health`` says 503 meanwhile). Requests submit :class:`trellm.generator.Job`
objects through :meth:`ModelHost.submit`, which refuses work beyond ``max_batch_size + max_queue``
jobs in flight: the caller turns that into 429 with ``Retry-After``.

A load builds the new model beside the loaded one and swaps only when it succeeded, so a failed
load leaves the old model serving. On shutdown :meth:`ModelHost.drain` stops admitting, waits for
running requests, and ends what is left with a 503 ``server_shutting_down`` error.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
import weakref
from pathlib import Path
from typing import Any

import attrs

from trellm.generator import AsyncGenerator, AsyncJob, DraftModelProposer, Generator, Job, NgramProposer

from .config import ServerConfig
from .errors import APIError
from .metrics import ServerMetrics
from .template_sandbox import TemplateSandbox

log = logging.getLogger("trellm.server")

STATE_EMPTY, STATE_LOADING, STATE_READY, STATE_FAILED = "empty", "loading", "ready", "failed"


class QueueFullError(Exception):
    """More jobs in flight than the server admits; answered with 429."""

    def __init__(self, in_flight: int, limit: int):
        super().__init__(f"the server is busy: {in_flight} jobs in flight, limit {limit}; retry shortly")
        self.in_flight, self.limit = in_flight, limit


class ModelNotReadyError(Exception):
    """No model is loaded (loading, failed or unloaded), or the server is stopping; answered with 503."""

    def __init__(self, message: str, code: str = "model_not_ready"):
        super().__init__(message)
        self.code = code


def shutting_down_error(detail: str) -> APIError:
    return APIError(503, f"the server is shutting down: {detail}", "server_error", code="server_shutting_down",
                    headers={"Retry-After": "5"})


@attrs.define
class LoadSettings:
    """What one model load uses (from the config, or an admin load request)."""

    model_dir: Path
    model_name: str
    cache_size: int
    page_size: int
    cache_bits: tuple[int, int] | None
    draft_model: Path | None
    num_draft_tokens: int
    max_batch_size: int
    max_chunk_tokens: int
    device: str | None
    dtype: str | None
    loras: dict[str, str] = attrs.field(factory=dict)  # NAME -> PEFT adapter directory, served as <model_name>:NAME
    tensor_parallel: int = 1
    gpu_split: str | list[float] | None = None

    @classmethod
    def from_config(cls, config: ServerConfig, model_dir: Path) -> "LoadSettings":
        return cls(
            model_dir=model_dir, model_name=config.model_name or model_dir.name, cache_size=config.cache_size,
            page_size=config.page_size, cache_bits=config.cache_bits,
            draft_model=Path(config.draft_model) if config.draft_model else None, num_draft_tokens=config.num_draft_tokens,
            max_batch_size=config.max_batch_size, max_chunk_tokens=config.max_chunk_tokens,
            device=config.device, dtype=config.dtype, loras=dict(config.lora),
            tensor_parallel=config.tensor_parallel, gpu_split=config.gpu_split,
        )


class ModelHost:
    """Holds the loaded model and its AsyncGenerator; counts jobs in flight against the queue limit."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.state = STATE_EMPTY
        self.error: str | None = None
        self.settings: LoadSettings | None = None
        self.lm: Any = None
        self.generator: Generator | None = None
        self.agen: AsyncGenerator | None = None
        self.loaded_at: float | None = None
        self.in_flight = 0
        self.draining = False
        self.metrics = ServerMetrics(known_routes=set())  # create_app names the routes
        self.template_sandbox = (TemplateSandbox(config.template_timeout_s, config.template_memory_mb)
                                 if config.allow_request_chat_template else None)
        self._live_jobs: weakref.WeakSet[AsyncJob] = weakref.WeakSet()
        self._load_lock = asyncio.Lock()

    # ---- state ------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == STATE_READY

    @property
    def model_name(self) -> str | None:
        return self.settings.model_name if self.settings else None

    @property
    def tokenizer(self):
        return self.lm.tokenizer if self.lm is not None else None

    @property
    def job_limit(self) -> int:
        return self.settings.max_batch_size + self.config.max_queue if self.settings else 0

    @property
    def max_model_len(self) -> int | None:
        """The most tokens (prompt + new) one request may use: the model's context or the cache, whichever is less."""
        if self.generator is None:
            return None
        context = int(getattr(self.lm.config, "max_position_embeddings", 0) or 0)
        capacity = self.generator.capacity_tokens
        return min(context, capacity) if context else capacity

    def adapter_for(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names: ``<model_name>:NAME`` -> NAME, the model's own name (or
        None, or any name when names are not strict) -> None; raises LookupError for an adapter not loaded."""
        base = self.model_name
        if model is None or model == base:
            return None
        prefix = f"{base}:"
        if model.startswith(prefix):
            name = model[len(prefix):]
            if name not in self.loras:
                raise LookupError(f"the model {model!r} does not exist here: no LoRA adapter {name!r} is loaded "
                                  f"(loaded: {sorted(self.loras) or 'none'})")
            return name
        if self.config.strict_model_name:
            raise LookupError(f"the model {model!r} does not exist here; this server serves {base!r}"
                              + "".join(f", {base}:{n}" for n in self.loras))
        return None

    @property
    def loras(self) -> list[str]:
        """Names of the LoRA adapters loaded into the model."""
        return self.lm.loras if self.lm is not None else []

    async def load_lora(self, name: str, path: str, scale: float = 1.0) -> None:
        """Load a PEFT adapter as ``<model_name>:name`` between generator steps; raises LoraError for a bad one."""
        self.require_ready()
        await asyncio.to_thread(self.agen.between_steps, lambda: self.lm.load_lora(path, name=name, scale=scale))

    async def unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` between steps; its running jobs end with an error."""
        self.require_ready()
        await asyncio.to_thread(self.agen.between_steps, lambda: self.lm.unload_lora(name))

    def require_ready(self) -> None:
        if self.draining:
            raise ModelNotReadyError("the server is shutting down; no new requests are admitted", "server_shutting_down")
        if not self.ready:
            detail = {STATE_LOADING: "the model is still loading", STATE_FAILED: f"the model failed to load: {self.error}",
                      STATE_EMPTY: "no model is loaded (POST /v1/model/load with the admin key)"}[self.state]
            raise ModelNotReadyError(detail)

    # ---- load / unload ----------------------------------------------------------------------------

    async def load(self, settings: LoadSettings) -> None:
        """Load ``settings.model_dir`` beside the loaded model, then swap (the old one's requests end with 503);
        raises what loading raised, and the old model keeps serving. The new model's decode graphs are captured after the
        old one is gone (state "loading" meanwhile); should that raise, the state is "failed"."""
        async with self._load_lock:
            if not self.ready:
                self.state, self.settings = STATE_LOADING, settings
            try:
                lm, generator = await asyncio.to_thread(_build, settings)
            except BaseException as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("loading %s failed: %s", settings.model_dir, self.error)
                if not self.ready:
                    self.state = STATE_FAILED
                raise
            await self._unload_now()
            self.state, self.settings = STATE_LOADING, settings  # (requests meanwhile hear "still loading")
            try:
                # every decode graph now, on no other model's time (a capture met mid-serving stalls every stream)
                await asyncio.to_thread(generator.capture_graphs)
            except BaseException as exc:
                lm.close()  # a tensor-parallel model's other ranks
                self.state, self.error = STATE_FAILED, f"{type(exc).__name__}: {exc}"
                log.error("capturing the decode graphs of %s failed: %s", settings.model_dir, self.error)
                raise
            self.lm, self.generator, self.settings, self.error = lm, generator, settings, None
            self.agen = AsyncGenerator(generator)
            self.state, self.loaded_at = STATE_READY, time.time()
            log.info("model %s ready (%s, cache %d tokens, page %d, cache_bits %s)", settings.model_name, lm,
                     generator.capacity_tokens, settings.page_size, settings.cache_bits or "fp16")

    async def unload(self) -> None:
        async with self._load_lock:
            await self._unload_now()

    async def _unload_now(self) -> None:
        if self.agen is not None:
            await self.agen.close()  # cancels running jobs; their streams end with finish_reason "cancelled"
        if self.lm is not None:
            self.lm.close()  # a tensor-parallel model's other ranks
        self.lm = self.generator = self.agen = None
        self.state, self.loaded_at = STATE_EMPTY, None
        gc.collect()

    # ---- jobs -------------------------------------------------------------------------------------

    def submit(self, jobs: list[Job]) -> list[AsyncJob]:
        """Submit jobs together or not at all (429 when the queue would overflow, 400 for a job too large)."""
        self.require_ready()
        if self.in_flight + len(jobs) > self.job_limit:
            raise QueueFullError(self.in_flight, self.job_limit)
        submitted: list[AsyncJob] = []
        try:
            for job in jobs:
                submitted.append(self.agen.submit(job))
        except BaseException:
            for aj in submitted:
                aj.cancel()
            raise
        self.in_flight += len(submitted)
        self._live_jobs.update(submitted)
        return submitted

    def release(self, count: int) -> None:
        """Called by a request when its jobs are finished or cancelled."""
        self.in_flight = max(0, self.in_flight - count)

    async def drain(self, grace_s: float) -> None:
        """Stop admitting; give running requests ``grace_s`` to finish, then end the rest with 503
        ``server_shutting_down`` (a stream gets it as its last event before ``[DONE]``)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        if self.in_flight:
            log.info("shutting down: waiting up to %.1f s for %d jobs", grace_s, self.in_flight)
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = [aj for aj in self._live_jobs if aj.final is None]
        if not left:
            return
        log.warning("shutting down: cancelling %d jobs after the %.1f s grace period", len(left), grace_s)
        for aj in left:
            aj.queue.put_nowait(shutting_down_error(f"the request was cancelled after the {grace_s:g} s grace period"))
            aj.cancel()
        while self.in_flight and loop.time() < deadline + 5:  # let the responses be written
            await asyncio.sleep(0.05)


MTP_DRAFT = "mtp"  # draft_model value: draft with the model's multi-token-prediction head (trellm.generator.mtp)
NGRAM_DRAFT = "ngram"  # draft_model value: prompt lookup (trellm.generator.NgramProposer), no model
BUILTIN_DRAFTS = (MTP_DRAFT, NGRAM_DRAFT)  # draft_model values that name a proposer, not a directory


def _build(settings: LoadSettings) -> tuple[Any, Generator]:
    """Blocking: load the model (and draft model) and build the cache and generator."""
    import trellm

    if not (settings.model_dir / "config.json").is_file():
        from trellm.errors import ConfigError

        raise ConfigError(f"{settings.model_dir}: not a model directory (no config.json)")
    lm = trellm.load(settings.model_dir, device=settings.device, dtype=settings.dtype,
                     tensor_parallel=settings.tensor_parallel, gpu_split=settings.gpu_split, context=settings.cache_size)
    try:
        for name, path in settings.loras.items():
            lm.load_lora(path, name=name)
    except BaseException:
        lm.close()  # a tensor-parallel model's workers end with the refusal
        raise
    cache = None  # fp16: the generator builds it (a hybrid model's cache also holds recurrent-state slots)
    if settings.cache_bits is not None:
        from trellm.cache.quantized import quantized_cache
        from trellm.capabilities import is_hybrid
        from trellm.errors import ConfigError

        if is_hybrid(lm.model):
            raise ConfigError(f"{settings.model_dir}: cache_bits is not supported for models with recurrent layers; "
                              "serve it with an fp16 cache")
        k_bits, v_bits = settings.cache_bits
        cache = quantized_cache(lm.model, k_bits=k_bits, v_bits=v_bits, max_tokens=settings.cache_size,
                                page_size=settings.page_size)
    proposer = None
    if settings.draft_model is not None and str(settings.draft_model) == NGRAM_DRAFT:  # copies what followed the context's tail
        proposer = NgramProposer(num_tokens=settings.num_draft_tokens)
    elif settings.draft_model is not None and str(settings.draft_model) == MTP_DRAFT:  # the model's own MTP head
        from trellm.generator.mtp import MTPProposer

        proposer = MTPProposer(lm, num_tokens=settings.num_draft_tokens, cache_tokens=settings.cache_size,
                               page_size=settings.page_size)
    elif settings.draft_model is not None:
        draft = trellm.load(settings.draft_model, device=settings.device, dtype=settings.dtype, tokenizer=False)
        proposer = DraftModelProposer(draft, num_tokens=settings.num_draft_tokens, cache_tokens=settings.cache_size,
                                      page_size=settings.page_size)
    generator = Generator(lm, cache, cache_tokens=settings.cache_size, page_size=settings.page_size,
                          max_batch_size=settings.max_batch_size, max_chunk_tokens=settings.max_chunk_tokens,
                          proposer=proposer, num_draft_tokens=settings.num_draft_tokens)
    return lm, generator
