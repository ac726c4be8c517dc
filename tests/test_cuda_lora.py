"""LoRA on the GPU: the per-row kernels (both routes of ``TRELLM_LORA_KERNEL``: one fused launch, or the split
shrink -> expand pair) against their reference, under graph capture, and whole models (dense and EXL3) with
several adapters in one batch against their references. GPU only."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


ROUTES = ["fused", "split"]


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch):
    """Each kernel route of the update in turn (``TRELLM_LORA_KERNEL``)."""
    from trellm.ops.lora import LORA_KERNEL_ENV

    monkeypatch.setenv(LORA_KERNEL_ENV, request.param)
    return request.param


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _case(rows, k, n, num_slots, rank, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
    a = (torch.randn(num_slots * rank, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, num_slots * rank, device="cuda", generator=g).to(dtype)
    y = torch.randn(rows, n, device="cuda", generator=g).to(dtype)
    slots = torch.randint(-1, num_slots, (rows,), device="cuda", generator=g)
    return y, x, a, b, slots


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,k,n,num_slots,rank", [
    (1, 128, 256, 1, 8), (8, 4096, 4096, 4, 16), (37, 1024, 14336, 2, 64), (300, 4096, 1024, 3, 16), (5, 384, 200, 2, 256),
    (1, 14336, 4096, 2, 16), (3, 520, 300, 2, 5), (2, 130, 70, 3, 24),  # long k; a rank not in whole 16-byte groups; odd k
    (8, 14336, 4096, 4, 16), (4, 4104, 600, 3, 20), (6, 700, 515, 2, 17), (2, 8, 40, 2, 3),  # split: partial last k-slice, odd n
])
def test_lora_add_kernel_matches_reference(ops, route, dtype, rows, k, n, num_slots, rank):
    y, x, a, b, slots = _case(rows, k, n, num_slots, rank, dtype)
    want = ops.lora_add.reference(y.clone().float(), x.float(), a.float(), b.float(), slots, rank)
    got = ops.lora_add.impls["cuda"](y.clone(), x, a, b, slots, rank)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    untouched = slots < 0
    assert torch.equal(got[untouched], y[untouched])  # rows on the base are left exactly as they were
    before = y.clone()
    out = ops.lora_add.impls["cuda"](y, x, a, b, slots, rank, out=torch.full_like(y, float("nan")))
    assert torch.equal(y, before) and torch.equal(out, got)  # out of place: y kept, every row of out written


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,ns,rank", [(1, (4096, 1024, 1024), 16), (8, (14336, 14336), 16), (33, (256, 100, 3000, 8), 64)])
@pytest.mark.parametrize("k", [2048, 14336, 1030])
def test_lora_add_parts_one_launch_matches_each_part_alone(ops, route, dtype, rows, ns, rank, k):
    """q/k/v (or gate/up) updates in one call (one launch, or the split pair) equal each part's own lora_add
    reference, strided outputs included; long and odd k."""
    num_slots = 3
    cases = [_case(rows, k, n, num_slots, rank, dtype, seed=p) for p, n in enumerate(ns)]
    x, slots = cases[0][1], cases[0][4]
    wide = torch.zeros(rows, sum(ns) + 64, dtype=dtype, device="cuda")  # parts as column views of one buffer
    ys, edge = [], 32
    for (y, *_), n in zip(cases, ns):
        wide[:, edge:edge + n] = y
        ys.append(wide[:, edge:edge + n])
        edge += n
    ops.lora_add_parts.impls["cuda"](ys, x, [c[2] for c in cases], [c[3] for c in cases], slots, rank)
    for got, (y, _, a, b, _) in zip(ys, cases):
        want = ops.lora_add.reference(y.clone().float(), x.float(), a.float(), b.float(), slots, rank)
        assert rel_err(got, want) < 1e-2
        assert torch.equal(got[slots < 0], y[slots < 0])
    assert not wide[:, :32].any() and not wide[:, edge:].any()  # nothing written outside the parts


def test_lora_add_kernel_strided_rows_and_bad_arguments(ops, kb, route):
    y, x, a, b, slots = _case(6, 256, 512, 2, 8, torch.float16)
    wide = torch.zeros(6, 1024, dtype=torch.float16, device="cuda")
    wide[:, 100:612] = y
    view = wide[:, 100:612]
    ops.lora_add.impls["cuda"](view, x, a, b, slots, 8)
    want = ops.lora_add.reference(y.clone().float(), x.float(), a.float(), b.float(), slots, 8)
    assert rel_err(wide[:, 100:612], want) < 1e-2 and not wide[:, :100].any()
    with pytest.raises(kb.KernelArgumentError, match="rank 300"):
        kb.lora_add(y, x, torch.zeros(600, 256, dtype=torch.float16, device="cuda"),
                    torch.zeros(512, 600, dtype=torch.float16, device="cuda"), slots, 300)
    with pytest.raises(kb.KernelArgumentError, match="slots"):
        kb.lora_add(y, x, a, b, slots.int(), 8)
    with pytest.raises(kb.KernelArgumentError, match="slots"):
        kb.lora_add_split([y], x, [a], [b], slots.int(), 8)
    with pytest.raises(kb.KernelArgumentError, match=r"outs\[0\]"):
        kb.lora_add_split([y], x, [a], [b], slots, 8, outs=[torch.empty(6, 511, dtype=torch.float16, device="cuda")])


def test_lora_add_replays_in_a_cuda_graph_with_new_slots(ops, route):
    y0, x, a, b, slots = _case(8, 1024, 2048, 4, 16, torch.bfloat16)
    y = y0.clone()
    impl = ops.lora_add.impls["cuda"]
    impl(y, x, a, b, slots, 16)  # warm-up (library load)
    graph = torch.cuda.CUDAGraph()
    y.copy_(y0)
    with torch.cuda.graph(graph):
        impl(y, x, a, b, slots, 16)
    for seed in range(3):
        slots.copy_(torch.randint(-1, 4, (8,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        y.copy_(y0)
        graph.replay()
        want = ops.lora_add.reference(y0.clone().float(), x.float(), a.float(), b.float(), slots, 16)
        assert rel_err(y, want) < 1e-2


def test_lora_updates_chained_in_a_graph_read_what_the_kernel_before_wrote(ops, route):
    """A decode layer's order in one captured graph: each update reads the x the op before it wrote and adds to
    the y it wrote, and the next op reads its result (the split route's launches start early: programmatic
    dependent launch). Every replay, with new slots and new inputs, equals the reference chain."""
    rows, k, rank, num_slots = 8, 4096, 16, 3
    g = torch.Generator(device="cuda").manual_seed(5)
    dtype = torch.float16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    a1, b1 = rand(num_slots * rank, k, scale=k ** -0.5), rand(14336, num_slots * rank)
    a2, b2 = rand(num_slots * rank, 14336, scale=14336 ** -0.5), rand(k, num_slots * rank)
    w1, w2 = rand(14336, k, scale=k ** -0.5), rand(k, 14336, scale=14336 ** -0.5)
    x0, slots = torch.empty(rows, k, dtype=dtype, device="cuda"), torch.empty(rows, dtype=torch.int64, device="cuda")

    def chain(x0, slots, lora_add, lora_add_parts):
        x = x0 * 2  # the op before writes x
        up = x @ w1.t()  # the base matmul writes y
        lora_add_parts([up], x, [a1], [b1], slots, rank)
        h = torch.nn.functional.silu(up)  # reads the update's result
        down = h @ w2.t()
        return lora_add(down, h, a2, b2, slots, rank, out=torch.empty_like(down)) + 1  # out of place, then read

    impls = (ops.lora_add.impls["cuda"], ops.lora_add_parts.impls["cuda"])
    x0.copy_(rand(rows, k))
    slots.copy_(torch.arange(rows, device="cuda") % (num_slots + 1) - 1)
    chain(x0, slots, *impls)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(x0, slots, *impls)
    for seed in range(3):
        x0.copy_(rand(rows, k))
        slots.copy_(torch.randint(-1, num_slots, (rows,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        want = chain(x0, slots, ops.lora_add.reference, ops.lora_add_parts.reference)
        assert rel_err(got, want) < 2e-2


def test_lora_kernel_route_reaches_its_kernels(ops, kb, monkeypatch):
    """``TRELLM_LORA_KERNEL`` picks the launches of both ops (fused: one; split: the shrink -> expand pair), and a
    bad value is refused naming the variable."""
    from trellm.ops.lora import LORA_KERNEL_ENV

    calls = []
    for name in ("lora_add", "lora_add_parts", "lora_add_split"):
        real = getattr(kb, name)
        monkeypatch.setattr(kb, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    y, x, a, b, slots = _case(2, 256, 512, 2, 8, torch.float16)
    for route, want in (("fused", ["lora_add", "lora_add_parts"]), ("split", ["lora_add_split", "lora_add_split"])):
        monkeypatch.setenv(LORA_KERNEL_ENV, route)
        calls.clear()
        ops.lora_add(y.clone(), x, a, b, slots, 8)
        ops.lora_add_parts([y.clone()], x, [a], [b], slots, 8)
        assert calls == want, route
    monkeypatch.setenv(LORA_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="TRELLM_LORA_KERNEL='fast'"):
        ops.lora_add(y.clone(), x, a, b, slots, 8)


# ---- whole models on the GPU -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_lora import ALL_TARGETS, make_peft_adapter, make_tiny_llama

    root = tmp_path_factory.mktemp("cuda_lora")
    base = make_tiny_llama(root / "base", heads=2, kv_heads=1)  # head_dim 64: graph-capturable attention
    a = make_peft_adapter(base, root / "all", r=8, alpha=16, targets=ALL_TARGETS, seed=1)
    b = make_peft_adapter(base, root / "rs", r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], rslora=True, seed=2)
    return root, base, a, b


@pytest.fixture(scope="module")
def exl3_dir(tiny):
    from trellm.convert import convert

    root, base, _, _ = tiny
    convert(base, root / "q4", root / "work", 4.0, device="cpu", progress=False, cal_rows=8, cal_cols=64, head_bits=6)
    return root / "q4"


@pytest.mark.parametrize("fmt", ["dense", "exl3"])
def test_generator_mixing_adapters_under_graphs_matches_each_alone_and_the_reference(ops, route, tiny, exl3_dir, fmt):
    """Decode steps run as captured CUDA graphs (every route: GEMV / fused adds on EXL3) with rows on two
    adapters and on none; each job equals its run alone, and the merged-weights reference on the GPU."""
    import trellm
    from test_lora import assert_close, merged_reference
    from trellm.generator import Generator, Job

    _, base, a, b = tiny
    model_dir = base if fmt == "dense" else exl3_dir
    load = dict(device="cuda", dtype=torch.float16)
    lm = trellm.load(model_dir, tokenizer=False, **load)
    lm.load_lora(a, name="all")
    lm.load_lora(b, name="rs")
    if fmt == "exl3":  # adapters on q/k/v: the base parts still run as one EXL3 group launch
        assert type(lm.model.layers[0].attn.qkv.weights().base).__name__ == "EXL3Group"
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    for name, path in (("all", a), ("rs", b)):
        ref = merged_reference(model_dir, {path: 1.0}, **load)
        assert_close(lm.logits(ids, lora=name), ref.logits(ids), tol=2e-2)
    prompts = [ids[0, :12].tolist(), ids[1, :9].tolist(), ids[0, :12].tolist(), ids[1, :15].tolist()]
    choices = ["all", None, "rs", "all"]
    alone = []
    for p, name in zip(prompts, choices):
        gen = Generator(lm, max_batch_size=4, cache_tokens=1024, page_size=16)
        alone.append(gen.generate(p, max_new_tokens=8, return_results=True, lora=name, stop_token_ids=[]).token_ids)
    gen = Generator(lm, max_batch_size=4, cache_tokens=1024, page_size=16)
    assert gen.graph_runner is not None
    jobs = [Job(p, 8, lora=n, stop_token_ids=[], identifier=i) for i, (p, n) in enumerate(zip(prompts, choices))]
    gen.enqueue(jobs)
    done = {r.identifier: r.token_ids for r in gen.stream() if type(r).__name__ == "JobFinished"}
    assert [done[i] for i in range(4)] == alone
    assert gen.graph_runner.graphs, "decode steps ran eagerly: the graphs were not captured"
