"""Hybrid linear-attention families (Qwen3.5, Qwen3.5 MoE, Qwen3-Next) against HF transformers.

Tiny random weights. Checked: prompt logits without a cache (prompts longer than one delta-rule
chunk), chunked prefill through the paged cache + recurrent-state slots, and greedy continuations
decoded for several sequences in one batch, each compared with HF's own cached greedy decoding.
Cached decoding builds ForwardBatches here directly (with ``state_slots``), as the generator does.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import trellm
from trellm.batch import ForwardBatch
from trellm.cache import CacheFullError, SequenceState
from trellm.cache.recurrent import (
    RecurrentStateLayer,
    alloc_state_slot,
    copy_state_slot,
    free_state_slot,
    state_layers,
)
from trellm.sdk.testing import _hf_greedy, make_tiny_hf_model

LINEAR = {
    "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
}
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}

FAMILIES = {
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", {**LINEAR, **EXPERTS}),
    "qwen3_5": ("Qwen3_5ForCausalLM", LINEAR),
    "qwen3_next": ("Qwen3NextForCausalLM", {**LINEAR, **EXPERTS, "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
    "olmo_hybrid": ("OlmoHybridForCausalLM", {
        "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
    "nemotron_h": ("NemotronHForCausalLM", {
        "num_hidden_layers": 3, "layers_block_type": ["linear_attention", "full_attention", "moe"], "mamba_num_heads": 4,
        "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "head_dim": 16, "n_group": 2, "topk_group": 1,
        "chunk_size": 16, "routed_scaling_factor": 1.5}),
    "lfm2_moe": ("Lfm2MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_dense_layers": 1, "num_hidden_layers": 3,
        "layer_types": ["conv", "full_attention", "conv"], "routed_scaling_factor": 1.5}),
}

PROMPT_LENS = (70, 9, 23)  # 70 > one 64-token delta-rule chunk
NEW_TOKENS = 12


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def cached_greedy(model, prompt_ids: list[list[int]], new_tokens: int, chunk: int = 16, page_size: int = 16):
    """Chunked prefill of all prompts side by side, then greedy decode of all of them in one batch per step.

    Returns (greedy tokens per prompt, logits of each prompt's last token after prefill).
    """
    cache = model.make_cache(max_tokens=sum(len(p) + new_tokens for p in prompt_ids) + 64, page_size=page_size,
                             max_slots=len(prompt_ids) + 1)
    seqs, slots = [], []
    for p in prompt_ids:
        s = SequenceState(cache)
        s.reserve(len(p) + new_tokens)
        seqs.append(s)
        slots.append(alloc_state_slot(cache))
    last_logits: list[torch.Tensor | None] = [None] * len(prompt_ids)
    while any(s.length < len(p) for s, p in zip(seqs, prompt_ids)):  # prefill chunks of every unfinished prompt
        rows = [i for i, (s, p) in enumerate(zip(seqs, prompt_ids)) if s.length < len(p)]
        feeds = [prompt_ids[i][seqs[i].length: seqs[i].length + chunk] for i in rows]
        batch = ForwardBatch.with_cache(feeds, [seqs[i].length for i in rows], [seqs[i].pages for i in rows], cache)
        batch.state_slots = torch.tensor([slots[i] for i in rows], dtype=torch.long)
        logits = model.forward(batch)
        for j, i in enumerate(rows):
            seqs[i].length += len(feeds[j])
            if seqs[i].length == len(prompt_ids[i]):
                last_logits[i] = logits[j]
    out = [[int(l.argmax())] for l in last_logits]
    for _ in range(new_tokens - 1):
        batch = ForwardBatch.with_cache([[o[-1]] for o in out], [s.length for s in seqs], [s.pages for s in seqs], cache)
        batch.state_slots = torch.tensor(slots, dtype=torch.long)
        logits = model.forward(batch)
        for i, o in enumerate(out):
            seqs[i].length += 1
            o.append(int(logits[i].argmax()))
    for s, slot in zip(seqs, slots):
        s.release()
        free_state_slot(cache, slot)
    return out, torch.stack(last_logits)


def randomize(model_dir, suffixes: tuple[str, ...], scale: float = 0.5) -> None:
    """Give router biases (zero in a fresh HF model) random values in the saved checkpoint."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(0)
    for name in tensors:
        if name.endswith(suffixes):
            tensors[name] = torch.randn(tensors[name].shape, generator=g) * scale
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, cfg = FAMILIES[request.param]
    model_dir = make_tiny_hf_model(arch, tmp_path_factory.mktemp(request.param), **cfg)
    randomize(model_dir, ("e_score_correction_bias", "expert_bias"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lm = trellm.load(model_dir, device="cpu", dtype=torch.float32)
    return hf, lm


def test_prompt_logits_match_hf(family):
    hf, lm = family
    ps = prompts(lm.config.vocab_size)
    got = lm.logits(ps)  # all prompts in one varlen batch, no cache
    with torch.no_grad():
        for i, p in enumerate(ps):
            ref = hf(torch.tensor([p])).logits[0]
            assert (ref - got[i, : len(p)]).abs().max() <= 1e-3 * (ref.max() - ref.min())
            assert torch.equal(ref.argmax(-1), got[i, : len(p)].argmax(-1))


def test_batched_cached_greedy_matches_hf(family):
    hf, lm = family
    ps = prompts(lm.config.vocab_size, seed=1)
    with torch.inference_mode():
        greedy, last = cached_greedy(lm.model, ps, NEW_TOKENS)
        whole = lm.logits(ps)
    for i, p in enumerate(ps):  # chunked, cached prefill == one uncached pass
        assert (last[i] - whole[i, len(p) - 1]).abs().max() < 1e-4
    assert greedy == [_hf_greedy(hf, p, NEW_TOKENS) for p in ps]


def test_multimodal_checkpoint_text_path(tmp_path):
    """Qwen3_5MoeForConditionalGeneration: the language model under model.language_model.*, vision ignored."""
    text = {k: v for k, v in {**LINEAR, **EXPERTS}.items()}
    text.update(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.15)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    lm = trellm.load(tmp_path, device="cpu", dtype=torch.float32)
    p = prompts(256)[0]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([p])).logits[0]
    got = lm.logits([p])[0]
    assert (ref - got).abs().max() <= 1e-3 * (ref.max() - ref.min())
    with torch.inference_mode():
        greedy, _ = cached_greedy(lm.model, [p], 6)
    assert greedy[0] == _hf_greedy(hf, p, 6)


def test_state_slot_checkpoint_and_restore(family):
    """copy_slot snapshots a sequence's recurrent state: continuing from the copy gives the same tokens."""
    _, lm = family
    model = lm.model
    p = prompts(lm.config.vocab_size, seed=2)[1]
    cache = model.make_cache(max_tokens=128, page_size=16, max_slots=3)
    seq = SequenceState(cache)
    seq.reserve(len(p) + 4)
    slot = alloc_state_slot(cache)

    def step(tokens, s, slot_id):
        batch = ForwardBatch.with_cache([tokens], [s.length], [s.pages], cache)
        batch.state_slots = torch.tensor([slot_id])
        s.length += len(tokens)
        return int(model.forward(batch)[-1].argmax())

    with torch.inference_mode():
        first = step(p, seq, slot)
        snapshot = alloc_state_slot(cache)
        copy_state_slot(cache, slot, snapshot)
        saved_len = seq.length
        a = step([first], seq, slot)
        seq.length = saved_len  # roll back: the attention layers simply overwrite the same page slots
        b = step([first], seq, snapshot)
    assert a == b


def test_recurrent_state_layer_slots():
    layer = RecurrentStateLayer(2, conv_dim=3, conv_width=4, state_shape=(2, 4, 4), dtype=torch.float32, device="cpu")
    a = layer.alloc_slot()
    layer.states[a] += 1.0
    layer.conv_states[a] += 1.0
    b = layer.alloc_slot()
    assert a != b and layer.free_slots == 0
    with pytest.raises(CacheFullError):
        layer.alloc_slot()
    layer.copy_slot(a, b)
    assert torch.equal(layer.states[b], layer.states[a])
    layer.free_slot(a)
    with pytest.raises(ValueError):
        layer.free_slot(a)
    again = layer.alloc_slot()
    assert again == a and not layer.states[again].any() and not layer.conv_states[again].any()  # zeroed on alloc
    fresh_conv, fresh_state = layer.read(torch.tensor([b]), fresh=torch.tensor([True]))
    assert not fresh_state.any() and not fresh_conv.any()


def test_hybrid_cache_layout(family):
    _, lm = family
    cache = lm.model.make_cache(max_tokens=64, page_size=16, max_slots=2)
    kinds = ["state" if isinstance(l, RecurrentStateLayer) else "kv" if l is not None else None for l in cache.layers]
    want = ["state" if r is not None else "kv" if a is not None else None
            for r, a in zip(lm.model.recurrent_layers(), lm.model.attention_layers())]
    assert kinds == want and "state" in kinds and "kv" in kinds
    assert len(state_layers(cache)) == kinds.count("state")


def test_cached_forward_without_slots_is_an_error(family):
    _, lm = family
    cache = lm.model.make_cache(max_tokens=64, page_size=16, max_slots=2)
    seq = SequenceState(cache)
    seq.reserve(4)
    batch = ForwardBatch.with_cache([[1, 2, 3]], [0], [seq.pages], cache)
    with pytest.raises(ValueError, match="state_slots"):
        lm.model.forward(batch)


def test_generator_batches_hybrid_jobs(family):
    """The continuous-batching generator (chunked prefill next to decode, one state slot per job) gives the
    same greedy tokens as decoding each batch by hand, which the test above holds against HF."""
    from trellm.generator import Generator

    _, lm = family
    ps = prompts(lm.config.vocab_size, seed=1)
    gen = Generator(lm, cache=lm.model.make_cache(max_tokens=1024, page_size=16, max_slots=2), max_batch_size=2,
                    max_chunk_tokens=24)  # 2 slots for 3 jobs: the third waits for a free slot
    with torch.inference_mode():
        done = gen.generate([list(p) for p in ps], max_new_tokens=NEW_TOKENS, return_results=True, stop_token_ids=[])
        want, _ = cached_greedy(lm.model, ps, NEW_TOKENS)
    assert [r.token_ids for r in done] == want


def test_nemotron_h_latent_moe_logits(tmp_path):
    """NemotronH with ``moe_latent_size``: routed experts run in a projected latent space."""
    arch, cfg = FAMILIES["nemotron_h"]
    model_dir = make_tiny_hf_model(arch, tmp_path, **{**cfg, "moe_latent_size": 16})
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lm = trellm.load(model_dir, device="cpu", dtype=torch.float32)
    p = prompts(lm.config.vocab_size)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0]
    got = lm.logits([p])[0]
    assert (ref - got).abs().max() <= 1e-3 * (ref.max() - ref.min())


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2_moe", "nemotron_h"])
def test_parity_kit_and_simple_generate_handle_recurrent_state(tmp_path, family):
    """check_parity (LoadedModel.generate_ids + cached batched logits) allocates state slots itself."""
    from trellm.sdk.testing import check_parity

    arch, overrides = FAMILIES[family]
    if not hasattr(transformers, arch):
        pytest.skip(f"transformers has no {arch}")
    report = check_parity(make_tiny_hf_model(arch, tmp_path, **overrides), max_new_tokens=12)
    report.assert_ok()


def _run_jobs(gen, jobs_prompts: list[list[int]], new_tokens: int, one_at_a_time: bool) -> tuple[list, list]:
    """Greedy results (JobFinished) and JobStarted events, jobs run one after another or all together."""
    from trellm.generator import Job, JobFinished, JobStarted

    finished, started = [], []
    groups = [[p] for p in jobs_prompts] if one_at_a_time else [jobs_prompts]
    with torch.inference_mode():
        for group in groups:
            gen.enqueue([Job(list(p), new_tokens, stop_token_ids=[], identifier=len(finished) + i) for i, p in enumerate(group)])
            while gen.has_work():
                for r in gen.iterate():
                    finished += [r] if isinstance(r, JobFinished) else []
                    started += [r] if isinstance(r, JobStarted) else []
    return sorted(finished, key=lambda r: r.identifier), sorted(started, key=lambda r: r.identifier)


def test_generator_reuses_prefix_through_state_checkpoints(family):
    """A job sharing a long prefix with a finished one starts from the recurrent-state checkpoint of the
    deepest shared page: it prefills less and decodes exactly what a run without prefix caching decodes."""
    from trellm.generator import Generator

    _, lm = family
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, lm.config.vocab_size, (50,), generator=g).tolist()
    ps = [base + torch.randint(0, lm.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 2)]

    def make(prefix_caching: bool) -> Generator:
        return Generator(lm, max_batch_size=2, max_chunk_tokens=24, cache_tokens=512, page_size=16, prefix_caching=prefix_caching)

    gen = make(True)
    done, started = _run_jobs(gen, ps, NEW_TOKENS, one_at_a_time=True)
    want, _ = _run_jobs(make(False), ps, NEW_TOKENS, one_at_a_time=True)
    assert [r.token_ids for r in done] == [r.token_ids for r in want]
    assert [s.cached_tokens for s in started] == [0, 48, 48]  # three full 16-token pages of the shared 50
    assert gen.stats["reused_tokens"] == 96
    gen.verify_pages()  # pages and state slots: jobs (none left) + prefix entries and their checkpoints
    assert gen.cache.prefix_cache.checkpoint_of
    gen.clear_prefix_cache()
    assert all(layer.free_slots == layer.max_slots for layer in state_layers(gen.cache))


class ReplayProposer:
    """Drafts the known greedy continuation of each prompt, every other time with its last draft token
    wrong, so verification sees both full and partial acceptance (random tiny models rarely repeat
    themselves, so the n-gram proposer alone seldom gets a draft accepted)."""

    def __init__(self, full_sequences: list[list[int]], num_tokens: int = 4):
        self.full_sequences, self.num_tokens, self.calls = full_sequences, num_tokens, 0

    def propose(self, requests):
        out = []
        for req in requests:
            self.calls += 1
            seq = next((s for s in self.full_sequences if s[: len(req.tokens)] == list(req.tokens)), [])
            draft = seq[len(req.tokens): len(req.tokens) + min(self.num_tokens, req.max_tokens)]
            if draft and self.calls % 2:
                draft[-1] = (draft[-1] + 1) % 256
            out.append(draft)
        return out

    def release(self, key) -> None:
        pass


def test_generator_speculative_decoding_rolls_state_back(family):
    """Drafts on a hybrid model: snapshot before verification, restore on rejection and re-feed the accepted
    tokens. Tokens equal plain greedy decoding (n-gram and replayed drafts), drafts are accepted, and no state
    slot leaks (prefix checkpoints are on as well)."""
    from trellm.generator import Generator, NgramProposer

    _, lm = family
    g = torch.Generator().manual_seed(4)
    motif = torch.randint(0, lm.config.vocab_size, (7,), generator=g).tolist()
    ps = [motif * 6, (motif[::-1] * 5)[:33]]  # repetitive prompts give the n-gram proposer something to copy
    make = lambda proposer: Generator(lm, max_batch_size=2, max_chunk_tokens=24, cache_tokens=512, page_size=16,  # noqa: E731
                                      proposer=proposer)
    want, _ = _run_jobs(make(None), ps, 24, one_at_a_time=False)
    for proposer in (NgramProposer(4), ReplayProposer([p + r.token_ids for p, r in zip(ps, want)])):
        gen = make(proposer)
        done, _ = _run_jobs(gen, ps, 24, one_at_a_time=False)
        assert [r.token_ids for r in done] == [r.token_ids for r in want]
        gen.verify_pages()
        gen.clear_prefix_cache()
        assert all(layer.free_slots == layer.max_slots for layer in state_layers(gen.cache))
    proposed, accepted = sum(r.draft_proposed for r in done), sum(r.draft_accepted for r in done)
    assert 0 < accepted < proposed, (accepted, proposed)  # both full and partial acceptance happened
    assert gen.stats["steps"] < 24  # accepted drafts saved decode steps despite the re-fed tokens


def test_generator_banned_string_rewind_restarts_state(tmp_path):
    """A banned-string rewind puts a hybrid job back at its last release point: its recurrent state restarts
    from the deepest checkpoint of its own pages, so every token but the banned choice is plain greedy."""
    from test_generator import byte_tokenizer  # tests/ is on sys.path

    from trellm.generator import Generator

    arch, cfg = FAMILIES["qwen3_5"]
    lm = trellm.load(make_tiny_hf_model(arch, tmp_path, **cfg), device="cpu", dtype=torch.float32)
    tok = byte_tokenizer()
    prompt = torch.randint(33, 120, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        gen = Generator(lm, tokenizer=tok, cache_tokens=512, page_size=8, max_chunk_tokens=24)
        text = gen.generate(prompt, 30, stop_token_ids=[], return_results=True).text
        banned = text[20:23]
        got = gen.generate(prompt, 30, stop_token_ids=[], banned_strings=[banned], return_results=True)
        plain = Generator(lm, tokenizer=tok, cache_tokens=512, page_size=8, prefix_caching=False)
        greedy = [plain.generate(prompt + got.token_ids[:j], 1, stop_token_ids=[], return_results=True).token_ids[0]
                  for j in range(len(got.token_ids))]
    assert banned not in got.text and len(got.token_ids) == 30
    differs = [j for j, (a, b) in enumerate(zip(got.token_ids, greedy)) if a != b]
    assert 1 <= len(differs) <= 2, differs  # only where the banned string was steered around
    gen.verify_pages()
