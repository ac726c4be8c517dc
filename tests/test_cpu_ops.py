"""The ops with a CPU implementation of their own (torch's fused kernels), each held against its reference, as
the cuda tests hold the CUDA ones; and dispatch: CPU tensors reach them unless ``TRELLM_OPS=reference``. Also the
token -> sequence helpers that the sparse, compressed and cached-window ops share."""
from __future__ import annotations

import itertools

import pytest
import torch

from trellm import ops


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _paged_setup(dtype, ctx_lens, q_lens, hq=8, hkv=2, d=64, dv=None, page_size=16):
    gen = torch.Generator().manual_seed(0)
    batch = len(ctx_lens)
    max_blocks = max((c + page_size - 1) // page_size for c in ctx_lens)
    num_pages = batch * max_blocks + 3
    k_pages = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype)
    v_pages = torch.randn(num_pages, page_size, hkv, dv or d, generator=gen).to(dtype)
    table = torch.randperm(num_pages, generator=gen)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(int(sum(q_lens)), hq, d, generator=gen).to(dtype)
    return q, k_pages, v_pages, table, cu, torch.tensor(ctx_lens, dtype=torch.int32)


CASES = [
    dict(ctx=[1, 17, 300, 64], q=[1, 1, 1, 1]),  # decode
    dict(ctx=[40, 77], q=[40, 13]),  # a whole prompt, and a chunk after 64 cached tokens
    dict(ctx=[200, 33], q=[1, 5], window=32),
    dict(ctx=[90, 90], q=[90, 3], window=20),  # the window in a whole prompt
    dict(ctx=[90], q=[3], softcap=30.0, sinks=True),  # the reference's route
    dict(ctx=[50, 50], q=[50, 1], hq=6, hkv=6),  # no grouping
    dict(ctx=[70], q=[70], dv=32),  # value heads narrower than the keys (MLA)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_paged_attention_cpu(dtype, case):
    q, kp, vp, table, cu, lens = _paged_setup(dtype, case["ctx"], case["q"], hq=case.get("hq", 8),
                                              hkv=case.get("hkv", 2), dv=case.get("dv"))
    sinks = torch.randn(q.shape[1]) if case.get("sinks") else None
    kw = dict(sliding_window=case.get("window", 0), softcap=case.get("softcap", 0.0), sinks=sinks)
    out = ops.paged_attention.impls["cpu"](q, kp, vp, table, cu, lens, None, **kw)
    ref = ops.paged_attention.reference(q, kp, vp, table, cu, lens, None, **kw)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=7), dict(causal=False), dict(softcap=20.0), dict(scale=0.3)])
def test_attention_varlen_cpu(dtype, kw):
    gen = torch.Generator().manual_seed(1)
    lens = [1, 30, 9]
    q = torch.randn(sum(lens), 8, 32, generator=gen).to(dtype)
    k, v = (torch.randn(sum(lens), 4, 32, generator=gen).to(dtype) for _ in range(2))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    out = ops.attention_varlen.impls["cpu"](q, k, v, cu, **kw)
    ref = ops.attention_varlen.reference(q, k, v, cu, **kw)
    assert out.dtype == ref.dtype and rel_err(out, ref) < TOLERANCE[dtype]


def test_cpu_tensors_take_the_cpu_implementation_unless_reference_is_forced(monkeypatch):
    calls = []
    monkeypatch.setitem(ops.paged_attention.impls, "cpu", lambda *a, **k: calls.append("cpu"))
    q, kp, vp, table, cu, lens = _paged_setup(torch.float32, [5], [5])
    monkeypatch.delenv("TRELLM_OPS", raising=False)
    ops.paged_attention(q, kp, vp, table, cu, lens)
    assert calls == ["cpu"]
    monkeypatch.setenv("TRELLM_OPS", "reference")
    assert ops.paged_attention(q, kp, vp, table, cu, lens).shape == q.shape and calls == ["cpu"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,dv", [(4, 2, 8, 8), (4, 1, 12, 10), (2, 2, 8, 8)])
def test_sparse_attention_gathering_chosen_keys_equals_masking_the_context(monkeypatch, dtype, hq, hkv, d, dv):
    """Decode-sized sparse attention gathers only the keys each token names; it equals the prefill route (the
    whole context gathered and masked) with GQA, scattered pages, -1 entries, a position named twice (counted
    once) and a sequence whose token names none (zeros)."""
    from trellm.ops import sparse

    g = torch.Generator().manual_seed(hq * 10 + hkv)
    page_size, num_pages, lens, new = 4, 40, [9, 17, 1], [2, 3, 1]
    k_pages = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    v_pages = torch.randn(num_pages, page_size, hkv, dv, generator=g).to(dtype)
    table = torch.zeros(3, 6, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=g)
    for b, n in enumerate(lens):
        table[b, : -(-n // page_size)] = order[b * 6: b * 6 + -(-n // page_size)]
    cu, ctx = torch.tensor([0, 2, 5, 6], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(6, hq, d, generator=g).to(dtype)
    chosen = []
    for n, m in zip(lens, new):
        for j in range(m):
            c = torch.randint(0, n - m + j + 1, (5,), generator=g)
            chosen.append(c.masked_fill(torch.rand(5, generator=g) < 0.3, -1))
    indices = torch.stack(chosen)
    indices[0, 1] = indices[0, 0] = 3
    indices[5] = -1
    gathered = sparse.sparse_paged_attention(q, k_pages, v_pages, table, cu, ctx, indices, 0.3)
    monkeypatch.setattr(sparse, "CHOSEN_MAX_PAIRS", 0)
    masked = sparse.sparse_paged_attention(q, k_pages, v_pages, table, cu, ctx, indices, 0.3)
    assert (gathered[5] == 0).all()
    torch.testing.assert_close(gathered.float(), masked.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)


@pytest.mark.parametrize("selected", [False, True])
@pytest.mark.parametrize("route", ["each token gathers its own", "per sequence"])
def test_compressed_attention_reads_only_the_window_pages(selected, route, monkeypatch):
    """DeepSeek V4's compressed attention gathers only the pages of its new tokens' sliding windows, and with a
    selection only the chosen entries; it equals attention over the whole context and every entry, masked (the
    former route), past and within the window."""
    from trellm.ops import compressed
    from trellm.ops.attention import _attend, gather_pages
    from trellm.ops.compressed import compressed_attention

    if route == "per sequence":
        monkeypatch.setattr(compressed, "WINDOW_ENTRIES_MAX_PAIRS", 0)
    g = torch.Generator().manual_seed(1)
    page_size, window, rate, heads, d = 4, 6, 2, 3, 8
    lens, new = [30, 5, 13], [1, 2, 3]
    k_pages = torch.randn(24, page_size, 1, d, generator=g)
    table = torch.randperm(24, generator=g)[:24].view(3, 8).to(torch.int32)
    cu = torch.tensor([0, 1, 3, 6], dtype=torch.int32)
    q = torch.randn(6, heads, d, generator=g)
    entries = [torch.randn(n // rate, d, generator=g) for n in lens]
    sinks = torch.randn(heads, generator=g)
    selection = torch.randint(-1, 3, (6, 2), generator=g) if selected else None
    # the entries in pages of 2 under their own block table, a sequence's pages scattered
    per_page, entry_table = 2, torch.randperm(30, generator=g)[:24].view(3, 8).to(torch.int32)
    entry_pages = torch.randn(30, per_page, d, generator=g)
    for b, e in enumerate(entries):
        for w in range(len(e)):
            entry_pages[entry_table[b, w // per_page], w % per_page] = e[w]
    out = compressed_attention(q, k_pages, table, cu, torch.tensor(lens, dtype=torch.int32), entry_pages, entry_table,
                               0.4, window, rate, sinks, selection)
    for b, (s0, n, m) in enumerate(zip([0, 1, 3], lens, new)):
        kv = torch.cat([gather_pages(k_pages, table[b], n), entries[b][:, None]])
        qpos = torch.arange(m)[:, None] + n - m
        kpos = torch.arange(n)[None]
        keep_tokens = (kpos <= qpos) & (kpos > qpos - window)
        if selection is None:
            keep_entries = torch.arange(len(entries[b]))[None] < (qpos + 1) // rate
        else:
            keep_entries = torch.zeros(m, len(entries[b]) + 1, dtype=torch.bool)
            chosen = selection[s0:s0 + m]
            keep_entries.scatter_(1, torch.where(chosen >= 0, chosen, len(entries[b])), True)
            keep_entries = keep_entries[:, :-1]
        want = _attend(q[s0:s0 + m], kv, kv, 0.4, 0, 0, 0.0, sinks, causal=False,
                       keep=torch.cat([keep_tokens, keep_entries], dim=1))
        torch.testing.assert_close(out[s0:s0 + m], want, atol=1e-6, rtol=0)


def test_token_sequences_and_indices():
    """Each new token's sequence (B past the batch's tokens) and its index in that sequence, with a cache (the new
    tokens end each context) and without (they are the sequence), an empty sequence among them; on meta tensors
    too, where a host read raises."""
    from trellm.ops.attention import token_indices, token_sequences

    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    assert token_sequences(cu, 6).tolist() == [0, 0, 0, 2, 2, 3]
    seq, index = token_indices(cu, 5, torch.tensor([10, 4, 7], dtype=torch.int32))
    assert seq.tolist() == [0, 0, 0, 2, 2] and index.tolist() == [7, 8, 9, 5, 6]
    assert token_indices(cu, 5)[1].tolist() == [0, 1, 2, 0, 1]
    seq, index = token_indices(cu.to("meta"), 5, torch.zeros(3, dtype=torch.int32, device="meta"))
    assert seq.shape == index.shape == (5,) and token_sequences(cu.to("meta"), 6).shape == (6,)
