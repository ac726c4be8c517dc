"""Layer split (trellm.distributed.layer_split): decoder layers spread in order over several devices.

On CPU, each entry of ``gpu_split`` is a stage on the CPU: the real placement, the per-stage batch copies and the
hidden-state crossings run, and every layer and cache layer must sit in the stage the plan gives it. The plan is
held to given device sizes (auto and explicit GiB), and a split must not change a logit or a greedy token.
The cuda test runs the same on cuda:0 / cuda:1 where two GPUs exist.
"""
from __future__ import annotations

import pytest
import torch

import trellm
from trellm.cli import main as cli_main
from trellm.distributed import TensorParallelError
from trellm.errors import UsageError
from trellm.distributed.plan import GiB, MemoryPlanError, layer_costs, plan_layer_split
from trellm.generator import DraftModelProposer, Generator, Job
from trellm.lora import LoraWeights
from trellm.sdk.testing import make_tiny_hf_model
from test_families_dsa import deepseek_v4_dir, glm_dsa_dir  # noqa: F401 - fixtures
from test_families_gemma4 import GEMMA4
from test_moe_families import randomize

CONTEXT = 1024
SLOTS = 32  # plan_layer_split's default state slots (2 * max_batch)
PROMPTS = [[1, 5, 9, 20, 3, 7, 11, 40, 2], [7, 7, 30, 1, 99, 4]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, glm_dsa_dir, deepseek_v4_dir):
    root = tmp_path_factory.mktemp("split")
    return {
        "llama": make_tiny_hf_model("LlamaForCausalLM", root / "llama", num_hidden_layers=4, tie_word_embeddings=True),
        "hybrid": make_tiny_hf_model("Qwen3_5MoeForCausalLM", root / "hybrid", head_dim=16, linear_num_key_heads=2,
                                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                     num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=32,
                                     layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
        "glm_dsa": glm_dsa_dir,  # layer 1 reuses layer 0's sparse selection
        "deepseek_v4": deepseek_v4_dir,  # hyper-connection streams and head
        "gemma4_kv_shared": gemma4_kv_shared(root / "gemma4_kv_shared"),  # layers 4 and 5 read layers 2 and 3's KV
    }


def gemma4_kv_shared(path):
    """An E2B-shaped Gemma 4 (per-layer inputs) of 6 layers whose last two share the KV of layers 2 (sliding) and 3."""
    make_tiny_hf_model("Gemma4ForCausalLM", path, **dict(GEMMA4["per_layer_inputs_kv_sharing"], num_hidden_layers=6,
                                                          layer_types=["sliding_attention", "full_attention"] * 3))
    randomize(path, "layer_scalar", scale=1.0)
    return path


def budgets(model_dir, groups: list[list[int]], context: int = CONTEXT, device: str = "cpu") -> list[float]:
    """GiB per device that hold exactly these layer groups (the first with the embedding, the last with the head)."""
    c = layer_costs(model_dir, device)
    out = []
    for d, group in enumerate(groups):
        size = c.activations + sum(c.layer(i, context, SLOTS) for i in group)
        size += (c.embed if d == 0 else 0) + (c.tail - (c.tied_head if d == 0 else 0) if d == len(groups) - 1 else 0)
        out.append(size / GiB)
    return out


def stages(plan) -> list[tuple[int, int]]:
    return [r.layers for r in plan.ranks]


# ---- the plan ---------------------------------------------------------------------------------------


def test_explicit_split_puts_the_boundaries_where_the_sizes_say(dirs):
    d = dirs["llama"]
    assert stages(plan_layer_split(d, budgets(d, [[0, 1], [2, 3]]), CONTEXT, "cpu")) == [(0, 2), (2, 4)]
    assert stages(plan_layer_split(d, budgets(d, [[0], [1, 2], [3]]), CONTEXT, "cpu")) == [(0, 1), (1, 3), (3, 4)]
    # the same sizes with a longer context hold fewer layers each
    assert stages(plan_layer_split(d, [*budgets(d, [[0, 1], [2, 3]]), 1.0], 2 * CONTEXT, "cpu")) == [(0, 1), (1, 2), (2, 4)]


def test_auto_split_fills_free_memory_passes_over_a_small_device_and_keeps_the_head_with_the_last_layer(dirs):
    d = dirs["llama"]
    c = layer_costs(d, "cpu")
    first, rest = budgets(d, [[0, 1], [2, 3]])
    tiny = (c.activations + c.layer(2, CONTEXT, SLOTS) - 1) / GiB  # one byte short of a layer: passed over
    assert stages(plan_layer_split(d, "auto", CONTEXT, "cpu", free=[first, tiny, rest])) == [(0, 2), (2, 4)]
    # room for both last layers but not for the head too: the last layer goes on with the head
    short = rest - (c.tail - c.tied_head / 2) / GiB
    plan = plan_layer_split(d, "auto", CONTEXT, "cpu", free=[first, short, 1.0])
    assert stages(plan) == [(0, 2), (2, 3), (3, 4)]
    assert plan.ranks[2].weights == c.layer_weights[3] + c.tail  # the tied head's copy sits with the last layer
    assert plan.ranks[0].weights == c.embed + c.layer_weights[0] + c.layer_weights[1]


def test_refusals_name_the_device_the_need_and_the_room(dirs):
    d = dirs["llama"]
    first, rest = budgets(d, [[0, 1], [2, 3]])
    head = layer_costs(d, "cpu").tail / GiB
    with pytest.raises(MemoryPlanError, match=r"layers 3-3 and the head are left, .* more") as e:
        plan_layer_split(d, [first, rest - head / 2], CONTEXT, "cpu")
    assert "cpu layers 0-1; cpu layers 2-2" in str(e.value)
    with pytest.raises(MemoryPlanError, match=r"the first device cpu holds the embedding and layer 0: it needs .* "
                                              r"\(embedding .*, layer 0 with 1024 tokens of cache .*\), the split gives it"):
        plan_layer_split(d, [0.001, 1.0], CONTEXT, "cpu")
    with pytest.raises(MemoryPlanError, match=r"gpu_split asks 2.00 GiB of cpu, which has 1.00 GiB free"):
        plan_layer_split(d, [2.0, 1.0], CONTEXT, "cpu", free=[1.0, 1.0])
    with pytest.raises(MemoryPlanError, match="needs CUDA devices"):
        plan_layer_split(d, "auto", CONTEXT, "cpu")
    with pytest.raises(TensorParallelError, match="cannot be combined"):
        trellm.load(d, device="cpu", gpu_split=[1.0, 1.0], tensor_parallel=2)


def test_kv_sharing_layers_stay_on_the_device_of_the_cache_they_read(dirs):
    """Gemma 4's KV-sharing layers attend over their source layer's cache pages: sizes that would end a stage
    between them move the boundary back before the source (it cannot go forward: no device holds the head besides);
    when no device holds the whole run the plan refuses naming it, and a hand-made split that cuts it is refused."""
    from trellm.distributed.layer_split import LayerSplit, Stage

    d = dirs["gemma4_kv_shared"]
    assert layer_costs(d, "cpu").cache_reads == (0, 1, 2, 3, 2, 3)
    exact = budgets(d, [[0, 1, 2, 3], [4, 5]])
    assert stages(plan_layer_split(d, [exact[0], 1.0], CONTEXT, "cpu")) == [(0, 2), (2, 6)]
    with pytest.raises(MemoryPlanError, match=r"\(cpu layers 0-1\): layers 2-5 and the head are left, .* more; "
                                              r"layers 2-5 stay on one device"):
        plan_layer_split(d, exact, CONTEXT, "cpu")
    model = trellm.load(d, device="cpu", tokenizer=False).model
    cpu = torch.device("cpu")
    with pytest.raises(UsageError, match=r"layer 4 reads the KV cache of layer 2, but the split puts them on different"):
        LayerSplit([Stage(0, cpu, 0, 3), Stage(1, cpu, 3, 6)]).install(model)


def test_vision_models_are_refused_before_loading(tmp_path):
    transformers = pytest.importorskip("transformers")
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                             image_size=32, patch_size=4)
    text = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                       image_token_index=262, boi_token_index=260, eoi_token_index=261)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(MemoryPlanError, match="Gemma3VisionLanguageModel is not one .*image input are not split yet"):
        trellm.load(tmp_path, device="cpu", tokenizer=False, gpu_split=[1.0, 1.0])


def test_cli_refuses_a_bad_split_in_one_line(dirs, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "-m", str(dirs["llama"]), "--device", "cpu", "--gpu-split", "1,x", "hi"])
    assert e.value.code == 2
    assert "gpu_split must be 'auto' or GiB per device" in capsys.readouterr().err


def test_server_reads_the_split_and_refuses_a_bad_one():
    config = pytest.importorskip("trellm.server.config")
    from trellm.errors import ConfigError

    assert config.ServerConfig(gpu_split="20,24").gpu_split == [20.0, 24.0]
    assert config.ServerConfig(gpu_split="auto").gpu_split == "auto"
    with pytest.raises(ConfigError, match="gpu_split must be 'auto' or GiB per device"):
        config.ServerConfig(gpu_split="20,-1")


# ---- the placed model -------------------------------------------------------------------------------


def tensors_of(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor a module, a Weights or a cache layer holds (walking attributes, lists and dicts)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v, seen)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v, seen)]
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("trellm"):
        return [t for v in vars(obj).values() for t in tensors_of(v, seen)]
    return []


def assert_placed_as_planned(lm, plan, cache) -> None:
    split = lm.model.layer_split
    assert [(s.first, s.last) for s in split.stages] == stages(plan)
    assert [str(s.device) for s in split.stages] == [r.device for r in plan.ranks]
    for stage in split.stages:
        for i in range(stage.first, stage.last):
            assert split.layer_device(i) == stage.device
            held = tensors_of(lm.model.layers[i]) + tensors_of(cache.layers[i])
            assert held and all(t.device == stage.device for t in held), f"layer {i}"
            assert split.stage_of(lm.model, lm.model.layers[i]) is stage
    assert split.stage_of(lm.model, lm.model.embed) is split.stages[0]
    assert split.stage_of(lm.model, lm.model.lm_head) is split.stages[-1]
    assert all(t.device == split.tail.device for t in tensors_of(lm.model.lm_head))


@pytest.mark.parametrize("name,groups", [("llama", [[0, 1], [2, 3]]), ("llama", [[0], [1, 2], [3]]),
                                         ("hybrid", [[0, 1], [2, 3]]), ("glm_dsa", [[0], [1, 2]]),
                                         ("deepseek_v4", [[0], [1, 2]]), ("gemma4_kv_shared", [[0, 1], [2, 3, 4, 5]])])
def test_split_model_gives_the_logits_and_greedy_tokens_of_the_whole_one(dirs, name, groups):
    d = dirs[name]
    whole = trellm.load(d, device="cpu", tokenizer=False)
    split_sizes = budgets(d, groups)
    lm = trellm.load(d, device="cpu", tokenizer=False, gpu_split=split_sizes, context=CONTEXT)
    split = lm.model.layer_split
    crossings = len(groups) - 1

    want, got = whole.logits(PROMPTS), lm.logits(PROMPTS)
    assert (got - want).abs().max() <= 1e-5 * (want.max() - want.min())
    assert split.counts.hidden_moves == crossings and split.counts.batch_copies == crossings  # per step, not per layer

    gen = Generator(lm, cache_tokens=CONTEXT, page_size=16)
    assert_placed_as_planned(lm, plan_layer_split(d, split_sizes, CONTEXT, "cpu"), gen.cache)
    ref = Generator(whole, cache_tokens=CONTEXT, page_size=16)
    for g in (ref, gen):
        g.enqueue([Job(p, 32, stop_token_ids=[], identifier=i) for i, p in enumerate(PROMPTS)])
    done = [{r.identifier: r.token_ids for r in g.stream() if type(r).__name__ == "JobFinished"} for g in (ref, gen)]
    assert done[0] == done[1] and all(len(t) == 32 for t in done[1].values())
    long = list(range(3, 43))  # two whole pages of 16 the prefix cache keeps
    first = gen.generate(long, max_new_tokens=8, return_results=True, stop_token_ids=[])
    before, steps = split.counts.batch_copies, gen.stats["steps"]
    again = gen.generate(long, max_new_tokens=8, return_results=True, stop_token_ids=[])
    assert again.token_ids == first.token_ids == ref.generate(long, max_new_tokens=8, return_results=True,
                                                              stop_token_ids=[]).token_ids
    if name == "llama":  # the prefix cache serves the split model's pages (hybrid: at its state checkpoints)
        assert again.cached_tokens == 32
    assert split.counts.batch_copies - before == crossings * (gen.stats["steps"] - steps)
    gen.verify_pages()


def test_speculative_decoding_and_lora_on_a_split_model(dirs, tmp_path):
    pytest.importorskip("peft")
    from test_lora import make_peft_adapter

    d = dirs["llama"]
    adapter = make_peft_adapter(d, tmp_path / "adapter", r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj", "lm_head"])
    whole = trellm.load(d, device="cpu", tokenizer=False, lora=adapter)
    lm = trellm.load(d, device="cpu", tokenizer=False, lora=adapter, gpu_split=budgets(d, [[0, 1], [2, 3]]),
                     context=CONTEXT)
    want = whole.logits(PROMPTS)
    assert not torch.allclose(want, whole.logits(PROMPTS, lora=""), atol=1e-3)  # the adapter changes the logits
    assert (lm.logits(PROMPTS) - want).abs().max() <= 1e-5 * (want.max() - want.min())
    adapted = [lin for lin in lm.model.lora.linears.values() if isinstance(lin.impl, LoraWeights)]
    assert len(adapted) == 4 * 3 + 1 and all(lin.impl.a.device == lin.device for lin in adapted)

    draft = trellm.load(d, device="cpu", tokenizer=False)
    plain = Generator(whole, cache_tokens=CONTEXT, page_size=16).generate(PROMPTS[0], max_new_tokens=32,
                                                                         return_results=True, stop_token_ids=[])
    spec = Generator(lm, cache_tokens=CONTEXT, page_size=16, proposer=DraftModelProposer(draft, num_tokens=3))
    out = spec.generate(PROMPTS[0], max_new_tokens=32, return_results=True, stop_token_ids=[])
    assert out.token_ids == plain.token_ids
    assert spec.stats["draft_proposed"] > 0


def test_mtp_drafting_on_a_split_hybrid_model(dirs, tmp_path):
    import shutil

    from test_mtp import add_mtp_tensors
    from trellm.generator import MTPProposer

    d = tmp_path / "with_mtp"
    shutil.copytree(dirs["hybrid"], d)
    add_mtp_tensors(d)
    whole = trellm.load(d, device="cpu", tokenizer=False)
    lm = trellm.load(d, device="cpu", tokenizer=False, gpu_split=budgets(d, [[0, 1], [2, 3]]), context=CONTEXT)
    split = lm.model.layer_split
    assert split.stage_of(lm.model, lm.model.mtp) is split.tail
    prompt = list(range(5, 45))
    plain = Generator(whole, cache_tokens=CONTEXT, page_size=16).generate(prompt, max_new_tokens=24, return_results=True,
                                                                         stop_token_ids=[])
    proposer = MTPProposer(lm, num_tokens=3, cache_tokens=CONTEXT, page_size=16)
    assert proposer.cache.layers[0].k_pages.device == split.tail.device
    gen = Generator(lm, cache_tokens=CONTEXT, page_size=16, proposer=proposer, num_draft_tokens=3)
    out = gen.generate(prompt, max_new_tokens=24, return_results=True, stop_token_ids=[])
    assert out.token_ids == plain.token_ids and out.draft_proposed > 0 and proposer.stats["mtp_forwards"] > 0


# ---- two GPUs ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_split_over_two_gpus_matches_one_gpu_and_the_plan(tmp_path):
    """Real placement on cuda:0 / cuda:1 (layers wide enough that the allocator's rounding is noise): each device
    holds its planned weights and cache; logits and 32 greedy tokens as on one GPU."""
    d = make_tiny_hf_model("LlamaForCausalLM", tmp_path / "llama", num_hidden_layers=4, hidden_size=256,
                           intermediate_size=704, vocab_size=1024)
    sizes = budgets(d, [[0, 1], [2, 3]], device="cuda")
    one = trellm.load(d, device="cuda:0", tokenizer=False)
    before = [torch.cuda.memory_allocated(i) for i in range(2)]
    lm = trellm.load(d, device="cuda", tokenizer=False, gpu_split=sizes, context=CONTEXT)
    plan = plan_layer_split(d, sizes, CONTEXT, "cuda")
    loaded = [torch.cuda.memory_allocated(i) - before[i] for i in range(2)]
    gen = Generator(lm, cache_tokens=CONTEXT, page_size=16)
    assert_placed_as_planned(lm, plan, gen.cache)
    assert [s.device for s in lm.model.layer_split.stages] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    for i, (rank, stage) in enumerate(zip(plan.ranks, lm.model.layer_split.stages)):
        assert abs(loaded[i] - rank.weights) <= 0.02 * rank.weights, (i, loaded[i], rank.weights)
        cache = sum(gen.cache.layers[j].nbytes() for j in range(stage.first, stage.last))
        assert cache == rank.kv_per_token * gen.cache.capacity_tokens
        held = torch.cuda.memory_allocated(i) - before[i]
        assert abs(held - (rank.weights + cache)) <= 0.05 * (rank.weights + cache), (i, held, rank.weights + cache)
    want, got = one.logits(PROMPTS), lm.logits(PROMPTS)
    assert got.device == torch.device("cuda", 0)
    assert (got - want).abs().max() <= 1e-5 * (want.max() - want.min())
    ref = Generator(one, cache_tokens=CONTEXT, page_size=16)
    outs = [g.generate(PROMPTS[0], max_new_tokens=32, return_results=True, stop_token_ids=[]).token_ids for g in (ref, gen)]
    assert outs[0] == outs[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("name", ["hybrid", "glm_dsa", "deepseek_v4", "gemma4_kv_shared"])
def test_families_split_over_two_gpus(dirs, name):
    """Recurrent state, a sparse selection reused across the boundary, hyper-connection streams, KV-sharing layers
    (sizes for [0-3 | 4-5] planned as [0-1 | 2-5]: layers 4 and 5 read the cache of 2 and 3): on cuda:0 / cuda:1
    as on one GPU."""
    d = dirs[name]
    one = trellm.load(d, device="cuda:0", tokenizer=False)
    n = len(one.model.layers)
    first = [0, 1, 2, 3] if name == "gemma4_kv_shared" else [0]
    sizes = [budgets(d, [first, list(range(len(first), n))], device="cuda")[0], 1.0]
    lm = trellm.load(d, device="cuda", tokenizer=False, gpu_split=sizes, context=CONTEXT)
    assert lm.model.layer_split.devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    if name == "gemma4_kv_shared":
        assert [(s.first, s.last) for s in lm.model.layer_split.stages] == [(0, 2), (2, 6)]
    want, got = one.logits(PROMPTS), lm.logits(PROMPTS)
    assert (got - want).abs().max() <= 1e-3 * (want.max() - want.min())
    outs = [Generator(m, cache_tokens=CONTEXT, page_size=16).generate(PROMPTS[0], max_new_tokens=16, return_results=True,
                                                                      stop_token_ids=[]).token_ids for m in (one, lm)]
    assert outs[0] == outs[1]
