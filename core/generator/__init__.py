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
    gen.capture_graphs()                  # CUDA: capture every decode batch size now, not mid-run

    # blocking
    text = gen.generate("Once upon a time", max_new_tokens=64)                  # str
    texts = gen.generate(["a", "b"], max_new_tokens=64, sampler=SamplerSettings(temperature=0.7, top_p=0.9))
    done = gen.generate([1, 2, 3], max_new_tokens=8, return_results=True)      # JobFinished

    # streaming, many jobs
    job = Job(prompt_ids_or_text, max_new_tokens=256, min_new_tokens=0, stop=["\\n\\n"], stop_token_ids=None,
              sampler=SamplerSettings.preset("default"), seed=1, banned_strings=["As an AI"],
              logprobs=True, top_logprobs=5, identifier="req-17")
    Job(prompt_with_image_markers, images=["cat.png", png_bytes, "data:image/png;base64,...", pil_image])
    Job(mm.input_ids, images=mm)          # mm = trellm.multimodal.prepare_prompt(lm, prompt, images), reused
    from trellm.grammar import Grammar    # constrained output (llguidance): masks computed beside the forward
    Job(prompt, grammar=Grammar.json_schema(schema))   # also .json_object(), .regex(p), .lark(text or GBNF), .choice([...])
    gen.enqueue(job)                      # raises JobTooLargeError if prompt+max_new_tokens > gen.capacity_tokens,
                                          # ImageError for a bad image (before any cache page is touched)
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
  ``eos_reason`` is one of stop_token, stop_string, grammar_end (the grammar admits nothing more),
  max_new_tokens, cancelled, error. ``text`` and
  ``token_ids`` are the whole completion, without the stop token / stop string.

Sampling: every job of a step samples on the logits' device at once (``trellm.generator.sampling``: bias, bans,
penalties, temperature, top-k, top-p, min-p, then the argmax or a draw), and one copy brings the ids back;
stacks with other steps (DRY, XTC, typical-p, a plugin's) sample on the host. A draw is the inverse CDF at
``trellm.samplers.uniform_for(seed, generated index)``, so a seeded job gives the same tokens batched or
alone, on either path and with or without speculative drafts.

Speculative decoding: ``Generator(lm, proposer=NgramProposer())``,
``proposer=DraftModelProposer(draft_lm)`` or ``proposer=MTPProposer(lm)`` (the model's own MTP head,
Qwen3.5; docs/speculative.md), ``num_draft_tokens=4``.

Hybrid models (recurrent-state layers: Qwen3.5, Qwen3-Next, LFM2, NemotronH, OLMo Hybrid) hold one
state slot per job. Prefix reuse works through state checkpoints: prefill chunks end at page
boundaries and the state after a named page is copied into a slot the prefix cache owns (freed with
the page, or given up to admit a job); a job reuses pages up to the deepest checkpoint. Speculative
decoding verifies drafts in a CUDA graph where it can: the recurrent layers (gated delta net, Kimi delta
attention) take each row's tokens one at a time and leave the state after each in a slot the job holds,
and the slot after its last kept token becomes the job's state. Otherwise (no graphs, other recurrent
mixers, prefill chunks in the step) it snapshots the state before verifying and, when drafts are
rejected, restores it and re-feeds the accepted tokens next step. Either way output equals plain
decoding. The default cache has ``max_batch_size`` slots for jobs, with a proposer ``num_draft_tokens``
more per job for those states (one for a snapshot without CUDA graphs), and ``state_checkpoints`` (default
``max_batch_size``) for checkpoints; with too few, checkpoints and drafts are skipped, never jobs. A banned-string rewind recomputes the job's state from its start.

Images (vision-language models, docs/multimodal.md): prefix-cache pages are named by the image's
content digest, so two images never share pages and the same image reuses them; prefill chunks never
cut an image run (an image longer than ``max_chunk_tokens`` goes in one chunk).

CUDA graphs: ``Generator(lm, cuda_graphs=True)`` (the default) replays captured decode steps through
``trellm.graph.GraphRunner`` on CUDA, and steps that verify drafts too: one graph per (padded batch size,
k + 1 tokens per row), k the step's longest draft, shorter drafts filled up with placeholder tokens whose
logits are never read. With an MTP proposer the graphs also return the hidden states it drafts from
(and the proposer replays graphs of its own proposals: docs/speculative.md).
Batches with prefill chunks or images run eagerly. Models with recurrent layers replay graphs too (each
row's state slot is a graph input; verification: see above). The runner keeps one scratch page (and one scratch state slot)
for padding rows, so ``capacity_tokens`` is one page less than the cache.

Async scheduling: ``Generator(lm, async_scheduling=None)`` (on by default on CUDA) queues decode step
n+1 on the device before step n is read back, feeding each job the token step n chose without it
leaving the device; the host then commits step n (stop checks, detokenising, streaming, prefix-cache
naming) while the device runs n+1, so the device no longer idles through the host's bookkeeping. A job
that finishes at step n wastes its row of step n+1. Grammar jobs run ahead too: step n+1's forward is
queued first, and its masks are filled once step n is committed, while that forward runs; only its
masking and sampling wait for them. A step whose next step needs the host's view
(jobs waiting for a slot, cancellations, drafts, host-only samplers, banned
strings, images, a page completing on a model with recurrent layers, whose state checkpoint must not
include the next token, pages that are not free) is read back first, as without it; output is the same
either way. ``iterate()`` returns step n's results while step n+1 runs.

Housekeeping: ``gen.stats`` (prefilled / reused / decoded tokens, steps, steps queued ahead, seconds waited for the device's tokens, draft tokens proposed / accepted), ``gen.verify_pages()``
(page refcounts vs holders), ``gen.clear_prefix_cache()``, ``gen.abort(error)`` (fail everything,
free all pages), ``gen.num_active`` / ``gen.num_pending`` / ``gen.has_work()``.
Thread safety: a Generator is single-threaded except ``cancel()``, which only sets a flag, and
``prepare(job)`` (checks a job and returns its prompt ids; ``add_prepared(job, ids)`` then queues it
on the generator's thread). AsyncGenerator.submit() prepares on the caller's thread and hands the job
to the worker through an inbox, so it never waits for a running step.
"""
from ..samplers import SamplerSettings, SamplerStack
from .async_generator import AsyncGenerator, AsyncJob
from .generator import Generator, JobTooLargeError
from .job import Job, JobFinished, JobStarted, PrefillProgress, Result, TokenChunk
from .speculative import DraftModelProposer, DraftRequest, NgramProposer, Proposer
from .mtp import MTPProposer

__all__ = [
    "AsyncGenerator", "AsyncJob", "DraftModelProposer", "DraftRequest", "Generator", "Job", "JobFinished",
    "JobStarted", "JobTooLargeError", "MTPProposer", "NgramProposer", "PrefillProgress", "Proposer", "Result",
    "SamplerSettings", "SamplerStack", "TokenChunk",
]
