"""Decode fusions of the hybrid MoE layers, held against their unfused routes: the shared expert folded into
the routed pair launches, and the gated delta net's step and output norm each as one op.

CPU tests: the ops' references (against plain loops where the reference is new math), when the fold
applies and when it declines, the route decisions (device, rows, ``TRELLM_MOE_DECODE``,
``TRELLM_DELTANET_DECODE``, replaced weights), and the fused routes' outputs against the unfused ones on
hand-built blocks and on the benchmark's random EXL3 model. CUDA tests (skipped without a GPU): each
kernel against its reference, the fused routes against the unfused kernels, in a CUDA graph.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from test_cuda_moe import (  # noqa: F401  (tests/ is on sys.path; kernels: a fixture)
    EXL3_CASES, cuda_impl, exl3_experts, kernels, on_cuda, random_exl3, rel_err, routing,
)
from trellm.modules.layers import GatedMLP
from trellm.modules.linear import DenseLinear, Linear
from trellm.modules.moe import (
    MOE_DECODE_ENV, SYNC_FREE_MAX_PAIRS, MoE, Router, ScoreTopK, SoftmaxTopK, fold_shared_expert,
)
from trellm.ops.moe import exl3_experts_down, exl3_experts_gate_up, softmax_topk, softmax_topk_shared


def exl3_moe(e=6, h=128, i=128, top_k=2, gated=True, scaling=1.0, shared_width=None, shared_bits=4,
             device="cpu", dtype=torch.float32, seed=0) -> MoE:
    """A MoE block of random EXL3 experts and shared expert, dense router and shared gate, folded."""
    g = torch.Generator().manual_seed(seed + 100)
    experts = exl3_experts(e, h, i, device=device, seed=seed)
    router = Router("r", h, e, SoftmaxTopK(top_k, True, scaling))
    router.gate.impl = DenseLinear((torch.randn(e, h, generator=g) / math.sqrt(h)).to(device, dtype), None)
    width = shared_width or i
    shared = GatedMLP("s", h, width)
    shared.gate_proj.impl = random_exl3(h, width, shared_bits, "mcg", g, device)
    shared.up_proj.impl = random_exl3(h, width, shared_bits, "mcg", g, device)
    shared.down_proj.impl = random_exl3(width, h, shared_bits, "mcg", g, device)
    shared_gate = None
    if gated:
        shared_gate = Linear("sg", h, 1)
        shared_gate.impl = DenseLinear(torch.randn(1, h, generator=g).to(device, dtype), None)
    moe = MoE("m", router, experts, shared, shared_gate)
    moe.shared_fold = fold_shared_expert(moe, torch.device(device))
    return moe


# ---- CPU: routing reference -------------------------------------------------------------------------


@pytest.mark.parametrize("shared", ["sigmoid", "one"])
def test_softmax_topk_shared_appends_the_shared_pair(shared):
    logits = torch.randn(5, 9 if shared == "sigmoid" else 8)
    weights, ids = softmax_topk_shared(logits, 3, True, 2.5, shared)
    routed_w, routed_ids = softmax_topk(logits[:, :8], 3, True)
    assert weights.shape == ids.shape == (5, 4) and weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids[:, :3], routed_ids) and (ids[:, 3] == 8).all()
    assert torch.allclose(weights[:, :3], 2.5 * routed_w)
    expect = torch.sigmoid(logits[:, 8]) if shared == "sigmoid" else torch.ones(5)
    assert torch.allclose(weights[:, 3], expect)


def test_softmax_topk_shared_names_a_bad_mode():
    with pytest.raises(ValueError, match="shared='softmax'"):
        softmax_topk_shared(torch.randn(2, 4), 1, True, 1.0, "softmax")


# ---- CPU: the fold equals the block ---------------------------------------------------------------


@pytest.mark.parametrize("gated,scaling", [(True, 1.0), (False, 1.0), (True, 2.0)])
def test_fold_matches_the_unfused_block(gated, scaling):
    moe = exl3_moe(gated=gated, scaling=scaling)
    fold = moe.shared_fold
    assert fold is not None and fold.shared == ("sigmoid" if gated else "one")
    x = torch.randn(3, 128)
    ref = moe.forward(x)  # CPU: routed experts grouped by expert, the shared MLP and its gate apart
    assert rel_err(fold.forward(x), ref) < 1e-5


def test_fold_shares_the_router_and_gate_storage():
    moe = exl3_moe()
    joint = moe.shared_fold.router.weight
    assert joint.shape == (7, 128)
    assert moe.router.gate.impl.weight.data_ptr() == joint.data_ptr()
    assert moe.shared_gate.impl.weight.data_ptr() == joint[6:].data_ptr()


def test_fold_declines_what_it_cannot_run():
    assert exl3_moe(shared_width=256).shared_fold is None  # shared expert wider than the routed ones
    assert exl3_moe(shared_bits=3).shared_fold is None  # another bitrate: not one pair set
    moe = exl3_moe()
    moe.router.strategy = ScoreTopK(2)  # sigmoid routing: no fused routing op
    assert fold_shared_expert(moe, torch.device("cpu")) is None
    moe = exl3_moe()
    moe.router.gate.impl = DenseLinear(moe.router.gate.impl.weight.clone(), torch.zeros(6))  # a router bias
    assert fold_shared_expert(moe, torch.device("cpu")) is None
    moe = exl3_moe()
    moe.shared.activation = "gelu"  # activations differ
    assert fold_shared_expert(moe, torch.device("cpu")) is None

    class Hashed(MoE):
        def route(self, x, batch):
            return super().route(x, batch)

    moe = exl3_moe()
    assert fold_shared_expert(Hashed("h", moe.router, moe.experts, moe.shared, moe.shared_gate), torch.device("cpu")) is None


def test_decode_decision(monkeypatch):
    moe = exl3_moe(top_k=2)
    fold = moe.shared_fold
    monkeypatch.delenv(MOE_DECODE_ENV, raising=False)
    assert moe.fold_for("cuda", 4) is fold  # the default: fused, measured fastest on the H200
    monkeypatch.setenv(MOE_DECODE_ENV, "fused")
    assert moe.fold_for("cuda", 4) is fold
    assert moe.fold_for("cpu", 4) is None
    assert moe.fold_for("cuda", SYNC_FREE_MAX_PAIRS // 3) is fold
    assert moe.fold_for("cuda", SYNC_FREE_MAX_PAIRS // 3 + 1) is None  # prefill: grouped by expert
    monkeypatch.setenv(MOE_DECODE_ENV, "pairs")
    assert moe.fold_for("cuda", 4) is None
    monkeypatch.setenv(MOE_DECODE_ENV, "one_launch")  # the fold, and one launch per pair matmul
    assert moe.fold_for("cuda", 4) is fold
    monkeypatch.setenv(MOE_DECODE_ENV, "fast")
    with pytest.raises(ValueError, match="TRELLM_MOE_DECODE='fast'"):
        moe.fold_for("cuda", 4)
    monkeypatch.setenv(MOE_DECODE_ENV, "fused")
    moe.shared.down_proj.impl = random_exl3(128, 128, 4, "mcg", torch.Generator().manual_seed(9), "cpu")  # e.g. sharded
    assert moe.fold_for("cuda", 4) is None
    moe.unload()
    assert moe.shared_fold is None


def test_benchmark_model_folds_every_moe_layer():
    """The tiny Qwen3.5-MoE benchmark model with random EXL3 weights: each MoE block (and only through load)
    gets a fold, which gives the block's output."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_moe_decode as bench
    finally:
        sys.path.pop(0)
    from trellm.config import DecoderConfig
    from trellm.modules.base import LoadContext
    from trellm.sdk import build_qwen3_5_moe

    cfg = DecoderConfig.from_hf(dict(bench.TINY, num_hidden_layers=2, architectures=["Qwen3_5MoeForCausalLM"]))
    model = build_qwen3_5_moe(cfg)
    model.load(LoadContext(store=bench.RandomWeights(stacked_experts=False), device=torch.device("cpu"),
                           dtype=torch.float32, quant_formats=[bench.RandomEXL3(4)]))
    blocks = [layer.mlp for layer in model.layers]
    assert all(isinstance(b, MoE) and b.shared_fold is not None for b in blocks)
    x = torch.randn(2, cfg.hidden_size) * 0.1
    for b in blocks:
        assert rel_err(b.shared_fold.forward(x), b.forward(x)) < 1e-5


# ---- CUDA -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("experts,k,normalize,scaling,shared,dtype", [
    (256, 8, True, 1.0, "sigmoid", torch.bfloat16), (128, 8, True, 1.0, "one", torch.bfloat16),
    (60, 4, False, 2.5, "sigmoid", torch.float32), (1024, 2, True, 1.0, "sigmoid", torch.float16),
])
@on_cuda
def test_softmax_topk_shared_cuda(experts, k, normalize, scaling, shared, dtype):
    logits = (torch.randn(37, experts + (shared == "sigmoid"), device="cuda") * 3).to(dtype)
    weights, ids = cuda_impl(softmax_topk_shared)(logits, k, normalize, scaling, shared)
    ref_w, ref_ids = softmax_topk_shared.reference(logits, k, normalize, scaling, shared)
    assert weights.shape == ids.shape == (37, k + 1) and weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids[:, k], ref_ids[:, k]) and all(len(set(row)) == k for row in ids[:, :k].tolist())
    assert rel_err(weights, ref_w) < 1e-5  # tie order of equal weights aside, the sorted weights agree
    chosen = torch.softmax(logits[:, :experts].float(), -1).gather(1, ids[:, :k])
    if normalize:
        chosen = chosen / chosen.sum(-1, keepdim=True)
    assert rel_err(weights[:, :k], scaling * chosen) < 1e-5


@pytest.mark.parametrize("tokens,gated,experts,top_k", [(1, True, 32, 8), (16, True, 32, 8), (5, False, 16, 16), (16, True, 16, 16)])
@on_cuda
def test_shared_fold_cuda(tokens, gated, experts, top_k, monkeypatch):
    """The folded block on CUDA (the router matmul, then 3 launches) against its own ops' torch references
    (TRELLM_OPS=reference: the same router logits, so the same experts) and against the unfused pair path where
    every expert is chosen (its [E, H] router matmul may round a logit otherwise than the fold's [E + 1, H] one)."""
    moe = exl3_moe(e=experts, h=512, i=256, top_k=top_k, gated=gated, device="cuda", dtype=torch.bfloat16)
    assert moe.shared_fold is not None
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv(MOE_DECODE_ENV, "fused")
    assert moe.fold_for("cuda", tokens) is moe.shared_fold
    fused = moe.forward(x)
    monkeypatch.setenv("TRELLM_OPS", "reference")
    reference = moe.forward(x)
    monkeypatch.delenv("TRELLM_OPS")
    monkeypatch.setenv(MOE_DECODE_ENV, "pairs")
    unfused = moe.forward(x)
    assert fused.shape == unfused.shape == (tokens, 512) and fused.dtype == x.dtype
    assert rel_err(fused, reference) < 2e-2
    if top_k == experts:
        assert rel_err(fused, unfused) < 2e-2


@pytest.mark.parametrize("mode", ["fused", "one_launch"])
@on_cuda
def test_shared_fold_in_cuda_graph(monkeypatch, mode):
    monkeypatch.setenv(MOE_DECODE_ENV, mode)
    moe = exl3_moe(e=16, h=256, i=128, top_k=16, device="cuda", dtype=torch.bfloat16)  # no choice to round otherwise
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        moe.forward(x)  # warm-up
        with torch.cuda.graph(graph, stream=stream):
            out = moe.forward(x)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv(MOE_DECODE_ENV, "pairs")
        assert rel_err(out, moe.forward(x)) < 2e-2
        monkeypatch.setenv(MOE_DECODE_ENV, mode)


@pytest.mark.parametrize("case", EXL3_CASES)
@on_cuda
def test_exl3_expert_pairs_one_launch_cuda(case, monkeypatch):
    """One launch per pair matmul (the last block of each output group finishes it) gives exactly the two-launch
    result (the same sums in the same order), and leaves its arrival counters zero for the next launch."""
    from trellm.kernels_cuda.ops import _MOE_COUNTERS

    h, i, bits, down_bits, codebook, tokens, top_k, e, act, bias = case
    experts = exl3_experts(e, h, i, bits, codebook, "cuda", act, bias, down_bits)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(tokens, e, top_k, "cuda")
    expert_of = ids.reshape(-1)
    results = {}
    for mode in ("fused", "one_launch", "one_launch"):  # twice: the counters must be back at zero
        monkeypatch.setenv(MOE_DECODE_ENV, mode)
        hidden = cuda_impl(exl3_experts_gate_up)(x, expert_of, experts.pair_set, top_k, act)
        out = cuda_impl(exl3_experts_down)(hidden, expert_of, experts.pair_set, weights)
        if mode in results:
            assert torch.equal(hidden, results[mode][0]) and torch.equal(out, results[mode][1])
        results[mode] = (hidden, out)
    assert torch.equal(results["one_launch"][0], results["fused"][0])
    assert torch.equal(results["one_launch"][1], results["fused"][1])
    torch.cuda.synchronize()
    assert int(_MOE_COUNTERS[x.device].abs().sum()) == 0


# ---- gated delta net: the step from raw inputs and the output norm ----------------------------------------


def delta_net_inputs(device, dtype=torch.bfloat16, batch=3, k_heads=2, v_heads=4, dk=64, dv=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = dict(
        mixed=torch.randn(batch, 2 * k_heads * dk + v_heads * dv, generator=g).to(dtype),
        a=torch.randn(batch, v_heads, generator=g).to(dtype), b=torch.randn(batch, v_heads, generator=g).to(dtype),
        A_log=torch.rand(v_heads, generator=g) * 2, dt_bias=torch.randn(v_heads, generator=g),
        states=torch.randn(6, v_heads, dk, dv, generator=g) * 0.1, slots=torch.tensor([4, 1, 3][:batch]),
        fresh=torch.tensor([False, True, False][:batch]),
    )
    return {n: x.to(device) for n, x in t.items()}


def test_gated_delta_net_step_reference_is_the_per_head_recurrence():
    """Against a loop over (sequence, value head) written from the formulas, not from gated_delta_inputs."""
    from trellm.ops.deltanet import gated_delta_net_step_slots

    t = delta_net_inputs("cpu", torch.float32)
    k_heads, dk, v_heads, dv = 2, 64, 4, 64
    states = t["states"].clone()
    out = gated_delta_net_step_slots(t["mixed"], t["a"], t["b"], t["A_log"], t["dt_bias"], states, t["slots"], t["fresh"],
                                     k_heads, dk, 2.0)
    for n, slot in enumerate(t["slots"].tolist()):
        for h in range(v_heads):
            kh = h // (v_heads // k_heads)
            q = t["mixed"][n, kh * dk:(kh + 1) * dk]
            k = t["mixed"][n, k_heads * dk + kh * dk:k_heads * dk + (kh + 1) * dk]
            v = t["mixed"][n, 2 * k_heads * dk + h * dv:2 * k_heads * dk + (h + 1) * dv]
            q, k = q / (q.square().sum() + 1e-6).sqrt(), k / (k.square().sum() + 1e-6).sqrt()
            decay = math.exp(-math.exp(t["A_log"][h]) * math.log1p(math.exp(t["a"][n, h] + t["dt_bias"][h])))
            beta = 2.0 / (1 + math.exp(-t["b"][n, h]))
            s = torch.zeros(dk, dv) if t["fresh"][n] else t["states"][slot, h] * decay
            s = s + torch.outer(k, beta * (v - s.t() @ k))
            assert torch.allclose(states[slot, h], s, atol=1e-5)
            assert torch.allclose(out[n, h], s.t() @ q / math.sqrt(dk), atol=1e-5)
    assert torch.equal(states[[0, 2, 5]], t["states"][[0, 2, 5]])  # other slots untouched


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_rms_norm_reference_is_norm_then_gate(activation):
    from trellm.ops import gated_rms_norm, rms_norm

    x, gate = torch.randn(3, 4, 64).bfloat16(), torch.randn(3, 4, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    act = torch.sigmoid if activation == "sigmoid" else torch.nn.functional.silu
    expect = (rms_norm(x, w, 1e-6).float() * act(gate.float())).bfloat16()
    assert torch.equal(gated_rms_norm(x, w, gate, 1e-6, activation), expect)
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        gated_rms_norm(x, w, gate, 1e-6, "relu")


def test_deltanet_decode_mode(monkeypatch):
    from trellm.modules.recurrent import DELTANET_DECODE_ENV, deltanet_decode_mode

    monkeypatch.delenv(DELTANET_DECODE_ENV, raising=False)
    assert deltanet_decode_mode() == "fused"  # measured faster on the H200 (bench_moe_decode.py)
    monkeypatch.setenv(DELTANET_DECODE_ENV, "unfused")
    assert deltanet_decode_mode() == "unfused"
    monkeypatch.setenv(DELTANET_DECODE_ENV, "yes")
    with pytest.raises(ValueError, match="TRELLM_DELTANET_DECODE='yes'"):
        deltanet_decode_mode()


def tiny_hybrid_decode(device, dtype, monkeypatch, modes: dict[str, str], steps: int = 2):
    """Logits of a few batch-2 decode steps of the benchmark's tiny Qwen3.5-MoE model (random EXL3 weights)
    under the given environment, from one prefill of two prompts. Every token routes to all 16 experts: with
    a choice, two routes' roundings could pick different experts for a token near a tie."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_moe_decode as bench
    finally:
        sys.path.pop(0)
    from trellm.config import DecoderConfig
    from trellm.modules.base import LoadContext
    from trellm.sdk import build_qwen3_5_moe

    for name, value in modes.items():
        monkeypatch.setenv(name, value)
    cfg = DecoderConfig.from_hf(dict(bench.TINY, num_experts_per_tok=bench.TINY["num_experts"],
                                     architectures=["Qwen3_5MoeForCausalLM"]))
    model = build_qwen3_5_moe(cfg)
    model.load(LoadContext(store=bench.RandomWeights(stacked_experts=False), device=torch.device(device), dtype=dtype,
                           quant_formats=[bench.RandomEXL3(4)]))
    return decode_logits(model, device, steps)


def decode_logits(model, device, steps: int = 2, prompts=((1, 2, 3, 4), (5, 6, 7))) -> torch.Tensor:
    """Logits [steps, 2, vocab] of a hybrid model's batch-2 decode steps after its first forward pass over two
    prompts (one token each: that pass is a decode step too, from fresh state slots)."""
    from trellm.batch import ForwardBatch
    from trellm.cache import SequenceState
    from trellm.cache.recurrent import alloc_state_slot

    cache = model.make_cache(max_tokens=512, page_size=64, max_slots=2)
    seqs = [SequenceState(cache) for _ in range(2)]
    for s in seqs:
        s.reserve(64)
    slots = torch.tensor([alloc_state_slot(cache) for _ in seqs], device=device)
    logits = []
    with torch.inference_mode():  # fixed tokens: both routes must see the same ones (argmax could differ in bf16)
        for tokens in [[list(p) for p in prompts]] + [[[10 + i], [20 + i]] for i in range(steps)]:
            batch = ForwardBatch.with_cache(tokens, [s.length for s in seqs], [s.pages for s in seqs], cache)
            batch.state_slots = slots
            logits.append(model.forward(batch).float())
            for s, t in zip(seqs, tokens):
                s.length += len(t)
    return torch.stack(logits[1:])


def test_hybrid_decode_fused_routes_match_unfused_on_cpu(monkeypatch):
    fused = tiny_hybrid_decode("cpu", torch.float32, monkeypatch, {"TRELLM_DELTANET_DECODE": "fused", MOE_DECODE_ENV: "fused"})
    unfused = tiny_hybrid_decode("cpu", torch.float32, monkeypatch, {"TRELLM_DELTANET_DECODE": "unfused", MOE_DECODE_ENV: "pairs"})
    assert rel_err(fused, unfused) < 1e-5


@pytest.mark.parametrize("dk,dv,k_heads,v_heads,dtype,beta_scale", [
    (128, 128, 16, 32, torch.bfloat16, 1.0),  # Qwen3.5-35B-A3B
    (64, 96, 2, 2, torch.float32, 2.0),
    (256, 64, 1, 4, torch.float16, 1.0),
])
@pytest.mark.parametrize("with_fresh", [False, True])
@on_cuda
def test_gated_delta_net_step_cuda(dk, dv, k_heads, v_heads, dtype, beta_scale, with_fresh):
    from trellm.ops.deltanet import gated_delta_net_step_slots

    t = delta_net_inputs("cuda", dtype, k_heads=k_heads, v_heads=v_heads, dk=dk, dv=dv)
    fresh = t["fresh"] if with_fresh else None
    states, ref_states = t["states"].clone(), t["states"].clone()
    args = (t["a"], t["b"], t["A_log"], t["dt_bias"])
    out = cuda_impl(gated_delta_net_step_slots)(t["mixed"], *args, states, t["slots"], fresh, k_heads, dk, beta_scale)
    ref = gated_delta_net_step_slots.reference(t["mixed"].float(), *(x.float() for x in args), ref_states, t["slots"], fresh,
                                               k_heads, dk, beta_scale)
    assert out.dtype == dtype and out.shape == (3, v_heads, dv)
    assert rel_err(states, ref_states) < 1e-5
    assert rel_err(out, ref) < (1e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 128), (torch.float16, 96), (torch.float32, 1000)])
@on_cuda
def test_gated_rms_norm_cuda(activation, dtype, dim):
    from trellm.ops import gated_rms_norm

    x, gate = (torch.randn(5, 7, dim, device="cuda") * 3).to(dtype), torch.randn(5, 7, dim, device="cuda").to(dtype)
    w = torch.randn(dim, device="cuda").to(dtype)
    out = cuda_impl(gated_rms_norm)(x, w, gate, 1e-6, activation)
    ref = gated_rms_norm.reference(x, w, gate, 1e-6, activation)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) < (1e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("moe_route", ["fused", "one_launch"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 5e-3)])
@on_cuda
def test_hybrid_decode_fused_routes_match_unfused_cuda(monkeypatch, moe_route, dtype, tolerance):
    """The tiny Qwen3.5-MoE model's decode logits on the GPU, fused routes against the unfused kernels."""
    fused = tiny_hybrid_decode("cuda", dtype, monkeypatch, {"TRELLM_DELTANET_DECODE": "fused", MOE_DECODE_ENV: moe_route})
    unfused = tiny_hybrid_decode("cuda", dtype, monkeypatch, {"TRELLM_DELTANET_DECODE": "unfused", MOE_DECODE_ENV: "pairs"})
    assert rel_err(fused, unfused) < tolerance
