"""LoRA adapters: real PEFT adapters on a tiny random Llama, dense and EXL3, one or several per batch."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import trellm
from trellm import ops
from trellm.generator import Generator, Job
from trellm.lora import LoraError, read_peft_adapter

peft = pytest.importorskip("peft")

WEIGHTS = "adapter_model.safetensors"
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def make_tiny_llama(path: Path, heads: int = 4, kv_heads: int = 2) -> Path:
    """2 layers, hidden 128 (EXL3 needs multiples of 128), an untied head PEFT can target. ``heads``: 2 makes
    head_dim 64, which the CUDA attention kernels take (32 runs the reference attention, which no CUDA graph
    can hold: it reads the batch's lengths on the host)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 if "embed" in name else 0.1)
    model.save_pretrained(path)
    return path


def make_peft_adapter(base_dir: Path, out: Path, r: int, alpha: float, targets: list[str], rslora: bool = False,
                      seed: int = 1, std: float = 0.1, parameters: list[str] | None = None, **options) -> Path:
    """A real PEFT adapter: the base wrapped with LoraConfig, every lora_A / lora_B random and non-zero, saved.
    ``parameters``: PEFT's ``target_parameters`` (MoE expert stacks); ``options``: more LoraConfig fields."""
    peft_model(base_dir, r, alpha, targets, rslora, seed, std, parameters, **options).save_pretrained(out)
    return out


def peft_logits_and_tokens(pm, ids: torch.Tensor, prompt: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The PEFT model's float logits on ``ids`` and its 8 greedy tokens after ``prompt``: what trellm must give."""
    with torch.no_grad():
        logits = pm(ids).logits.float()
    tokens = pm.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    return logits, tokens


def peft_model(base_dir: Path, r: int, alpha: float, targets: list[str], rslora: bool = False, seed: int = 1,
               std: float = 0.1, parameters: list[str] | None = None, **options):
    """The PeftModel :func:`make_peft_adapter` saves, in memory (eval mode). ``targets``: module names, or a regex
    PEFT matches whole."""
    from peft import LoraConfig, get_peft_model
    from trellm.sdk.testing import load_hf_model

    model = load_hf_model(base_dir)
    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                          target_parameters=parameters, **options))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return pm.eval()


def peft_logits(base_dir: Path, adapter_dir: Path | None, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def one_batch(lm, prompts: list[list[int]], names: list[str], new_tokens: int = 6) -> list[list[int]]:
    """Each prompt's greedy tokens from one Generator batch, job i on adapter ``names[i]`` ("": the base); its pages
    checked after."""
    gen = Generator(lm, max_batch_size=4, cache_tokens=1024, page_size=16)
    gen.enqueue([Job(p, new_tokens, lora=n, stop_token_ids=[], identifier=i) for i, (p, n) in enumerate(zip(prompts, names))])
    done = {r.identifier: r.token_ids for r in gen.stream() if type(r).__name__ == "JobFinished"}
    gen.verify_pages()
    return [done[i] for i in range(len(prompts))]


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-3) -> None:
    span = (want.max() - want.min()).item()
    err = (got - want).abs().max().item()
    assert err <= tol * span, f"max |diff| {err:.3g} > {tol} x logit range {span:.3g}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_llama(root / "base")
    a = make_peft_adapter(base, root / "all", r=8, alpha=16, targets=ALL_TARGETS, seed=1)
    b = make_peft_adapter(base, root / "rs", r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], rslora=True, seed=2)
    return root, base, a, b


IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def test_peft_adapter_reads_rank_alpha_rslora(tiny):
    _, _, a, b = tiny
    ad = read_peft_adapter(a)
    f = ad.modules["model.layers.0.self_attn.q_proj"]
    assert f.rank == 8 and f.scale == pytest.approx(16 / 8) and tuple(f.a.shape) == (8, 128)
    assert "lm_head" in ad.modules and len(ad.modules) == 2 * 7 + 1
    rs = read_peft_adapter(b, scale=0.5)
    assert rs.modules["model.layers.1.mlp.down_proj"].scale == pytest.approx(0.5 * 8 / 4 ** 0.5)


@pytest.mark.parametrize("which", ["all", "rs"])
def test_dense_logits_and_greedy_match_peft(tiny, which):
    _, base, a, b = tiny
    adapter = a if which == "all" else b
    want = peft_logits(base, adapter, IDS)
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    got = lm.logits(IDS)
    assert_close(got, want)
    assert not torch.allclose(want, peft_logits(base, None, IDS), atol=1e-2)  # the adapter changes the logits
    assert_close(lm.logits(IDS, lora=""), peft_logits(base, None, IDS))  # "" = the base model

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32), adapter).eval()
    prompt = IDS[0, :10]
    mask = torch.ones(1, 10, dtype=torch.long)
    hf_out = hf.generate(input_ids=prompt[None], attention_mask=mask, max_new_tokens=8, do_sample=False)[0, 10:].tolist()
    ours = list(lm.generate_ids(prompt.tolist(), max_new_tokens=8, stop_token_ids=[]))
    assert ours == hf_out


def test_several_adapters_in_one_generator_batch_match_single_runs(tiny):
    _, base, a, b = tiny
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False)
    lm.load_lora(a, name="all")
    lm.load_lora(b, name="rs")
    assert lm.loras == ["all", "rs"]
    prompts = [IDS[0, :12].tolist(), IDS[1, :9].tolist(), IDS[0, :12].tolist()]
    choices = ["all", None, "rs"]
    alone = []
    for p, name in zip(prompts, choices):
        gen = Generator(lm, max_batch_size=4, cache_tokens=1024, page_size=16)
        alone.append(gen.generate(p, max_new_tokens=6, return_results=True, lora=name, stop_token_ids=[]).token_ids)
        ref = list(lm.generate_ids(p, max_new_tokens=6, stop_token_ids=[], lora=name or ""))
        assert alone[-1] == ref
    gen = Generator(lm, max_batch_size=4, cache_tokens=1024, page_size=16)
    jobs = [Job(p, 6, lora=name, stop_token_ids=[], identifier=i) for i, (p, name) in enumerate(zip(prompts, choices))]
    gen.enqueue(jobs)
    done = {r.identifier: r.token_ids for r in gen.stream() if type(r).__name__ == "JobFinished"}
    assert [done[i] for i in range(3)] == alone
    assert len({tuple(t) for t in alone}) == 3  # the same prompt gives different tokens under different adapters
    gen.verify_pages()


def test_prefix_cache_pages_are_keyed_by_adapter(tiny):
    _, base, a, _ = tiny
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False)
    lm.load_lora(a, name="all")
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    gen = Generator(lm, max_batch_size=2, cache_tokens=1024, page_size=16)
    base_first = gen.generate(prompt, max_new_tokens=4, return_results=True, stop_token_ids=[])
    with_adapter = gen.generate(prompt, max_new_tokens=4, return_results=True, lora="all", stop_token_ids=[])
    again = gen.generate(prompt, max_new_tokens=4, return_results=True, lora="all", stop_token_ids=[])
    assert base_first.cached_tokens == 0 and with_adapter.cached_tokens == 0  # the base's pages are not the adapter's
    assert again.cached_tokens == 32 and again.token_ids == with_adapter.token_ids
    lm.unload_lora("all")
    lm.load_lora(a, name="all")  # a new load of the same name does not find the old load's pages
    assert gen.generate(prompt, max_new_tokens=4, return_results=True, lora="all", stop_token_ids=[]).cached_tokens == 0


def test_unload_and_unknown_names(tiny):
    _, base, a, b = tiny
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False)
    base_logits = lm.logits(IDS)
    lm.load_lora(a, name="x")
    lm.load_lora(b, name="y", scale=0.5)
    with pytest.raises(LoraError, match="already loaded"):
        lm.load_lora(a, name="x")
    lm.unload_lora("x")
    assert lm.loras == ["y"]
    assert torch.equal(lm.logits(IDS), base_logits)  # nothing runs for rows on the base
    with pytest.raises(LoraError, match="no LoRA adapter named 'x'"):
        lm.logits(IDS, lora="x")
    gen = Generator(lm, max_batch_size=2, cache_tokens=512, page_size=16)
    with pytest.raises(LoraError, match="'nope'"):
        gen.enqueue(Job([1, 2, 3], 2, lora="nope"))
    with pytest.raises(LoraError, match="'nope'"):
        lm.unload_lora("nope")


def _edit_adapter(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        path = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(str(path))), str(path))
    return dst


def test_bad_adapters_say_what_is_wrong(tiny, tmp_path):
    root, base, a, _ = tiny
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False)
    with pytest.raises(LoraError, match="no such adapter directory"):
        lm.load_lora(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="adapter_config.json is missing"):
        lm.load_lora(tmp_path / "empty")
    no_weights = _edit_adapter(a, tmp_path / "nw")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match="adapter_model.safetensors is missing"):
        lm.load_lora(no_weights)
    with pytest.raises(LoraError, match="use_dora=True .*DoRA"):
        lm.load_lora(_edit_adapter(a, tmp_path / "dora", {"use_dora": True}))
    with pytest.raises(LoraError, match="modules_to_save"):
        lm.load_lora(_edit_adapter(a, tmp_path / "mts", {"modules_to_save": ["lm_head"]}))
    with pytest.raises(LoraError, match="peft_type 'IA3'"):
        lm.load_lora(_edit_adapter(a, tmp_path / "ia3", {"peft_type": "IA3"}))

    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"

    def wider(t):
        t[key] = torch.zeros(8, 256)
        return t

    other = _edit_adapter(a, tmp_path / "other_base", tensors=wider)
    with pytest.raises(LoraError, match=r"'model.layers.1.self_attn.q_proj.lora_A.weight' has shape \[8, 256\].*needs \[8, 128\]"):
        lm.load_lora(other)

    def extra_layer(t):
        t["base_model.model.model.layers.7.mlp.up_proj.lora_A.weight"] = torch.zeros(8, 128)
        t["base_model.model.model.layers.7.mlp.up_proj.lora_B.weight"] = torch.zeros(128, 8)
        return t

    with pytest.raises(LoraError, match="'model.layers.7.mlp.up_proj', which this model does not have"):
        lm.load_lora(_edit_adapter(a, tmp_path / "deeper", tensors=extra_layer))
    assert lm.loras == []  # nothing of a refused adapter stays
    assert_close(lm.logits(IDS), peft_logits(base, None, IDS))


def test_lora_add_reference_is_per_row():
    g = torch.Generator().manual_seed(0)
    rank, slots_n, k, n = 4, 3, 32, 24
    a, b = torch.randn(slots_n * rank, k, generator=g), torch.randn(n, slots_n * rank, generator=g)
    x, y = torch.randn(5, k, generator=g), torch.randn(5, n, generator=g)
    slots = torch.tensor([2, -1, 0, 0, 1])
    got = ops.lora_add(y.clone(), x, a, b, slots, rank)
    out = ops.lora_add(y, x, a, b, slots, rank, out=torch.empty_like(y))
    assert torch.equal(out, got) and not torch.equal(out, y)  # out of place: y kept
    for i, s in enumerate(slots.tolist()):
        want = y[i] if s < 0 else y[i] + b[:, s * rank:(s + 1) * rank] @ (a[s * rank:(s + 1) * rank] @ x[i])
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


# ---- EXL3 bases: the adapter runs beside the quantized weights ------------------------------------------


@pytest.fixture(scope="module")
def exl3_dir(tiny):
    from trellm.convert import convert

    root, base, _, _ = tiny
    convert(base, root / "q4", root / "work", 4.0, device="cpu", progress=False, cal_rows=8, cal_cols=64, head_bits=6)
    return root / "q4"


def merged_reference(model_dir: Path, adapters: dict[str, float], **load) -> "trellm.model.LoadedModel":
    """The model with each adapter's update ``scale * B @ A`` merged into a dense copy of every projection it
    targets (EXL3 layers decoded first): the math an adapter beside the base weights must reproduce."""
    from trellm.modules.linear import DenseLinear, Linear

    lm = trellm.load(model_dir, tokenizer=False, **load)
    linears = {m.key: m for m in lm.model.modules() if isinstance(m, Linear)}
    for path, scale in adapters.items():
        for key, f in read_peft_adapter(path, scale).modules.items():
            lin = linears[key]
            w = lin.impl.dense_weight().float().cpu() + f.scale * f.b @ f.a
            bias = getattr(lin.impl, "bias", None)
            lin.impl = DenseLinear(w.to(lm.device, lm.dtype), None if bias is None else bias[: lin.out_features].to(lm.dtype))
    return lm


def test_exl3_base_with_adapter_matches_merged_reference(tiny, exl3_dir):
    _, _, a, b = tiny
    cpu = dict(device="cpu", dtype=torch.float32)
    for adapter in (a, b):
        lm = trellm.load(exl3_dir, tokenizer=False, lora=adapter, **cpu)
        assert type(lm.model.layers[0].attn.q_proj.impl.base).__name__ == "EXL3Linear"
        assert type(lm.model.layers[0].attn.qkv.weights()).__name__ == "LoraGroup"  # the adapted group's route
        want = merged_reference(exl3_dir, {adapter: 1.0}, **cpu).logits(IDS)
        assert_close(lm.logits(IDS), want)
        assert not torch.allclose(lm.logits(IDS, lora=""), want, atol=1e-2)
        prompt = IDS[1, :10].tolist()
        ref = merged_reference(exl3_dir, {adapter: 1.0}, **cpu)
        assert list(lm.generate_ids(prompt, 8, stop_token_ids=[])) == list(ref.generate_ids(prompt, 8, stop_token_ids=[]))


# ---- a MoE and hybrids: attention, linear attention, shared experts, the head --------------------------

_ATTN = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
_LINEAR_ATTN = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
_SHARED = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate"]


@pytest.mark.parametrize("arch,targets", [
    ("Qwen3MoeForCausalLM", _ATTN),
    ("Qwen3_5ForCausalLM", _ATTN + _LINEAR_ATTN + ["gate_proj", "up_proj", "down_proj"]),
    ("Qwen3_5MoeForCausalLM", _ATTN + _LINEAR_ATTN + _SHARED),
])
def test_moe_and_hybrid_logits_match_peft(tmp_path, arch, targets):
    from test_hybrid_families import EXPERTS, LINEAR
    from trellm.sdk.testing import make_tiny_hf_model

    cfg = {"Qwen3MoeForCausalLM": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "mlp_only_layers": [1]},
           "Qwen3_5ForCausalLM": LINEAR, "Qwen3_5MoeForCausalLM": {**LINEAR, **EXPERTS}}[arch]
    base = make_tiny_hf_model(arch, tmp_path / "base", **cfg)
    adapter = make_peft_adapter(base, tmp_path / "adapter", r=4, alpha=8, targets=targets)
    ids = IDS[:, :16]
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    assert_close(lm.logits(ids), peft_logits(base, adapter, ids))


_STACKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
_QWEN3_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1]}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE (per-expert checkpoint tensors, as transformers saves them) and real PEFT adapters on its
    expert stacks (``target_parameters``): both stacks with attention, and the down stack alone."""
    from trellm.sdk.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("moe_lora")
    base = make_tiny_hf_model("Qwen3MoeForCausalLM", root / "base", **_QWEN3_MOE)
    both = make_peft_adapter(base, root / "both", r=4, alpha=8, targets=["q_proj", "o_proj"], parameters=_STACKS)
    down = make_peft_adapter(base, root / "down", r=2, alpha=4, targets=["v_proj"], parameters=_STACKS[1:], seed=5)
    return base, both, down


@pytest.mark.parametrize("which", ["both", "down"])
def test_expert_stack_adapters_match_peft(moe, which):
    base, both, down = moe
    adapter = both if which == "both" else down
    ids = IDS[:, :16]
    want = peft_logits(base, adapter, ids)
    assert not torch.allclose(want, peft_logits(base, None, ids), atol=1e-2)
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    stacks = read_peft_adapter(adapter).expert_stacks["model.layers.0.mlp.experts"]
    assert sorted(stacks) == (["down_proj", "gate_up_proj"] if which == "both" else ["down_proj"])
    assert_close(lm.logits(ids), want)
    experts = lm.model.layers[0].mlp.experts
    assert experts.lora is not None and experts.run_pairs(ids[0, :, None].float(), None, None) is None  # no pair kernels
    lm.unload_lora(lm.loras[0])
    assert experts.lora is None
    assert_close(lm.logits(ids), peft_logits(base, None, ids))


def test_expert_stacks_targeted_per_layer_match_peft(tmp_path):
    """target_parameters may name one layer's stack: layer 0's experts then carry one wrapper (gate_up) and layer
    1's one (down), each read as its own tensor, not as the last of every name the list holds."""
    from trellm.sdk.testing import make_tiny_hf_model

    base = make_tiny_hf_model("Qwen3MoeForCausalLM", tmp_path / "base", **{**_QWEN3_MOE, "mlp_only_layers": []})
    adapter = make_peft_adapter(base, tmp_path / "adapter", r=4, alpha=8, targets=["q_proj"],
                                parameters=["model.layers.0.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"])
    stacks = read_peft_adapter(adapter).expert_stacks
    assert {m: sorted(s) for m, s in stacks.items()} == {"model.layers.0.mlp.experts": ["gate_up_proj"],
                                                         "model.layers.1.mlp.experts": ["down_proj"]}
    ids = IDS[:, :16]
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    assert_close(lm.logits(ids), peft_logits(base, adapter, ids))


def test_expert_stack_named_bare_matches_peft(moe, tmp_path):
    """target_parameters ["down_proj"]: PEFT matches the tail of each parameter's name, so the bare name targets
    every experts module's down stack (only expert stacks are raw parameters of that name)."""
    base = moe[0]
    adapter = make_peft_adapter(base, tmp_path / "bare", r=2, alpha=4, targets=["v_proj"], parameters=["down_proj"], seed=5)
    assert sorted(read_peft_adapter(adapter).expert_stacks["model.layers.0.mlp.experts"]) == ["down_proj"]
    ids = IDS[:, :16]
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    assert_close(lm.logits(ids), peft_logits(base, adapter, ids))


def test_expert_stack_rank_and_alpha_patterns_match_peft(moe, tmp_path):
    """PEFT looks an expert stack's rank_pattern / alpha_pattern up under the tensor's name (experts.down_proj), not
    the experts module's: a pattern on one stack gives it its own rank and scale."""
    base = moe[0]
    adapter = make_peft_adapter(base, tmp_path / "patterns", r=4, alpha=8, targets=["q_proj"], parameters=_STACKS,
                                rank_pattern={"gate_up_proj": 2}, alpha_pattern={"experts.down_proj": 32})
    stacks = read_peft_adapter(adapter).expert_stacks["model.layers.0.mlp.experts"]
    assert (stacks["gate_up_proj"].rank, stacks["gate_up_proj"].scale) == (2, 4.0)
    assert (stacks["down_proj"].rank, stacks["down_proj"].scale) == (4, 8.0)
    ids = IDS[:, :16]
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    assert_close(lm.logits(ids), peft_logits(base, adapter, ids))


def test_adapter_on_a_family_expert_collection_matches_merged_weights(tmp_path):
    """NemotronH's own (ungated) experts, dispatched by the shared expert loop: an adapter on their per-expert
    projections (the names transformers 4 gave them) is told each regrouped row's token, so it gives the logits of
    the base with the updates merged into its weights, and a generator batch mixing it with the base equals single
    runs (before, the adapter saw an expert's rows as the batch's tokens and raised)."""
    from safetensors.torch import load_file, save_file
    from test_hybrid_families import FAMILIES
    from trellm.sdk.testing import make_tiny_hf_model

    arch, cfg = FAMILIES["nemotron_h"]
    base = make_tiny_hf_model(arch, tmp_path / "base", **cfg)
    shared = make_peft_adapter(base, tmp_path / "shared", r=4, alpha=8, targets=["shared_experts.up_proj"])
    weights = load_file(str(base / "model.safetensors"))
    g, factors = torch.Generator().manual_seed(3), {}
    for e in range(cfg["n_routed_experts"]):
        key = f"backbone.layers.2.mixer.experts.{e}.up_proj"
        a, b = torch.randn(4, 64, generator=g) * 0.3, torch.randn(32, 4, generator=g) * 0.3
        factors[f"base_model.model.{key}.lora_A.weight"], factors[f"base_model.model.{key}.lora_B.weight"] = a, b
        weights[f"{key}.weight"] = weights[f"{key}.weight"] + 2.0 * b @ a  # alpha 8 / r 4
    adapter = _edit_adapter(shared, tmp_path / "experts", {"target_modules": ["up_proj"]}, tensors=lambda _: factors)
    merged = shutil.copytree(base, tmp_path / "merged")
    save_file(weights, str(merged / "model.safetensors"), metadata={"format": "pt"})

    ids = IDS[:, :16]
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False)
    plain = lm.logits(ids)
    lm.load_lora(adapter, name="experts")
    want = trellm.load(merged, device="cpu", dtype=torch.float32, tokenizer=False).logits(ids)
    assert not torch.allclose(want, plain, atol=1e-2)
    assert_close(lm.logits(ids, lora="experts"), want)
    prompts, names = [IDS[0, :9].tolist(), IDS[1, :12].tolist()], ["experts", None]
    singles = [list(lm.generate_ids(p, 6, stop_token_ids=[], lora=n or "")) for p, n in zip(prompts, names)]
    gen = Generator(lm, max_batch_size=4, cache_tokens=1024, page_size=16)
    gen.enqueue([Job(p, 6, lora=n, stop_token_ids=[], identifier=i) for i, (p, n) in enumerate(zip(prompts, names))])
    done = {r.identifier: r.token_ids for r in gen.stream() if type(r).__name__ == "JobFinished"}
    assert [done[i] for i in range(2)] == singles


def test_nemotron_h_adapter_named_after_transformers_modules_matches_peft(tmp_path):
    """transformers 5 nests NemotronH's blocks as model.layers where its checkpoints (and trellm's modules) say
    backbone.layers: a real PEFT adapter, named after transformers' modules, is read through the family's aliases and
    gives PEFT's logits and greedy tokens; the same factors under the checkpoint's names (older adapters) load too."""
    from test_hybrid_families import FAMILIES
    from trellm.sdk.testing import make_tiny_hf_model

    arch, cfg = FAMILIES["nemotron_h"]
    base = make_tiny_hf_model(arch, tmp_path / "base", **cfg)
    targets = ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "shared_experts.up_proj", "shared_experts.down_proj",
               "lm_head"]
    adapter = make_peft_adapter(base, tmp_path / "adapter", r=4, alpha=8, targets=targets)
    assert "model.layers.0.mixer.in_proj" in read_peft_adapter(adapter).modules  # as PEFT names it
    ids = IDS[:, :16]
    want = peft_logits(base, adapter, ids)
    assert not torch.allclose(want, peft_logits(base, None, ids), atol=1e-2)
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    got = lm.logits(ids)
    assert_close(got, want)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    prompt = IDS[0, :10]
    hf_out = hf.generate(input_ids=prompt[None], attention_mask=torch.ones(1, 10, dtype=torch.long), max_new_tokens=8,
                         do_sample=False)[0, 10:].tolist()
    assert list(lm.generate_ids(prompt.tolist(), max_new_tokens=8, stop_token_ids=[])) == hf_out

    def checkpoint_names(t):
        return {k.replace("base_model.model.model.", "base_model.model.backbone."): v for k, v in t.items()}

    lm.load_lora(_edit_adapter(adapter, tmp_path / "checkpoint_names", tensors=checkpoint_names), name="old")
    assert lm.logits(ids, lora="old").equal(got)


def test_nemotron_h_expert_stack_adapter_matches_peft(tmp_path):
    """transformers 5 holds NemotronH's ungated experts as two stacks, up_proj and down_proj: PEFT's target_parameters
    on them (named model.layers..., as transformers names the module) give PEFT's logits, each expert's factors on its
    own up / down projections."""
    from test_hybrid_families import FAMILIES
    from trellm.sdk.testing import make_tiny_hf_model

    arch, cfg = FAMILIES["nemotron_h"]
    base = make_tiny_hf_model(arch, tmp_path / "base", **cfg)
    adapter = make_peft_adapter(base, tmp_path / "adapter", r=4, alpha=8, targets=["q_proj"],
                                parameters=["experts.up_proj", "experts.down_proj"], std=0.3)
    stacks = read_peft_adapter(adapter).expert_stacks["model.layers.2.mixer.experts"]
    assert sorted(stacks) == ["down_proj", "up_proj"] and stacks["up_proj"].experts == cfg["n_routed_experts"]
    ids = IDS[:, :16]
    want = peft_logits(base, adapter, ids)
    assert not torch.allclose(want, peft_logits(base, None, ids), atol=1e-2)
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    assert_close(lm.logits(ids), want)
    assert lm.model.layers[2].attn.experts.lora is not None  # the dispatch tells the adapters each row's token
    relabelled = {"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}
    assert_stack_refused(lm, _edit_adapter(adapter, tmp_path / "gated", relabelled), ids,
                         "model.layers.2.mixer.experts.base_layer.lora_A.weight", "gate_up_proj",
                         "backbone.layers.2.mixer.experts", "have no gate")


def assert_stack_refused(lm, adapter: Path, ids: torch.Tensor, tensor: str, stack: str, experts: str, reason: str):
    """Loading ``adapter`` is refused naming its weights file, the lora_A tensor of the expert stack it labels
    ``stack``, the model's experts and ``reason``; no adapter is left loaded and the logits stay the model's."""
    before = lm.logits(ids)
    with pytest.raises(LoraError) as refused:
        lm.load_lora(adapter, name="refused")
    want = (f"{adapter / WEIGHTS}: tensor 'base_model.model.{tensor}' ({stack}) targets experts '{experts}', whose "
            f"experts {reason}")
    assert str(refused.value).startswith(want), str(refused.value)
    assert "refused" not in lm.loras and lm.logits(ids).equal(before)


def test_up_proj_stack_on_gated_experts_is_refused(tmp_path):
    """Mixtral's experts are gated (transformers 5 stacks them as gate_up_proj): an adapter whose target_parameters
    call the inner stack up_proj (NemotronH's ungated layout) is refused by file, tensor and reason, before anything
    of it loads."""
    from test_moe_families import FAMILIES
    from trellm.sdk.testing import make_tiny_hf_model

    base = make_tiny_hf_model(*FAMILIES["mixtral"][:1], tmp_path / "base", **FAMILIES["mixtral"][1])
    adapter = make_peft_adapter(base, tmp_path / "adapter", r=4, alpha=8, targets=["q_proj"], parameters=_STACKS)
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    ungated = _edit_adapter(adapter, tmp_path / "ungated", {"target_parameters": ["mlp.experts.up_proj",
                                                                                  "mlp.experts.down_proj"]})
    assert_stack_refused(lm, ungated, IDS[:, :16], "model.layers.0.mlp.experts.base_layer.lora_A.weight", "up_proj",
                         "model.layers.0.block_sparse_moe.experts", "are gated (a gate_up_proj stack)")


def _renamed_families() -> dict:
    """Families whose transformers 5 module names differ from their checkpoints': (architecture, tiny config, what PEFT
    targets, a module as PEFT names it)."""
    from test_families_gemma4 import LAGUNA
    from test_moe_families import FAMILIES
    from test_new_families import HY_V3

    shared = ["q_proj", "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]
    return {  # block_sparse_moe (checkpoint) is mlp; shared_expert / shared_mlp are shared_experts
        "mixtral": (*FAMILIES["mixtral"], ["q_proj", "v_proj"], "model.layers.0.mlp.experts"),
        "minimax_m2": (*FAMILIES["minimax_m2"], ["q_proj", "v_proj"], "model.layers.0.mlp.experts"),
        "laguna": ("LagunaForCausalLM", LAGUNA, shared, "model.layers.1.mlp.shared_experts.up_proj"),
        "hy_v3": ("HYV3ForCausalLM", HY_V3, shared, "model.layers.1.mlp.shared_experts.up_proj"),
    }


@pytest.mark.parametrize("family", ["mixtral", "minimax_m2", "laguna", "hy_v3"])
def test_adapter_named_after_transformers_modules_matches_peft(tmp_path, family):
    """A real PEFT adapter (expert stacks and other projections) named after transformers 5's modules where they differ
    from the checkpoint's is read through the family's aliases and gives the logits of the PEFT model that saved it
    (not of one reloaded from it: transformers 5.25's Laguna renames 'mlp.shared_expert.' as an unanchored pattern, and
    PeftModel.from_pretrained then leaves the shared expert's factors out)."""
    from trellm.sdk.testing import make_tiny_hf_model

    arch, cfg, targets, renamed = _renamed_families()[family]
    base = make_tiny_hf_model(arch, tmp_path / "base", **cfg)
    ids = IDS[:, :16]
    pm = peft_model(base, r=4, alpha=8, targets=targets, parameters=_STACKS)
    with torch.no_grad():
        want = pm(ids).logits.float()
    pm.save_pretrained(tmp_path / "adapter")
    adapter = tmp_path / "adapter"
    read = read_peft_adapter(adapter)
    assert renamed in {**read.modules, **read.expert_stacks}
    assert not torch.allclose(want, peft_logits(base, None, ids), atol=1e-2)
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    assert_close(lm.logits(ids), want)


def test_glm5_next_adapter_named_after_transformers_modules_matches_peft(tmp_path):
    """transformers 5 nests GLM 5.3's delta-attention forget gate as self_attn.forget_gate.f_a_proj / f_b_proj where
    its checkpoints (and trellm's modules) say self_attn.f_a_proj: a real PEFT adapter on every text projection (delta
    and latent attention, dense MLPs, shared experts, the expert stacks, the head) of the image-text model is read
    through the family's aliases and gives the PEFT model's logits and greedy tokens; the text-only model (a flat
    config) reads it the same."""
    from test_families_next import glm5_next_checkpoint

    base = glm5_next_checkpoint(tmp_path / "base")
    text = ("q_proj|k_proj|v_proj|o_proj|f_a_proj|f_b_proj|g_a_proj|g_b_proj|b_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|"
            "gate_proj|up_proj|down_proj")
    targets = rf".*language_model\.layers\.\d+\.(self_attn|self_attn\.forget_gate|mlp|mlp\.shared_experts)\.({text})|lm_head"
    pm = peft_model(base, r=4, alpha=8, targets=targets, parameters=_STACKS, std=0.2)
    ids, prompt = IDS[:, :16], IDS[0, :10]
    want, hf_tokens = peft_logits_and_tokens(pm, ids, prompt)
    pm.save_pretrained(tmp_path / "adapter")
    read = read_peft_adapter(tmp_path / "adapter")
    assert "model.language_model.layers.0.self_attn.forget_gate.f_a_proj" in read.modules  # as PEFT names it
    assert "model.language_model.layers.1.mlp.experts" in read.expert_stacks
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=tmp_path / "adapter")
    got = lm.logits(ids)
    assert_close(got, want)
    assert not torch.allclose(got, lm.logits(ids, lora=""), atol=1e-2)
    assert list(lm.generate_ids(prompt.tolist(), max_new_tokens=8, stop_token_ids=[])) == hf_tokens

    config = json.loads((base / "config.json").read_text())
    flat = tmp_path / "text_only"
    flat.mkdir()
    (flat / "config.json").write_text(json.dumps({**config.pop("text_config"),
                                                  **{k: v for k, v in config.items() if k != "vision_config"}}))
    (flat / "model.safetensors").symlink_to(base / "model.safetensors")
    text_lm = trellm.load(flat, device="cpu", dtype=torch.float32, tokenizer=False, lora=tmp_path / "adapter")
    assert torch.equal(text_lm.logits(ids), got)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_vision_language_adapter_matches_peft_on_text(tmp_path, family):
    """A real PEFT adapter on the text model of a tiny image-text model (PEFT names its modules
    model.language_model.layers..., trellm's Qwen2.5-VL modules model.layers...: the family's aliases; GLM 4.1V's fused
    gate_up_proj) gives the PEFT model's logits and greedy tokens on text input. The tower is left alone: the regex
    keeps PEFT off it, as trellm adapts only the language model."""
    from test_vision_qwen import save_tiny_vl

    save_tiny_vl(family, tmp_path / "base")
    text = "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|gate_up_proj|down_proj"
    targets = rf".*language_model\.layers\.\d+\.(self_attn|mlp)\.({text})|lm_head"
    pm = peft_model(tmp_path / "base", r=4, alpha=8, targets=targets, std=0.2)
    ids, prompt = IDS[:, :16], IDS[0, :10]
    want, hf_tokens = peft_logits_and_tokens(pm, ids, prompt)
    pm.save_pretrained(tmp_path / "adapter")
    assert "model.language_model.layers.0.self_attn.q_proj" in read_peft_adapter(tmp_path / "adapter").modules
    lm = trellm.load(tmp_path / "base", device="cpu", dtype=torch.float32, tokenizer=False, lora=tmp_path / "adapter")
    got = lm.logits(ids)
    assert_close(got, want)
    assert not torch.allclose(got, lm.logits(ids, lora=""), atol=1e-2)
    assert list(lm.generate_ids(prompt.tolist(), max_new_tokens=8, stop_token_ids=[])) == hf_tokens


def per_expert_layout(stacked: Path, out: Path) -> Path:
    """The adapter ``stacked`` (PEFT's LoRA on expert stacks) laid out one module per expert (``experts.3.gate_proj``),
    as an adapter trained where experts were nn.Linear modules names them: the same factors, the same update."""
    from safetensors.torch import load_file, save_file

    tensors = {k: t for k, t in load_file(str(stacked / WEIGHTS)).items() if ".experts." not in k}
    for module, stacks in read_peft_adapter(stacked).expert_stacks.items():
        gate_up, down = stacks["gate_up_proj"], stacks["down_proj"]
        rows = gate_up.b.shape[0] // 2
        for e in range(gate_up.experts):
            gu, dn = gate_up.expert(e), down.expert(e)
            for name, a, b in (("gate_proj", gu.a, gu.b[:rows]), ("up_proj", gu.a, gu.b[rows:]), ("down_proj", dn.a, dn.b)):
                tensors[f"base_model.model.{module}.{e}.{name}.lora_A.weight"] = a.clone()
                tensors[f"base_model.model.{module}.{e}.{name}.lora_B.weight"] = b.clone()
    targets = json.loads((stacked / "adapter_config.json").read_text())["target_modules"]
    legacy = _edit_adapter(stacked, out, {"target_parameters": None,
                                          "target_modules": sorted(targets) + ["gate_proj", "up_proj", "down_proj"]})
    save_file(tensors, str(legacy / WEIGHTS))
    return legacy


def test_per_expert_module_adapter_matches_peft(moe, tmp_path):
    """An adapter trained where experts were nn.Linear modules names each expert's projections: the same factors
    as the stacked adapter, laid out per expert, give PEFT's logits of the stacked one."""
    base, both, _ = moe
    legacy = per_expert_layout(both, tmp_path / "legacy")
    ids = IDS[:, :16]
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=legacy)
    assert_close(lm.logits(ids), peft_logits(base, both, ids))


def test_expert_adapters_in_a_mixed_generator_batch_match_single_runs(moe):
    """Rows on different adapters (and on none) share one batch: expert dispatch regroups rows by expert, and each
    row still gets its own adapter's update."""
    base, both, down = moe
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False)
    lm.load_lora(both, name="both")
    lm.load_lora(down, name="down")
    prompts = [IDS[0, :9].tolist(), IDS[1, :12].tolist(), IDS[0, 3:14].tolist()]
    names = ["both", "", "down"]
    singles = [list(lm.generate_ids(p, 6, stop_token_ids=[], lora=n)) for p, n in zip(prompts, names)]
    assert one_batch(lm, prompts, names) == singles
    assert len({tuple(t) for t in singles}) == 3


def test_bad_expert_adapters_say_what_is_wrong(moe, tiny, tmp_path):
    base, both, _ = moe
    with pytest.raises(LoraError, match="target_parameters names 'mlp.gate.weight'.*expert stacks"):
        read_peft_adapter(_edit_adapter(both, tmp_path / "router", {"target_parameters": ["mlp.gate.weight"]}))
    lm = trellm.load(tiny[1], device="cpu", dtype=torch.float32, tokenizer=False)  # a dense Llama: no experts
    with pytest.raises(LoraError, match="experts 'model.layers.0.mlp.experts', which this model does not have"):
        lm.load_lora(both)

    def fewer_experts(t):
        for key in list(t):
            if ".mlp.experts." in key:
                t[key] = (t[key][:16] if "lora_A" in key else t[key][:, :16]).contiguous()
        return t

    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False)
    with pytest.raises(LoraError, match="factors for 4 experts of rank 4.*has 8"):
        lm.load_lora(_edit_adapter(both, tmp_path / "fewer", tensors=fewer_experts))
    assert lm.loras == []


def test_adapters_on_stacked_expert_tensors_are_refused_by_name(tmp_path):
    """gpt-oss checkpoints keep experts as 3-D tensors: LoRA there is refused, naming the experts."""
    from trellm.sdk.testing import make_tiny_hf_model

    base = make_tiny_hf_model("GptOssForCausalLM", tmp_path / "base", num_local_experts=4, num_experts_per_tok=2,
                              intermediate_size=32, layer_types=["full_attention", "sliding_attention"])
    adapter = make_peft_adapter(base, tmp_path / "adapter", r=2, alpha=4, targets=["q_proj"], parameters=_STACKS)
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False)
    with pytest.raises(LoraError, match="stores 'model.layers.0.mlp.experts' as stacked 3-D tensors"):
        lm.load_lora(adapter)
