"""The continuous-batching generator on a tiny random Llama: every batched result is checked
against the same job decoded alone (``LoadedModel.generate_ids``, greedy)."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

pytest.importorskip("transformers")

import trellm  # noqa: E402
from trellm.cache.quantized import quantized_cache  # noqa: E402
from trellm.cache.recurrent import RecurrentStateLayer  # noqa: E402
from trellm.generator import (  # noqa: E402
    AsyncGenerator,
    DraftModelProposer,
    Generator,
    Job,
    JobFinished,
    JobStarted,
    JobTooLargeError,
    NgramProposer,
    PrefillProgress,
    SamplerSettings,
    TokenChunk,
)
from trellm.sdk.testing import make_tiny_hf_model  # noqa: E402


def byte_tokenizer():
    """A 256-token byte-level tokenizer (token id = byte), so the tiny model can stream text."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

    from trellm.tokenizer import Tokenizer

    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    backend = Backend(models.BPE(vocab={chr(c): b for b, c in zip(printable, chars)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine thread barriers cost ~5x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    model_dir = make_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)
    model = trellm.load(model_dir, device="cpu", dtype="float32")
    model.tokenizer = byte_tokenizer()
    return model


_solo_cache: dict = {}


def solo(lm, prompt, n):
    """Greedy tokens of ``prompt`` decoded alone, no stop tokens (the oracle)."""
    key = (tuple(prompt), n)
    if key not in _solo_cache:
        _solo_cache[key] = list(lm.generate_ids(list(prompt), n, stop_token_ids=[]))
    return _solo_cache[key]


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(n)] for n in lengths]


def test_batching_invariance(lm):
    prompts = prompts_of([3, 17, 40, 9, 64, 1])
    gen = Generator(lm, cache_tokens=1024, page_size=16, max_batch_size=6, max_chunk_tokens=48)
    results = gen.generate(prompts, max_new_tokens=12, stop_token_ids=[], return_results=True)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == solo(lm, prompt, 12)
        assert result.eos_reason == "max_new_tokens" and result.finish_reason == "length"
        assert result.generated_tokens == 12 and result.prompt_tokens == len(prompt)
    gen.verify_pages()


def test_results_stream_in_order(lm):
    gen = Generator(lm, cache_tokens=512, page_size=16, max_chunk_tokens=16)
    job = gen.enqueue(Job(prompts_of([40])[0], 6, stop_token_ids=[], identifier="req-1", logprobs=True, top_logprobs=3))
    results = list(gen.stream())
    assert all(r.identifier == "req-1" for r in results)
    assert isinstance(results[0], JobStarted) and isinstance(results[-1], JobFinished)
    progress = [r.prefilled for r in results if isinstance(r, PrefillProgress)]
    assert progress == [16, 32, 40]  # chunked prefill under the 16-token budget
    chunks = [r for r in results if isinstance(r, TokenChunk)]
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == results[-1].token_ids == solo(lm, job.prompt_ids, 6)
    logprobs = [lp for c in chunks if c.logprobs for lp in c.logprobs]
    tops = [tp for c in chunks if c.top_logprobs for tp in c.top_logprobs]
    assert len(logprobs) == len(tops) == 6
    for token, lp, top in zip(streamed, logprobs, tops):
        assert top[0][0] == token and top[0][1] == pytest.approx(lp) and len(top) == 3 and lp <= 0
    assert "".join(c.text for c in chunks) == results[-1].text == lm.tokenizer.decode(streamed)


def test_text_prompt_stop_string_and_banned_string(lm):
    gen = Generator(lm, cache_tokens=1024, page_size=16)
    prompt = "The quick brown fox"
    plain = gen.generate(prompt, 24, stop_token_ids=[], return_results=True)
    assert plain.token_ids == solo(lm, lm.tokenizer.encode(prompt), 24)
    text = plain.text
    assert len(text) > 8
    stop = text[5:8]
    stopped = gen.generate(prompt, 24, stop=[stop, "\x00never"], stop_token_ids=[], return_results=True)
    assert stopped.eos_reason == "stop_string" and stopped.stop_string == stop
    assert stopped.text == text[: text.index(stop)]
    # The streamed text never shows a partial stop string: it is held back while it may still match.
    banned = text[3:6]
    job = gen.enqueue(Job(prompt, 24, banned_strings=[banned, "\x00nope"], stop_token_ids=[]))
    results = list(gen.stream())
    result = results[-1]
    streamed = [r for r in results if isinstance(r, TokenChunk)]
    assert banned not in result.text and result.text.startswith(text[:3]) and result.text != text
    assert "".join(c.text for c in streamed) == result.text  # nothing streamed was taken back
    assert [t for c in streamed for t in c.token_ids] == result.token_ids and len(result.token_ids) == 24
    assert result.job is job
    gen.verify_pages()


def test_stop_token_and_min_new_tokens(lm):
    prompt = prompts_of([10], seed=3)[0]
    reference = solo(lm, prompt, 16)
    stop = reference[3]
    first = reference.index(stop)
    gen = Generator(lm, cache_tokens=512, page_size=16)
    r = gen.generate(prompt, 16, stop_token_ids=[stop], return_results=True)
    assert r.eos_reason == "stop_token" and r.stop_token == stop and r.token_ids == reference[:first]
    r = gen.generate(prompt, 16, stop_token_ids=[stop], min_new_tokens=8, return_results=True)
    assert len(r.token_ids) >= 8 and stop not in r.token_ids[:8]


def test_prefix_sharing_skips_prefill_and_keeps_output(lm):
    shared = prompts_of([48], seed=5)[0]
    a, b = shared + [7, 8, 9], shared + [10, 11]
    gen = Generator(lm, cache_tokens=1024, page_size=16)
    gen.generate(a, 8, stop_token_ids=[])
    before = gen.stats["prefilled_tokens"]
    r = gen.generate(b, 8, stop_token_ids=[], return_results=True)
    assert r.cached_tokens == 48  # three full pages found by their chained hashes
    assert gen.stats["prefilled_tokens"] - before == len(b) - 48
    assert r.token_ids == solo(lm, b, 8)
    gen.verify_pages()
    gen.clear_prefix_cache()
    assert gen.cache.allocator.free_pages == gen.cache.num_pages


def test_too_large_job_is_refused_and_others_keep_going(lm):
    gen = Generator(lm, cache_tokens=128, page_size=16)
    ok = gen.enqueue(Job(prompts_of([8])[0], 8, stop_token_ids=[]))
    with pytest.raises(JobTooLargeError, match="cache holds only 128"):
        gen.enqueue(Job(prompts_of([200])[0], 4))
    with pytest.raises(JobTooLargeError, match="max_new_tokens"):
        gen.enqueue(Job([1, 2, 3], 500))
    with pytest.raises(JobTooLargeError, match="outside the vocabulary"):
        gen.enqueue(Job([1, 999], 4))
    finished = [r for r in gen.stream() if isinstance(r, JobFinished)]
    assert [f.job for f in finished] == [ok] and finished[0].token_ids == solo(lm, ok.prompt_ids, 8)


def test_a_failing_sampler_fails_only_its_job(lm):
    class Broken:
        name, greedy = "broken", False

        def __call__(self, logits, ctx):
            raise RuntimeError("broken sampler step")

    from trellm.samplers import SamplerStack

    gen = Generator(lm, cache_tokens=512, page_size=16)
    good, bad = prompts_of([7, 9], seed=6)
    jobs = gen.enqueue([Job(good, 5, stop_token_ids=[]), Job(bad, 5, stop_token_ids=[], sampler=SamplerStack([Broken()]))])
    finished = {r.job: r for r in gen.stream() if isinstance(r, JobFinished)}
    assert finished[jobs[0]].token_ids == solo(lm, good, 5)
    assert finished[jobs[1]].eos_reason == "error" and "broken sampler step" in finished[jobs[1]].error
    gen.verify_pages()


def test_seeded_sampling_is_batch_invariant(lm):
    settings = SamplerSettings(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1)
    prompts = prompts_of([5, 20, 33], seed=9)
    gen = Generator(lm, cache_tokens=1024, page_size=16)
    together = gen.generate(prompts, 10, sampler=settings, seed=123, stop_token_ids=[], return_results=True)
    alone = [gen.generate(p, 10, sampler=settings, seed=123, stop_token_ids=[], return_results=True) for p in prompts]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_equals_plain_greedy(lm, proposer):
    # Repetitive prompts give the n-gram proposer something to find.
    prompts = [[5, 6, 7, 8] * 6, prompts_of([30], seed=2)[0], [9, 9, 9, 1, 2, 9, 9, 9, 1]]
    if proposer == "ngram":
        prop = NgramProposer(num_tokens=4)
    else:
        prop = DraftModelProposer(lm, num_tokens=3, cache_tokens=512, page_size=16)  # drafting for itself: all accepted
    gen = Generator(lm, cache_tokens=1024, page_size=16, proposer=prop, num_draft_tokens=4)
    results = gen.generate(prompts, 16, stop_token_ids=[], return_results=True)
    for prompt, r in zip(prompts, results):
        assert r.token_ids == solo(lm, prompt, 16)
    assert sum(r.draft_proposed for r in results) > 0
    if proposer == "draft":
        assert all(r.draft_accepted == r.draft_proposed for r in results)
        assert gen.stats["steps"] < 16 + 3  # several tokens per step
    gen.verify_pages()


@pytest.mark.parametrize("bits", [(8, 8), (4, 6)])
def test_quantized_cache_generates(lm, bits):
    prompts = prompts_of([12, 30], seed=4)
    gen = Generator(lm, cache=quantized_cache(lm, *bits, max_tokens=512, page_size=16))
    results = gen.generate(prompts, 8, stop_token_ids=[], return_results=True)
    assert all(len(r.token_ids) == 8 for r in results)
    if bits == (8, 8):  # near-lossless: the first tokens agree with the fp32 cache
        assert all(r.token_ids[:2] == solo(lm, p, 8)[:2] for p, r in zip(prompts, results))
    gen.verify_pages()


def test_stress_eviction_waiting_cancellation(lm):
    """Many jobs at varying depth through a small cache: waiting, eviction, cancels; nothing lost or leaked."""
    rng = random.Random(42)
    stems = prompts_of([16, 24, 8], seed=11)  # shared prefixes
    jobs = []
    for i in range(22):
        prompt = list(rng.choice(stems))[: rng.choice([8, 16, 24])] + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 12))]
        jobs.append(Job(prompt, rng.randrange(2, 16), stop_token_ids=[], identifier=i))
    gen = Generator(lm, cache_tokens=8 * 20, page_size=8, max_batch_size=5, max_chunk_tokens=24)
    to_cancel = {3, 11, 17, 20}
    waiting_seen = False
    queue = list(jobs)
    gen.enqueue([queue.pop(0) for _ in range(8)])
    finished: dict[int, JobFinished] = {}
    streamed: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    while gen.has_work() or queue:
        if queue and rng.random() < 0.4:
            gen.enqueue(queue.pop(0))
        for result in gen.iterate():
            if isinstance(result, TokenChunk):
                streamed[result.identifier] += result.token_ids
                if result.identifier in to_cancel and len(streamed[result.identifier]) >= 2:
                    gen.cancel(result.job)
            elif isinstance(result, JobFinished):
                assert result.identifier not in finished
                finished[result.identifier] = result
        waiting_seen |= gen.num_pending > 0 and gen.num_active < gen.max_batch_size
        gen.verify_pages()
    assert sorted(finished) == list(range(len(jobs)))
    assert waiting_seen and gen.cache.prefix_cache.evictions > 0 and gen.stats["reused_tokens"] > 0
    for i, job in enumerate(jobs):
        result = finished[i]
        expected = solo(lm, job.prompt_ids, job.max_new_tokens)
        assert streamed[i] == result.token_ids
        if result.eos_reason == "cancelled":
            assert i in to_cancel and result.token_ids == expected[: len(result.token_ids)]
        else:
            assert result.token_ids == expected, f"job {i}"
    assert {i for i in to_cancel if finished[i].eos_reason == "cancelled"}
    gen.clear_prefix_cache()
    assert gen.cache.allocator.free_pages == gen.cache.num_pages


def test_async_generator_streams_and_cancels(lm):
    prompts = prompts_of([6, 20, 11, 35], seed=8)

    async def main():
        gen = Generator(lm, cache_tokens=1024, page_size=16, max_batch_size=4)
        async with AsyncGenerator(gen) as agen:
            jobs = [agen.submit(Job(p, 24, stop_token_ids=[], identifier=i)) for i, p in enumerate(prompts)]

            async def consume(async_job):
                return [r async for r in async_job]

            async def cancel_soon(async_job):
                async for r in async_job:
                    if isinstance(r, TokenChunk) and r.token_ids:
                        async_job.cancel()
                return async_job.final

            tasks = [asyncio.create_task(consume(j)) for j in jobs[:2]]
            canceller = asyncio.create_task(cancel_soon(jobs[2]))
            victim = asyncio.create_task(consume(jobs[3]))
            await asyncio.sleep(0)
            victim.cancel()  # the consuming task goes away: the job must be cancelled and its pages freed
            outs = await asyncio.gather(*tasks)
            cancelled = await canceller
            with pytest.raises(asyncio.CancelledError):
                await victim
            with pytest.raises(JobTooLargeError):
                agen.submit(Job([1] * 2000, 4))
            again = await agen.generate(prompts[0], 5, stop_token_ids=[])
        return gen, outs, cancelled, again

    gen, outs, cancelled, again = asyncio.run(main())
    for prompt, results in zip(prompts, outs):
        assert isinstance(results[-1], JobFinished) and results[-1].token_ids == solo(lm, prompt, 24)
    assert cancelled.eos_reason == "cancelled"
    assert again.token_ids == solo(lm, prompts[0], 5)
    assert not gen.has_work()
    gen.verify_pages()


def test_smollm2_generator_matches_simple_loop(smollm2_dir):
    lm = trellm.load(smollm2_dir, device="cpu")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    gen = Generator(lm, cache_tokens=1024, page_size=32)
    texts = gen.generate(prompts, 8)
    assert texts == [lm.generate(p, max_new_tokens=8) for p in prompts]


class CountingStateLayer(RecurrentStateLayer):
    """A recurrent-state cache layer no model module reads (tiny per-slot tensors) that counts allocations."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots, conv_dim=1, conv_width=2, state_shape=(1,), dtype=torch.float32, device="cpu")
        self.allocs = 0

    def alloc_slot(self) -> int:
        self.allocs += 1
        return super().alloc_slot()


def test_recurrent_state_slots_are_allocated_and_passed(lm):
    from trellm.cache import KVCache

    cache = KVCache.for_model(lm.model, max_tokens=1024, page_size=16)
    states = CountingStateLayer(num_slots=2)
    cache.layers.append(states)  # an extra layer no attention module reads
    gen = Generator(lm, cache=cache)
    assert gen.prefix_caching  # state checkpoints at page boundaries make prefix reuse safe
    seen = []
    forward = lm.model.forward

    def spy(batch):
        seen.append(batch.state_slots.tolist())
        return forward(batch)

    lm.model.forward = spy
    try:
        prompts = prompts_of([5, 9, 14], seed=1)
        results = gen.generate(prompts, 4, stop_token_ids=[], return_results=True)
    finally:
        del lm.model.forward
    assert [r.token_ids for r in results] == [solo(lm, p, 4) for p in prompts]
    assert all(len(set(slots)) == len(slots) and set(slots) <= {0, 1} for slots in seen)
    assert max(len(s) for s in seen) == 2  # only two slots: the third job waited
    checkpoints = len(gen.cache.prefix_cache.checkpoint_of)  # the 14-token job filled a page while decoding
    assert checkpoints == 1 and states.allocs == 3 + checkpoints
    gen.verify_pages()
    gen.clear_prefix_cache()  # hands the checkpoint slot back
    assert sorted(states._free) == [0, 1]
    Generator(lm, cache=cache, proposer=NgramProposer())  # speculative decoding rolls recurrent state back


@pytest.mark.parametrize("overtake", [0, 3])
def test_big_job_is_not_starved(lm, overtake):
    """Small jobs keep arriving; a big one that needs most of the cache still gets in (aging)."""
    gen = Generator(lm, cache_tokens=16 * 8, page_size=16, max_batch_size=8, max_overtake_steps=overtake)
    small = lambda i: Job(prompts_of([4], seed=100 + i)[0], 6, stop_token_ids=[], identifier=f"s{i}")  # noqa: E731
    gen.enqueue([small(i) for i in range(3)])
    gen.iterate()  # the small ones are running
    big = gen.enqueue(Job(prompts_of([40], seed=7)[0], 60, stop_token_ids=[], identifier="big"))  # needs 7 of 8 pages
    started = {}
    for step in range(200):
        if step < 40:
            gen.enqueue(small(10 + step))
        for r in gen.iterate():
            if isinstance(r, JobStarted):
                started[r.identifier] = step
        if "big" in started:
            break
    assert "big" in started and started["big"] <= overtake + 12
    overtook = [k for k, v in started.items() if k != "big" and v < started["big"] and int(k[1:]) >= 10]
    assert (len(overtook) == 0) if overtake == 0 else (len(overtook) > 0)
    gen.cancel(big)
    list(gen.stream())
    gen.verify_pages()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generator_on_cuda(lm):
    cuda_lm = trellm.load(lm.model_dir, device="cuda", dtype="float32")
    prompts = prompts_of([3, 17, 40, 9], seed=12)
    gen = Generator(cuda_lm, cache_tokens=1024, page_size=16, proposer=NgramProposer())
    batched = gen.generate(prompts, 10, stop_token_ids=[], return_results=True)
    assert [r.token_ids for r in batched] == [list(cuda_lm.generate_ids(p, 10, stop_token_ids=[])) for p in prompts]
    qgen = Generator(cuda_lm, cache=quantized_cache(cuda_lm, 8, 8, max_tokens=1024, page_size=16))
    assert all(len(r.token_ids) == 10 for r in qgen.generate(prompts, 10, stop_token_ids=[], return_results=True))
    gen.verify_pages()


@pytest.mark.slow
def test_smollm2_counting_stress(smollm2_dir):
    """Real weights, self-checking: prompts count upward, every continuation must keep counting.
    A small cache forces waiting and prefix-page eviction; some jobs are cancelled mid-stream."""
    lm = trellm.load(smollm2_dir, device="cpu")
    rng = random.Random(7)
    specs = [(rng.randrange(1, 200), rng.randrange(4, 40)) for _ in range(16)]
    gen = Generator(lm, cache_tokens=32 * 12, page_size=32, max_batch_size=6, max_chunk_tokens=128)
    jobs = [Job(", ".join(str(i) for i in range(s, s + n)) + ",", 12, identifier=k) for k, (s, n) in enumerate(specs)]
    queue, finished, cancel = list(jobs), {}, {2, 9}
    gen.enqueue([queue.pop(0) for _ in range(6)])
    while gen.has_work() or queue:
        if queue and rng.random() < 0.5:
            gen.enqueue(queue.pop(0))
        for r in gen.iterate():
            if isinstance(r, TokenChunk) and r.identifier in cancel:
                gen.cancel(r.job)
            if isinstance(r, JobFinished):
                finished[r.identifier] = r
        gen.verify_pages()
    assert sorted(finished) == list(range(len(jobs)))
    for k, (s, n) in enumerate(specs):
        r = finished[k]
        if k in cancel:
            assert r.eos_reason == "cancelled"
            continue
        numbers = [int(x) for x in r.text.split(",")[:-1]]
        assert numbers[:2] == [s + n, s + n + 1], (k, r.text)


def test_prefix_pages_shared_while_the_first_job_still_prefills(lm):
    """Pages are named as soon as a prefill chunk fills them, so a second job reuses them mid-prefill;
    this also holds with a quantized cache and speculative decoding on."""
    shared = prompts_of([64], seed=21)[0]
    gen = Generator(lm, cache=quantized_cache(lm, 8, 8, max_tokens=1024, page_size=16), max_chunk_tokens=32,
                    proposer=NgramProposer())
    first = gen.enqueue(Job(shared + [1, 2], 6, stop_token_ids=[]))
    gen.iterate()  # 32 of 66 prompt tokens in: two full pages named
    second = gen.enqueue(Job(shared + [3], 6, stop_token_ids=[]))
    results = list(gen.stream())
    started = {r.job: r for r in results if isinstance(r, JobStarted)}
    assert started[second].cached_tokens == 32
    done = {r.job: r for r in results if isinstance(r, JobFinished)}
    assert done[first].generated_tokens == done[second].generated_tokens == 6
    gen.verify_pages()


def test_long_prompt_does_not_stall_running_streams(lm):
    gen = Generator(lm, cache_tokens=1024, page_size=16, max_chunk_tokens=32)
    running = gen.enqueue(Job(prompts_of([5], seed=30)[0], 30, stop_token_ids=[]))
    gen.iterate()
    long = gen.enqueue(Job(prompts_of([200], seed=31)[0], 4, stop_token_ids=[]))
    prefill_steps = 0
    while not long.finished:
        results = gen.iterate()
        if any(isinstance(r, PrefillProgress) and r.job is long for r in results):
            prefill_steps += 1
            assert any(isinstance(r, TokenChunk) and r.job is running for r in results)  # one token every step
    assert prefill_steps >= 200 // 32  # the prompt went in chunks under the shared budget
    list(gen.stream())
    gen.verify_pages()


def test_images_for_a_text_model_raise_at_enqueue(lm):
    from trellm.multimodal import ImageError

    gen = Generator(lm, cache_tokens=512, page_size=16)
    with pytest.raises(ImageError, match="takes no image input"):
        gen.enqueue(Job([1, 2, 3], 4, images=[b"\x89PNG"]))
    assert gen.num_pending == 0
    assert gen.generate([1, 2, 3], 3, stop_token_ids=[], images=[]) == gen.generate([1, 2, 3], 3, stop_token_ids=[])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_matches_eager(tmp_path):
    # head_dim 64: the paged-attention kernel's smallest; with the reference attention (which reads
    # cu_seqlens on the host) capture fails and the runner falls back to eager decoding.
    model_dir = make_tiny_hf_model("LlamaForCausalLM", tmp_path, hidden_size=128, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=64, max_position_embeddings=1024)
    cuda_lm = trellm.load(model_dir, device="cuda", dtype="float32")
    prompts = prompts_of([3, 17, 40, 9, 5], seed=13)
    outputs = {}
    for graphs in (False, True):
        gen = Generator(cuda_lm, cache_tokens=1024, page_size=16, max_batch_size=6, cuda_graphs=graphs)
        assert (gen.graph_runner is not None) == graphs
        outputs[graphs] = [r.token_ids for r in gen.generate(prompts, 12, stop_token_ids=[], return_results=True)]
        gen.verify_pages()
        if graphs:
            assert gen.graph_runner.graphs, "no decode step was captured"
    assert outputs[True] == outputs[False]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_capture_with_every_page_taken(tmp_path):
    """Batches 1 and 8 are captured (no fallback warning) although the running jobs hold every page
    but the graphs' scratch page: a capture must not need a free page. head_dim 64 keeps the path on
    the CUDA kernels (the reference attention reads cu_seqlens on the host and cannot be captured)."""
    import warnings

    model_dir = make_tiny_hf_model("LlamaForCausalLM", tmp_path, hidden_size=128, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=64, max_position_embeddings=1024)
    cuda_lm = trellm.load(model_dir, device="cuda", dtype="float32")
    prompts = prompts_of([3, 5, 4, 6, 3, 5, 4, 6], seed=15)
    # 8 pages of 16 tokens, each job needs one: 7 jobs and the scratch page fill the cache (padded batch 8),
    # then the 8th job decodes alone (batch 1). Before the scratch page was reserved up front, the first
    # capture came with all 8 pages held by jobs and failed with "need 1 cache pages, 0 free of 8".
    gen = Generator(cuda_lm, cache_tokens=8 * 16, page_size=16, max_batch_size=8, prefix_caching=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = gen.generate(prompts, 8, stop_token_ids=[], return_results=True)
    assert not [str(w.message) for w in caught if "trellm" in str(w.message)]
    # Which padded sizes run depends on admission (jobs now take pages as they grow, with headroom):
    # every size that ran was captured, none fell back.
    assert gen.graph_runner.graphs and not gen.graph_runner._failed
    assert [r.token_ids for r in results] == [list(cuda_lm.generate_ids(p, 8, stop_token_ids=[])) for p in prompts]
    gen.verify_pages()


def test_no_cuda_graphs_on_cpu(lm):
    assert Generator(lm, cache_tokens=512, page_size=16).graph_runner is None


def test_graph_scratch_page_is_taken_when_the_runner_is_made(lm):
    """A decode graph is captured lazily, mid-decoding, when running jobs may hold every page: the padding
    rows' scratch page is the runner's from the start, so preparing a capture needs no free page.
    (The capture itself needs CUDA; its inputs are built the same way on CPU.)"""
    from trellm.cache import KVCache
    from trellm.graph import GraphRunner

    cache = KVCache.for_model(lm.model, max_tokens=4 * 16, page_size=16)
    runner = GraphRunner(lm.model, cache, batch_sizes=(1, 8))
    scratch = runner._scratch_page
    assert scratch is not None and cache.allocator.free_pages == 3
    held = cache.allocator.alloc(3)  # the jobs take all the rest
    batch = runner._padding_batch(8)
    assert batch.slots.tolist() == [scratch * 16] * 8 and set(batch.block_table.flatten().tolist()) == {scratch}
    runner.close()
    cache.allocator.decref(held)
    assert cache.allocator.free_pages == 4


def test_graph_scratch_page_evicts_a_prefix_cached_page(lm):
    from trellm.cache import KVCache
    from trellm.graph import GraphRunner

    gen = Generator(lm, cache_tokens=4 * 16, page_size=16)
    gen.generate(list(range(1, 50)), 1, stop_token_ids=[])  # three full prompt pages stay named in the prefix cache
    prefix = gen.cache.prefix_cache
    gen.cache.allocator.alloc(gen.cache.allocator.free_pages)
    assert prefix.evictable() > 0
    runner = GraphRunner(lm.model, gen.cache, batch_sizes=(1,))
    assert runner._scratch_page is not None and runner._padding_batch(1).slots.tolist() == [runner._scratch_page * 16]


def test_async_submit_does_not_wait_for_a_running_step(lm):
    """submit() returns while the worker is inside a step (here: while its lock is held) and the job runs after."""
    prompt = prompts_of([9], seed=14)[0]

    async def main():
        gen = Generator(lm, cache_tokens=512, page_size=16)
        async with AsyncGenerator(gen) as agen:
            with agen._lock:  # what the worker holds during a whole iterate()
                t0 = time.perf_counter()
                ajob = agen.submit(Job(prompt, 4, stop_token_ids=[]))
                waited = time.perf_counter() - t0
                with pytest.raises(JobTooLargeError):  # checked at once, on the caller's thread
                    agen.submit(Job([1] * 2000, 4))
                assert gen.num_pending == 0  # still in the inbox: the worker adds it before its next step
            result = await ajob.result()
        return gen, waited, result

    gen, waited, result = asyncio.run(main())
    assert waited < 0.5 and result.token_ids == solo(lm, prompt, 4)
    gen.verify_pages()
