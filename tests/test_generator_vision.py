"""Images through the continuous-batching Generator: batching, chunked prefill and prefix pages.

Uses the tiny random Gemma 3 VL model of tests/test_vision.py (image block: rows 4..7 of the expanded
PROMPT, 16 tokens in all; with 4-token pages the image fills page 1 exactly).
"""
from __future__ import annotations

import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from test_vision import PROMPT, encoded, gemma3, random_image  # noqa: E402,F401  (tests/ is on sys.path; gemma3 is a fixture)
from test_vision_qwen import qwen  # noqa: E402,F401  (a fixture)
from trellm.generator import Generator, Job, JobFinished, JobStarted  # noqa: E402
from trellm.multimodal import ImageError, prepare_prompt  # noqa: E402

RED = Image.new("RGB", (40, 50), (255, 0, 0))
BLUE = Image.new("RGB", (40, 50), (0, 40, 255))


def run_jobs(gen: Generator, jobs: list[Job]) -> tuple[list[JobFinished], list[JobStarted]]:
    gen.enqueue(jobs)
    done: dict[int, JobFinished] = {}
    started: dict[int, JobStarted] = {}
    while gen.has_work():
        for r in gen.iterate():
            if isinstance(r, JobFinished):
                done[r.job.job_id] = r
            elif isinstance(r, JobStarted):
                started[r.job.job_id] = r
    gen.verify_pages()
    return [done[j.job_id] for j in jobs], [started[j.job_id] for j in jobs]


def new_generator(lm, **kw) -> Generator:
    return Generator(lm, cache_tokens=256, page_size=4, max_chunk_tokens=kw.pop("max_chunk_tokens", 64), **kw)


def test_two_images_same_text_batched_like_alone(gemma3):
    _, lm, _ = gemma3
    alone = [list(lm.generate_ids(PROMPT, max_new_tokens=6, stop_token_ids=[], images=[img])) for img in (RED, BLUE)]
    assert alone[0] != alone[1]  # the images matter
    for chunk in (64, 6):  # one prefill chunk, and chunks that would cut the image run (4..8) at 6
        gen = new_generator(lm, max_chunk_tokens=chunk, prefix_caching=False)
        jobs = [Job(PROMPT, 6, stop_token_ids=[], images=[img]) for img in (RED, BLUE)]
        done, _ = run_jobs(gen, jobs)
        assert [d.token_ids for d in done] == alone, chunk


def test_text_prompt_with_images_and_prepared_prompt(gemma3):
    _, lm, _ = gemma3
    text = lm.tokenizer.decode(PROMPT[1:])  # a text prompt with the marker string; BOS is added by encode
    mm = prepare_prompt(lm, text, [RED])
    want = list(lm.generate_ids(mm.input_ids, max_new_tokens=4, stop_token_ids=[], images=mm))
    gen = new_generator(lm)
    done, _ = run_jobs(gen, [Job(text, 4, stop_token_ids=[], images=[RED]), Job(text, 4, stop_token_ids=[], images=mm)])
    assert [d.token_ids for d in done] == [want, want]


def test_same_image_reuses_prefix_pages_other_image_does_not(gemma3):
    _, lm, _ = gemma3
    gen = new_generator(lm)
    first, _ = run_jobs(gen, [Job(PROMPT, 4, stop_token_ids=[], images=[RED])])
    # the same image in another encoding: text page, image page and the page after it are reused
    again, started = run_jobs(gen, [Job(PROMPT, 4, stop_token_ids=[], images=[encoded(RED)])])
    assert started[0].cached_tokens == 12 and again[0].token_ids == first[0].token_ids
    # another image behind the same placeholder ids: only the text page before the image is shared
    other, started = run_jobs(gen, [Job(PROMPT, 4, stop_token_ids=[], images=[BLUE])])
    assert started[0].cached_tokens == 4
    assert other[0].token_ids == list(lm.generate_ids(PROMPT, max_new_tokens=4, stop_token_ids=[], images=[BLUE]))


def test_bad_images_raise_at_enqueue_and_touch_nothing(gemma3):
    _, lm, _ = gemma3
    gen = new_generator(lm)
    free = gen.cache.prefix_cache.available()
    with pytest.raises(ImageError, match="not a readable image"):
        gen.enqueue(Job(PROMPT, 4, images=[b"garbage"]))
    with pytest.raises(ImageError, match="1 image markers .* but 2 images"):
        gen.enqueue(Job(PROMPT, 4, images=[RED, BLUE]))
    assert gen.num_pending == 0 and gen.cache.prefix_cache.available() == free
    done, _ = run_jobs(gen, [Job(PROMPT, 3, stop_token_ids=[], images=[random_image(3)])])
    assert done[0].eos_reason == "max_new_tokens"



def test_mrope_families_batched_like_alone(qwen):
    """Qwen2.5-VL / Qwen3-VL / GLM 4.1V: M-RoPE positions (and their delta after the image) on every step."""
    from test_vision_qwen import PROMPT as QWEN_PROMPT

    _, _, lm = qwen
    images = [Image.new("RGB", (61, 37), (255, 0, 0)), Image.new("RGB", (37, 61), (0, 40, 255))]  # other grids, deltas
    alone = [list(lm.generate_ids(QWEN_PROMPT, max_new_tokens=5, stop_token_ids=[], images=[img])) for img in images]
    gen = Generator(lm, cache_tokens=512, page_size=8, max_chunk_tokens=16)
    done, _ = run_jobs(gen, [Job(QWEN_PROMPT, 5, stop_token_ids=[], images=[img]) for img in images])
    assert [d.token_ids for d in done] == alone
