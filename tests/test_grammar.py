"""Constrained decoding in the generator (``Job(grammar=...)``) on a 2-layer random Llama that speaks
SmolLM2's tokenizer: a random model samples anything, so every output matching its grammar shows the
masks, not the model, did it."""
from __future__ import annotations

import json
import re

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

import trellm  # noqa: E402
from trellm.generator import Generator, Job, NgramProposer, SamplerSettings  # noqa: E402
from trellm.grammar import Grammar, GrammarError  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "address", "tags", "score"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def lm(tiny_llama_smollm2_tokenizer_dir):
    torch.set_num_threads(1)
    return trellm.load(tiny_llama_smollm2_tokenizer_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def gen(lm):
    return Generator(lm, cache_tokens=4096, page_size=64, max_batch_size=8)


def run(gen: Generator, jobs: list[Job]) -> list:
    gen.enqueue(jobs)
    done = {r.job.job_id: r for r in gen.stream() if type(r).__name__ == "JobFinished"}
    gen.verify_pages()
    return [done[j.job_id] for j in jobs]


def test_json_schema_outputs_validate_for_every_seed(gen):
    grammar = Grammar.json_schema(PERSON)
    jobs = [Job("A person:", 200, grammar=grammar, sampler=SamplerSettings(temperature=1.0), seed=s) for s in range(6)]
    results = run(gen, jobs)
    for r in results:
        assert r.eos_reason in ("grammar_end", "stop_token"), (r.eos_reason, r.text, r.error)
        jsonschema.validate(json.loads(r.text), PERSON)
    assert len({r.text for r in results}) > 1  # the model still chooses: the seeds give different people


def test_choice_regex_lark_and_gbnf(gen):
    sampler = SamplerSettings(temperature=1.0)
    jobs = [
        Job("Pick:", 20, grammar=Grammar.choice(["yes", "no", "maybe not"]), sampler=sampler, seed=1),
        Job("Code:", 20, grammar=Grammar.regex(r"[0-9]{3}-[a-z]{2}"), sampler=sampler, seed=2),
        Job("Say:", 30, grammar=Grammar.lark('start: "Answer: " NUM "!"\nNUM: /[1-9][0-9]?/'), sampler=sampler, seed=3),
        Job("Say:", 30, grammar=Grammar.lark('root ::= "x=" [0-9] [0-9]'), sampler=sampler, seed=4),
    ]
    choice, code, answer, gbnf = (r.text for r in run(gen, jobs))
    assert choice in ("yes", "no", "maybe not")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", code)
    assert re.fullmatch(r"Answer: [1-9][0-9]?!", answer)
    assert re.fullmatch(r"x=[0-9][0-9]", gbnf)


def test_bad_grammars_name_the_problem(gen):
    with pytest.raises(GrammarError, match="unclosed character class"):
        Grammar.regex("[a-z")
    with pytest.raises(GrammarError, match="strin"):
        gen.enqueue(Job("x", 4, grammar=Grammar.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}})))
    with pytest.raises(GrammarError, match="not JSON"):
        Grammar.json_schema("{nope")
    with pytest.raises(GrammarError, match="non-empty list"):
        Grammar.choice([])
    with pytest.raises(TypeError, match="Grammar"):
        Job("x", 4, grammar={"type": "object"})
    assert not gen.has_work()


def test_plain_jobs_beside_grammar_jobs_are_unchanged(gen):
    alone = run(gen, [Job("Once upon a time", 12)])[0].text
    mixed = run(gen, [Job("Once upon a time", 12), Job("Pick:", 8, grammar=Grammar.choice(["a", "b"]))])
    assert mixed[0].text == alone and mixed[1].text in ("a", "b")


def test_stop_tokens_only_where_the_output_is_complete(gen, lm):
    """A job's own stop ids replace the model's: with none (ignore_eos) a closed object still ends the job."""
    digit = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
             "additionalProperties": False}
    jobs = [Job("Obj:", 60, grammar=Grammar.json_schema(digit), stop_token_ids=[], sampler=SamplerSettings(temperature=1.0),
                seed=s) for s in range(3)]
    for r in run(gen, jobs):
        assert 0 <= json.loads(r.text)["a"] <= 9 and r.eos_reason == "grammar_end"


class BadProposer:
    """Drafts tokens the grammar refuses (and the one it wants, behind them)."""

    def __init__(self, bad: int):
        self.bad = bad

    def propose(self, requests):
        return [[self.bad] * r.max_tokens for r in requests]

    def release(self, key):
        pass


def test_drafts_are_cut_where_the_grammar_refuses_them(lm, gen):
    grammar = Grammar.regex(r"[0-9]{12}")
    plain = run(gen, [Job("Digits:", 16, grammar=grammar)])[0]
    letter = lm.tokenizer.encode("x", add_special_tokens=False)[0]
    spec = Generator(lm, cache_tokens=4096, page_size=64, max_batch_size=4, proposer=BadProposer(letter))
    cut = run(spec, [Job("Digits:", 16, grammar=grammar)])[0]
    assert cut.text == plain.text and cut.draft_proposed == 0  # every draft refused before verification
    ngram = Generator(lm, cache_tokens=4096, page_size=64, max_batch_size=4, proposer=NgramProposer(min_ngram=1))
    schema_plain = run(gen, [Job("A person:", 120, grammar=Grammar.json_schema(PERSON))])[0]
    schema_spec = run(ngram, [Job("A person:", 120, grammar=Grammar.json_schema(PERSON))])[0]
    assert schema_spec.text == schema_plain.text and schema_spec.draft_proposed > 0


def test_masks_put_a_jobs_own_stop_ids_where_the_output_may_end(gen, lm):
    """The engine's masks (draft rows included): a job's stop ids replace the model's exactly in the rows where
    the output is complete; rows without a grammar allow everything."""
    engine = gen.grammar_engine
    digits = Grammar.regex(r"[0-9]{1,3}")
    one, two, own = (lm.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("1", "2", "!"))
    fresh, after_one = engine.compile(digits), engine.compile(digits)
    assert after_one.consume(one)
    # rows 0-2: a fresh state with the draft "1", "2" (masks at "", "1", "12"); row 3: after "1", the
    # model's stop ids; row 4: no grammar
    used, masks = engine.fill_masks([(fresh, 0, [one, two]), (after_one, 3, [])], 5, [{own}, None])
    assert used == [0, 1, 2, 3]

    def allowed(row: int, token: int) -> bool:
        return bool(int(masks[row, token >> 5]) >> (token & 31) & 1)

    eos = engine.stop_ids[0]
    assert [allowed(r, two) for r in range(5)] == [True, True, True, True, True]
    assert [allowed(r, own) for r in range(5)] == [False, True, True, False, True]
    assert [allowed(r, eos) for r in range(5)] == [False, False, False, True, True]
    logits = torch.zeros(5, lm.config.vocab_size)
    engine.apply_masks(logits, (used, masks))
    assert torch.isinf(logits[0, own]) and logits[1, own] == 0 and logits[3, eos] == 0 and torch.isinf(logits[3, own])
    assert not torch.isinf(logits[4]).any() and torch.isinf(logits[:4]).sum(1).min() > 40000


def test_the_engine_keeps_compiled_grammars_by_text(gen, lm, monkeypatch):
    """Two requests with the same schema share one compiled grammar (and the lexer states it builds); each job
    still gets its own state; the engine keeps a bounded number of them, least recently used dropped first."""
    import trellm.grammar as grammar_module

    monkeypatch.setattr(grammar_module, "COMPILED_GRAMMARS", 2)
    engine = gen.grammar_engine
    a = lm.tokenizer.encode("a", add_special_tokens=False)[0]
    first, second = engine.compile(Grammar.regex("a{1,5}")), engine.compile(Grammar.regex("a{1,5}"))
    kept = dict(engine._compiled)
    assert Grammar.regex("a{1,5}").spec in kept and len(kept) <= 2
    assert first.consume(a) and first.valid_prefix([a] * 5) == 4 and second.valid_prefix([a] * 5) == 5
    engine.compile(Grammar.regex("b+"))
    engine.compile(Grammar.regex("a{1,5}"))  # used again: now the most recent
    engine.compile(Grammar.regex("c+"))
    assert list(engine._compiled) == [Grammar.regex("a{1,5}").spec, Grammar.regex("c+").spec]
