"""The DSA lightning indexer's top-k (``trellm.ops.sparse.sparse_index_topk``: GLM 5, DeepSeek V4) without host reads.

A decode step or a draft verification scores every token against the whole width of its sequence's block-table row
(``index_logits``, or kernels_cuda/indexer.cu where ``TRELLM_SPARSE_INDEX=kernel``), masks what it cannot see with
-inf and keeps the top k (``top_visible``); a large prefill loops over the sequences (``index_topk_by_sequence``).

CPU tests: the device route against the loop (several sequences of different lengths, rate 1 and 4, sequences
with no key or fewer keys than k, a multi-token query mid-sequence, ties; exact on integer-valued inputs), no host
read (the route runs on meta tensors, where the loop cannot), the route knob and the CUDA registration against a
stub library, a tiny GLM 5 decoding alike on both routes, and GLM 5 / GLM 5.3 steps (decode, n-gram verification)
through the GraphRunner's static buffers (in bf16, the runner's verification and the eager generator's agree up to
a near tie of GLM 5.3's logits, where their rounding may choose apart), and no host read in the steps of every size
those graphs capture (tests/host_reads.py). CUDA tests (skipped without a GPU): the
kernel's logits against ``index_logits`` (f16/bf16 queries, keys of their dtype or float32, 8..64 heads, 32..128
dims, strided key rows), its selection against the reference, the route captured in a CUDA graph and replayed over
new inputs, and a tiny GLM 5 and GLM 5.3 whose decode and verification steps capture in the Generator's graphs on
both routes.
"""
from __future__ import annotations

import pytest
import torch

from host_reads import HostReads
from test_cuda_kda import declared_arguments
from test_cuda_moe import kernels, on_cuda, rel_err  # noqa: F401  (kernels: a fixture)
from test_projection_routes import stub_kernels  # noqa: F401  (a fixture)
from trellm.ops import sparse
from trellm.ops.sparse import (
    SPARSE_INDEX_ENV, index_logits, index_topk_by_sequence, sparse_index_route, sparse_index_topk, top_visible,
)


def index_inputs(device="cpu", dtype=torch.float32, heads=8, dim=32, page_size=4, contexts=(37, 9, 0, 3, 20),
                 new=(5, 1, 0, 1, 2), rate=1, integer=False, row_pad=0, spare_pages=3, short_last=3, seed=0) -> dict:
    """The arguments of :func:`sparse_index_topk` (less topk) for sequences of ``contexts`` tokens whose last
    ``new[b]`` are this step's queries; ``contexts[b] // rate`` keys each (the last sequence ``short_last`` fewer, so
    that its count, not its queries' positions, bounds what they see), on scattered pages of a table wider than any
    sequence needs, its unused entries out of range (read one and the test fails). ``integer``: small integers
    and a power-of-two scale, so every route's float32 sums are exact and equal scores tie exactly.
    ``row_pad``: each key row sits in a wider row (strided pages, as a cache's extra rows)."""
    g = torch.Generator().manual_seed(seed)
    counts = [c // rate for c in contexts]
    counts[-1] = max(counts[-1] - short_last, 0)
    pages_of = [-(-n // page_size) for n in counts]
    width_pages = max(pages_of) + spare_pages
    num_pages = sum(pages_of) + 4

    def values(*shape):
        if integer:
            return torch.randint(-2, 3, shape, generator=g).float()
        return torch.randn(*shape, generator=g)

    rows = values(num_pages, page_size, dim + row_pad)
    key_pages = rows.to(dtype)[..., :dim]
    table = torch.full((len(contexts), width_pages), 10**6, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=g)
    used = 0
    for b, n in enumerate(pages_of):
        table[b, :n] = order[used: used + n]
        used += n
        table[b, n + 1:] = -1  # out of range the other way
    positions = [p for c, m in zip(contexts, new) for p in range(c - m, c)]
    t = len(positions)
    weights = values(t, heads) * (0.5 if integer else 1.0)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    args = dict(q=values(t, heads, dim).to(dtype), weights=weights, key_pages=key_pages, block_table=table,
                cu_seqlens=cu, key_counts=torch.tensor(counts, dtype=torch.int32),
                positions=torch.tensor(positions, dtype=torch.long), scale=0.25 if integer else dim**-0.5, rate=rate)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def device_route(a: dict, topk: int) -> torch.Tensor:
    logits = index_logits(a["q"], a["weights"], a["key_pages"], a["block_table"], a["cu_seqlens"], a["key_counts"],
                          a["positions"], a["scale"], a["rate"])
    return top_visible(logits, topk)


def loop_route(a: dict, topk: int) -> torch.Tensor:
    return index_topk_by_sequence(a["q"], a["weights"], a["key_pages"], a["block_table"], a["cu_seqlens"],
                                  a["key_counts"], a["positions"], topk, a["scale"], a["rate"])


def as_sets(chosen: torch.Tensor) -> torch.Tensor:
    """Each row's indices sorted (the consumers use them as a set)."""
    return chosen.sort(dim=-1).values


@pytest.mark.parametrize("rate", [1, 4])
@pytest.mark.parametrize("topk", [1, 6, 40])
@pytest.mark.parametrize("integer", [True, False])
def test_device_route_keeps_the_loops_keys(rate, topk, integer):
    """Five sequences (37 and 20 tokens with 5 and 2 new ones, a prefill-like query mid-sequence; 9 and 3 with one;
    an empty one), rate 1 and 4 (the 3-token sequence has no key at rate 4, the 9-token one fewer than k): the same
    keys as the loop, which also finds each query's visible keys as the contract says."""
    a = index_inputs(rate=rate, integer=integer, seed=rate + topk)
    device, loop = device_route(a, topk), loop_route(a, topk)
    assert device.shape == loop.shape == (a["q"].shape[0], topk) and device.dtype == torch.long
    assert torch.equal(as_sets(device), as_sets(loop))
    for t, pos in enumerate(a["positions"].tolist()):
        b = int(torch.searchsorted(a["cu_seqlens"][1:], t, right=True))
        visible = min((pos + 1) // rate, int(a["key_counts"][b]))
        row = loop[t].tolist()
        assert sorted(row)[: topk - min(topk, visible)] == [-1] * (topk - min(topk, visible))
        assert all(0 <= s < visible for s in row if s >= 0) and len({s for s in row if s >= 0}) == min(topk, visible)


def test_device_route_on_half_precision_and_strided_key_rows():
    """bf16 queries and keys, each key row inside a wider cache row: the same keys as the loop."""
    a = index_inputs(dtype=torch.bfloat16, heads=16, dim=64, row_pad=64, seed=3)
    assert a["key_pages"].stride(1) == 128
    assert torch.equal(as_sets(device_route(a, 8)), as_sets(loop_route(a, 8)))


def test_ties_go_to_the_earlier_key_on_both_routes():
    """Identical keys (every score equal): both routes keep the earliest visible keys; a score of -0.0 (negative
    head weights times relu's zeros) ties with 0.0."""
    a = index_inputs(contexts=(30, 7), new=(2, 1), integer=True, short_last=0)
    a["key_pages"] = torch.ones_like(a["key_pages"])
    want = [[0, 1, 2, 3, 4]] * 3
    assert as_sets(device_route(a, 5)).tolist() == as_sets(loop_route(a, 5)).tolist() == want
    tied = torch.tensor([[0.0, -0.0, float("-inf"), -0.0, 0.0, -1.0, 2.0], [-1.0, -2.0, -0.5, float("-inf"), -1.0, -1.0, 0.0]])
    assert as_sets(top_visible(tied, 4)).tolist() == [[0, 1, 3, 6], [0, 2, 4, 6]]
    assert as_sets(top_visible(tied, 8)).tolist() == [[-1, -1, 0, 1, 3, 4, 5, 6], [-1, -1, 0, 1, 2, 4, 5, 6]]


def test_the_device_route_reads_nothing_on_the_host():
    """On meta tensors (no data: any host read raises) the device route gives [T, topk]; the loop cannot run there."""
    a = index_inputs(device="meta")
    assert sparse_index_topk(**{**a, "topk": 6}).shape == (a["q"].shape[0], 6)
    with pytest.raises(Exception):
        loop_route(a, 6)


def test_the_reference_loops_past_its_gather_bound(monkeypatch):
    """Up to INDEX_GATHER_MAX_PAIRS (token, key slot) pairs the op runs the device route, past it the loop; alike."""
    a = index_inputs(seed=5)
    calls = []
    for name in ("index_logits", "index_topk_by_sequence"):
        monkeypatch.setattr(sparse, name, lambda *x, _f=getattr(sparse, name), _n=name, **k: calls.append(_n) or _f(*x, **k))
    small = sparse_index_topk(**a, topk=6)
    monkeypatch.setattr(sparse, "INDEX_GATHER_MAX_PAIRS", a["q"].shape[0] * a["block_table"].shape[1] * 4 - 1)
    large = sparse_index_topk(**a, topk=6)
    assert calls == ["index_logits", "index_topk_by_sequence"]
    assert torch.equal(as_sets(small), as_sets(large))


def test_sparse_index_route(monkeypatch):
    monkeypatch.delenv(SPARSE_INDEX_ENV, raising=False)
    assert sparse_index_route() == "kernel"  # measured faster on the H200 (bench_indexer.py)
    monkeypatch.setenv(SPARSE_INDEX_ENV, "reference")
    assert sparse_index_route() == "reference"
    monkeypatch.setenv(SPARSE_INDEX_ENV, "fused")
    with pytest.raises(ValueError, match="TRELLM_SPARSE_INDEX='fused'"):
        sparse_index_route()


def test_sparse_index_route_reaches_the_kernel(stub_kernels, monkeypatch):
    """On CPU tensors against a stub kernel library: the reference route launches nothing; "kernel" reaches the entry
    point with the header's argument count, the sizes and strides (a key row inside a wider row), scale and rate, for
    bf16 and float32 keys; fp32 queries, 16-dim heads and a prefill past INDEX_KERNEL_MAX_TOKENS keep the
    reference."""
    from trellm.kernels_cuda import ops as cuda_ops

    a = index_inputs(dtype=torch.bfloat16, heads=8, dim=64, row_pad=32, rate=4)
    monkeypatch.setenv(SPARSE_INDEX_ENV, "reference")
    sparse_index_topk(**a, topk=6)
    assert stub_kernels == []
    monkeypatch.setenv(SPARSE_INDEX_ENV, "kernel")
    assert sparse_index_topk(**a, topk=6).shape == (9, 6)
    sparse_index_topk(**{**a, "key_pages": a["key_pages"].float()}, topk=6)  # GLM 5.3's float32 pooled keys
    sparse_index_topk(**{**a, "q": a["q"].float(), "key_pages": a["key_pages"].float()}, topk=6)
    sparse_index_topk(**index_inputs(dtype=torch.bfloat16, dim=16), topk=6)
    monkeypatch.setattr(cuda_ops, "INDEX_KERNEL_MAX_TOKENS", 8)
    sparse_index_topk(**a, topk=6)
    assert [name for name, _ in stub_kernels] == ["sparse_index_logits"] * 2
    for (_, args), key_dtype, strides in zip(stub_kernels, (1, 2), ((4 * 96, 96), (4 * 64, 64))):
        assert len(args) == declared_arguments("sparse_index_logits")
        assert (args[1], args[4]) == (1, key_dtype)  # bf16 queries; bf16, then float32 keys
        assert args[10:20] == [9, 8, 64, 5, 4, *strides, a["block_table"].shape[1], 64**-0.5, 4]


def decode_logits(model, prompts, steps: int = 3) -> torch.Tensor:
    """Logits [steps, B, vocab] of ``steps`` decode steps (fixed tokens) after a prefill of ``prompts``, through the
    paged cache."""
    from trellm.batch import ForwardBatch
    from trellm.cache import KVCache

    cache = KVCache.for_model(model, max_tokens=64 * len(prompts), page_size=16)
    pages = [cache.allocator.alloc(4) for _ in prompts]
    lengths, logits = [0] * len(prompts), []
    with torch.inference_mode():
        for tokens in [[list(p) for p in prompts]] + [[[10 + i + b] for b in range(len(prompts))] for i in range(steps)]:
            logits.append(model.forward(ForwardBatch.with_cache(tokens, lengths, pages, cache)).float())
            lengths = [n + len(t) for n, t in zip(lengths, tokens)]
    return torch.stack(logits[1:])


def test_tiny_glm5_decodes_alike_through_both_routes(monkeypatch):
    """A tiny GLM 5 (DSA indexer over the paged cache) decoding two sequences: the device route (the default at this
    size) and the loop give the same logits at every step, and the decode steps took the device route."""
    model = tiny_glm_dsa("cpu", torch.float32).model
    prompts = ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10), (5, 6, 7))
    calls = []
    monkeypatch.setattr(sparse, "index_logits", lambda *x, _f=sparse.index_logits: calls.append(x[0].shape[0]) or _f(*x))
    device = decode_logits(model, prompts)
    assert calls.count(2) == 2 * 3  # two indexer layers, three decode steps of two tokens
    monkeypatch.setattr(sparse, "INDEX_GATHER_MAX_PAIRS", 0)
    loop = decode_logits(model, prompts)
    assert rel_err(device, loop) < 1e-5


def tiny_prompts(repeating: bool) -> list[list[int]]:
    """Three prompts of 23, 9 and 40 tokens; ``repeating``: each its first 5 tokens over and over, so that the
    n-gram proposer finds drafts."""
    prompts = [[(7 * i + j) % 96 for j in range(n)] for i, n in enumerate((23, 9, 40))]
    return [(p[:5] * 8)[:len(p)] for p in prompts] if repeating else prompts


def generate_tokens(model, prompts, drafts: int, cuda_graphs: bool = False, eager_graphs: bool = False,
                    host_reads: HostReads | None = None):
    """(the Generator, its 12 greedy tokens per prompt), n-gram drafting ``drafts`` tokens (0: none); ``eager_graphs``:
    through a GraphRunner replaying eager stand-ins for its graphs (tests/test_graph_hybrid.py), which runs on CPU,
    each graph's steps under ``host_reads`` (when given) once a first run has warmed it up, as a capture follows
    its warm-up runs."""
    from test_graph_hybrid import EagerGraphs
    from trellm.generator import Generator, Job, NgramProposer

    class AuditedGraphs(EagerGraphs):
        def _record(self, run):
            run()  # the warm-up: what a step builds once (tables, caches) exists before the capture

            def audited():
                with host_reads:
                    return run()
            return super()._record(audited)

    gen = Generator(model, max_batch_size=4, cache_tokens=512, page_size=16, cuda_graphs=cuda_graphs,
                    proposer=NgramProposer(num_tokens=drafts) if drafts else None, num_draft_tokens=max(drafts, 1))
    if eager_graphs:
        runner = EagerGraphs if host_reads is None else AuditedGraphs
        gen.graph_runner = runner(gen.model, gen.cache, batch_sizes=(1, 2, 4), max_context=gen.cache.capacity_tokens,
                                  max_width=1 + drafts)
    with torch.inference_mode():
        gen.enqueue([Job(p, 12, identifier=i, stop_token_ids=[]) for i, p in enumerate(prompts)])
        done = {r.identifier: r.token_ids for r in gen.stream() if type(r).__name__ == "JobFinished"}
    return gen, [done[i] for i in range(len(prompts))]


# How far below the best logit a token may lie and still be a near tie that rounding decides: 16 bf16 units in the
# last place at these tiny models' best logits (2 to 4). Two bf16 routes through the same model (the eager generator
# verifies drafts with the chunked recurrence, a captured graph token by token as decoding does) round differently,
# and tiny GLM 5.3's random weights put three tokens within 0.07 of each other at one step of its first prompt.
NEAR_TIE = 0.25


def assert_greedy_alike(model, prompts, got: list[list[int]], want: list[list[int]], device="cpu", tie: float = NEAR_TIE):
    """Each prompt's greedy tokens ``got`` equal ``want`` up to their first difference, and there both tokens lie within
    ``tie`` of the best logit of a cacheless forward over the common prefix: a near tie that two routes' rounding
    decided apart. Past it the runs continue from different tokens, so nothing after it is compared."""
    from trellm.batch import ForwardBatch

    for j, (prompt, g, w) in enumerate(zip(prompts, got, want)):
        assert len(g) == len(w), (j, g, w)
        n = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if n is None:
            continue
        with torch.inference_mode():
            batch = ForwardBatch.no_cache([list(prompt) + w[:n]], device, all_logits=False)
            logits = getattr(model, "model", model).forward(batch).float()[-1]
        gap = float(logits.max() - logits[[g[n], w[n]]].min())
        assert gap <= tie, f"prompt {j}, token {n}: {g[n]} against {w[n]}, {gap:.3f} below the best logit (not a near tie)"


@pytest.mark.parametrize("drafts", [0, 3])
@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm5_next"])
def test_tiny_glm5_steps_through_the_graph_runner_on_cpu(family, drafts):
    """The GraphRunner's steps on CPU (eager stand-ins for the graphs, tests/test_graph_hybrid.py) of GLM 5 and GLM
    5.3 (pooled indexer keys, recurrent layers): the indexer scores over the runner's static block table (as wide as
    the cache), padding rows and, with n-gram drafts, verification rows; the tokens equal plain eager decoding's."""
    lm = TINY_FAMILIES[family]("cpu", torch.float32)
    prompts = [([1, 2, 3, 4, 5] * 8)[:n] for n in (23, 9, 40)]
    _, plain = generate_tokens(lm, prompts, 0)
    gen, replayed = generate_tokens(lm, prompts, drafts, eager_graphs=True)
    assert gen.graph_runner.replays and replayed == plain
    if drafts:
        assert any(width > 1 for _, width in gen.graph_runner.graphs), "no verification step went through the runner"


def test_bf16_drafts_verified_through_the_runner_match_eager_drafting_up_to_a_near_tie():
    """What test_tiny_glm5_decode_steps_capture[glm5_next-*-3] met on an H100 (its graphs captured; its tokens differed
    from the eager generator's at the 11th token of the first prompt), reproduced on CPU: in bf16 with n-gram drafts,
    the runner's verification (the recurrence token by token) and the eager generator's (chunked) choose apart at a
    step where three tokens lie within 0.07 of the best logit (on the CPU this was written on, the 11th token of the
    first prompt too), equal before it; a token far from the best is caught."""
    lm = tiny_glm5_next("cpu", torch.bfloat16)
    prompts = tiny_prompts(repeating=True)
    _, eager = generate_tokens(lm, prompts, 3)
    gen, graphed = generate_tokens(lm, prompts, 3, eager_graphs=True)
    assert any(width > 1 for _, width in gen.graph_runner.graphs)
    assert_greedy_alike(lm, prompts, graphed, eager)
    from trellm.batch import ForwardBatch

    with torch.inference_mode():
        logits = lm.forward(ForwardBatch.no_cache([prompts[1] + eager[1][:4]], all_logits=False))[-1]
    worst = [*eager[1][:4], int(logits.argmin()), *eager[1][5:]]
    with pytest.raises(AssertionError, match=r"prompt 1, token 4: .*\(not a near tie\)"):
        assert_greedy_alike(lm, prompts, [graphed[0], worst, graphed[2]], eager)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm5_next"])
def test_tiny_glm5_steps_of_every_captured_size_read_nothing_on_the_host(family, monkeypatch):
    """The steps the Generator's graphs run (decode at 1, 2 and 4 rows, verification of up to 3 n-gram draft tokens,
    as many as the CUDA slot count allows), after their warm-up run, read no device tensor on the host and copy
    nothing from it (tests/host_reads.py), as a capture requires. The MoE takes the sync-free pair route it takes on
    CUDA (dense experts stacked at load there, CPU steps group rows by expert, which reads the counts)."""
    from trellm.ops import moe

    monkeypatch.setattr(moe, "PAIR_DEVICE_TYPES", ("cuda", "cpu"))  # dense experts stacked at load, dispatch by pairs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the Generator's slots for verification (one per draft token)
    lm = TINY_FAMILIES[family]("cpu", torch.float32)
    reads = HostReads()
    gen, _ = generate_tokens(lm, tiny_prompts(repeating=True), 3, eager_graphs=True, host_reads=reads)
    sizes = sorted(gen.graph_runner.graphs)
    assert {(1, 1), (2, 1), (4, 1)} <= set(sizes) and max(width for _, width in sizes) >= 3, sizes
    assert not reads.found, "\n".join(f"{what}\n{where}" for what, where in reads.found[:3])


def test_host_reads_finds_what_a_capture_refuses():
    """tests/host_reads.py flags host reads of tensors that existed before (the step's inputs and weights), host data
    copied or used beside them, and a Python list index; tensors made with their device pass."""
    x, ids = torch.randn(5, 3), torch.tensor([0, 2, 2])
    steps = {
        "tolist": lambda: torch.bincount(ids).tolist(), "int": lambda: int(x.sum() > 0), "item": lambda: x[0, 0].item(),
        "host index": lambda: x[torch.arange(2)], "host data": lambda: torch.tensor([1, 2], device=x.device),
        "moved": lambda: torch.zeros(3).to(x.device), "list index": lambda: x[[0, 1]],
        "beside": lambda: x + torch.ones(5, 3),
    }
    for what, step in steps.items():
        with HostReads() as reads:
            step()
        assert len(reads.found) == 1, (what, reads.found)
    with HostReads() as reads:
        rows = torch.arange(2, device=x.device)
        x[rows] * torch.tensor(2.0) + x[ids].sum(0).clamp_min(0)  # a host scalar is a kernel argument, not a copy
        torch.searchsorted(ids, rows, right=True)
    assert not reads.found, reads.found


# index_topk 4 < the prompts: later queries attend to a selection; 32-dim indexer heads, which the kernel takes
TINY_GLM_DSA = dict(
    architectures=["GlmMoeDsaForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=256,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    index_topk=4, index_head_dim=32, index_n_heads=8, first_k_dense_replace=1,
    indexer_types=["full", "shared", "full"],
)


def tiny_glm_dsa(device, dtype):
    """A tiny random GLM 5 (:data:`TINY_GLM_DSA`) built by the glm_moe_dsa plugin, made with transformers."""
    import tempfile

    import trellm
    from trellm.sdk.testing import make_tiny_hf_model

    config = {k: v for k, v in TINY_GLM_DSA.items() if k != "architectures"}
    model_dir = make_tiny_hf_model("GlmMoeDsaForCausalLM", tempfile.mkdtemp(prefix="tiny_glm_dsa_"), **config)
    return trellm.load(model_dir, device=device, dtype=dtype, tokenizer=False)


def tiny_glm5_next(device, dtype):
    """benchmarks/glm5_decode_ops.py's tiny random GLM 5.3 (KDA layers, a pooled indexer of 32-dim heads over float32
    pool keys, hyper-connections) as a module tree."""
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    from glm5_decode_ops import tiny_glm5

    return tiny_glm5(device, dtype, index_head_dim=32)


TINY_FAMILIES = {"glm_moe_dsa": tiny_glm_dsa, "glm5_next": tiny_glm5_next}


# ---- CUDA: the kernel against the torch route ----------------------------------------------------------------


@pytest.mark.parametrize("float32_keys", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,dim,rate,row_pad", [(64, 128, 1, 0), (64, 128, 4, 128), (8, 32, 1, 32), (20, 64, 2, 0),
                                                    (16, 96, 1, 0)])
@on_cuda
def test_index_logits_kernel_cuda(dtype, float32_keys, heads, dim, rate, row_pad):
    """The kernel's logits equal index_logits (finite where visible, -inf at exactly the same slots), and its
    selection keeps keys whose scores equal the reference's kept ones; float32 keys (split in two 16-bit parts in the
    kernel) as closely."""
    from trellm.kernels_cuda import binding

    a = index_inputs("cuda", dtype, heads=heads, dim=dim, page_size=16, contexts=(700, 90, 0, 3, 301),
                     new=(5, 1, 0, 1, 2), rate=rate, row_pad=row_pad, seed=heads + dim)
    if float32_keys:  # rows inside wider rows as the 16-bit keys' are
        pages, page_size = a["key_pages"].shape[:2]
        a["key_pages"] = torch.randn(pages, page_size, dim + row_pad, device="cuda")[..., :dim] * 3
    args = [a[k] for k in ("q", "weights", "key_pages", "block_table", "cu_seqlens", "key_counts", "positions")]
    got = binding.sparse_index_logits(*args, a["scale"], rate)
    want = index_logits(*args, a["scale"], rate)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert rel_err(got[finite], want[finite]) < (5e-5 if float32_keys else 1e-5)
    chosen = top_visible(got, 32)
    ref = top_visible(want, 32)
    assert torch.equal((chosen < 0).sum(-1), (ref < 0).sum(-1))
    kept = lambda c: want.gather(1, c.clamp_min(0)).masked_fill(c < 0, 0).sort(dim=-1).values  # noqa: E731
    torch.testing.assert_close(kept(chosen), kept(ref), atol=1e-4 * float(want[finite].abs().max()), rtol=0)


@on_cuda
def test_sparse_index_topk_cuda_route_matches_the_reference(monkeypatch):
    """Through the op with TRELLM_SPARSE_INDEX=kernel: the same keys as the CPU loop on integer-valued inputs (exact
    sums: identical scores, ties included)."""
    monkeypatch.setenv(SPARSE_INDEX_ENV, "kernel")
    a = index_inputs("cuda", torch.bfloat16, heads=64, dim=128, page_size=16, contexts=(300, 40, 0, 3), new=(3, 1, 0, 1),
                     rate=4, integer=True)
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    assert torch.equal(as_sets(sparse_index_topk(**a, topk=16)).cpu(), as_sets(loop_route(cpu, 16)))


@on_cuda
def test_sparse_index_topk_kernel_route_captures(monkeypatch):
    """The kernel route captured in a CUDA graph, replayed after the step's positions, key counts and keys change in
    place (the next decode step): each replay equals the route run eagerly on those inputs."""
    monkeypatch.setenv(SPARSE_INDEX_ENV, "kernel")
    a = index_inputs("cuda", torch.bfloat16, heads=64, dim=128, page_size=16, contexts=(500, 77, 1000),
                     new=(1, 1, 1), spare_pages=8)
    names = ("q", "weights", "key_pages", "block_table", "cu_seqlens", "key_counts", "positions")
    run = lambda: sparse_index_topk(*(a[n] for n in names), 64, a["scale"], 1)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step in range(1, 4):
        a["positions"] += 1
        a["key_counts"] += 1
        a["q"].copy_(torch.randn_like(a["q"], dtype=torch.float32).to(a["q"].dtype))
        graph.replay()
        assert torch.equal(as_sets(out), as_sets(run())), step


@pytest.mark.parametrize("drafts", [0, 3])
@pytest.mark.parametrize("route", ["reference", "kernel"])
@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm5_next"])
@on_cuda
def test_tiny_glm5_decode_steps_capture(monkeypatch, family, route, drafts):
    """A tiny GLM 5 and GLM 5.3 in bf16 through the Generator: their decode steps (and with n-gram drafts of 3
    tokens, verification steps) run as captured CUDA graphs on both routes (the reference's device route at this
    size, the kernel at any; GLM 5.3's float32 pool keys through the kernel's split) and give the tokens of eager
    decoding; with drafts, up to a near tie, which the two verification routes may round apart in bf16 (see
    test_bf16_drafts_verified_through_the_runner_match_eager_drafting_up_to_a_near_tie). A failed capture names the
    op that read the host."""
    import warnings

    monkeypatch.setenv(SPARSE_INDEX_ENV, route)
    model = TINY_FAMILIES[family]("cuda", torch.bfloat16)
    prompts = tiny_prompts(repeating=bool(drafts))
    _, eager = generate_tokens(model, prompts, drafts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen, graphed = generate_tokens(model, prompts, drafts, cuda_graphs=True)
    failed = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]  # a failed capture warns why
    assert gen.graph_runner.graphs and not gen.graph_runner._failed and not failed, failed
    if drafts:
        assert any(width > 1 for _, width in gen.graph_runner.graphs), "no verification step was captured"
        assert_greedy_alike(model, prompts, graphed, eager, "cuda")  # verification rounds apart from eager drafting
    else:
        assert graphed == eager  # the same kernels on the same shapes
