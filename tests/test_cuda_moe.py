"""Sync-free MoE dispatch and the gated-delta-net decode kernels, held against their torch references.

CPU tests: the sync-free pair path (dense stacked experts, EXL3 per-expert Linears) gives what the
grouped :func:`dispatch_experts` gives. CUDA tests (skipped without a GPU): the pair kernels against
the ops' references, the whole MoE dispatch inside a CUDA graph, the delta-rule and conv1d step kernels.
"""
from __future__ import annotations

import math

import pytest
import torch

from trellm.modules.base import LoadContext
from trellm.modules.linear import DenseExpertSet
from trellm.modules.moe import ExpertList, StackedExperts, dispatch_experts, dispatch_experts_sync_free
from trellm.ops.moe import dense_experts_matmul, exl3_experts_down, exl3_experts_gate_up
from trellm.quant.exl3.format import EXL3ExpertSet

from host_reads import HostReads


def on_cuda(test):
    """cuda-marked, skipped without a GPU, with the kernel library loaded and the CUDA ops registered."""
    test = pytest.mark.usefixtures("kernels")(test)
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test)
    return pytest.mark.cuda(test)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class DictStore:
    """A WeightStore over a dict of tensors."""

    model_dir = "<test tensors>"

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> torch.Tensor:
        return self.tensors[name]  # callers read .shape, as of a WeightStore's TensorInfo

    def get(self, name, shape=None, dtype=None, device=None):
        t = self.tensors[name]
        if shape is not None:
            assert tuple(t.shape) == tuple(shape), (name, t.shape, shape)
        return t.to(device=device, dtype=dtype or t.dtype)


def stacked_experts(e: int, h: int, i: int, device="cpu", dtype=torch.float32, bias=False, seed=0) -> StackedExperts:
    g = torch.Generator().manual_seed(seed)
    t = {
        "x.gate_up_proj": torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h),
        "x.down_proj": torch.randn(e, h, i, generator=g) / math.sqrt(i),
    }
    if bias:
        t["x.gate_up_proj_bias"] = torch.randn(e, 2 * i, generator=g) * 0.1
        t["x.down_proj_bias"] = torch.randn(e, h, generator=g) * 0.1
    experts = StackedExperts("x", e, h, i, "silu", bias=bias)
    experts.load(LoadContext(store=DictStore(t), device=torch.device(device), dtype=dtype))
    return experts


def random_exl3(k: int, n: int, bits: int, codebook: str, g: torch.Generator, device, bias: bool = False):
    from trellm.quant.exl3.format import EXL3Linear

    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * bits), generator=g, dtype=torch.int32).to(torch.int16)
    suh = (torch.randint(0, 2, (k,), generator=g) * 2 - 1).half()
    svh = (torch.rand(n, generator=g) * 0.5 + 0.5).half() / math.sqrt(k)
    b = (torch.randn(n, generator=g) * 0.1).half().to(device) if bias else None
    return EXL3Linear(trellis.to(device), suh.to(device), svh.to(device), codebook, k, n, b)


def exl3_experts(e: int, h: int, i: int, bits=4, codebook="mcg", device="cpu", activation="silu", bias=False,
                 down_bits=None, seed=0, gated=True) -> ExpertList:
    """EXL3 experts of random trellis codes; ``gated=False``: no gate, down(act(up(x))) (NemotronH)."""
    g = torch.Generator().manual_seed(seed)
    experts = ExpertList("x", e, h, i, activation=activation, gated=gated)
    for mlp in experts.experts:
        if gated:
            mlp.gate_proj.impl = random_exl3(h, i, bits, codebook, g, device, bias)
        mlp.up_proj.impl = random_exl3(h, i, bits, codebook, g, device, bias)
        mlp.down_proj.impl = random_exl3(i, h, down_bits or bits, codebook, g, device, bias)
    experts.pair_set = EXL3ExpertSet.from_experts(experts.experts, torch.device(device))
    return experts


def dense_per_expert(e: int, h: int, i: int, device="cpu", dtype=torch.float32, bias=False, seed=0,
                     gated=True) -> ExpertList:
    """Per-expert dense Linears (the layout HF checkpoints keep), loaded as a family loads them; on CUDA the load
    stacks them into a DenseExpertSet. ``gated=False``: no gate_proj, down(relu(up(x))^2) (NemotronH)."""
    g = torch.Generator().manual_seed(seed)
    t = {}
    names = (("gate_proj", (i, h)),) if gated else ()
    for x in range(e):
        for name, (n, k) in (*names, ("up_proj", (i, h)), ("down_proj", (h, i))):
            t[f"x.{x}.{name}.weight"] = torch.randn(n, k, generator=g) / math.sqrt(k)
            if bias:
                t[f"x.{x}.{name}.bias"] = torch.randn(n, generator=g) * 0.1
    experts = ExpertList("x", e, h, i, activation="silu" if gated else "relu2", gated=gated, bias=bias)
    experts.load(LoadContext(store=DictStore(t), device=torch.device(device), dtype=dtype))
    return experts


def routing(tokens: int, e: int, top_k: int, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, e, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(device), ids.to(device)


# ---- CPU: the sync-free pair path equals the grouped dispatch -------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_sync_free_stacked_matches_grouped(bias):
    experts = stacked_experts(8, 64, 32, bias=bias)
    x = torch.randn(5, 64)
    weights, ids = routing(5, 8, 3)
    ref = dispatch_experts(experts, x, weights, ids)  # CPU: the grouped path
    out = dispatch_experts_sync_free(experts, x, weights, ids)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("gated", [True, False])
def test_sync_free_exl3_matches_grouped(gated):
    experts = exl3_experts(4, 128, 256, bits=3, down_bits=2, activation="silu" if gated else "relu2", gated=gated)
    assert experts.pair_set is not None and len(experts.pair_set.gate_up_table) == (2 if gated else 1)
    x = torch.randn(3, 128)
    weights, ids = routing(3, 4, 2)
    ref = dispatch_experts(experts, x, weights, ids)
    out = dispatch_experts_sync_free(experts, x, weights, ids)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_per_expert_set_matches_grouped(bias, gated):
    """Dense per-expert Linears stacked into a DenseExpertSet (what a CUDA load makes), gated or not (NemotronH): the
    experts' weights become views of the stacks (nothing held twice), each expert computes what it did, and the
    pair path equals the grouped dispatch and reads nothing on the host (the grouped one does)."""
    experts = dense_per_expert(6, 64, 32, bias=bias, gated=gated)
    assert experts.pair_set is None  # on CPU nothing is stacked: its steps group rows by expert
    x = torch.randn(5, 64)
    weights, ids = routing(5, 6, 2)
    ref = dispatch_experts(experts, x, weights, ids)
    before = [experts.run_expert(e, x) for e in range(6)]
    inputs = ("gate_proj", "up_proj") if gated else ("up_proj",)
    nbytes = sum(getattr(m, name).impl.nbytes() for m in experts.experts for name in (*inputs, "down_proj"))
    dense = DenseExpertSet.from_experts(experts.experts)
    assert dense is not None and dense.gated == gated
    assert tuple(dense.gate_up.shape) == (6, 32 * len(inputs), 64) and tuple(dense.down.shape) == (6, 64, 32)
    for e, mlp in enumerate(experts.experts):
        for j, name in enumerate(inputs):
            assert getattr(mlp, name).impl.weight.data_ptr() == dense.gate_up[e, 32 * j:].data_ptr()
        assert torch.equal(experts.run_expert(e, x), before[e])
    assert nbytes == dense.gate_up.nbytes + dense.down.nbytes + (0 if not bias else dense.gate_up_bias.nbytes + dense.down_bias.nbytes)
    experts.pair_set = dense
    with HostReads() as reads:
        out = dispatch_experts_sync_free(experts, x, weights, ids)
    assert not reads.found, reads.found
    with HostReads() as reads:
        dispatch_experts(experts, x, weights, ids)  # on CPU: grouped, the counts read on the host
    assert any("tolist" in what for what, _ in reads.found)
    assert rel_err(out, ref) < 1e-5
    assert DenseExpertSet.from_experts(experts.experts) is None  # views already: stacking again would copy them


def test_expert_sets_refuse_experts_gated_and_not():
    """Experts some of which have a gate and some not form no pair set (dense or EXL3)."""
    dense = dense_per_expert(3, 64, 32)
    dense.experts[1] = dense_per_expert(3, 64, 32, gated=False).experts[1]
    assert DenseExpertSet.from_experts(dense.experts) is None
    exl3 = exl3_experts(3, 128, 128)
    exl3.experts[1] = exl3_experts(3, 128, 128, gated=False).experts[1]
    assert EXL3ExpertSet.from_experts(exl3.experts, torch.device("cpu")) is None


def test_sync_free_falls_back_where_it_has_no_path():
    callable_act = exl3_experts(2, 128, 128, activation=lambda g, u: g * u)
    x = torch.randn(2, 128)
    weights, ids = routing(2, 2, 1)
    assert dispatch_experts_sync_free(callable_act, x, weights, ids) is None
    mixed = exl3_experts(2, 128, 128)
    mixed.experts[1].gate_proj.impl = random_exl3(128, 128, 2, "mcg", torch.Generator().manual_seed(3), "cpu")
    assert EXL3ExpertSet.from_experts(mixed.experts, torch.device("cpu")) is None  # gate bits differ between experts


def test_dense_experts_matmul_reference_is_a_gathered_matmul():
    w = torch.randn(4, 6, 8)
    b = torch.randn(4, 6)
    x = torch.randn(3, 8)
    expert_of = torch.tensor([2, 0, 3, 3, 1, 2])
    y = dense_experts_matmul(x, expert_of, w, b, 2)
    for p, e in enumerate(expert_of.tolist()):
        assert torch.allclose(y[p], w[e] @ x[p // 2] + b[e], atol=1e-5)


# ---- CUDA: pair kernels against the references ------------------------------------------------------


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("cffi")
    from trellm.kernels_cuda import binding
    from trellm.kernels_cuda import ops as cuda_ops  # noqa: F401  (registers the implementations)

    binding.lib()
    return binding


def cuda_impl(op):
    impl = op.impls.get("cuda")
    assert impl is not None, f"{op.name} has no CUDA implementation registered"
    return impl


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("pairs_per_row", [1, 4])
@on_cuda
def test_dense_experts_matmul_cuda(dtype, bias, pairs_per_row):
    e, n, k, rows = 16, 200, 256, 5
    w = (torch.randn(e, n, k, device="cuda") / 16).to(dtype)
    b = torch.randn(e, n, device="cuda").to(dtype) if bias else None
    x = torch.randn(rows, k, device="cuda").to(dtype)
    expert_of = torch.randint(0, e, (rows * pairs_per_row,), device="cuda")
    out = cuda_impl(dense_experts_matmul)(x, expert_of, w, b, pairs_per_row)
    ref = dense_experts_matmul.reference(x.float(), expert_of, w.float(), None if b is None else b.float(), pairs_per_row)
    assert out.dtype == dtype and out.shape == (rows * pairs_per_row, n)
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


EXL3_CASES = [  # (hidden, intermediate, bits, down bits, codebook, tokens, top_k, experts, activation, bias)
    (256, 128, 4, 4, "mcg", 1, 2, 4, "silu", False),
    (512, 256, 2, 3, "3inst", 3, 4, 8, "silu", True),
    (128, 384, 8, 5, "mul1", 2, 1, 3, "gelu", False),
    (2048, 512, 4, 4, "mcg", 16, 8, 32, "silu", False),  # Qwen3.5-MoE expert shape, batch 16
    (1024, 256, 3, 6, "mcg", 7, 3, 5, "relu2", False),
]


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("case", EXL3_CASES)
@on_cuda
def test_exl3_expert_pairs_cuda(case, gated):
    """The pair kernels against the references; experts with no gate (NemotronH) take one plain launch of their up
    projections, then the activation."""
    h, i, bits, down_bits, codebook, tokens, top_k, e, act, bias = case
    experts = exl3_experts(e, h, i, bits, codebook, "cuda", act, bias, down_bits, gated=gated)
    bank = experts.pair_set
    assert bank is not None and bool(bank.gate) == gated
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(tokens, e, top_k, "cuda")
    expert_of = ids.reshape(-1)
    hidden = cuda_impl(exl3_experts_gate_up)(x, expert_of, bank, top_k, act)
    hidden_ref = exl3_experts_gate_up.reference(x.float(), expert_of, bank, top_k, act)
    assert hidden.shape == (tokens * top_k, i) and hidden.dtype == x.dtype
    assert rel_err(hidden, hidden_ref) < 1.5e-2
    out = cuda_impl(exl3_experts_down)(hidden, expert_of, bank, weights)
    out_ref = exl3_experts_down.reference(hidden.float(), expert_of, bank, weights)
    assert out.shape == (tokens, h)
    assert rel_err(out, out_ref) < 1.5e-2


@pytest.mark.parametrize("case", [EXL3_CASES[2], (2048, 512, 4, 4, "mul1", 16, 8, 32, "silu", False)])
@on_cuda
def test_exl3_expert_pairs_mul1_split_route(case, monkeypatch):
    # TRELLM_MUL1_GEMV=split: the pair kernels decode MUL1 into split-halves operands and add the codebook's
    # offset from each slice's sum of x. Held against the reference, and not bit-equal to the default route
    # (whose weights are rounded to fp16), which would mean the route was not taken.
    from trellm.ops.exl3 import MUL1_GEMV_ENV

    h, i, bits, down_bits, codebook, tokens, top_k, e, act, bias = case
    bank = exl3_experts(e, h, i, bits, codebook, "cuda", act, bias, down_bits).pair_set
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(tokens, e, top_k, "cuda")
    expert_of = ids.reshape(-1)
    results = {}
    for route in ("fma", "split"):
        monkeypatch.setenv(MUL1_GEMV_ENV, route)
        hidden = cuda_impl(exl3_experts_gate_up)(x, expert_of, bank, top_k, act)
        results[route] = (hidden, cuda_impl(exl3_experts_down)(hidden, expert_of, bank, weights))
    hidden, out = results["split"]
    assert rel_err(hidden, exl3_experts_gate_up.reference(x.float(), expert_of, bank, top_k, act)) < 1.5e-2
    assert rel_err(out, exl3_experts_down.reference(hidden.float(), expert_of, bank, weights)) < 1.5e-2
    assert not torch.equal(hidden, results["fma"][0])
    assert rel_err(hidden, results["fma"][0]) < 1e-2


@pytest.mark.parametrize("layout", ["exl3", "stacked", "dense_per_expert", "exl3_ungated", "dense_ungated"])
@on_cuda
def test_moe_dispatch_sync_free_in_cuda_graph(layout):
    """dispatch_experts on CUDA takes the pair path, captures in a graph and replays with new routing; experts with
    no gate (NemotronH's relu^2 ones, "_ungated") too."""
    e, h, i, tokens, top_k = 16, 256, 128, 4, 4
    if layout.startswith("exl3"):
        experts = exl3_experts(e, h, i, device="cuda", activation="relu2", gated=False) if layout == "exl3_ungated" \
            else exl3_experts(e, h, i, device="cuda")
    elif layout == "stacked":
        experts = stacked_experts(e, h, i, "cuda", torch.bfloat16)
    else:
        experts = dense_per_expert(e, h, i, "cuda", torch.bfloat16, gated=layout == "dense_per_expert")
        assert isinstance(experts.pair_set, DenseExpertSet)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(tokens, e, top_k, "cuda", seed=5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        dispatch_experts(experts, x, weights, ids)  # warm-up (kernel library, tables)
        with torch.cuda.graph(graph, stream=stream):
            out = dispatch_experts(experts, x, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (6, 7):
        new_w, new_ids = routing(tokens, e, top_k, "cuda", seed=seed)
        x.copy_(torch.randn_like(x))
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        grouped = x.new_zeros(x.shape).float()
        for t in range(tokens):  # the per-expert Linears, one pair at a time
            for j in range(top_k):
                grouped[t] += weights[t, j] * experts.run_expert(int(ids[t, j]), x[t : t + 1])[0].float()
        assert rel_err(out, grouped) < 2e-2


# ---- CUDA: gated delta net decode kernels -----------------------------------------------------------


@pytest.mark.parametrize("dk,dv", [(128, 128), (64, 96), (256, 64)])
@pytest.mark.parametrize("v_dtype", [torch.bfloat16, torch.float32])
@on_cuda
def test_gated_delta_rule_step_cuda(dk, dv, v_dtype):
    from trellm.ops.deltanet import gated_delta_rule_step

    b, h = 3, 8
    q = torch.nn.functional.normalize(torch.randn(b, h, dk, device="cuda"), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, h, dk, device="cuda"), dim=-1)
    v = torch.randn(b, h, dv, device="cuda").to(v_dtype)
    g = -torch.rand(b, h, device="cuda")
    beta = torch.rand(b, h, device="cuda")
    state = torch.randn(b, h, dk, dv, device="cuda") * 0.3
    out, new_state = cuda_impl(gated_delta_rule_step)(q, k, v, g, beta, state)
    ref_out, ref_state = gated_delta_rule_step.reference(q, k, v.float(), g, beta, state)
    assert out.dtype == v_dtype and new_state.dtype == torch.float32
    assert rel_err(new_state, ref_state) < 1e-5
    assert rel_err(out, ref_out) < (1e-2 if v_dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
@on_cuda
def test_causal_conv1d_step_cuda(dtype, bias, activation):
    from trellm.ops.deltanet import causal_conv1d_step

    b, c, width = 3, 1000, 4
    x = torch.randn(b, c, device="cuda").to(dtype)
    w = torch.randn(c, width, device="cuda").to(dtype)
    bb = torch.randn(c, device="cuda").to(dtype) if bias else None
    states = torch.randn(b, c, width - 1, device="cuda").to(dtype)
    out, new_states = cuda_impl(causal_conv1d_step)(x, w, bb, states, activation)
    ref_out, ref_states = causal_conv1d_step.reference(x.float(), w.float(), None if bb is None else bb.float(),
                                                       states.float(), activation)
    assert out.dtype == dtype and new_states.dtype == dtype
    assert torch.equal(new_states.float(), ref_states)  # a shift: exact
    assert rel_err(out, ref_out) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


# ---- gated delta net decode on the cache's slots (in place) ----------------------------------------------


def slot_inputs(device, v_dtype=torch.bfloat16, b=3, h=4, dk=64, dv=64, slots_total=6, conv_c=96, width=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)
    q = torch.nn.functional.normalize(r(b, h, dk), dim=-1)
    k = torch.nn.functional.normalize(r(b, h, dk), dim=-1)
    t = dict(
        q=q, k=k, v=r(b, h, dv).to(v_dtype), g=-torch.rand(b, h, generator=g), beta=torch.rand(b, h, generator=g),
        states=r(slots_total, h, dk, dv) * 0.3, x=r(b, conv_c).to(v_dtype), w=r(conv_c, width).to(v_dtype),
        conv_states=r(slots_total, conv_c, width - 1).to(v_dtype),
        slots=torch.tensor([4, 1, 3]), fresh=torch.tensor([False, True, False]),
    )
    return {n: x.to(device) for n, x in t.items()}


def test_slot_step_references_update_only_their_slots():
    from trellm.ops.deltanet import causal_conv1d_step, causal_conv1d_step_slots, gated_delta_rule_step, gated_delta_rule_step_slots

    t = slot_inputs("cpu", torch.float32)
    states, conv = t["states"].clone(), t["conv_states"].clone()
    out = gated_delta_rule_step_slots(t["q"], t["k"], t["v"], t["g"], t["beta"], states, t["slots"], t["fresh"])
    start = t["states"][t["slots"]] * (~t["fresh"]).float().view(-1, 1, 1, 1)
    ref_out, ref_state = gated_delta_rule_step(t["q"], t["k"], t["v"], t["g"], t["beta"], start)
    assert torch.allclose(out, ref_out) and torch.allclose(states[t["slots"]], ref_state)
    untouched = [0, 2, 5]
    assert torch.equal(states[untouched], t["states"][untouched])
    y = causal_conv1d_step_slots(t["x"], t["w"], None, conv, t["slots"], t["fresh"])
    window = t["conv_states"][t["slots"]] * (~t["fresh"]).float().view(-1, 1, 1)
    ref_y, ref_conv = causal_conv1d_step(t["x"], t["w"], None, window)
    assert torch.allclose(y, ref_y) and torch.equal(conv[t["slots"]], ref_conv)
    assert torch.equal(conv[untouched], t["conv_states"][untouched])


@pytest.mark.parametrize("with_fresh", [False, True])
@pytest.mark.parametrize("dk", [64, 128])
@on_cuda
def test_slot_steps_cuda(with_fresh, dk):
    from trellm.ops.deltanet import causal_conv1d_step_slots, gated_delta_rule_step_slots

    t = slot_inputs("cuda", dk=dk, dv=96)
    fresh = t["fresh"] if with_fresh else None
    states, ref_states = t["states"].clone(), t["states"].clone()
    out = cuda_impl(gated_delta_rule_step_slots)(t["q"], t["k"], t["v"], t["g"], t["beta"], states, t["slots"], fresh)
    ref = gated_delta_rule_step_slots.reference(t["q"], t["k"], t["v"].float(), t["g"], t["beta"], ref_states, t["slots"], fresh)
    assert rel_err(states, ref_states) < 1e-5
    assert rel_err(out, ref) < 1e-2
    conv, ref_conv = t["conv_states"].clone(), t["conv_states"].clone()
    bias = torch.randn(t["x"].shape[1], device="cuda").to(t["x"].dtype)
    y = cuda_impl(causal_conv1d_step_slots)(t["x"], t["w"], bias, conv, t["slots"], fresh)
    ref_y = causal_conv1d_step_slots.reference(t["x"].float(), t["w"].float(), bias.float(), ref_conv, t["slots"], fresh)
    assert torch.equal(conv, ref_conv)  # a shift of bf16 values: exact
    assert rel_err(y, ref_y) < 1e-2


# ---- router -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("experts,k,normalize,dtype", [(256, 8, True, torch.bfloat16), (60, 4, False, torch.float32),
                                                       (1024, 2, True, torch.float16), (8, 8, True, torch.float32)])
@on_cuda
def test_softmax_topk_cuda(experts, k, normalize, dtype):
    from trellm.ops.moe import softmax_topk

    logits = (torch.randn(37, experts, device="cuda") * 3).to(dtype)
    weights, ids = cuda_impl(softmax_topk)(logits, k, normalize)
    ref_w, ref_ids = softmax_topk.reference(logits, k, normalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert all(len(set(row)) == k for row in ids.tolist())
    chosen = torch.softmax(logits.float(), -1).gather(1, ids)  # tie order may differ from torch.topk's
    if normalize:
        chosen = chosen / chosen.sum(-1, keepdim=True)
    assert rel_err(chosen, ref_w) < 1e-5
    assert rel_err(weights, ref_w) < 1e-5
