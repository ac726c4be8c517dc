"""Cached window entries (issue 30): DeepSeek V4's compressed entries and CSA indexer keys, GLM 5.3-Flash's pooled
indexer keys and Qwen 3.8-Flash-Next's block keys are folded once, by the forward pass that completes their window,
and read from entry pages afterwards. Held against the former route, which rebuilt every entry from the cached rows
at every step (the reference functions below), and against the cacheless forward: chunked prefill of several
sequences of different lengths in one batch, decode steps across window boundaries, a rejected draft that
completed a window, prefix-shared pages, and the real generator with prefix caching and drafts."""
from __future__ import annotations

import attrs
import pytest
import torch

pytest.importorskip("transformers")

import trellm  # noqa: E402
from trellm.batch import ForwardBatch  # noqa: E402
from trellm.cache import SequenceState  # noqa: E402
from trellm.cache import KVCache, KVCacheLayer, indexed  # noqa: E402
from trellm.cache.indexed import ExtraRowsKVCacheLayer, WindowEntries, completed_windows, window_rows  # noqa: E402
from trellm.cache.recurrent import copy_state_slot  # noqa: E402
from trellm.errors import ConfigError  # noqa: E402
from trellm.modules.compressed import rope_tail  # noqa: E402
from trellm.ops.attention import gather_pages  # noqa: E402
from trellm.sdk.testing import make_tiny_hf_model, torch_threads  # noqa: E402

from test_families_dsa import DEEPSEEK_V4, random_tid2eid  # noqa: E402
from test_families_next import glm5_next_checkpoint, qwen4_exp_checkpoint  # noqa: E402
from test_moe_families import randomize  # noqa: E402

PAGE = 8  # a multiple of every window here (2 and 4), smaller than the prompts: sequences span several pages


def _deepseek_v4(path):
    model_dir = make_tiny_hf_model("DeepseekV4ForCausalLM", path, **DEEPSEEK_V4)
    for suffix in ("gate.bias", ".ape"):
        randomize(model_dir, suffix)
    random_tid2eid(model_dir, 8)
    return model_dir


FAMILIES = {"deepseek_v4": _deepseek_v4, "glm5_next": glm5_next_checkpoint, "qwen4_exp": qwen4_exp_checkpoint}


@pytest.fixture(scope="module", params=list(FAMILIES))
def lm(request, tmp_path_factory):
    model_dir = FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
    with torch_threads(1):
        yield trellm.load(model_dir, device="cpu", dtype=torch.float32, tokenizer=False)


# ---- the former route: every entry of a sequence rebuilt from its cached rows ----

def compress_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, rate: int, overlap: bool) -> torch.Tensor:
    """The former op: the entries [n, D] of one sequence's complete windows (``kv``, ``gate`` [S, C]) in one go."""
    n, width = kv.shape[0] // rate, kv.shape[-1]
    kv = kv[: n * rate].float().view(n, rate, width)
    gate = gate[: n * rate].float().view(n, rate, width) + position_bias.float()
    if overlap:
        d = kv.shape[-1] // 2
        prev_kv = torch.cat([kv.new_zeros(1, rate, d), kv[:-1, :, :d]])[:n]
        prev_gate = torch.cat([gate.new_full((1, rate, d), float("-inf")), gate[:-1, :, :d]])[:n]
        kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
        gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
    return (kv * gate.softmax(dim=1)).sum(dim=1)


def rebuilt_entries(attn, layer: ExtraRowsKVCacheLayer, table_row: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    """Each entry kind's entries [length // rate, width] of one sequence, as the former route computed them at
    every step from the sequence's cached rows (and, for Qwen 3.8, positions)."""
    rows = gather_pages(layer.row_pages, table_row, length)
    name = type(attn).__name__
    if name == "CompressedAttention":
        out, start = {}, 0
        for entry, c in attn._compressors().items():
            kv, gate = rows[:, start:start + 2 * c.width].split(c.width, dim=-1)
            e = c.norm.forward(compress_windows(kv, gate, c.ape, c.rate, c.overlap).to(rows.dtype))
            cos, sin = c.rope.cos_sin(torch.arange(e.shape[0]) * c.rate, length)
            out[entry] = rope_tail(e[:, None], cos, sin)[:, 0]
            start += 2 * c.width
        return out
    if name == "SparseLatentAttention":
        p, d = attn.indexer.pool, attn.indexer.head_dim
        keys, gates = rows[: length // p * p].float().view(-1, p, 2, d).unbind(2)
        return {"pooled_keys": ((gates + attn.indexer.pool_bias.float()).softmax(dim=1) * keys).sum(1)}
    r = attn.ratio
    blocks = length // r
    positions = gather_pages(layer.position_pages, table_row, length)
    pooled = attn.index_k_norm.forward(rows[: blocks * r].float().view(blocks, r, -1).mean(1).to(rows.dtype))
    return {"block_keys": attn._rotate(pooled[:, None], positions[: blocks * r: r], length)[:, 0]}


def check_entries_match_the_rebuild(lm, cache, sequences) -> int:
    """Every cached entry of every sequence equals the former route's; returns how many were compared."""
    compared = 0
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, ExtraRowsKVCacheLayer) or not layer.entries:
            continue
        attn = lm.model.attention_layers()[i]
        for seq in sequences:
            table_row = torch.tensor(seq.state.pages, dtype=torch.int32)
            for name, want in rebuilt_entries(attn, layer, table_row, seq.state.length).items():
                got = gather_pages(layer.entries[name].pages, table_row, want.shape[0])
                torch.testing.assert_close(got, want.to(got.dtype), atol=1e-6, rtol=1e-6)
                compared += want.shape[0]
    return compared


# ---- driving the model with a cache, step by step ----

class Seq:
    """One sequence: its cache pages and the tokens they hold."""

    def __init__(self, cache, tokens: list[int]):
        self.state = SequenceState(cache, with_state_slot=True)
        self.tokens = list(tokens)


def step(lm, cache, feeds: list[tuple[Seq, list[int]]]) -> None:
    """Forward the new tokens of each sequence in one batch; their logits must equal the cacheless forward's."""
    for seq, new in feeds:
        seq.state.reserve(seq.state.length + len(new))
    slots = [seq.state.state_slot for seq, _ in feeds]
    batch = ForwardBatch.with_cache([new for _, new in feeds], [seq.state.length for seq, _ in feeds],
                                    [seq.state.pages for seq, _ in feeds], cache, all_logits=True,
                                    state_slots=None if slots[0] is None else slots)
    with torch.inference_mode():
        got = lm.model.forward(batch)
    start = 0
    for seq, new in feeds:
        seq.state.length += len(new)
        seq.tokens += new
        want = lm.logits([seq.tokens])[0, -len(new):]
        scale = float(want.max() - want.min())
        torch.testing.assert_close(got[start:start + len(new)], want, atol=1e-4 * scale, rtol=0)
        start += len(new)


@pytest.mark.parametrize("route", ["every token folds", "found on the host"])
def test_cached_entries_equal_the_rebuild_across_chunks_decode_and_a_rejected_draft(lm, route, monkeypatch):
    """Both routes of completed_windows: these batches are small enough for every token to fold its window (no
    host read), or, with no room for that, the windows completed are found on the host."""
    if route == "found on the host":
        monkeypatch.setattr(indexed, "FOLD_EVERY_TOKEN_MAX", 0)
    cache = lm.new_cache(max_tokens=256, page_size=PAGE)
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(3, 200, (n,), generator=g).tolist()  # noqa: E731  (below the image ids)
    prompts = [draw(23), draw(9), draw(14)]
    seqs = [Seq(cache, []) for _ in prompts]
    with torch_threads(1):
        # prefill in uneven chunks, the three sequences in one batch: windows straddle the chunk starts
        for cut0, cut1 in ((0, 5), (5, 11), (11, 23)):
            step(lm, cache, [(s, p[cut0:cut1]) for s, p in zip(seqs, prompts) if p[cut0:cut1]])
        for _ in range(6):  # decode across several window boundaries
            step(lm, cache, [(s, draw(1)) for s in seqs])
        assert check_entries_match_the_rebuild(lm, cache, seqs) > 0
        # a draft of 5 tokens (positions 15-19) completes windows; all but its first token are rejected, and a
        # different continuation rewrites positions 15-18: the entries of windows ending at 15 and 17 are folded
        # again, the stale one ending at 19 (rate 4) is not read before position 19 is rewritten by the decode
        seq = seqs[1]
        assert seq.state.length == 15
        length, tokens = seq.state.length, list(seq.tokens)
        snapshot = SequenceState(cache, with_state_slot=True)  # the recurrent layers' state before the draft
        if snapshot.state_slot is not None:
            copy_state_slot(cache, seq.state.state_slot, snapshot.state_slot)
        draft = draw(5)
        step(lm, cache, [(seq, draft)])
        seq.state.length, seq.tokens = length, tokens
        if snapshot.state_slot is not None:
            copy_state_slot(cache, snapshot.state_slot, seq.state.state_slot)
        snapshot.release()
        step(lm, cache, [(seq, draft[:1] + draw(3))])
        for _ in range(5):
            step(lm, cache, [(s, draw(1)) for s in seqs])
        assert check_entries_match_the_rebuild(lm, cache, seqs) > 0


# ---- the real generator: prefix-shared pages, rejected drafts, chunked prefill of several jobs ----

class SameDrafts:
    """Drafts the same token every time: the generator verifies the drafts and rejects most of them, after they
    have completed windows (4 draft tokens cover a window end of every rate here)."""

    def propose(self, requests):
        return [[7] * min(r.max_tokens, 4) for r in requests]

    def release(self, key) -> None:
        pass


def greedy(lm, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from the cacheless forward over the whole sequence at every step."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(lm.logits([tokens])[0, -1].argmax()))
    return tokens[len(prompt):]


def test_generator_with_shared_prefix_pages_and_rejected_drafts_matches_the_cacheless_forward(lm):
    from trellm.generator import Generator

    g = torch.Generator().manual_seed(1)
    draw = lambda n: torch.randint(3, 200, (n,), generator=g).tolist()  # noqa: E731
    a, b = draw(21), draw(10)
    c = a[:16] + draw(6)  # two pages of a's prompt, then its own tokens
    with torch_threads(1):
        gen = Generator(lm, cache_tokens=512, page_size=PAGE, max_chunk_tokens=7, proposer=SameDrafts())
        first = gen.generate([a, b], max_new_tokens=9, stop_token_ids=[], return_results=True)
        second = gen.generate([c, a], max_new_tokens=9, stop_token_ids=[], return_results=True)
        for prompt, result in zip([a, b, c, a], first + second):
            assert result.token_ids == greedy(lm, prompt, 9)
        gen.verify_pages()
    assert second[0].cached_tokens >= 8 and second[1].cached_tokens >= 16  # prefix pages (and their entries) reused
    proposed = sum(r.draft_proposed for r in first + second)
    assert proposed > sum(r.draft_accepted for r in first + second)  # drafts were rejected


def test_copy_page_copies_entries_and_a_page_size_the_windows_do_not_divide_is_refused(lm):
    cache = lm.new_cache(max_tokens=64, page_size=PAGE)
    layers = [l for l in cache.layers if isinstance(l, ExtraRowsKVCacheLayer) and l.entries]
    assert layers
    for layer in layers:
        for entries in layer.entries.values():
            entries.pages[2].normal_()
        layer.row_pages[2].normal_()
        layer.copy_page(2, 5)
        for entries in layer.entries.values():
            assert entries.pages.shape[1] == PAGE // entries.spec.rate
            assert torch.equal(entries.pages[5], entries.pages[2]) and entries.pages[5].abs().sum() > 0
        assert torch.equal(layer.row_pages[5], layer.row_pages[2])
        extra = [layer.row_pages] + ([layer.position_pages] if layer.position_pages is not None else [])
        extra += [e.pages for e in layer.entries.values()]
        assert layer.nbytes() == layer.kv.nbytes() + sum(t.numel() * t.element_size() for t in extra)  # the plan counts them
    with pytest.raises(ConfigError, match=r"cache page size 6 is not a multiple of 4, the window of the '\w+' entries"):
        lm.new_cache(max_tokens=64, page_size=6)


def test_a_decode_step_folds_and_stores_its_windows_without_a_host_read(monkeypatch):
    """On meta tensors, where a host read raises, a decode step (2 sequences) and a draft verification (2 x 3
    tokens) find, read and store their windows; a batch past the budget finds them on the host."""
    layer = ExtraRowsKVCacheLayer(KVCacheLayer(6, 8, 1, 4, 4, torch.float32, "meta"), 6, entries=[WindowEntries("e", 4, 3)])
    cache = KVCache([layer], 8, torch.device("meta"))
    for new, budget in ((1, indexed.FOLD_EVERY_TOKEN_MAX), (3, indexed.FOLD_EVERY_TOKEN_MAX), (3, 6 * 4 * 6 - 1)):
        monkeypatch.setattr(indexed, "FOLD_EVERY_TOKEN_MAX", budget)
        batch = ForwardBatch(input_ids=torch.zeros(2 * new, dtype=torch.long), positions=torch.zeros(2 * new, dtype=torch.long),
                             cu_seqlens=torch.tensor([0, new, 2 * new], dtype=torch.int32), cache=cache,
                             block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
                             context_lens=torch.tensor([9, 17], dtype=torch.int32) + new)
        batch = ForwardBatch(**{name: value.to("meta") if isinstance(value, torch.Tensor) else value
                                for name, value in attrs.asdict(batch, recurse=False).items()})
        if 2 * new * 4 * 6 > budget:
            with pytest.raises(NotImplementedError, match="nonzero"):
                completed_windows(batch, 4, 4 * 6)
            continue
        windows = completed_windows(batch, 4, 4 * 6)
        assert windows.count == 2 * new
        rows, valid = window_rows(windows, 4, None, batch, layer.row_pages)
        assert rows.shape == (2 * new, 4, 6) and valid.shape == (2 * new, 4)
        layer.entries["e"].store(rows[:, -1, :3], windows, batch.block_table)
