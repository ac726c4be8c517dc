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
