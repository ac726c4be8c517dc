"""LoRA under tensor parallel on CPU: real gloo worker processes, real PEFT adapters, against one process and PEFT.

One tensor-parallel model (2 ranks) serves the module: starting the workers is most of the time. Its q/k/v and
gate/up are column shards (each rank B's rows of its columns), o/down row shards (A's columns of its rows, the
update summed by the all-reduce after them), the head vocab-parallel.
"""
from __future__ import annotations

import pytest
import torch

import trellm
from trellm.generator import Generator, Job
from trellm.lora import LoraError

peft = pytest.importorskip("peft")

from test_lora import ALL_TARGETS, IDS, _edit_adapter, make_peft_adapter, one_batch, peft_logits, tiny  # noqa: E402,F401 - tiny: the fixture

STEP_TIMEOUT = 30.0
# tiny: a 2-layer Llama of 4 heads and 2 KV heads (one KV head per rank), an adapter "all" (rank 8, every projection
# and the head) and "rs" (rank 4, rsLoRA, q/v/down)


@pytest.fixture(scope="module")
def one(tiny):
    _, base, every, rs = tiny
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=every)
    lm.load_lora(rs, name="rs")
    return lm


@pytest.fixture(scope="module")
def split(tiny):
    _, base, every, _ = tiny
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=every, tensor_parallel=2,
                     step_timeout=STEP_TIMEOUT)
    procs = lm.model.workers.procs
    yield lm
    lm.close()
    assert [p.poll() for p in procs] == [0] * len(procs)  # the workers survived every refusal and ended cleanly


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    span = (want.max() - want.min()).item()
    assert span > 1.0
    err = (got - want).abs().max().item()
    assert err <= tol * span, f"max |diff| {err:.3g} > {tol} x logit range {span:.3g}"


def _greedy(lm, lora: str | None = None) -> list[int]:
    return list(lm.generate_ids(IDS[0, :10].tolist(), max_new_tokens=16, stop_token_ids=[], lora=lora))


def test_adapter_on_every_projection_and_the_head_matches_one_rank_and_peft(tiny, one, split):
    """q/k/v/gate/up column shards, o/down row shards, the vocab-parallel head: one process's logits within 1e-4 of
    their range, PEFT's within 1e-3, the same greedy tokens; the base ("") too."""
    _, base, every, _ = tiny
    assert split.loras == ["all"] and split.default_lora == "all"
    want = one.logits(IDS, lora="all")
    got = split.logits(IDS)
    _assert_close(got, want, 1e-4)
    _assert_close(got, peft_logits(base, every, IDS), 1e-3)
    assert not torch.allclose(got, split.logits(IDS, lora=""), atol=1e-2)  # the adapter changes the logits
    _assert_close(split.logits(IDS, lora=""), one.logits(IDS, lora=""), 1e-4)
    assert _greedy(split) == _greedy(one, "all")


def test_generator_batch_mixing_two_adapters_and_none_equals_each_job_alone(tiny, one, split):
    _, _, _, rs = tiny
    split.load_lora(rs, name="rs")
    assert split.loras == ["all", "rs"]
    prompts = [IDS[0, :12].tolist(), IDS[1, :9].tolist(), IDS[0, :12].tolist()]
    choices = ["all", "", "rs"]
    alone = []
    for p, name in zip(prompts, choices):
        gen = Generator(split, max_batch_size=4, cache_tokens=1024, page_size=16)
        alone.append(gen.generate(p, max_new_tokens=6, return_results=True, lora=name, stop_token_ids=[]).token_ids)
        assert alone[-1] == list(one.generate_ids(p, max_new_tokens=6, stop_token_ids=[], lora=name))
    gen = Generator(split, max_batch_size=4, cache_tokens=1024, page_size=16)
    gen.enqueue([Job(p, 6, lora=name, stop_token_ids=[], identifier=i) for i, (p, name) in enumerate(zip(prompts, choices))])
    done = {r.identifier: r.token_ids for r in gen.stream() if type(r).__name__ == "JobFinished"}
    assert [done[i] for i in range(3)] == alone
    assert len({tuple(t) for t in alone}) == 3  # the same prompt gives different tokens under different adapters
    gen.verify_pages()


def test_bad_adapter_gives_the_one_process_error_and_no_rank_keeps_it(tiny, one, split, tmp_path):
    """Shapes are checked against the whole projections (the error names the unsharded shapes) on every rank; a
    refused adapter's name is then free on every rank (a rank keeping it would refuse the next load)."""
    _, _, every, rs = tiny

    def wrong(t):
        t["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"] = torch.zeros(8, 96)  # a row shard's A
        return t

    other = _edit_adapter(every, tmp_path / "other_base", tensors=wrong)
    with pytest.raises(LoraError) as single:
        one.load_lora(other, name="bad")
    with pytest.raises(LoraError) as parallel:
        split.load_lora(other, name="bad")
    assert str(parallel.value) == str(single.value)
    assert "'model.layers.1.self_attn.o_proj.lora_A.weight' has shape [8, 96]" in str(parallel.value)
    assert "needs [8, 128]" in str(parallel.value)
    with pytest.raises(LoraError, match="no such adapter directory"):
        split.load_lora(tmp_path / "missing", name="bad")
    assert split.loras == one.loras
    split.load_lora(rs, name="bad")  # every rank takes the name again
    assert split.logits(IDS, lora="bad").equal(split.logits(IDS, lora="rs"))
    split.unload_lora("bad")
    with pytest.raises(LoraError, match="no LoRA adapter named 'nope'"):
        split.unload_lora("nope")


def test_unload_gives_the_base_logits(one, split):
    split.unload_lora("all")
    assert split.default_lora is None and "all" not in split.loras
    _assert_close(split.logits(IDS), one.logits(IDS, lora=""), 1e-4)
    with pytest.raises(LoraError, match="no LoRA adapter named 'all'"):
        split.logits(IDS, lora="all")


_RANK1 = """
import os, sys, torch, torch.distributed as dist
import trellm
from trellm.distributed.comm import Comm
from trellm.distributed.launch import lora_command
from trellm.lora import lora_set
port, base, adapter = int(sys.argv[1]), sys.argv[2], sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
comm = Comm(store, 1, 2, torch.device("cpu"), 30.0)
model = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False).model
assert lora_command(comm, model, ("load", adapter, "x", 1.0)) == (None, None)  # refused here: nothing raised
comm.all_gather_object(lora_set(model).names())
comm.close()
os._exit(0)  # as a worker does: a gloo group torn down by the interpreter may abort the process
"""


def test_a_refusal_on_another_rank_is_undone_on_the_ranks_that_took_it(tiny, tmp_path):
    """The agreement after a load, over real gloo: rank 1 refuses (its adapter is for another base), rank 0 took
    the adapter and drops it, then raises rank 1's refusal; neither keeps it."""
    import subprocess
    import sys

    import torch.distributed as dist

    from trellm.distributed.comm import Comm
    from trellm.distributed.launch import lora_command
    from trellm.lora import lora_set

    _, base, every, _ = tiny

    def wrong(t):
        t["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"] = torch.zeros(64, 8)
        return t

    bad = _edit_adapter(every, tmp_path / "bad", tensors=wrong)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    rank1 = subprocess.Popen([sys.executable, "-c", _RANK1, str(store.port), str(base), str(bad)])
    try:
        comm = Comm(store, 0, 2, torch.device("cpu"), STEP_TIMEOUT)
        model = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False).model
        name, error = lora_command(comm, model, ("load", str(every), "x", 1.0))
        assert name is None and isinstance(error, LoraError)
        assert str(error).startswith("tensor-parallel rank 1 refused the LoRA load: ")
        assert "'model.layers.0.mlp.gate_proj.lora_B.weight' has shape [64, 8]" in str(error)
        assert comm.all_gather_object(lora_set(model).names()) == [[], []]
        comm.close()
        assert rank1.wait(timeout=60) == 0
    finally:
        if rank1.poll() is None:
            rank1.kill()



def test_exl3_base_with_adapter_matches_one_rank(tmp_path):
    """EXL3 weights split on 128-blocks, the adapter's factors anywhere: one process's logits and greedy tokens."""
    from test_tensor_parallel import EXL3_SMALL, _exl3_from_dense
    from trellm.sdk.testing import make_tiny_hf_model

    dense = make_tiny_hf_model("LlamaForCausalLM", tmp_path / "dense", **EXL3_SMALL)
    adapter = make_peft_adapter(dense, tmp_path / "adapter", r=8, alpha=16, targets=ALL_TARGETS)
    exl3 = _exl3_from_dense(dense, tmp_path / "exl3")
    one = trellm.load(exl3, device="cpu", tokenizer=False, lora=adapter)
    with trellm.load(exl3, device="cpu", tokenizer=False, lora=adapter, tensor_parallel=2, step_timeout=STEP_TIMEOUT) as split:
        ids = IDS[:, :16]
        want = one.logits(ids)
        assert not torch.allclose(want, one.logits(ids, lora=""), atol=1e-2)
        _assert_close(split.logits(ids), want, 1e-4)
        assert _greedy(split) == _greedy(one)

# ---- a hybrid MoE: linear attention and shared experts split, routed experts spread over the ranks --------------

@pytest.fixture(scope="module")
def hybrid_moe(tmp_path_factory):
    """A tiny Qwen3.5-MoE (gated delta net + gated attention, shared experts) split over 2 ranks, with a PEFT adapter
    on attention, linear attention, the shared expert (its down projection a partial sum, all-reduced with the
    routed experts'), its gate and the head, and one on the routed experts' stacks."""
    from test_lora import _ATTN, _LINEAR_ATTN, _SHARED, _STACKS
    from test_tensor_parallel import MODELS
    from trellm.sdk.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tp_lora_moe")
    arch, cfg = MODELS["qwen3_5_moe"]
    base = make_tiny_hf_model(arch, root / "base", **cfg)
    dense = make_peft_adapter(base, root / "dense", r=4, alpha=8, targets=_ATTN + _LINEAR_ATTN + _SHARED)
    experts = make_peft_adapter(base, root / "experts", r=2, alpha=4, targets=["q_proj"], parameters=_STACKS, seed=4)
    lm = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, tensor_parallel=2, step_timeout=STEP_TIMEOUT)
    yield base, dense, experts, lm
    lm.close()


@pytest.mark.parametrize("which", ["dense", "experts"])
def test_hybrid_moe_adapter_matches_one_rank_and_peft(hybrid_moe, which):
    """"experts": the routed experts spread over the ranks (expert parallel) with shared experts beside: each rank keeps
    its own experts' factors of PEFT's stacks, their update part of its partial sum (all-reduced with the shared
    expert's)."""
    base, dense, experts, split = hybrid_moe
    adapter = dense if which == "dense" else experts
    ids = IDS[:, :16]
    split.load_lora(adapter, name=which)
    one = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, lora=adapter)
    want = one.logits(ids)
    assert not torch.allclose(want, one.logits(ids, lora=""), atol=1e-2)
    _assert_close(split.logits(ids, lora=which), want, 1e-4)
    _assert_close(split.logits(ids, lora=which), peft_logits(base, adapter, ids), 1e-3)
    assert _greedy(split, which) == _greedy(one)
    split.unload_lora(which)
    _assert_close(split.logits(ids), one.logits(ids, lora=""), 1e-4)


# ---- expert parallel: a Qwen3-MoE's routed experts spread over the ranks, adapters on them ---------------------------

@pytest.fixture(scope="module")
def spread_moe(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts: 0-3 on rank 0, 4-7 on rank 1) on 2 ranks and one process, with PEFT's adapters on
    its expert stacks (both with attention; down alone) and the first one's factors laid out per expert."""
    from test_lora import _QWEN3_MOE, _STACKS, per_expert_layout
    from trellm.sdk.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("ep_lora")
    base = make_tiny_hf_model("Qwen3MoeForCausalLM", root / "base", **{**_QWEN3_MOE, "mlp_only_layers": []})
    both = make_peft_adapter(base, root / "both", r=4, alpha=8, targets=["q_proj", "o_proj"], parameters=_STACKS)
    down = make_peft_adapter(base, root / "down", r=2, alpha=4, targets=["v_proj"], parameters=["down_proj"], seed=2)
    legacy = per_expert_layout(both, root / "per_expert")
    one = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False)
    one.load_lora(both, name="both")
    one.load_lora(down, name="down")
    split = trellm.load(base, device="cpu", dtype=torch.float32, tokenizer=False, tensor_parallel=2,
                        step_timeout=STEP_TIMEOUT)
    yield base, both, down, legacy, one, split
    split.close()


def test_expert_stack_adapter_under_expert_parallel_matches_one_rank_and_peft(spread_moe):
    base, both, down, _, one, split = spread_moe
    assert type(split.model.local.layers[0].mlp).__name__ == "ExpertParallelMoE"
    split.load_lora(both, name="both")
    split.load_lora(down, name="down")
    ids = IDS[:, :16]
    for name, adapter in (("both", both), ("down", down)):
        want = one.logits(ids, lora=name)
        assert not torch.allclose(want, one.logits(ids, lora=""), atol=1e-2)
        _assert_close(split.logits(ids, lora=name), want, 1e-4)
        _assert_close(split.logits(ids, lora=name), peft_logits(base, adapter, ids), 1e-3)
        assert _greedy(split, name) == _greedy(one, name)


def test_generator_batch_mixing_expert_adapters_under_expert_parallel_equals_each_job_alone(spread_moe):
    """Rows of two expert adapters and the base in one batch: each rank's dispatch regroups its experts' rows and
    tells their adapters each row's token."""
    _, _, _, _, one, split = spread_moe
    prompts = [IDS[0, :12].tolist(), IDS[1, :9].tolist(), IDS[0, :12].tolist()]
    choices = ["both", "", "down"]
    alone = [list(one.generate_ids(p, max_new_tokens=6, stop_token_ids=[], lora=name)) for p, name in zip(prompts, choices)]
    assert one_batch(split, prompts, choices) == alone
    assert len({tuple(t) for t in alone}) == 3


def test_per_expert_adapter_under_expert_parallel_matches_one_rank(spread_moe):
    """An adapter naming each expert's projections (experts.5.up_proj): a rank keeps its own experts' modules and
    leaves the others' to the rank holding them; the stacked adapter's logits."""
    _, _, _, legacy, one, split = spread_moe
    split.load_lora(legacy, name="per_expert")
    ids = IDS[:, :16]
    _assert_close(split.logits(ids, lora="per_expert"), one.logits(ids, lora="both"), 1e-4)
    split.unload_lora("per_expert")


def test_bad_expert_adapter_under_expert_parallel_is_refused_on_every_rank(spread_moe, tmp_path):
    """A wrong expert count is the one-process error on every rank (each checks the whole collection); a wrong shape in
    one expert rank 1 holds is rank 1's refusal, and rank 0, which took its own experts' factors, drops them."""
    _, both, _, legacy, one, split = spread_moe

    def fewer_experts(t):
        return {k: (v[:16] if "lora_A" in k else v[:, :16]).contiguous() if ".mlp.experts" in k else v for k, v in t.items()}

    fewer = _edit_adapter(both, tmp_path / "fewer", tensors=fewer_experts)
    with pytest.raises(LoraError) as single:
        one.load_lora(fewer, name="bad")
    with pytest.raises(LoraError) as parallel:
        split.load_lora(fewer, name="bad")
    assert str(parallel.value) == str(single.value) and "factors for 4 experts of rank 4" in str(single.value)

    def wrong_expert_6(t):
        t["base_model.model.model.layers.1.mlp.experts.6.up_proj.lora_B.weight"] = torch.zeros(48, 4)
        return t

    with pytest.raises(LoraError, match=r"tensor-parallel rank 1 refused the LoRA load: .*experts\.6\.up_proj\.lora_B"
                                        r"\.weight' has shape \[48, 4\]"):
        split.load_lora(_edit_adapter(legacy, tmp_path / "wrong_6", tensors=wrong_expert_6), name="bad")
    assert "bad" not in split.loras
    split.load_lora(legacy, name="bad")  # the name is free on every rank
    split.unload_lora("bad")


# ---- the server: --lora with --tp ----------------------------------------------------------------------------------

def test_server_serves_adapters_under_tensor_parallel(tiny_llama_smollm2_tokenizer_dir, tmp_path):
    """``trellm serve --tp 2 --lora sql=DIR``: ``tiny:sql`` and ``tiny`` each answer as the one-process Python API
    does; the admin loads and unloads another adapter on every rank."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    from test_server_lora import ADMIN, ADMIN_KEY, API_KEY, PROMPT, httpx
    from trellm.server.config import ServerConfig
    from trellm.server.testing import ServerThread

    base = tiny_llama_smollm2_tokenizer_dir
    sql = make_peft_adapter(base, tmp_path / "sql", r=8, alpha=16, targets=["q_proj", "v_proj", "o_proj", "down_proj"], std=0.3)
    other = make_peft_adapter(base, tmp_path / "other", r=4, alpha=4, targets=["up_proj", "lm_head"], seed=5, std=0.3)
    one = trellm.load(base, device="cpu")
    one.load_lora(sql, name="sql")
    one.load_lora(other, name="other")
    config = ServerConfig(model=str(base), model_name="tiny", api_key=API_KEY, admin_key=ADMIN_KEY, device="cpu",
                          cache_size=1024, page_size=32, lora=[f"sql={sql}"], models_dir=str(tmp_path), tensor_parallel=2)
    with ServerThread(config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)

        def complete(model: str) -> str:
            return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text

        assert {m.id for m in client.models.list().data} == {"tiny", "tiny:sql"}
        assert complete("tiny:sql") == one.generate(PROMPT, max_new_tokens=12, lora="sql")
        assert complete("tiny") == one.generate(PROMPT, max_new_tokens=12, lora="")
        assert complete("tiny:sql") != complete("tiny")
        r = httpx.post(server.url + "/v1/lora/load", json={"name": "other", "path": "other"}, headers=ADMIN, timeout=60)
        assert r.status_code == 200
        assert complete("tiny:other") == one.generate(PROMPT, max_new_tokens=12, lora="other")
        assert httpx.post(server.url + "/v1/lora/unload", json={"name": "other"}, headers=ADMIN, timeout=60).status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete("tiny:other")
