"""Tensor parallel on CPU: real gloo worker processes on loopback (2 and 4 ranks) against one process.

Each model directory is loaded once per world size (module-scoped fixtures): starting the workers is
most of the time these tests take.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import trellm
from trellm.batch import ForwardBatch
from trellm.distributed import ShardingError, TensorParallelError
from trellm.cli import main as cli_main
from trellm.distributed.plan import gib, plan_memory
from trellm.distributed.sharding import head_shard, partition, shard_columns, shard_rows
from trellm.generator import Generator, Job
from trellm.generator.mtp import MTPProposer
from trellm.quant.exl3.format import EXL3Linear
from trellm.sdk.testing import make_tiny_hf_model

from test_families_dsa import DEEPSEEK_V4, GLM_DSA, random_tid2eid  # tests/ is on sys.path
from test_families_gemma4 import GEMMA4, LAGUNA
from test_families_next import glm5_next_checkpoint, qwen4_exp_checkpoint
from test_moe_families import randomize
from test_mtp import add_mtp_tensors
from test_vision_qwen import save_tiny_vl

STEP_TIMEOUT = 30.0


def _exl3_from_dense(dense: Path, out: Path) -> Path:
    """``dense`` with every projection and the LM head as random EXL3 tensors (2 bits, 3INST codebook)."""
    out.mkdir()
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for name, t in load_file(dense / "model.safetensors").items():
        if t.dim() == 2 and (name.endswith("_proj.weight") or name == "lm_head.weight"):
            key, (n, k) = name.removesuffix(".weight"), t.shape
            tensors[f"{key}.trellis"] = torch.randint(-32768, 32768, (k // 16, n // 16, 32), generator=g, dtype=torch.int16)
            sign = lambda size: torch.randint(0, 2, (size,), generator=g) * 2 - 1  # noqa: E731
            tensors[f"{key}.suh"] = (sign(k) * 0.3).half()
            tensors[f"{key}.svh"] = (sign(n) * 0.3).half()
        else:
            tensors[name] = t
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text((dense / "config.json").read_text())
    return out


# EXL3 splits on 128-blocks, so its heads are 128 wide. The CPU reference decodes every weight at every call:
# the model that generates is as small as 2 ranks allow (1 KV head, so replicated); the one 4 ranks split
# (128 columns of MLP and vocabulary each) is only compared by its logits.
EXL3_SMALL = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=256,
                  vocab_size=256, num_hidden_layers=1, tie_word_embeddings=False)
EXL3_WIDE = dict(EXL3_SMALL, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512, vocab_size=512)
# hybrids: gated delta net (2 key heads, 4 value heads) + gated attention, 3 layers
LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"])
MODELS = {  # name: (HF architecture, tiny config overrides)
    "llama": ("LlamaForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=16, intermediate_size=96, vocab_size=250)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True, mlp_only_layers=[1])),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                                            topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                            routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True)),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", dict(LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=32)),
    "qwen3_5": ("Qwen3_5ForCausalLM", LINEAR),
    "nemotron_h": ("NemotronHForCausalLM", dict(
        num_hidden_layers=3, layers_block_type=["linear_attention", "full_attention", "moe"], mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, head_dim=16, n_group=2, topk_group=1, chunk_size=16, routed_scaling_factor=1.5)),
    "lfm2_moe": ("Lfm2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1, num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"], routed_scaling_factor=1.5)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_key_value_heads=4)),
    "dense_small": ("LlamaForCausalLM", EXL3_SMALL),
    "dense_wide": ("LlamaForCausalLM", EXL3_WIDE),
}


def _tiny(arch: str, overrides: dict, *randomized: str):
    """A writer of a tiny ``arch`` checkpoint whose tensors ending in ``randomized`` get random values (HF starts
    them at constants: a router bias, a scalar, a position bias)."""

    def write(path: Path) -> Path:
        make_tiny_hf_model(arch, path, **overrides)
        for suffix in randomized:
            randomize(path, suffix)
        return path

    return write


def _deepseek_v4(path: Path) -> Path:
    _tiny("DeepseekV4ForCausalLM", DEEPSEEK_V4, "gate.bias", ".ape")(path)
    random_tid2eid(path, 8)
    return path


def _step3p5(path: Path) -> Path:
    """StepFun's Step3p5ForCausalLM checkpoint: the text tensors of a tiny Step 3.7 under StepFun's config."""
    from test_families_step import _step_hf_model, _stepfun_config

    _step_hf_model().save_pretrained(path / "hf")
    text = {k: t for k, t in load_file(path / "hf" / "model.safetensors").items() if k.startswith(("model.", "lm_head"))}
    save_file(text, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_stepfun_config()))
    return path


def _with_mtp(path: Path) -> Path:
    """The hybrid MoE of MODELS with an MTP head (random mtp.* tensors)."""
    arch, overrides = MODELS["qwen3_5_moe"]
    make_tiny_hf_model(arch, path, **overrides)
    add_mtp_tensors(path)
    return path


def _qwen3_vl_moe(path: Path) -> Path:
    save_tiny_vl("qwen3_vl_moe", path)
    return path


# checkpoints the newer attention kinds, MTP drafting and images run on: name -> writer of its directory
WRITERS = {
    "glm_dsa": _tiny("GlmMoeDsaForCausalLM", GLM_DSA, "e_score_correction_bias"),  # DSA: MLA + indexer, shared layers
    "deepseek_v4": _deepseek_v4,  # sliding / CSA / HCA, hyper-connections, hash-routed experts
    "gemma4_kv_shared": _tiny("Gemma4ForCausalLM", GEMMA4["per_layer_inputs_kv_sharing"], "layer_scalar"),
    # K=V global layers of 32-dim heads and their own KV head (no per-layer inputs: HF's default table is 262144 rows)
    "gemma4_k_eq_v": _tiny("Gemma4ForCausalLM", dict(GEMMA4["moe_k_eq_v"], hidden_size_per_layer_input=0), "layer_scalar"),
    "laguna": _tiny("LagunaForCausalLM", dict(LAGUNA, gating="per-head"), "e_score_correction_bias"),  # 4 / 8 / 2 heads
    "step3p5": _step3p5,  # 4 heads on full layers, 8 on sliding ones, head-gated
    "qwen3_5_moe_mtp": _with_mtp,
    "qwen3_vl_moe": _qwen3_vl_moe,
    # hybrids with mixers of their own, split by heads: GLM 5.3's KimiDeltaAttention (4 heads) beside its sparse MLA,
    # Qwen 3.8's PLEDeltaNet (2 key heads, 4 value heads) and IndexedAttention (4 heads, 2 KV heads)
    "glm5_next": glm5_next_checkpoint,
    "qwen4_exp": qwen4_exp_checkpoint,
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Model directories by name, each written on first use."""
    root = tmp_path_factory.mktemp("tp")

    class Dirs(dict):
        def __missing__(self, name: str) -> Path:
            if name.startswith("exl3_"):
                self[name] = _exl3_from_dense(self[name.replace("exl3", "dense")], root / name)
            elif name in WRITERS:
                (root / name).mkdir()
                self[name] = WRITERS[name](root / name)
            else:
                arch, overrides = MODELS[name]
                self[name] = make_tiny_hf_model(arch, root / name, **overrides)
            return self[name]

    return Dirs()


_loaded: dict = {}


def _model(model_dirs, name: str, world: int):
    key = (name, world)
    if key not in _loaded:
        _loaded[key] = trellm.load(model_dirs[name], device="cpu", tokenizer=False, tensor_parallel=world,
                                   step_timeout=STEP_TIMEOUT)
    return _loaded[key]


@pytest.fixture(scope="module", autouse=True)
def _close_models():
    """Every model loaded here ends with close(); its workers must then have exited cleanly."""
    yield
    procs = [p for lm in _loaded.values() if lm.model.__class__.__name__ == "TensorParallelModel" for p in lm.model.workers.procs]
    for lm in _loaded.values():
        lm.close()
    _loaded.clear()
    _reference.clear()
    assert [p.poll() for p in procs] == [0] * len(procs)


PROMPTS = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(3))


_reference: dict = {}


def _one_rank(model_dirs, name: str, what: str, compute):
    """``compute(model)`` on the one-process model, once per model and question."""
    if (name, what) not in _reference:
        _reference[name, what] = compute(_model(model_dirs, name, 1))
    return _reference[name, what]


def _greedy(lm) -> list[int]:
    return list(lm.generate_ids(PROMPTS[0, :8].tolist(), max_new_tokens=32, stop_token_ids=[]))


@pytest.mark.parametrize("name,world,generate", [
    ("llama", 2, True), ("llama", 4, True), ("qwen3", 2, True), ("exl3_small", 2, True), ("exl3_wide", 4, False),
    ("qwen3_moe", 2, True), ("glm4_moe", 2, True), ("qwen3_5_moe", 2, True), ("nemotron_h", 2, True), ("deepseek_v3", 2, True),
    pytest.param("qwen3_5", 2, True, marks=pytest.mark.slow), pytest.param("lfm2_moe", 2, True, marks=pytest.mark.slow),
    pytest.param("glm5_next", 4, True, marks=pytest.mark.slow),  # one KDA head and one MLA head per rank
])
def test_logits_and_greedy_tokens_match_one_rank(model_dirs, name, world, generate):
    """Heads and MLP columns split (EXL3 on 128-blocks; GQA KV heads replicated), MoE experts spread, recurrent
    mixers by heads (gated delta net, Mamba-2 groups, short-conv channels; state per rank): the logits
    of one process within 1e-4 of their range, the same 32 greedy tokens through the paged cache."""
    split = _model(model_dirs, name, world)
    want, got = _one_rank(model_dirs, name, "logits", lambda lm: lm.logits(PROMPTS)), split.logits(PROMPTS)
    spread = (want.max() - want.min()).item()
    assert spread > 1.0
    assert (want - got).abs().max().item() <= 1e-4 * spread
    if generate:
        assert _greedy(split) == _one_rank(model_dirs, name, "greedy", _greedy)


def _generator_greedy(lm, proposer=None) -> list[int]:
    gen = Generator(lm, max_batch_size=2, max_chunk_tokens=16, cache_tokens=256, page_size=16,
                    proposer=proposer, num_draft_tokens=3 if proposer else 0)
    return gen.generate([PROMPTS[1, :9].tolist()], max_new_tokens=32, return_results=True, stop_token_ids=[])[0].token_ids


def _local(lm):
    """The module tree this process runs (rank 0's shard under tensor parallel)."""
    return getattr(lm.model, "local", lm.model)


def _heads(lm) -> list[int]:
    """Each layer's query heads as this process holds them."""
    return [getattr(layer.attn, "num_heads", None) or layer.attn.heads for layer in _local(lm).layers]


def _assert_same_logits(want: torch.Tensor, got: torch.Tensor) -> None:
    spread = (want.max() - want.min()).item()
    assert spread > 1.0
    assert (want - got).abs().max().item() <= 1e-4 * spread, (want - got).abs().max().item() / spread


@pytest.mark.parametrize("name", ["glm_dsa", "deepseek_v4", "gemma4_kv_shared", "gemma4_k_eq_v", "laguna", "step3p5"])
def test_newer_attention_kinds_split_by_heads(model_dirs, name):
    """DSA sparse MLA (indexer and latent whole), DeepSeek V4's compressed attention (by output groups; the K = V
    head, compressors and indexer whole; hyper-connections and hash-routed experts), Gemma 4's KV-sharing and
    K=V layers with two head sizes, Laguna's and Step 3.5's per-layer head counts with their output gates: every
    layer holds half its heads on each of 2 ranks; logits within 1e-4 of their range, 32 greedy tokens of
    generate_ids and of the Generator as one process gives."""
    split, whole = _model(model_dirs, name, 2), _model(model_dirs, name, 1)
    assert [2 * h for h in _heads(split)] == _heads(whole)
    _assert_same_logits(_one_rank(model_dirs, name, "logits", lambda lm: lm.logits(PROMPTS)), split.logits(PROMPTS))
    assert _greedy(split) == _one_rank(model_dirs, name, "greedy", _greedy)
    assert _generator_greedy(split) == _one_rank(model_dirs, name, "generator", _generator_greedy)


def _mixer_heads(mixer) -> int:
    return getattr(mixer, "num_heads", None) or mixer.num_v_heads  # a gated delta net counts value heads


def _state_per_slot(cache) -> int:
    return sum(layer.nbytes() // layer.max_slots for layer in cache.state_layers())


@pytest.mark.parametrize("name", ["glm5_next", "qwen4_exp"])
def test_own_recurrent_mixers_split_by_heads(model_dirs, name, capsys):
    """GLM 5.3's KDA (its heads' q/k/v, decay and gate channels, conv channels and [H, Dk, Dv] state; the low-rank
    f_a / g_a whole) and Qwen 3.8's PLE gated delta net and indexed attention (its indexer whole): every layer's mixer
    holds half its heads on each of 2 ranks, and so does its recurrent state. Logits within 1e-4 of their range, 32
    greedy tokens of generate_ids and of the Generator as one process gives; the memory plan's state per slot is what
    rank 0's cache holds."""
    split, whole = _model(model_dirs, name, 2), _model(model_dirs, name, 1)
    assert [2 * _mixer_heads(layer.attn) for layer in _local(split).layers] == \
        [_mixer_heads(layer.attn) for layer in _local(whole).layers]
    _assert_same_logits(_one_rank(model_dirs, name, "logits", lambda lm: lm.logits(PROMPTS)), split.logits(PROMPTS))
    assert _greedy(split) == _one_rank(model_dirs, name, "greedy", _greedy)
    assert _generator_greedy(split) == _one_rank(model_dirs, name, "generator", _generator_greedy)

    caches = [lm.model.make_cache(max_tokens=64, page_size=16, max_slots=2) for lm in (whole, split)]
    state = [_state_per_slot(cache) for cache in caches]
    plan = [plan_memory(model_dirs[name], world, "cpu", "float32").ranks for world in (1, 2)]
    assert [plan[0][0].state_per_slot, plan[1][0].state_per_slot, plan[1][1].state_per_slot] == [state[0], state[1], state[1]]
    assert cli_main(["info", "-m", str(model_dirs[name]), "--device", "cpu", "--dtype", "float32", "--tp", "2"]) == 0
    assert capsys.readouterr().out.count(f"recurrent state {gib(state[1])}/slot") == 2  # a vision-language config too
    if name == "glm5_next":  # KDA keeps nothing whole per slot: half the state on each rank
        assert 2 * state[1] == state[0]
        kda, kda_whole = _local(split).layers[0].attn, _local(whole).layers[0].attn
        replicated = sum(m.nbytes() for m in (kda.f_a_proj, kda.g_a_proj, kda.o_norm))
        assert 2 * kda.nbytes() - kda_whole.nbytes() == replicated > 0
    else:  # the PLE's token history and dilated-conv inputs ride whole in the delta net's slots
        ple = sum(t.nbytes // layer.max_slots for layer in caches[0].state_layers() for t in layer.extra.values())
        assert ple > 0 and 2 * state[1] - state[0] == ple


def test_experts_spread_over_ranks(model_dirs):
    """DeepSeek V4's hash layers (experts by token id) and score-routed ones alike, and Gemma 4's experts beside its
    dense MLP: each of 2 ranks holds half the experts (and the zero expert standing for the other rank's)."""
    layers = _local(_model(model_dirs, "deepseek_v4", 2)).layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["ExpertParallelMoE"] * 3
    assert type(layers[0].mlp.moe).__name__ == "HashRoutedMoE"
    assert [layer.mlp.moe.experts.local.num_experts for layer in layers] == [4 + 1] * 3
    layers = _local(_model(model_dirs, "gemma4_k_eq_v", 2)).layers
    assert [layer.mlp.experts.local.num_experts for layer in layers] == [2 + 1] * 4


@pytest.mark.parametrize("name, world, refusal", [
    ("laguna", 4, r"model\.layers\.2\.self_attn \(OutputGatedAttention\): 2 attention heads cannot be split evenly over 4 ranks"),
    ("deepseek_v4", 4, r"model\.layers\.0\.attn \(CompressedAttention\): output groups \(o_groups\) \(2\) cannot be split evenly"),
    ("gemma4_k_eq_v", 3, r"model\.layers\.0\.self_attn \(Gemma4Attention\): 4 attention heads cannot be split evenly over 3"),
    ("qwen4_exp", 4, r"layers\.0\.linear_attn \(PLEDeltaNet\): linear-attention key heads \(2\) cannot be split evenly"),
])
def test_unsplittable_layers_are_refused_naming_the_kind(model_dirs, name, world, refusal):
    """The memory plan cuts each rank's shard as a load does (no worker started): a head count the ranks do not
    divide is refused, naming the layer and its kind."""
    with pytest.raises(ShardingError, match=refusal):
        plan_memory(model_dirs[name], world, "cpu", "float32")


def test_mtp_drafting_under_tensor_parallel(model_dirs):
    """MTP drafts on 2 ranks: the hidden states, the MTP head (split as the layers are: its attention by heads, its
    experts spread) and its own cache run on every rank. The same drafts at every step as one process drafts, the
    32 greedy tokens of one process without drafts, and every MTP page released."""
    one, split = _model(model_dirs, "qwen3_5_moe_mtp", 1), _model(model_dirs, "qwen3_5_moe_mtp", 2)
    assert _local(split).mtp.layer.attn.num_heads * 2 == _local(one).mtp.layer.attn.num_heads

    def drafting(lm):
        proposer = MTPProposer(lm, num_tokens=3, cache_tokens=256, page_size=16)
        drafts, propose = [], proposer.propose
        proposer.propose = lambda requests: drafts.append(propose(requests)) or drafts[-1]
        return _generator_greedy(lm, proposer), drafts, proposer

    batch = ForwardBatch.no_cache([PROMPTS[0, :7].tolist()])
    with torch.inference_mode():  # the Generator's split forward: hidden states, then logits from them
        want = one.model.logits_from_hidden(one.model.hidden_states(batch), batch)
        hidden = split.model.hidden_states(batch)
        _assert_same_logits(want, split.model.logits_from_hidden(hidden, batch))  # the ranks' own hidden states
        _assert_same_logits(want, split.model.logits_from_hidden(hidden.clone(), batch))  # rows sent to them

    tokens, drafts, proposer = drafting(split)
    assert (tokens, drafts) == drafting(one)[:2]
    assert tokens == _generator_greedy(one)
    assert sum(len(d) for step in drafts for d in step) > 10
    assert proposer.cache.allocator.free_pages == proposer.cache.num_pages


def test_images_under_tensor_parallel(model_dirs):
    """A Qwen3-VL MoE (M-RoPE, DeepStack) on 2 ranks: rank 0's tower embeds the images and the embeddings travel with
    the step; the other rank holds no tower. Logits with an image within 1e-4 of one process's range, 32 greedy tokens
    of generate_ids and of the Generator identical, two images batched."""
    from PIL import Image
    from test_generator_vision import run_jobs
    from test_vision_qwen import PROMPT, random_image

    one, split = _model(model_dirs, "qwen3_vl_moe", 1), _model(model_dirs, "qwen3_vl_moe", 2)
    img = random_image(3)
    _assert_same_logits(one.logits([PROMPT], images=[[img]]), split.logits([PROMPT], images=[[img]]))

    def greedy(lm):
        return list(lm.generate_ids(PROMPT, max_new_tokens=32, stop_token_ids=[], images=[img]))

    assert greedy(split) == greedy(one)
    images = [Image.new("RGB", (61, 37), (255, 0, 0)), Image.new("RGB", (37, 61), (0, 40, 255))]

    def generator(lm):
        gen = Generator(lm, max_batch_size=2, max_chunk_tokens=64, cache_tokens=512, page_size=16)
        done, _ = run_jobs(gen, [Job(PROMPT, 32, stop_token_ids=[], images=[im]) for im in images])
        return [r.token_ids for r in done]

    assert generator(split) == generator(one)
    plan = plan_memory(model_dirs["qwen3_vl_moe"], 2, "cpu", "float32").ranks
    tower = _local(one).vision.nbytes()
    assert tower > 0 and _local(split).vision.nbytes() == tower  # whole on rank 0
    assert plan[0].weights - plan[1].weights > 0.99 * tower  # and not by rank 1 (it keeps a RoPE table, 8 bytes)


def test_generator_batching_under_tensor_parallel(model_dirs):
    """Three jobs batched on two ranks give each job's tokens of one rank run alone."""
    one, split = _model(model_dirs, "llama", 1), _model(model_dirs, "llama", 2)
    prompts = [PROMPTS[0, :5].tolist(), PROMPTS[1, :11].tolist(), PROMPTS[0, 7:20].tolist()]

    def run(lm, batch):
        gen = Generator(lm, max_batch_size=batch, max_chunk_tokens=16, cache_tokens=512, page_size=16)
        done = gen.generate(prompts, max_new_tokens=12, return_results=True, stop_token_ids=[])
        return [r.token_ids for r in done]

    alone = [list(one.generate_ids(p, max_new_tokens=12, stop_token_ids=[])) for p in prompts]
    assert run(split, 3) == alone
    assert run(split, 1) == alone


def test_hybrid_prefix_checkpoints_reach_every_rank(model_dirs):
    """A gated-delta-net hybrid on two ranks in the Generator: the second prompt starts from a recurrent-state
    checkpoint of the first's shared prefix (a slot copy on rank 0, which the other rank repeats before its next
    step); each job's tokens are those of one process run alone, and each rank holds half the state."""
    one, split = _model(model_dirs, "qwen3_5_moe", 1), _model(model_dirs, "qwen3_5_moe", 2)
    prefix = PROMPTS[1].tolist() + PROMPTS[0, :12].tolist()  # two whole 16-token pages
    prompts = [prefix + [5, 6, 7], prefix + [9, 8]]
    alone = [list(one.generate_ids(p, max_new_tokens=10, stop_token_ids=[])) for p in prompts]
    gen = Generator(split, max_batch_size=2, max_chunk_tokens=16, cache_tokens=256, page_size=16)
    got = [gen.generate([p], max_new_tokens=10, return_results=True, stop_token_ids=[])[0].token_ids for p in prompts]
    assert gen.cache.prefix_cache.checkpoint_of  # the second job did start from a checkpoint
    assert got == alone
    whole = one.model.make_cache(max_tokens=16, page_size=16, max_slots=1).state_layers()[0].states
    assert gen.cache.state_layers()[0].states.shape[1] * 2 == whole.shape[1]  # value heads: 2 of 4 per rank


def test_quantized_cache_and_own_kv_heads_per_rank(model_dirs):
    """A quantized cache made for rank 0 is made on the other rank at its first step: greedy tokens match one
    process with the same cache; each rank holds its own KV head (2 over 2 ranks); a cache built by hand is refused."""
    from trellm.cache import KVCache
    from trellm.cache.quantized import quantized_cache

    def greedy(lm):
        cache = quantized_cache(lm, k_bits=8, v_bits=8, max_tokens=256, page_size=16)
        return list(lm.generate_ids(PROMPTS[1, :6].tolist(), max_new_tokens=10, stop_token_ids=[], cache=cache)), cache

    split = _model(model_dirs, "dense_small", 2)  # heads of 128: the quantized cache's groups of 32 fit one
    tokens, cache = greedy(split)
    assert tokens == greedy(_model(model_dirs, "dense_small", 1))[0]
    split = _model(model_dirs, "llama", 2)
    assert split.new_cache(max_tokens=64, page_size=16).layers[0].k_pages.shape[2] == 1
    by_hand = KVCache(KVCache.for_model(split.model.local, max_tokens=64, page_size=16).layers, 16, "cpu")
    with pytest.raises(TensorParallelError, match="not made by KVCache.for_model"):
        split.model.forward(ForwardBatch.with_cache([[1, 2]], [0], [[0]], by_hand))


def test_bad_token_id_is_refused_before_any_rank_runs(model_dirs):
    split = _model(model_dirs, "llama", 2)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        split.logits([[1, 2, 999]])
    assert split.logits([[1, 2, 3]]).shape == (1, 3, 256)  # the group still works


def test_exl3_shards_are_the_dense_weights_slices():
    g = torch.Generator().manual_seed(0)
    layer = EXL3Linear(torch.randint(-32768, 32768, (256 // 16, 384 // 16, 48), generator=g, dtype=torch.int16),
                       torch.randn(256, generator=g).half(), torch.randn(384, generator=g).half(), "3inst", 256, 384)
    full = layer.dense_weight()  # [out, in]
    assert torch.equal(shard_columns(layer, 128, 384).dense_weight(), full[128:384])
    assert torch.equal(shard_rows(layer, 128, 256, keep_bias=False).dense_weight(), full[:, 128:256])
    with pytest.raises(ShardingError, match="128-wide Hadamard blocks"):
        shard_columns(layer, 64, 192)


def _random_exl3(in_features: int, out_features: int, g: torch.Generator) -> EXL3Linear:
    k, n = -(-in_features // 128) * 128, -(-out_features // 128) * 128
    sign = lambda size: ((torch.randint(0, 2, (size,), generator=g) * 2 - 1) * 0.3).half()  # noqa: E731
    return EXL3Linear(torch.randint(-32768, 32768, (k // 16, n // 16, 32), generator=g, dtype=torch.int16), sign(k),
                      sign(n), "3inst", in_features, out_features)


def test_exl3_columns_off_the_blocks_keep_the_blocks_covering_them():
    """Ranges of EXL3 columns that do not lie on 128-blocks (a recurrent mixer's one column per head) keep the blocks
    covering them and pick their columns: the same outputs as the whole projection's, fewer bytes. Dense weights and
    ranges on the blocks are cut as before."""
    from trellm.distributed.sharding import ColumnSelect, split_column_ranges, split_columns
    from trellm.modules.linear import DenseLinear, Linear

    g = torch.Generator().manual_seed(1)
    whole = _random_exl3(256, 640, g)
    x = torch.randn(3, 256, generator=g)
    want = whole.forward(x)
    ranges = [(40, 72), (100, 130), (520, 600)]  # blocks [0, 256) and [512, 640)
    lin = Linear("p", 256, 640)
    lin.impl = whole
    split_column_ranges(lin, ranges)
    assert isinstance(lin.impl, ColumnSelect) and lin.out_features == 32 + 30 + 80
    assert lin.impl.nbytes() < whole.nbytes()
    cols = torch.cat([torch.arange(a, b) for a, b in ranges])
    torch.testing.assert_close(lin.impl.forward(x), want[:, cols])
    assert torch.equal(lin.impl.dense_weight(), whole.dense_weight()[cols])
    narrow = Linear("b", 256, 4)  # one column per head, stored padded to one block
    narrow.impl = _random_exl3(256, 4, g)
    full = narrow.impl.forward(x)
    split_columns(narrow, 2, 4)
    torch.testing.assert_close(narrow.impl.forward(x), full[:, 2:4])
    on_blocks = Linear("q", 256, 640)
    on_blocks.impl = whole
    split_column_ranges(on_blocks, [(128, 256), (512, 640)])
    assert isinstance(on_blocks.impl, EXL3Linear)
    dense = Linear("d", 256, 640)
    dense.impl = DenseLinear(whole.dense_weight(), None)
    split_column_ranges(dense, ranges)
    assert isinstance(dense.impl, DenseLinear) and torch.equal(dense.impl.weight, whole.dense_weight()[cols])


class _PartialSums:
    """Rank ``rank`` of ``world`` in one process: its row-parallel outputs stay partial, for the test to sum as the
    all-reduce would."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def test_exl3_kda_split_by_heads_sums_to_the_whole_layer():
    """A KDA layer of EXL3 weights (two 128-wide heads; its b_proj one column per head, off the blocks): each of 2 ranks'
    shard holds one head, and their partial outputs sum to the whole layer's output."""
    import copy

    from trellm.distributed.sharding import shard_kimi_delta_attention
    from trellm.modules.recurrent import KimiDeltaAttention

    g = torch.Generator().manual_seed(2)
    kda = KimiDeltaAttention("kda", 0, hidden_size=128, num_heads=2, head_dim=128, conv_width=4, eps=1e-6)
    for lin in (kda.q_proj, kda.k_proj, kda.v_proj, kda.f_a_proj, kda.f_b_proj, kda.g_a_proj, kda.g_b_proj, kda.b_proj,
                kda.o_proj):
        lin.impl = _random_exl3(lin.in_features, lin.out_features, g)
    kda.conv_weight = torch.randn(kda.conv_dim, 4, generator=g) * 0.5
    kda.dt_bias, kda.A_log = torch.randn(kda.dim, generator=g), torch.randn(2, generator=g)
    kda.o_norm.weight = 1 + 0.1 * torch.randn(128, generator=g)
    batch = ForwardBatch.no_cache([list(range(7)), list(range(5))])
    x = torch.randn(12, 128, generator=g)
    with torch.inference_mode():
        want = kda.forward(x, batch)
        parts = []
        for rank in range(2):
            shard = copy.deepcopy(kda)
            shard_kimi_delta_attention(shard, _PartialSums(rank, 2))
            assert shard.num_heads == 1 and shard.state_layer(1, torch.float32, "cpu").states.shape[1:] == (1, 128, 128)
            parts.append(shard.forward(x, batch))
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_split_rules():
    assert head_shard(8, 2, 3, 4) == head_shard(8, 2, 3, 4) and head_shard(8, 2, 3, 4).kv0 == 1  # KV head replicated
    assert (head_shard(8, 8, 1, 4).kv0, head_shard(8, 8, 1, 4).kv1) == (2, 4)
    assert partition(250, 4) == [(0, 63), (63, 126), (126, 189), (189, 250)]
    with pytest.raises(ShardingError, match="3 KV heads"):
        head_shard(12, 3, 0, 2)
    with pytest.raises(ShardingError, match="256 cannot be split over 4 ranks in blocks of 128"):
        partition(256, 4, 128)


def test_unsplittable_model_is_refused_and_workers_end(model_dirs):
    with pytest.raises(ShardingError, match="4 attention heads cannot be split evenly over 3 ranks"):
        trellm.load(model_dirs["llama"], device="cpu", tokenizer=False, tensor_parallel=3, step_timeout=STEP_TIMEOUT)


def test_killed_worker_ends_the_run_with_a_clear_error(model_dirs):
    lm = trellm.load(model_dirs["llama"], device="cpu", tokenizer=False, tensor_parallel=2, step_timeout=STEP_TIMEOUT)
    worker = lm.model.workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
        lm.logits(PROMPTS)
    assert time.monotonic() - start < STEP_TIMEOUT
    with pytest.raises(TensorParallelError, match="closed"):
        lm.logits(PROMPTS)
    lm.close()


def test_worker_killed_mid_generation_ends_the_others(model_dirs):
    """Rank 2 of 4 killed between decode steps: the next step fails naming it, and ranks 1 and 3 exit too."""
    with trellm.load(model_dirs["llama"], device="cpu", tokenizer=False, tensor_parallel=4, step_timeout=STEP_TIMEOUT) as lm:
        procs = lm.model.workers.procs
        steps = lm.generate_ids(PROMPTS[0, :4].tolist(), max_new_tokens=20, stop_token_ids=[])
        next(steps)
        os.kill(procs[1].pid, signal.SIGKILL)
        with pytest.raises(TensorParallelError, match="worker rank 2 .* killed by SIGKILL"):
            list(steps)
        assert all(p.poll() is not None for p in procs)


def test_torchrun_launch(model_dirs, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, torch, trellm\n"
        f"lm = trellm.load({str(model_dirs['llama'])!r}, device='cpu', tokenizer=False, tensor_parallel=2)\n"
        "ids = list(lm.generate_ids([1, 2, 3], max_new_tokens=8, stop_token_ids=[]))\n"
        "print('TOKENS', ids)\n"
        "lm.close()\n"
    )
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    one = _model(model_dirs, "llama", 1)
    assert f"TOKENS {list(one.generate_ids([1, 2, 3], max_new_tokens=8, stop_token_ids=[]))}" in out.stdout
