"""The tiled paged-attention prefill kernel (kernels_cuda/attention_prefill.cu) against the torch reference op.

GPU only: skipped without CUDA. Mixed batches hold a whole prompt, a second chunk after cached tokens, a
one-token sequence and (where noted) an empty one; pages are a random permutation of the pool, so page
order never matches key order. Relative Frobenius error against the float32 reference, tolerances as
the per-token kernel's tests.
"""
from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = (torch.float16, torch.bfloat16)
# (context length, query tokens) per sequence: full prompt, second chunk after 160 cached tokens,
# one token, a short prompt.
MIXED = [(300, 300), (250, 90), (77, 1), (33, 33)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 2e-3


def setup(dtype, seqs, hq, hkv, d, page_size=16, seed=0):
    """Random q and a paged cache holding each sequence's context in randomly ordered pages."""
    torch.manual_seed(seed)
    ctx_lens = [c for c, _ in seqs]
    batch = len(seqs)
    max_blocks = max(1, max((c + page_size - 1) // page_size for c in ctx_lens))
    num_pages = batch * max_blocks + 3
    k_pages = torch.randn(num_pages, page_size, hkv, d, device="cuda", dtype=dtype)
    v_pages = torch.randn_like(k_pages)
    table = torch.randperm(num_pages, device="cuda")[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    cu = torch.tensor([0, *itertools.accumulate(n for _, n in seqs)], dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=dtype)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    return q, k_pages, v_pages, table, cu, ctx


def check(kb, ops, dtype, seqs, hq, hkv, d, page_size=16, window=0, softcap=0.0, sinks=False, scale=None):
    q, kp, vp, bt, cu, cl = setup(dtype, seqs, hq, hkv, d, page_size)
    sk = torch.randn(hq, device="cuda") if sinks else None
    scale = scale if scale is not None else d**-0.5
    out = kb.paged_attention_prefill(q, kp, vp, bt, cu, cl, scale, window, softcap, sk)
    ref = ops.paged_attention.reference(q, kp, vp, bt, cu, cl, scale, window, softcap, sk)
    err = rel_err(out, ref)
    assert err < tolerance(dtype), f"relative error {err:.2e}"
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_mixed_batch(kb, ops, dtype, d, group):
    check(kb, ops, dtype, MIXED, hq=2 * group, hkv=2, d=d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        dict(window=64),  # window shorter than a key tile
        dict(window=200),  # window across several tiles and the chunk boundary
        dict(softcap=30.0),
        dict(sinks=True),
        dict(window=50, softcap=20.0, sinks=True),
        dict(d=256, window=40, sinks=True),  # 32-key tiles, Q re-read from shared memory
    ],
)
def test_prefill_window_softcap_sinks(kb, ops, dtype, case):
    case = dict(case)
    check(kb, ops, dtype, MIXED, hq=8, hkv=2, d=case.pop("d", 128), **case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [96, 160, 192])
def test_prefill_other_head_dims(kb, ops, dtype, d):
    check(kb, ops, dtype, MIXED, hq=4, hkv=1, d=d)


@pytest.mark.parametrize("page_size", [12, 64])
def test_prefill_page_sizes(kb, ops, page_size):
    # 12: not a power of two (the division path); 64: a page per key tile.
    check(kb, ops, torch.float16, MIXED, hq=8, hkv=2, d=128, page_size=page_size, window=100)


def test_prefill_group_not_dividing_tile(kb, ops):
    # 3 heads per kv head: 21 tokens (63 rows) per tile; 16 heads: 4 tokens per tile.
    check(kb, ops, torch.bfloat16, MIXED, hq=6, hkv=2, d=128)
    check(kb, ops, torch.float16, MIXED, hq=32, hkv=2, d=64, sinks=True)


def test_prefill_many_sequences_and_empty_ones(kb, ops):
    # More than 32 sequences: the block -> (sequence, tile) scan runs over several warp-wide chunks;
    # empty sequences own no tile.
    torch.manual_seed(1)
    seqs = []
    for i in range(41):
        n = 0 if i % 10 == 3 else int(torch.randint(1, 70, ()).item())
        seqs.append((n + int(torch.randint(0, 50, ()).item()), n))
    check(kb, ops, torch.float16, seqs, hq=8, hkv=2, d=64)


def test_prefill_long_prompt(kb, ops):
    check(kb, ops, torch.bfloat16, [(1500, 1500)], hq=16, hkv=4, d=128, window=700, sinks=True)


def test_prefill_graph_capture(kb, ops):
    # No host sync in the launch: the call captures into a CUDA graph and replays with new inputs.
    q, kp, vp, bt, cu, cl = setup(torch.float16, MIXED, 8, 2, 128)
    scale = 128**-0.5
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kb.paged_attention_prefill(q, kp, vp, bt, cu, cl, scale)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = kb.paged_attention_prefill(q, kp, vp, bt, cu, cl, scale)
    torch.cuda.current_stream().wait_stream(s)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    ref = ops.paged_attention.reference(q, kp, vp, bt, cu, cl, scale)
    assert rel_err(out, ref) < tolerance(torch.float16)


def test_dispatch_takes_tiled_path_for_prefill(kb, ops):
    from trellm.kernels_cuda import ops as cuda_ops

    q, kp, vp, bt, cu, cl = setup(torch.bfloat16, MIXED, 32, 8, 128)
    before = cuda_ops.TILED_PREFILL_CALLS
    out = ops.paged_attention(q, kp, vp, bt, cu, cl)
    assert cuda_ops.TILED_PREFILL_CALLS == before + 1, "prefill fell back to the per-token kernel"
    assert rel_err(out, ops.paged_attention.reference(q, kp, vp, bt, cu, cl)) < tolerance(torch.bfloat16)
    # A decode step (one token per sequence) keeps the per-token kernel.
    q1, kp1, vp1, bt1, cu1, cl1 = setup(torch.bfloat16, [(300, 1), (77, 1)], 32, 8, 128)
    out1 = ops.paged_attention(q1, kp1, vp1, bt1, cu1, cl1)
    assert cuda_ops.TILED_PREFILL_CALLS == before + 1
    assert rel_err(out1, ops.paged_attention.reference(q1, kp1, vp1, bt1, cu1, cl1)) < tolerance(torch.bfloat16)


def test_prefill_argument_errors_name_the_argument(kb):
    q, kp, vp, bt, cu, cl = setup(torch.float16, [(40, 40)], 4, 1, 64)
    with pytest.raises(kb.KernelArgumentError, match="q: dtype"):
        kb.paged_attention_prefill(q.float(), kp, vp, bt, cu, cl, 0.125)
    with pytest.raises(kb.KernelArgumentError, match="v_pages"):
        kb.paged_attention_prefill(q, kp, vp[:, :8], bt, cu, cl, 0.125)
    with pytest.raises(kb.KernelArgumentError, match="cu_seqlens"):
        kb.paged_attention_prefill(q, kp, vp, bt, cu.long(), cl, 0.125)
    q80, kp80, vp80, bt80, cu80, cl80 = setup(torch.float16, [(40, 40)], 4, 1, 80)
    with pytest.raises(kb.KernelArgumentError, match="head_dim 80"):
        kb.paged_attention_prefill(q80, kp80, vp80, bt80, cu80, cl80, 0.125)
