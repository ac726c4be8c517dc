"""asyncio front end: the generator loop runs in a worker thread; jobs are async iterators.

The forward pass is blocking torch work, so it lives in one daemon thread that steps the
:class:`Generator` while it has work and hands each result to its job's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``. The event loop never blocks on the model; cancelling a job (or the
task iterating it) only sets a flag the worker acts on at its next step, which frees the pages.
Submitting never waits for a step either: the job is checked on the caller's thread and handed to
the worker through a thread-safe inbox that the worker drains before each step.
"""
from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any, Callable, Sequence

from .generator import Generator
from .job import Job, JobFinished, Result


class AsyncJob:
    """An enqueued job: ``async for result in async_job`` yields its results, the last a JobFinished."""

    def __init__(self, owner: "AsyncGenerator", job: Job, loop: asyncio.AbstractEventLoop):
        self.owner, self.job, self.loop = owner, job, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.final: JobFinished | None = None

    @property
    def identifier(self) -> Any:
        return self.job.identifier

    def __aiter__(self) -> "AsyncJob":
        return self

    async def __anext__(self) -> Result:
        if self.final is not None:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except asyncio.CancelledError:
            self.cancel()  # the consuming task went away: stop the job so its pages come back
            raise
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, JobFinished):
            self.final = item
        return item

    def cancel(self) -> None:
        self.owner.cancel(self)

    async def result(self) -> JobFinished:
        """Drain the job; return its JobFinished."""
        async for _ in self:
            pass
        assert self.final is not None
        return self.final


class AsyncGenerator:
    """Wraps a :class:`Generator` for asyncio servers; one worker thread runs every step."""

    def __init__(self, generator: Generator, idle_wait_s: float = 0.05):
        self.generator = generator
        self.idle_wait_s = idle_wait_s
        self._lock = threading.Lock()  # held by the worker for a whole step; submit() never takes it
        self._inbox: collections.deque[tuple[Job, list[int]]] = collections.deque()  # append/popleft are thread-safe
        self._wake = threading.Event()
        self._jobs: dict[int, AsyncJob] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, job: Job) -> AsyncJob:
        """Enqueue ``job`` (call from a coroutine); raises at once for a job that can never fit."""
        if self._closed:
            raise RuntimeError("the AsyncGenerator is closed")
        async_job = AsyncJob(self, job, asyncio.get_running_loop())
        prompt_ids = self.generator.prepare(job)  # raises JobTooLargeError / ImageError here, on the caller's thread
        self._jobs[job.job_id] = async_job
        self._inbox.append((job, prompt_ids))
        self._ensure_thread()
        self._wake.set()
        return async_job

    async def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, **job_kwargs: Any) -> JobFinished:
        return await self.submit(Job(prompt, max_new_tokens, **job_kwargs)).result()

    async def run_between_steps(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in a worker thread while no step runs: another forward over the same model and cache
        (embeddings) without racing the generator."""
        def locked() -> Any:
            with self._lock:
                return fn()

        return await asyncio.to_thread(locked)

    def cancel(self, async_job: AsyncJob | Job) -> None:
        job = async_job.job if isinstance(async_job, AsyncJob) else async_job
        self.generator.cancel(job)
        self._wake.set()

    def between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` while no step runs (blocking: call it from a worker thread), e.g. loading a LoRA adapter."""
        with self._lock:
            return fn()

    async def close(self) -> None:
        """Cancel what is left and stop the worker thread."""
        with self._lock:
            for aj in list(self._jobs.values()):
                self.generator.cancel(aj.job)
        self._wake.set()
        while True:
            with self._lock:
                if not self._inbox and not self.generator.has_work():
                    break
            await asyncio.sleep(self.idle_wait_s)
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def __aenter__(self) -> "AsyncGenerator":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="trellm-generator", daemon=True)
            self._thread.start()

    def _drain_inbox(self) -> None:
        while self._inbox:
            self.generator.add_prepared(*self._inbox.popleft())

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                self._drain_inbox()
                busy = self.generator.has_work()
                if busy:
                    try:
                        results = self.generator.iterate()
                    except Exception as exc:  # a bug, not bad input: fail every job rather than spin on it
                        results = self.generator.abort(error=repr(exc))
            if not busy:
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            for item in results:
                aj = self._jobs.get(item.job.job_id)
                if aj is None:
                    continue
                if isinstance(item, JobFinished):
                    self._jobs.pop(item.job.job_id, None)
                try:
                    aj.loop.call_soon_threadsafe(aj.queue.put_nowait, item)
                except RuntimeError:  # the job's event loop is closed; nobody is listening
                    self.generator.cancel(item.job)
