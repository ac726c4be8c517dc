"""Kimi delta attention's (KDA: GLM 5.3-Flash) decode step on CUDA, held against its torch reference.

``kda_step_slots`` is the gated delta rule with a decay per key channel; ``kimi_delta_attention_step_slots`` runs a
KDA layer's step from its raw inputs (q/k L2 norms, the per-channel decay and beta computed in the recurrence
kernel). Both are the gated delta net's step kernel in its KEY_DECAY form (kernels_cuda/deltanet.cu).
``TRELLM_KDA_DECODE`` picks the route: "reference", "kernel", "fused" (default).

CPU tests: the fused op's reference against a loop written from the formulas, the route knob, what the CUDA
registration does on the default route, and a tiny GLM 5.3 decoding through every route. CUDA tests (skipped
without a GPU): each kernel against its reference (bf16/fp16/fp32 inputs, Dk 64 and 128, head groups, fresh
rows, state slots updated in place), replayed from a CUDA graph, and the tiny GLM 5.3's decode logits.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from test_cuda_moe import cuda_impl, kernels, on_cuda, rel_err  # noqa: F401  (kernels: a fixture)
from test_cuda_moe_fused import decode_logits
from test_projection_routes import stub_kernels  # noqa: F401  (a fixture)
from trellm import ops
from trellm.ops.deltanet import (
    KDA_DECODE_ENV, kda_decode_route, kda_step_slots, kimi_delta_attention_step_slots, l2_normalize,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    from glm5_decode_ops import tiny_glm5
finally:
    sys.path.pop(0)

ROUTES = ("reference", "kernel", "fused")


def kda_rule_inputs(device, dtype, batch=3, heads=4, dk=64, dv=64, slots=6, seed=0):
    """q/k (L2-normalised), v in ``dtype``, g [B, H, Dk] (float32, in [-5, 0]), beta, float32 state slots."""
    g = torch.Generator().manual_seed(seed)
    t = dict(
        q=l2_normalize(torch.randn(batch, heads, dk, generator=g)).to(dtype),
        k=l2_normalize(torch.randn(batch, heads, dk, generator=g)).to(dtype),
        v=torch.randn(batch, heads, dv, generator=g).to(dtype),
        g=-5 * torch.rand(batch, heads, dk, generator=g),
        beta=torch.rand(batch, heads, generator=g),
        states=torch.randn(slots, heads, dk, dv, generator=g) * 0.1,
        slots=torch.tensor([4, 1, 3, 0, 5][:batch]),
        fresh=torch.tensor([False, True, False, True, False][:batch]),
    )
    return {n: x.to(device) for n, x in t.items()}


def kda_layer_inputs(device, dtype, batch=3, k_heads=2, v_heads=4, dk=64, dv=64, slots=6, seed=0):
    """A KDA layer's raw decode inputs: mixed = q | k | v, the forget-gate input f, beta's b, A_log, dt_bias."""
    g = torch.Generator().manual_seed(seed)
    t = dict(
        mixed=torch.randn(batch, 2 * k_heads * dk + v_heads * dv, generator=g).to(dtype),
        f=torch.randn(batch, v_heads * dk, generator=g).to(dtype), b=torch.randn(batch, v_heads, generator=g).to(dtype),
        A_log=torch.rand(v_heads, generator=g) * 2, dt_bias=torch.randn(v_heads * dk, generator=g),
        states=torch.randn(slots, v_heads, dk, dv, generator=g) * 0.1, slots=torch.tensor([4, 1, 3][:batch]),
        fresh=torch.tensor([False, True, False][:batch]),
    )
    return {n: x.to(device) for n, x in t.items()}


# ---- CPU: the fused op's reference, the route knob, the registration on the default route ----------------


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kimi_delta_attention_step_reference_is_the_per_channel_recurrence(lower_bound):
    """Against a loop over (sequence, value head) written from the formulas, not from kda_inputs."""
    t = kda_layer_inputs("cpu", torch.float32)
    k_heads, v_heads, dk, dv = 2, 4, 64, 64
    states = t["states"].clone()
    out = kimi_delta_attention_step_slots(t["mixed"], t["f"], t["b"], t["A_log"], t["dt_bias"], states, t["slots"],
                                          t["fresh"], k_heads, dk, lower_bound)
    for n, slot in enumerate(t["slots"].tolist()):
        for h in range(v_heads):
            kh = h // (v_heads // k_heads)
            q = t["mixed"][n, kh * dk:(kh + 1) * dk]
            k = t["mixed"][n, (k_heads + kh) * dk:(k_heads + kh + 1) * dk]
            v = t["mixed"][n, 2 * k_heads * dk + h * dv:2 * k_heads * dk + (h + 1) * dv]
            q, k = q / (q.square().sum() + 1e-6).sqrt(), k / (k.square().sum() + 1e-6).sqrt()
            x = t["f"][n, h * dk:(h + 1) * dk] + t["dt_bias"][h * dk:(h + 1) * dk]
            rate = math.exp(t["A_log"][h])
            g = lower_bound * torch.sigmoid(rate * x) if lower_bound is not None else -rate * torch.log1p(torch.exp(x))
            beta = 1 / (1 + math.exp(-t["b"][n, h]))
            s = torch.zeros(dk, dv) if t["fresh"][n] else t["states"][slot, h] * g.exp()[:, None]
            s = s + torch.outer(k, beta * (v - s.t() @ k))
            assert torch.allclose(states[slot, h], s, atol=1e-5)
            assert torch.allclose(out[n, h], s.t() @ q / math.sqrt(dk), atol=1e-5)
    assert torch.equal(states[[0, 2, 5]], t["states"][[0, 2, 5]])  # other slots untouched


def test_kda_decode_route(monkeypatch):
    monkeypatch.delenv(KDA_DECODE_ENV, raising=False)
    assert kda_decode_route() == "fused"  # measured fastest on the H200 (bench_kda_step.py)
    for route in ROUTES:
        monkeypatch.setenv(KDA_DECODE_ENV, route)
        assert kda_decode_route() == route
    monkeypatch.setenv(KDA_DECODE_ENV, "on")
    with pytest.raises(ValueError, match="TRELLM_KDA_DECODE='on'"):
        kda_decode_route()


def declared_arguments(entry: str) -> int:
    """How many arguments the kernel library's header declares for ``trellm_{entry}``."""
    import re

    from trellm.kernels_cuda import binding

    decl = re.search(rf"\btrellm_{entry}\((.*?)\);", binding.abi_declarations(), re.S)
    return len(decl.group(1).split(","))


def test_kda_cuda_routes_reach_their_kernels(stub_kernels, monkeypatch):
    """The CUDA implementations on CPU tensors against a stub kernel library (tests/test_projection_routes.py): on
    the reference route the recurrence answers with the reference and launches nothing; on "kernel" each op
    reaches its entry point with the header's argument count, the sizes, the scale and the decay's bound."""
    t = kda_rule_inputs("cpu", torch.bfloat16, batch=3, heads=4, dk=64, dv=96)
    rule = (t["q"], t["k"], t["v"], t["g"], t["beta"], t["states"], t["slots"], t["fresh"])
    monkeypatch.setenv(KDA_DECODE_ENV, "reference")
    ref_states = t["states"].clone()
    out = kda_step_slots(*rule)  # the stub routes every op to its CUDA implementation
    assert stub_kernels == []
    assert torch.equal(out, kda_step_slots.reference(*rule[:5], ref_states, t["slots"], t["fresh"]))
    monkeypatch.setenv(KDA_DECODE_ENV, "kernel")
    kda_step_slots(*rule)
    ops.gated_delta_rule_step_slots(*rule[:3], t["g"][..., 0], *rule[4:])  # the gated delta net's, beside it
    u = kda_layer_inputs("cpu", torch.float16, k_heads=2, v_heads=4, dk=128, dv=64)
    for bound in (-5.0, None):
        kimi_delta_attention_step_slots(u["mixed"], u["f"], u["b"], u["A_log"], u["dt_bias"], u["states"], u["slots"],
                                        u["fresh"], 2, 128, bound)
    assert [name for name, _ in stub_kernels] == ["kda_step_slots", "gated_delta_rule_step_slots"] + \
        ["kimi_delta_attention_step_slots"] * 2
    for name, args in stub_kernels:
        assert len(args) == declared_arguments(name), name
    kda, gdn, bounded, unbounded = (args for _, args in stub_kernels)
    assert kda[12:17] == gdn[12:17] == [3, 4, 64, 96, pytest.approx(64**-0.5)]  # batch, heads, dk, dv, scale
    assert kda[10] == "ptr" and kda[1] == 1  # the fresh rows; bf16
    assert bounded[8:10] == [1, -5.0] and unbounded[8] == 0  # bounded, lower_bound
    assert bounded[15:21] == [3, 2, 4, 128, 64, pytest.approx(128**-0.5)]  # batch, k_heads, v_heads, dk, dv, scale
    assert bounded[2] == u["mixed"].shape[1]  # the row stride of q | k | v


def tiny_glm5_decode(device, dtype, monkeypatch, route: str, lower_bound: float | None = -5.0, steps: int = 3,
                     prompts=((1, 2, 3, 4), (5, 6, 7))) -> torch.Tensor:
    """Decode logits [steps, 2, vocab] of benchmarks/glm5_decode_ops.py's tiny random GLM 5.3 (2 KDA layers) with
    ``TRELLM_KDA_DECODE=route``."""
    monkeypatch.setenv(KDA_DECODE_ENV, route)
    return decode_logits(tiny_glm5(device, dtype, linear_lower_bound=lower_bound), device, steps, prompts)


def counting(monkeypatch, name: str) -> list:
    """Calls of ``trellm.ops.<name>`` from here on (the op still runs)."""
    calls, op = [], getattr(ops, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return op(*args, **kwargs)

    monkeypatch.setattr(ops, name, counted)
    return calls


@pytest.mark.parametrize("prompts", [((1, 2, 3, 4), (5, 6, 7)), ((9,), (5,))])  # a prefill, or a first decode step
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_tiny_glm5_decodes_alike_on_every_route_on_cpu(monkeypatch, lower_bound, prompts):
    """On CPU every route runs the references: this holds the fused route's wiring (raw inputs, state slots,
    fresh rows, the output norm) to the unfused one, and checks that each decode step took the fused op."""
    ref = tiny_glm5_decode("cpu", torch.float32, monkeypatch, "reference", lower_bound, prompts=prompts)
    fused_calls = counting(monkeypatch, "kimi_delta_attention_step_slots")
    fused = tiny_glm5_decode("cpu", torch.float32, monkeypatch, "fused", lower_bound, prompts=prompts)
    assert len(fused_calls) == 2 * (3 + (len(prompts[0]) == 1))  # 2 KDA layers per decode step
    assert rel_err(fused, ref) < 1e-5


# ---- CUDA: the kernels against their references -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dk,dv,heads,batch", [(64, 64, 4, 3), (128, 128, 8, 5), (128, 96, 3, 2), (64, 160, 2, 4)])
@pytest.mark.parametrize("with_fresh", [False, True])
@on_cuda
def test_kda_step_cuda(monkeypatch, dtype, dk, dv, heads, batch, with_fresh):
    monkeypatch.setenv(KDA_DECODE_ENV, "kernel")
    t = kda_rule_inputs("cuda", dtype, batch=batch, heads=heads, dk=dk, dv=dv)
    fresh = t["fresh"] if with_fresh else None
    states, ref_states = t["states"].clone(), t["states"].clone()
    out = cuda_impl(kda_step_slots)(t["q"], t["k"], t["v"], t["g"], t["beta"], states, t["slots"], fresh)
    ref = kda_step_slots.reference(t["q"].float(), t["k"].float(), t["v"].float(), t["g"], t["beta"], ref_states,
                                   t["slots"], fresh)
    assert out.dtype == dtype and out.shape == (batch, heads, dv)
    assert rel_err(states, ref_states) < 1e-5  # float32 state: only the sums' order differs
    assert rel_err(out, ref) < (1e-2 if dtype != torch.float32 else 1e-5)
    untouched = [s for s in range(t["states"].shape[0]) if s not in t["slots"].tolist()]
    assert torch.equal(states[untouched], t["states"][untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dk,dv,k_heads,v_heads", [(128, 128, 4, 4), (64, 64, 2, 4), (128, 64, 1, 3)])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("with_fresh", [False, True])
@on_cuda
def test_kimi_delta_attention_step_cuda(dtype, dk, dv, k_heads, v_heads, lower_bound, with_fresh):
    t = kda_layer_inputs("cuda", dtype, k_heads=k_heads, v_heads=v_heads, dk=dk, dv=dv)
    fresh = t["fresh"] if with_fresh else None
    states, ref_states = t["states"].clone(), t["states"].clone()
    args = (t["A_log"], t["dt_bias"])
    out = cuda_impl(kimi_delta_attention_step_slots)(t["mixed"], t["f"], t["b"], *args, states, t["slots"], fresh,
                                                     k_heads, dk, lower_bound)
    ref = kimi_delta_attention_step_slots.reference(t["mixed"].float(), t["f"].float(), t["b"].float(), *args, ref_states,
                                                    t["slots"], fresh, k_heads, dk, lower_bound)
    assert out.dtype == dtype and out.shape == (3, v_heads, dv)
    assert rel_err(states, ref_states) < 1e-5
    assert rel_err(out, ref) < (1e-2 if dtype != torch.float32 else 1e-5)
    assert torch.equal(states[[0, 2, 5]], t["states"][[0, 2, 5]])


@pytest.mark.parametrize("op_name", ["kda_step_slots", "kimi_delta_attention_step_slots"])
@on_cuda
def test_kda_steps_replay_from_a_cuda_graph(monkeypatch, op_name):
    """Captured once, replayed over new inputs copied into the captured buffers: two steps on the same slots."""
    monkeypatch.setenv(KDA_DECODE_ENV, "kernel")
    if op_name == "kda_step_slots":
        t = kda_rule_inputs("cuda", torch.bfloat16)
        names = ("q", "k", "v", "g", "beta")
    else:
        t = kda_layer_inputs("cuda", torch.bfloat16)
        names = ("mixed", "f", "b", "A_log", "dt_bias")
    op = getattr(ops, op_name)
    impl, extra = cuda_impl(op), (() if op_name == "kda_step_slots" else (2, 64, -5.0))
    states, ref_states = t["states"].clone(), t["states"].clone()
    inputs = {n: t[n].clone() for n in names}
    impl(*inputs.values(), states, t["slots"], None, *extra)  # warm-up outside the capture
    states.copy_(t["states"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl(*inputs.values(), states, t["slots"], None, *extra)
    states.copy_(t["states"])
    for seed in (1, 2):
        fresh_inputs = (kda_rule_inputs if op_name == "kda_step_slots" else kda_layer_inputs)("cuda", torch.bfloat16, seed=seed)
        for n in names:
            inputs[n].copy_(fresh_inputs[n])
        graph.replay()
        ref = op.reference(*(inputs[n].float() if inputs[n].dtype != torch.float32 else inputs[n] for n in names),
                           ref_states, t["slots"], None, *extra)
        assert rel_err(states, ref_states) < 1e-5
        assert rel_err(out, ref) < 1e-2


# ---- CUDA: a tiny GLM 5.3's decoding through each route ------------------------------------------------


@pytest.mark.parametrize("route", ["kernel", "fused"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@on_cuda
def test_tiny_glm5_decode_cuda_matches_the_torch_route(monkeypatch, route, dtype, tolerance, lower_bound):
    """The decode logits of a tiny random GLM 5.3 on the GPU (every other op on its CUDA kernels), the KDA step
    on ``route`` against the torch reference route; a first decode step from fresh slots and a prefill."""
    for prompts in (((1, 2, 3, 4), (5, 6, 7)), ((9,), (5,))):
        ref = tiny_glm5_decode("cuda", dtype, monkeypatch, "reference", lower_bound, prompts=prompts)
        out = tiny_glm5_decode("cuda", dtype, monkeypatch, route, lower_bound, prompts=prompts)
        assert rel_err(out, ref) < tolerance
