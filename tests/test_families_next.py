"""GLM 5.3-Flash and Qwen 3.8-Flash-Next (issue 30): Kimi delta attention, the pooled DSA indexer,
hyper-connections, each held against transformers on tiny random weights."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packaging.version import Version  # noqa: E402

from trellm import ops
from trellm.sdk.testing import check_parity, make_tiny_hf_model, torch_threads

from test_moe_families import randomize

# ---- Kimi delta attention: the chunked and the one-step ops against transformers' token-by-token loop ----


def _kda_inputs(lengths, heads=3, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k = torch.randn(t, heads, dk, generator=g), torch.randn(t, heads, dk, generator=g)
    v = torch.randn(t, heads, dv, generator=g)
    decay = -5 * torch.sigmoid(torch.randn(t, heads, dk, generator=g))  # the lower-bounded gate's range
    beta = torch.sigmoid(torch.randn(t, heads, generator=g))
    init = torch.randn(len(lengths), heads, dk, dv, generator=g)
    return q, k, v, decay, beta, init


def _hf_kda(q, k, v, g, beta, state):
    from transformers.models.glm5_next.modeling_glm5_next import recurrent_kimi_delta_attention

    out, final = recurrent_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None], state, True,
                                                use_qk_l2norm_in_kernel=True)
    return out[0], final


def test_kda_chunked_matches_the_recurrence_across_chunks_and_sequences():
    from trellm.ops.deltanet import l2_normalize

    lengths = [23, 5, 40]  # within one chunk, shorter than one, several chunks with a remainder
    q, k, v, g, beta, init = _kda_inputs(lengths)
    cu = torch.tensor([0, 23, 28, 68])
    out, finals = ops.kda_chunked(l2_normalize(q), l2_normalize(k), v, g, beta, cu, init, chunk_size=8)
    for b in range(3):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        ref, ref_state = _hf_kda(q[s0:s1], k[s0:s1], v[s0:s1], g[s0:s1], beta[s0:s1], init[b : b + 1])
        torch.testing.assert_close(out[s0:s1], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(finals[b], ref_state[0], atol=1e-5, rtol=1e-5)


def test_kda_step_on_slots_updates_in_place_and_fresh_rows_start_from_zero():
    from trellm.ops.deltanet import l2_normalize

    q, k, v, g, beta, init = _kda_inputs([1, 1, 1])
    states = init.clone()
    slots, fresh = torch.tensor([2, 0, 1]), torch.tensor([False, True, False])
    out = ops.kda_step_slots(l2_normalize(q), l2_normalize(k), v, g, beta, states, slots, fresh)
    for row, (slot, start) in enumerate([(2, init[2:3]), (0, None), (1, init[1:2])]):
        ref, ref_state = _hf_kda(q[row : row + 1], k[row : row + 1], v[row : row + 1], g[row : row + 1],
                                 beta[row : row + 1], start)
        torch.testing.assert_close(out[row], ref[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(states[slot], ref_state[0], atol=1e-6, rtol=1e-5)


# ---- GLM 5.3-Flash ----

GLM5_NEXT = dict(
    moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
    index_topk=8, index_head_dim=16, index_n_heads=8, index_kpool=4,  # 2 pools of 4 out of up to 7: sparse
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "dense"],
    linear_head_dim=16, linear_num_heads=4, hc_mult=4, hc_sinkhorn_iters=5, swiglu_limit=1.0,
    pad_token_id=0, image_token_id=250, video_token_id=251, image_start_token_id=252, image_end_token_id=253,
    video_start_token_id=254, video_end_token_id=255,
    vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                       projection_intermediate_size=64),
)


def require_next_configs() -> None:
    """Skip where transformers cannot build these checkpoints: their configs are transformers 5.25's (5.17, on
    the lent GPU machine, rejects the "indexed_attention" layer type)."""
    if Version(transformers.__version__) < Version("5.25"):
        pytest.skip(f"transformers {transformers.__version__} predates the GLM 5.3 / Qwen 3.8 configs (5.25)")


def glm5_next_checkpoint(tmp_path, **overrides):
    require_next_configs()
    model_dir = make_tiny_hf_model("Glm5NextForConditionalGeneration", tmp_path, **{**GLM5_NEXT, **overrides})
    for suffix, scale in (("index_kpool_compress_ape", 0.5), ("index_kpool_compress_gate", 0.3), ("hc_attn_fn", 0.2),
                          ("hc_ffn_fn", 0.2), ("e_score_correction_bias", 0.5)):
        randomize(model_dir, suffix, scale)
    return model_dir


@pytest.mark.parametrize("variant", [
    {},
    {"linear_lower_bound": None, "index_topk": 4},  # softplus decay; one pool kept
])
def test_glm5_next_text_parity(tmp_path, variant):
    report = check_parity(glm5_next_checkpoint(tmp_path, **variant))
    print(report)
    report.assert_ok()


def test_glm5_next_indexer_attends_to_a_strict_subset(tmp_path):
    """The selection is sparse at this size (else parity would not test the indexer), and a shared layer
    attends exactly where the full layer before it does."""
    import trellm
    from trellm.sdk import ForwardBatch

    lm = trellm.load(glm5_next_checkpoint(tmp_path), device="cpu", dtype=torch.float32, tokenizer=False)
    attn1, attn2 = lm.model.layers[1].attn, lm.model.layers[2].attn
    with torch_threads(1), torch.inference_mode():
        lm.model.forward(ForwardBatch.no_cache([list(range(1, 24))]))
    assert attn1.indexer is not None and attn2.indexer is None and attn2.selection is attn1.selection
    chosen = attn1.selection  # [23, 2 pools of 4 + a tail of at most 3] token indices, -1: none
    assert chosen.shape == (23, 11)
    mask = torch.zeros(23, 24, dtype=torch.bool).scatter_(1, torch.where(chosen >= 0, chosen, 23), True)[:, :23]
    causal = torch.ones(23, 23, dtype=torch.bool).tril()
    assert not (mask & ~causal).any()
    assert (mask.sum(-1)[11:] < causal.sum(-1)[11:]).all()  # every query past 11 tokens skips some
    incomplete = (torch.arange(23) + 1) % 4 != 0
    assert mask.diagonal()[incomplete].all()  # a query's own incomplete pool is its tail


def test_pooled_selection_without_tail_reads_zeros_before_the_first_whole_pool():
    """index_kpool_always_select_tail false: a query that has seen no whole pool keeps no token and reads zeros
    (not NaN); later ones read their pools' tokens only."""
    from trellm.modules.latent import pool_tokens
    from trellm.ops.sparse import sparse_paged_attention, varlen_as_pages

    positions = torch.arange(6)
    chosen = torch.tensor([[-1], [-1], [-1], [0], [0], [0]])  # pool 0 (tokens 0-3) is whole from position 3
    tokens = pool_tokens(chosen, 4, None)
    assert tokens.shape == (6, 7) and (tokens[:3] < 0).all() and tokens[3].tolist() == [0, 1, 2, 3, -1, -1, -1]
    assert pool_tokens(chosen, 4, positions)[5, 4:].tolist() == [4, 5, -1]  # the tail: 4 and the query itself
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(6, 2, 8, generator=g), torch.randn(6, 1, 8, generator=g)
    cu = torch.tensor([0, 6])
    pages, table, lens = varlen_as_pages(kv, cu)
    out = sparse_paged_attention(q, pages, pages, table, cu, lens, tokens, 0.5)
    assert torch.isfinite(out).all() and (out[:3] == 0).all() and (out[3:].abs() > 0).any()


def test_glm5_next_config_errors(tmp_path):
    import json

    import trellm
    from trellm.sdk import ConfigError

    model_dir = glm5_next_checkpoint(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["indexer_types"] = ["full", "shared", "full", "full"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="layer 1 shares the indexer selection"):
        trellm.load(model_dir, device="cpu", tokenizer=False)


# ---- Qwen 3.8-Flash-Next ----

QWEN4_EXP_TEXT = dict(
    vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256, initializer_range=0.15, num_hidden_layers=4,
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
    hc_count=3, hc_lowrank=16,
    indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
    ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=1000,
    make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)
QWEN4_EXP_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=14)


def qwen4_exp_checkpoint(tmp_path, **text):
    require_next_configs()
    return make_tiny_hf_model("Qwen4ExpForConditionalGeneration", tmp_path, text_config={**QWEN4_EXP_TEXT, **text},
                              vision_config=QWEN4_EXP_VISION, image_token_id=250, video_token_id=251,
                              vision_start_token_id=252, vision_end_token_id=253)


def _prompts_with_eos(eos: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(3, 256, (23,), generator=g).tolist(), torch.randint(3, 256, (9,), generator=g).tolist()
    long[6] = long[7] = long[15] = eos  # n-gram histories restart after each EOS (two in a row too)
    short[1] = eos
    return [long, short]


@pytest.mark.parametrize("variant", [{}, {"output_gate_type": "sigmoid", "ple_layer_ids": [3]}])
def test_qwen4_exp_text_parity(tmp_path, variant):
    report = check_parity(qwen4_exp_checkpoint(tmp_path, **variant), prompts=_prompts_with_eos(2))
    print(report)
    report.assert_ok()


def test_ngram_embedding_history_in_pieces_matches_transformers():
    """The hashed n-gram ids of a token stream fed in pieces (the cached path: ngram_size - 1 tokens of
    history carried over), the pieces side by side as the sequences of one batch, equal transformers' ids over
    the whole stream, EOS resets included."""
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    from trellm.batch import ForwardBatch
    from trellm.plugins.architectures.qwen4_exp import NGramEmbedding, ngram_windows

    config = Qwen4ExpTextConfig(**{**QWEN4_EXP_TEXT, "ngram_size": 4, "ple_embed_dim": 48})
    torch.manual_seed(0)
    hf = Qwen4ExpTextNGramEmbedding(config, 48, layer_idx=0, ple_layer_index=1)
    ours = NGramEmbedding("e", 4, 2, 48, eos=2)
    ours.multipliers, ours.vocab_sizes, ours.offsets = hf.layer_multipliers, hf.ngram_heads_vocab_sizes, hf.ngram_heads_offsets
    ours.table = hf.ngram_embedding.weight.detach()
    stream = [5, 9, 2, 7, 7, 2, 2, 11, 13, 17, 19, 2, 23, 29]
    with torch.no_grad():
        want = hf(torch.tensor([stream]), None)[0]
    cuts = (0, 1, 6, 7, len(stream))
    padded = [2, 2, 2] + stream  # EOS before the start
    before = torch.tensor([padded[a: a + 3] for a in cuts[:-1]])  # each piece's 3 tokens of history
    batch = ForwardBatch.no_cache([stream[a:b] for a, b in zip(cuts[:-1], cuts[1:])])
    got = ours.forward(ngram_windows(before, batch))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dilation", [1, 3])
def test_conv_step_is_the_varlen_conv_of_one_token(dilation):
    """causal_conv1d_step (a decode step: no host read, the PLE's dilated conv included) gives the varlen conv's
    output and final states for one token per sequence, from the same initial states."""
    g = torch.Generator().manual_seed(0)
    batch, channels, width = 3, 8, 4
    x, weight = torch.randn(batch, channels, generator=g), torch.randn(channels, width, generator=g)
    states = torch.randn(batch, channels, (width - 1) * dilation, generator=g)
    want, want_states = ops.causal_conv1d(x, weight, None, torch.arange(batch + 1, dtype=torch.int32), states,
                                          dilation=dilation)
    got, got_states = ops.causal_conv1d_step(x, weight, None, states, dilation=dilation)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_states, want_states)
