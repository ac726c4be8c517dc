"""The built-in calibration mix (``trellm.data``) and the rows ``trellm convert`` cuts from it by default, on
SmolLM2's real tokenizer: every source gets its share of rows, and no text repeats (repeated rows let the
Hessians overfit a few passages: ``benchmarks/exl3_linear_ab.py``)."""
from __future__ import annotations

import inspect

import pytest

VOCAB = 49152
WINDOW = 64  # tokens: a stretch this long seen twice counts as repeated text


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from trellm.tokenizer import Tokenizer

    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def default_rows(tokenizer) -> list[list[int]]:
    from trellm.convert import calibration_rows, convert

    params = inspect.signature(convert).parameters
    return calibration_rows(tokenizer, VOCAB, params["cal_rows"].default, params["cal_cols"].default)


def test_default_rows_repeat_no_text(default_rows):
    from trellm.convert import convert

    params = inspect.signature(convert).parameters
    assert len(default_rows) == params["cal_rows"].default
    assert {len(r) for r in default_rows} == {params["cal_cols"].default}
    seen: dict[tuple[int, ...], int] = {}
    for i, row in enumerate(default_rows):
        for j in range(len(row) - WINDOW + 1):
            window = tuple(row[j : j + WINDOW])
            assert seen.setdefault(window, i) == i, f"rows {seen[window]} and {i} share a {WINDOW}-token stretch"
            seen[window] = i
    # within a row too: each row's windows are distinct
    for row in default_rows:
        windows = [tuple(row[j : j + WINDOW]) for j in range(len(row) - WINDOW + 1)]
        assert len(set(windows)) == len(windows)


def test_every_source_fills_its_share(tokenizer, default_rows):
    """Each row is traced back to the source whose text holds the middle of the row (decoded): every source
    of the mix fills round(share x rows) rows, the rest are random tokens."""
    from trellm.data import calibration_sources, chat_dialogues

    texts = {}
    for source in calibration_sources():
        if source.chat:
            texts[source.name] = "".join(tokenizer.apply_chat_template(d, add_generation_prompt=False)
                                         for d in chat_dialogues(source.text))
        else:
            texts[source.name] = source.text
    counts = dict.fromkeys(texts, 0)
    unmatched = 0
    for row in default_rows:
        text = tokenizer.decode(row)
        middle = text[len(text) // 2 - 20 : len(text) // 2 + 20]
        owners = [name for name, t in texts.items() if middle in t]
        assert len(owners) <= 1, (middle, owners)
        if owners:
            counts[owners[0]] += 1
        else:
            unmatched += 1
    n = len(default_rows)
    assert counts == {s.name: round(s.share * n) for s in calibration_sources()}
    assert unmatched == n - sum(counts.values()) >= n // 10  # random rows, about a tenth


def test_mix_sources_are_distinct_and_sized():
    """Sources have distinct names, shares summing to 0.9 (the rest random rows), and no paragraph of one
    written file appears in another (or in the held-out evaluation text)."""
    from trellm.data import calibration_sources
    from trellm.evaluate import eval_text

    sources = calibration_sources()
    assert len({s.name for s in sources}) == len(sources)
    assert sum(s.share for s in sources) == pytest.approx(0.9)
    paragraphs: dict[str, str] = {}
    for s in sources:
        for p in s.text.split("\n\n"):
            p = p.strip()
            if len(p) >= 80:
                assert paragraphs.setdefault(p, s.name) == s.name, f"{s.name} repeats a paragraph of {paragraphs[p]}"
    for p in eval_text().split("\n\n"):
        assert p.strip() not in paragraphs, "the evaluation text must stay held out of the calibration mix"
