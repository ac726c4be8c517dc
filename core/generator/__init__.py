"""Continuous batching over the paged KV cache: jobs, the generator, its asyncio front end.

Public API (stable; the OpenAI server builds on it)::

    from trellm.generator import Job, Generator, AsyncGenerator, SamplerSettings
    from trellm.generator import JobStarted, PrefillProgress, TokenChunk, JobFinished

    lm = trellm.load(path)
    gen = Generator(lm, cache_tokens=16384, page_size=256, max_batch_size=16, max_chunk_tokens=512,
                    max_overtake_steps=16, prefix_caching=True)
    # own cache: Generator(lm, cache=KVCache.for_model(lm.model, max_tokens=..., page_size=...))
    # quantized cache: from trellm.cache.quantized import quantized_cache
    #                  Generator(lm, cache=quantized_cache(lm, k_bits=4, v_bits=6, max_tokens=16384))
    gen.capacity_tokens                   # the most prompt + max_new_tokens one job may ask for

    # blocking
    text = gen.generate("Once upon a time", max_new_tokens=64)                  # str
    texts = gen.generate(["a", "b"], max_new_tokens=64, sampler=SamplerSettings(temperature=0.7, top_p=0.9))
    done = gen.generate([1, 2, 3], max_new_tokens=8, return_results=True)      # JobFinished

    # streaming, many jobs
    job = Job(prompt_ids_or_text, max_new_tokens=256, min_new_tokens=0, stop=["\\n\\n"], stop_token_ids=None,
              sampler=SamplerSettings.preset("default"), seed=1, banned_strings=["As an AI"],
              logprobs=True, top_logprobs=5, identifier="req-17")
    gen.enqueue(job)                      # raises JobTooLargeError if prompt+max_new_tokens > gen.capacity_tokens
    while gen.has_work():
        for result in gen.iterate():      # one batched forward per call
            ...                           # result.identifier == job.identifier
    gen.cancel(job)                       # next iterate() reports JobFinished(eos_reason="cancelled")

    # asyncio (server): the loop runs in a worker thread
    agen = AsyncGenerator(gen)
    ajob = agen.submit(Job(...))          # from a coroutine; raises JobTooLargeError at once
    async for result in ajob: ...         # ends after the JobFinished; cancelling the task cancels the job
    ajob.cancel(); final = await ajob.result(); await agen.close()

Results (attrs classes, all with ``job`` and ``identifier``):

- ``JobStarted(prompt_tokens, cached_tokens)``: admitted; ``cached_tokens`` came from the prefix cache.
- ``PrefillProgress(prefilled, total)``: after each prefill chunk.
- ``TokenChunk(text, token_ids, logprobs, top_logprobs)``: new tokens and the text that became final
  (UTF-8 complete, partial stop-string matches held back). ``logprobs[i]`` is the model's raw
  log-probability of ``token_ids[i]``; ``top_logprobs[i]`` a list of (token id, logprob), best first.
- ``JobFinished(eos_reason, text, token_ids, stop_token, stop_string, error, prompt_tokens,
  cached_tokens, generated_tokens, time_enqueued, time_started, time_first_token, time_finished,
  draft_proposed, draft_accepted)``; ``finish_reason`` gives OpenAI's "stop"/"length";
  ``eos_reason`` is one of stop_token, stop_string, max_new_tokens, cancelled, error. ``text`` and
  ``token_ids`` are the whole completion, without the stop token / stop string.

Speculative decoding: ``Generator(lm, proposer=NgramProposer())`` or
``proposer=DraftModelProposer(draft_lm)``, ``num_draft_tokens=4``.

Housekeeping: ``gen.stats`` (prefilled / reused / decoded tokens, steps), ``gen.verify_pages()``
(page refcounts vs holders), ``gen.clear_prefix_cache()``, ``gen.abort(error)`` (fail everything,
free all pages), ``gen.num_active`` / ``gen.num_pending`` / ``gen.has_work()``.
Thread safety: a Generator is single-threaded except ``cancel()``, which only sets a flag;
AsyncGenerator serializes everything else behind one lock.
"""
from ..samplers import SamplerSettings, SamplerStack
from .async_generator import AsyncGenerator, AsyncJob
from .generator import Generator, JobTooLargeError
from .job import Job, JobFinished, JobStarted, PrefillProgress, Result, TokenChunk
from .speculative import DraftModelProposer, DraftRequest, NgramProposer, Proposer

__all__ = [
    "AsyncGenerator", "AsyncJob", "DraftModelProposer", "DraftRequest", "Generator", "Job", "JobFinished",
    "JobStarted", "JobTooLargeError", "NgramProposer", "PrefillProgress", "Proposer", "Result",
    "SamplerSettings", "SamplerStack", "TokenChunk",
]
