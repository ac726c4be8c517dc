"""The decode-step fusion kernels against their torch references (GPU only; skipped without CUDA).

Fused RoPE (QK-norm + RoPE of q and k by position + the KV-page write), paged attention with its key
splits merged inside the kernel, the 16-byte vector paths
of rms_norm / add_rms_norm / hadamard_128 / rotary_embedding next to their scalar fallbacks, graph
capture of the fused op, and a tiny Llama / Qwen3 decoded with the kernels vs the references.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def cuda_impl(op):
    impl = op.impls.get("cuda")
    assert impl is not None, f"{op.name} has no CUDA implementation registered"
    return impl


def rope_tables(length: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(half, device="cuda").float() / half))
    ang = torch.arange(length, device="cuda").float()[:, None] * inv
    return ang.cos().contiguous(), ang.sin().contiguous()


# ---------------------------------------------------------------------------------------------
# Fused RoPE


@pytest.mark.parametrize("norm", [None, "plain", "unit_offset"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot_frac", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rotary_qk(ops, dtype, rot_frac, interleaved, norm):
    from trellm.ops.attention import rotary_qk

    torch.manual_seed(0)
    tokens, hq, hkv, d = 7, 8, 2, 128
    half = int(d * rot_frac) // 2
    q = torch.randn(tokens, hq, d, device="cuda", dtype=dtype) * 2
    k = torch.randn(tokens, hkv, d, device="cuda", dtype=dtype) * 2
    cos, sin = rope_tables(300, half)
    positions = torch.tensor([5, 0, 299, 17, 17, 128, 3], device="cuda")
    kw = {}
    if norm is not None:
        kw = {"q_norm": torch.randn(d, device="cuda", dtype=dtype), "k_norm": torch.randn(d, device="cuda", dtype=dtype),
              "norm_eps": 1e-6, "norm_unit_offset": norm == "unit_offset"}
    q_out, k_out = cuda_impl(rotary_qk)(q, k, cos, sin, positions, interleaved, **kw)
    q_ref, k_ref = rotary_qk.reference(q, k, cos, sin, positions, interleaved, **kw)
    tol = TOL[dtype] * (3 if norm else 1)
    assert q_out.shape == q_ref.shape and k_out.shape == k_ref.shape
    assert rel_err(q_out, q_ref) < tol
    assert rel_err(k_out, k_ref) < tol


@pytest.mark.parametrize("head_dim", [128, 64, 100])  # 100: rows not a whole number of 16-byte vectors
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_qk_write_kv(ops, dtype, head_dim):
    from trellm.ops.attention import rotary_qk_write_kv

    torch.manual_seed(1)
    tokens, hq, hkv, d, page_size, pages = 5, 8, 4, head_dim, 16, 6
    q = torch.randn(tokens, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(tokens, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(tokens, hkv, d, device="cuda", dtype=dtype)
    cos, sin = rope_tables(128, d // 2)
    positions = torch.tensor([0, 1, 2, 40, 90], device="cuda")
    slots = torch.tensor([3, 20, 21, 77, 95], device="cuda")
    norms = {"q_norm": torch.randn(d, device="cuda", dtype=dtype), "k_norm": torch.randn(d, device="cuda", dtype=dtype)}
    k_pages = torch.randn(pages, page_size, hkv, d, device="cuda", dtype=dtype)
    v_pages = torch.randn_like(k_pages)
    k_pages_ref, v_pages_ref = k_pages.clone(), v_pages.clone()
    q_out, k_out = cuda_impl(rotary_qk_write_kv)(q, k, v, cos, sin, positions, k_pages, v_pages, slots, False, **norms)
    q_ref, k_ref = rotary_qk_write_kv.reference(q, k, v, cos, sin, positions, k_pages_ref, v_pages_ref, slots, False,
                                                **norms)
    assert rel_err(q_out, q_ref) < 3 * TOL[dtype]
    assert rel_err(k_out, k_ref) < 3 * TOL[dtype]
    flat_k, flat_v = k_pages.view(-1, hkv, d), v_pages.view(-1, hkv, d)
    assert torch.equal(flat_k[slots], k_out), "the cache holds exactly the rotated keys returned"
    assert torch.equal(flat_v[slots], v), "values are copied unchanged"
    untouched = torch.ones(pages * page_size, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], k_pages_ref.view(-1, hkv, d)[untouched])
    assert torch.equal(flat_v[untouched], v_pages_ref.view(-1, hkv, d)[untouched])


@pytest.mark.parametrize("norm", [None, "plain", "unit_offset"])
@pytest.mark.parametrize("rope", ["neox", "gptj", "partial"])
@pytest.mark.parametrize("K", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exl3_qkv_rope_write_kv(ops, dtype, K, rope, norm):
    # One matmul call that finishes q/k/v as rotary_qk_write_kv does: against the reference, and against the
    # two separate CUDA ops (exl3_matmul_group, then the fused RoPE kernel) it replaces; v and the untouched
    # slots exactly. Rows 1 and 5 (the GEMV's finishing warp, by default) and 6, 16, 40 (the mid route's finish
    # launch), one negative slot.
    from test_cuda_ops import _random_layer
    from trellm.ops.exl3 import exl3_matmul_group, exl3_qkv_rope_write_kv

    torch.manual_seed(2)
    k_in, hq, hkv, d, page_size, pages = 1024, 4, 2, 128, 16, 4
    parts = [_random_layer(k_in, n, K) for n in (hq * d, hkv * d, hkv * d)]
    parts = [(t, suh, svh, bias if i == 0 else None) for i, (t, suh, svh, bias) in enumerate(parts)]
    half = d // 4 if rope == "partial" else d // 2
    cos, sin = rope_tables(64, half)
    kw = {"interleaved": rope == "gptj"}
    if norm is not None:
        kw.update(q_norm=torch.randn(d, device="cuda", dtype=dtype), k_norm=torch.randn(d, device="cuda", dtype=dtype),
                  norm_eps=1e-6, norm_unit_offset=norm == "unit_offset")
    tol = (1e-2 if dtype == torch.bfloat16 else 3e-3) * (3 if norm else 1)
    for rows in (1, 5, 6, 16, 40):
        x = torch.randn(rows, k_in, device="cuda", dtype=dtype)
        positions = torch.randint(0, 64, (rows,), device="cuda")
        slots = torch.randperm(pages * page_size, device="cuda")[:rows]
        slots[-1] = -1 if rows > 1 else slots[-1]
        caches = [torch.randn(pages, page_size, hkv, d, device="cuda", dtype=dtype) for _ in range(2)]
        before = [c.clone() for c in caches]
        ref_caches = [c.clone() for c in caches]
        sep_caches = [c.clone() for c in caches]
        q, k = cuda_impl(exl3_qkv_rope_write_kv)(x, parts, "mcg", d, cos, sin, positions, *caches, slots, **kw)
        q_ref, k_ref = exl3_qkv_rope_write_kv.reference(x.float(), parts, "mcg", d, cos, sin, positions,
                                                        *[c.float() for c in ref_caches], slots, **kw)
        assert q.shape == (rows, hq, d) and k.shape == (rows, hkv, d)
        assert rel_err(q, q_ref) < tol and rel_err(k, k_ref) < tol, (rows, rope, norm)
        # the same through the two ops it replaces
        ys = cuda_impl(exl3_matmul_group)(x, parts, "mcg")
        q_sep, k_sep = cuda_impl(rotary_qk_write_kv_op())(*(y.reshape(rows, -1, d) for y in ys), cos, sin, positions,
                                                          *sep_caches, slots, **kw)
        close = 8e-3 if dtype == torch.bfloat16 else 2e-3
        assert rel_err(q, q_sep) < close and rel_err(k, k_sep) < close, (rows, rope, norm)
        live = slots >= 0
        for c, sep, old in zip(caches, sep_caches, before):
            flat, flat_sep, flat_old = c.view(-1, hkv, d), sep.view(-1, hkv, d), old.view(-1, hkv, d)
            untouched = torch.ones(flat.shape[0], dtype=torch.bool, device="cuda")
            untouched[slots[live]] = False
            assert torch.equal(flat[untouched], flat_old[untouched])
        v_flat = caches[1].view(-1, hkv, d)
        assert torch.equal(v_flat[slots[live]], ys[2].reshape(rows, hkv, d)[live]), "v stored as the matmul computes it"
        assert torch.equal(caches[0].view(-1, hkv, d)[slots[live]], k[live]), "the cache holds the returned keys"


def test_exl3_qkv_rope_calls_refuse_bad_input(ops):
    # Both routes' q/k/v calls refuse, by name, what they cannot finish: two parts, widths that are not 128-wide
    # heads, more rows than the route takes.
    from test_cuda_ops import _random_layer
    from trellm.kernels_cuda import binding
    from trellm.kernels_cuda.binding import KernelArgumentError

    qkv = [_random_layer(256, n, 4) for n in (256, 128, 128)]
    cos, sin = rope_tables(16, 64)
    for route, max_rows in (("small", 16), ("mid", 64)):
        def call(*args):
            return binding.exl3_matmul_qkv_rope(*args, route=route)

        x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
        pos = torch.zeros(4, dtype=torch.int64, device="cuda")
        with pytest.raises(KernelArgumentError, match="q/k/v need 3"):
            call(x, qkv[:2], "mcg", cos, sin, pos)
        with pytest.raises(KernelArgumentError, match="128-wide heads"):
            call(x, [qkv[0], qkv[1], _random_layer(256, 256, 4)], "mcg", cos, sin, pos)
        many = torch.randn(max_rows + 1, 256, device="cuda", dtype=torch.float16)
        with pytest.raises(KernelArgumentError, match="rows"):
            call(many, qkv, "mcg", cos, sin, torch.zeros(max_rows + 1, dtype=torch.int64, device="cuda"))
    with pytest.raises(KernelArgumentError, match="route 'large'"):
        binding.exl3_matmul_qkv_rope(x, qkv, "mcg", cos, sin, pos, route="large")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exl3_matmul_add(ops, dtype):
    # The residual add and the per-group sums of squares in the GEMV's finishing step: the sum exactly as
    # the matmul's own output plus the residual (each rounded once), the sums against the result's. The GEMV's
    # rows (1..5 by default) and the mid-size matmul's (6..64) add in their finishing step; more rows take
    # decode + cuBLAS and a torch add, with no sums (the next norm reads h itself). The gated form takes the
    # activation in the GEMV at 1 row, in a launch of its own above (the matmul still adds and sums).
    from test_cuda_ops import _random_layer
    from trellm.kernels_cuda.ops import EXL3_MID_MAX_ROWS as EXL3_STREAM_MAX_ROWS
    from trellm.ops import gated_activation
    from trellm.ops.dense import group_sum_squares
    from trellm.ops.exl3 import exl3_matmul, exl3_matmul_add, exl3_matmul_gated, exl3_matmul_gated_add

    torch.manual_seed(5)
    k_in, n = 1024, 512
    trellis, suh, svh, bias = _random_layer(k_in, n, 4)
    for rows in (1, 5, 6, 16, 17, 70):
        x = torch.randn(rows, k_in, device="cuda", dtype=dtype)
        residual = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
        h, ssq = cuda_impl(exl3_matmul_add)(x, trellis, suh, svh, "mcg", bias, residual)
        h_ref, ssq_ref = exl3_matmul_add.reference(x, trellis, suh, svh, "mcg", bias, residual)
        y = cuda_impl(exl3_matmul)(x, trellis, suh, svh, "mcg", bias)
        assert h.dtype == dtype and torch.equal(h, y + residual), rows
        assert rel_err(h, h_ref) < (1e-2 if dtype == torch.bfloat16 else 3e-3), rows
        if rows > EXL3_STREAM_MAX_ROWS:
            assert ssq is None
            continue
        assert ssq.shape == (rows, n // 128) and ssq.dtype == torch.float32
        assert rel_err(ssq, group_sum_squares(h)) < 1e-5 and rel_err(ssq, ssq_ref) < 1e-2, rows
    for rows in (1, 2, 17, 70):
        gate, up = (torch.randn(rows, k_in, device="cuda", dtype=dtype) for _ in range(2))
        residual = torch.randn(rows, n, device="cuda", dtype=dtype)
        h, ssq = cuda_impl(exl3_matmul_gated_add)(gate, up, "silu", trellis, suh, svh, "mcg", None, residual)
        y = cuda_impl(exl3_matmul_gated)(gate, up, "silu", trellis, suh, svh, "mcg", None)
        assert torch.equal(h, y + residual), rows
        assert (ssq is None) if rows > EXL3_STREAM_MAX_ROWS else rel_err(ssq, group_sum_squares(h)) < 1e-5, rows
        y_sep = cuda_impl(exl3_matmul)(gated_activation(gate, up, "silu"), trellis, suh, svh, "mcg", None)
        assert torch.equal(y, y_sep)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exl3_matmul_mid_residual_stream(ops, dtype):
    # Both ends of the residual stream in the mid-size matmul: the finish adds the residual (bit-equal to its own
    # output plus the residual) and sums the squares; the pack norms x from those sums (against rms_norm and the
    # same matmul). Rows 6, 24 and 64; a row norm of the wrong shape is refused by name.
    from test_cuda_ops import _random_layer
    from trellm.kernels_cuda import binding
    from trellm.kernels_cuda.binding import KernelArgumentError
    from trellm.ops import RowNorm, rms_norm
    from trellm.ops.dense import group_sum_squares

    torch.manual_seed(8)
    k_in, n = 1024, 1024
    o_proj = _random_layer(k_in, n, 4)
    qk = [_random_layer(n, m, 4) for m in (512, 256)]
    w = (torch.randn(n, device="cuda") * 0.1 + 1.0).to(dtype)
    close = 8e-3 if dtype == torch.bfloat16 else 2e-3
    for rows in (6, 24, 64):
        x = torch.randn(rows, k_in, device="cuda", dtype=dtype)
        residual = torch.randn(rows, n, device="cuda", dtype=dtype) * 4
        h, ssq = binding.exl3_matmul_mid(x, *o_proj[:3], "mcg", o_proj[3], residual=residual)
        assert torch.equal(h, binding.exl3_matmul_mid(x, *o_proj[:3], "mcg", o_proj[3]) + residual), rows
        assert ssq.shape == (rows, n // 128) and rel_err(ssq, group_sum_squares(h)) < 1e-5, rows
        ys = binding.exl3_matmul_mid_multi(h, qk, "mcg", row_norm=RowNorm(ssq, w, 1e-5, False))
        ys_sep = binding.exl3_matmul_mid_multi(cuda_impl(rms_norm)(h, w, 1e-5), qk, "mcg")
        for y, y_sep in zip(ys, ys_sep):
            assert rel_err(y, y_sep) < close, rows
    with pytest.raises(KernelArgumentError, match="row_norm.ssq"):
        binding.exl3_matmul_mid_multi(h, qk, "mcg", row_norm=RowNorm(torch.zeros(rows, 3, device="cuda"), w, 1e-5, False))


@pytest.mark.parametrize("weight", ["plain", "unit_offset", None])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exl3_group_row_norm(ops, dtype, weight):
    # The RMSNorm in the GEMV's input transform from the producer's sums of squares (row_norm): against the
    # reference and against rms_norm + the GEMV on CUDA (the two launches it replaces), rows 1, 5 and 16;
    # also the q/k/v call with RoPE behind, on both routes. Sums of the wrong shape are refused by name.
    from test_cuda_ops import _random_layer
    from trellm.kernels_cuda import binding
    from trellm.kernels_cuda.binding import KernelArgumentError
    from trellm.ops import RowNorm, rms_norm
    from trellm.ops.dense import group_sum_squares
    from trellm.ops.exl3 import exl3_matmul_group, exl3_qkv_rope_write_kv

    torch.manual_seed(6)
    k_in, eps, unit = 4096, 1e-5, weight == "unit_offset"
    parts = [_random_layer(k_in, n, 4) for n in (512, 256)]
    w = None if weight is None else (torch.randn(k_in, device="cuda") * 0.1 + (0.0 if unit else 1.0)).to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 3e-3
    close = 8e-3 if dtype == torch.bfloat16 else 2e-3
    for rows in (1, 5, 16):
        h = torch.randn(rows, k_in, device="cuda", dtype=dtype) * 3
        norm = RowNorm(group_sum_squares(h), w, eps, unit)
        ys = cuda_impl(exl3_matmul_group)(h, parts, "mcg", norm)
        ys_ref = exl3_matmul_group.reference(h, parts, "mcg", norm)
        ys_sep = cuda_impl(exl3_matmul_group)(cuda_impl(rms_norm)(h, w, eps, unit), parts, "mcg")
        for y, y_ref, y_sep in zip(ys, ys_ref, ys_sep):
            assert rel_err(y, y_ref) < tol and rel_err(y, y_sep) < close, (rows, weight)
    d, hkv, page_size, pages = 128, 2, 16, 4
    qkv = [_random_layer(k_in, n, 4) for n in (4 * d, hkv * d, hkv * d)]
    cos, sin = rope_tables(64, d // 2)
    for rows in (3, 12):  # the GEMV's finishing warp, the mid route's finish launch
        h = torch.randn(rows, k_in, device="cuda", dtype=dtype)
        positions = torch.randint(0, 64, (rows,), device="cuda")
        slots = torch.randperm(pages * page_size, device="cuda")[:rows]
        caches = [torch.randn(pages, page_size, hkv, d, device="cuda", dtype=dtype) for _ in range(2)]
        sep_caches = [c.clone() for c in caches]
        q, k = cuda_impl(exl3_qkv_rope_write_kv)(h, qkv, "mcg", d, cos, sin, positions, *caches, slots,
                                                 row_norm=RowNorm(group_sum_squares(h), w, eps, unit))
        q_sep, k_sep = cuda_impl(exl3_qkv_rope_write_kv)(cuda_impl(rms_norm)(h, w, eps, unit), qkv, "mcg", d, cos,
                                                         sin, positions, *sep_caches, slots)
        assert rel_err(q, q_sep) < close and rel_err(k, k_sep) < close, rows
        for c, sep in zip(caches, sep_caches):
            assert rel_err(c, sep) < close, rows
    with pytest.raises(KernelArgumentError, match="row_norm.ssq"):
        binding.exl3_matmul_small_multi(h, parts[:1], "mcg", row_norm=RowNorm(torch.zeros(3, 7, device="cuda"), w, eps, unit))


def rotary_qk_write_kv_op():
    from trellm.ops.attention import rotary_qk_write_kv

    return rotary_qk_write_kv


def test_rotary_qk_write_kv_skips_negative_slots(ops):
    from trellm.kernels_cuda import binding

    q = torch.randn(2, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 2, 64, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    cos, sin = rope_tables(8, 32)
    k_pages = torch.zeros(2, 4, 2, 64, device="cuda", dtype=torch.float16)
    v_pages = torch.zeros_like(k_pages)
    binding.rotary_qk(q, k, cos, sin, torch.tensor([1, 2], device="cuda"), v=v, k_pages=k_pages, v_pages=v_pages,
                      slots=torch.tensor([-1, 5], device="cuda"))
    assert torch.equal(v_pages.view(-1, 2, 64)[5], v[1])
    assert int((v_pages != 0).sum()) == v[1].numel()


def test_rotary_qk_argument_errors(ops):
    from trellm.kernels_cuda import binding

    q = torch.randn(2, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 2, 64, device="cuda", dtype=torch.float16)
    cos, sin = rope_tables(8, 32)
    with pytest.raises(binding.KernelArgumentError, match="positions"):
        binding.rotary_qk(q, k, cos, sin, torch.tensor([1, 2], device="cuda", dtype=torch.int32))
    with pytest.raises(binding.KernelArgumentError, match="both or neither"):
        binding.rotary_qk(q, k, cos, sin, torch.tensor([1, 2], device="cuda"), q_norm=torch.ones(64, device="cuda",
                                                                                             dtype=torch.float16))
    with pytest.raises(binding.KernelArgumentError, match="cos_table"):
        binding.rotary_qk(q, k, *rope_tables(8, 40), torch.tensor([1, 2], device="cuda"))


def test_rotary_qk_write_kv_in_cuda_graph(ops):
    """Capturable (no host syncs): replays read the positions / slots written into the static inputs."""
    from trellm.ops.attention import rotary_qk_write_kv

    torch.manual_seed(2)
    q = torch.randn(1, 8, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 2, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    cos, sin = rope_tables(64, 64)
    positions = torch.tensor([3], device="cuda")
    slots = torch.tensor([3], device="cuda")
    k_pages = torch.zeros(4, 16, 2, 128, device="cuda", dtype=torch.float16)
    v_pages = torch.zeros_like(k_pages)
    impl = cuda_impl(rotary_qk_write_kv)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        impl(q, k, v, cos, sin, positions, k_pages, v_pages, slots)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            q_out, _ = impl(q, k, v, cos, sin, positions, k_pages, v_pages, slots)
    torch.cuda.current_stream().wait_stream(s)
    positions.fill_(50)
    slots.fill_(40)
    g.replay()
    torch.cuda.synchronize()
    q_ref, _ = rotary_qk_write_kv.reference(q, k, v, cos, sin, positions, k_pages.clone(), v_pages.clone(), slots)
    assert rel_err(q_out, q_ref) < 1e-3
    assert torch.equal(v_pages.view(-1, 2, 128)[40], v[0])


# ---------------------------------------------------------------------------------------------
# Paged attention: the key splits merged inside the kernel (arrival counters)


@pytest.mark.parametrize("split_keys", [None, "16"])  # default (128 keys per split) and over 32 splits
@pytest.mark.parametrize("sinks", [False, True])
def test_paged_attention_in_kernel_split_merge(ops, sinks, split_keys, monkeypatch):
    """Decode over a long context uses key splits; repeated calls and graph replays must each merge
    correctly (the counters reset themselves)."""
    from trellm.kernels_cuda import binding

    f16 = binding.DTYPE_CODES[torch.float16]
    if split_keys is not None:
        monkeypatch.setenv("TRELLM_ATTN_SPLIT_KEYS", split_keys)
        # more than 32: the merge's second lane half (splits 32..63) takes part
        assert binding.lib().trellm_paged_attention_splits_for(1, 32, 8, 128, f16, 16, 188, 132) > 32

    torch.manual_seed(3)
    hq, hkv, d, page_size, ctx = 32, 8, 128, 16, 3000
    pages = (ctx + page_size - 1) // page_size
    k_pages = torch.randn(pages + 2, page_size, hkv, d, device="cuda", dtype=torch.float16)
    v_pages = torch.randn_like(k_pages)
    table = torch.randperm(pages + 2, device="cuda")[:pages].to(torch.int32).view(1, pages)
    cu = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
    lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
    sink = torch.randn(hq, device="cuda") if sinks else None
    assert binding.lib().trellm_paged_attention_splits_for(1, hq, hkv, d, f16, page_size, pages, 132) > 1
    impl = cuda_impl(ops.paged_attention)
    scale = d**-0.5

    def ref(q):
        return ops.paged_attention.reference(q, k_pages, v_pages, table, cu, lens, scale, 0, 0.0, sink)

    for _ in range(3):
        q = torch.randn(1, hq, d, device="cuda", dtype=torch.float16)
        assert rel_err(impl(q, k_pages, v_pages, table, cu, lens, scale, 0, 0.0, sink), ref(q)) < 2e-3
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = impl(q, k_pages, v_pages, table, cu, lens, scale, 0, 0.0, sink)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref(q)) < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ctx_lens, window", [([600], 0), ([600, 3000, 1], 0), ([5000], 700)])
def test_paged_attention_splits_follow_the_context(ops, dtype, ctx_lens, window):
    """A short context in a large cache: the key splits divide each token's actual key range (not the
    cache's capacity), so most of them are empty; the merge must ignore those and stay exact."""
    from trellm.kernels_cuda import binding

    torch.manual_seed(5)
    hq, hkv, d, page_size, capacity = 32, 8, 128, 16, 8192
    blocks = capacity // page_size
    batch = len(ctx_lens)
    k_pages = torch.randn(batch * blocks, page_size, hkv, d, device="cuda", dtype=dtype)
    v_pages = torch.randn_like(k_pages)
    table = torch.randperm(batch * blocks, device="cuda").to(torch.int32).view(batch, blocks)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.tensor(ctx_lens, device="cuda", dtype=torch.int32)
    code = binding.DTYPE_CODES[dtype]
    assert binding.lib().trellm_paged_attention_splits_for(batch, hq, hkv, d, code, page_size, blocks, 132) > 8
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    out = cuda_impl(ops.paged_attention)(q, k_pages, v_pages, table, cu, lens, d**-0.5, window)
    ref = ops.paged_attention.reference(q, k_pages, v_pages, table, cu, lens, d**-0.5, window)
    assert rel_err(out, ref) < {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]


@pytest.mark.parametrize("d", [64, 96, 128, 160, 256])  # 96 and 160 in fp16: V dims not whole words
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_attention_vector_and_scalar_rows(ops, dtype, d):
    """K/V rows read with 16-byte loads (aligned pages) and element by element (pages 2 bytes off)."""
    torch.manual_seed(4)
    hq, hkv, page_size, ctx = 8, 2, 16, 200
    pages = (ctx + page_size - 1) // page_size
    shape = (pages, page_size, hkv, d)
    table = torch.arange(pages, device="cuda", dtype=torch.int32).flip(0).view(1, pages)
    cu = torch.tensor([0, 3], device="cuda", dtype=torch.int32)
    lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
    q = torch.randn(3, hq, d, device="cuda", dtype=dtype)
    impl = cuda_impl(ops.paged_attention)
    for k_pages, v_pages in (
        (torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype)),
        (unaligned(shape, dtype), unaligned(shape, dtype)),
    ):
        out = impl(q, k_pages, v_pages, table, cu, lens, d**-0.5)
        ref = ops.paged_attention.reference(q, k_pages, v_pages, table, cu, lens, d**-0.5)
        assert rel_err(out, ref) < (2e-3 if dtype == torch.float16 else 1e-5)


# ---------------------------------------------------------------------------------------------
# Vector paths next to their scalar fallbacks


def unaligned(shape, dtype, scale=1.0) -> torch.Tensor:
    """A random tensor whose data starts 2 bytes past a 16-byte boundary (forces the scalar path)."""
    n = 1
    for s in shape:
        n *= s
    base = torch.randn(n + 8, device="cuda").to(dtype) * scale
    return base[1 : n + 1].view(shape)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [8, 128, 1000, 999, 12288])
def test_rms_norm_vector_and_scalar(ops, dtype, dim):
    x = torch.randn(5, dim, device="cuda", dtype=dtype) * 3
    r = torch.randn_like(x)
    w = torch.randn(dim, device="cuda", dtype=dtype)
    for xx, rr in ((x, r), (unaligned((5, dim), dtype, 3.0), unaligned((5, dim), dtype))):
        out = cuda_impl(ops.rms_norm)(xx, w, 1e-6, True)
        assert rel_err(out, ops.rms_norm.reference(xx, w, 1e-6, True)) < TOL[dtype]
        y, h = cuda_impl(ops.add_rms_norm)(xx, rr, w, 1e-6)
        y_ref, h_ref = ops.add_rms_norm.reference(xx, rr, w, 1e-6)
        assert torch.equal(h, h_ref)
        assert rel_err(y, y_ref) < TOL[dtype]
    w32 = torch.randn(dim, device="cuda")  # weight wider than x: two 16-byte loads per vector
    out = cuda_impl(ops.rms_norm)(x, w32, 1e-6)
    assert rel_err(out, ops.rms_norm.reference(x, w32, 1e-6)) < TOL[dtype] * 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_hadamard_128_vector_and_scalar(ops, dtype):
    from trellm.kernels_cuda import binding

    dim = 512
    pre, post, bias = (torch.randn(dim, device="cuda", dtype=torch.float16) for _ in range(3))
    for x in (torch.randn(6, dim, device="cuda", dtype=dtype), unaligned((6, dim), dtype)):
        out = binding.hadamard_128(x, pre=pre, post=post, bias=bias, out_dtype=torch.float32)
        ref = ops.exl3.hadamard_128.reference(x.float() * pre.float()) * post.float() + bias.float()
        assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("head_dim", [128, 100])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rotary_embedding_vector_and_scalar(ops, dtype, head_dim):
    half = head_dim // 2
    pos = torch.arange(9, device="cuda").float()[:, None] * 13
    inv = 1.0 / (10000 ** (torch.arange(half, device="cuda").float() / half))
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
    for x in (torch.randn(9, 4, head_dim, device="cuda", dtype=dtype), unaligned((9, 4, head_dim), dtype)):
        out = cuda_impl(ops.rotary_embedding)(x, cos, sin, False)
        assert rel_err(out, ops.rotary_embedding.reference(x, cos, sin, False)) < TOL[dtype]


# ---------------------------------------------------------------------------------------------
# A whole model: the fused decoder path on the GPU vs the references


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_tiny_model_decode_kernels_vs_reference(ops, arch, tmp_path, monkeypatch):
    import trellm
    from trellm.batch import ForwardBatch
    from trellm.cache import KVCache
    from trellm.graph import GraphRunner
    from trellm.sdk.testing import make_tiny_hf_model

    model_dir = make_tiny_hf_model(arch, tmp_path, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=128, intermediate_size=256)
    lm = trellm.load(model_dir, device="cuda", dtype=torch.float16, tokenizer=False)
    model = lm.model
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]

    def run() -> list[torch.Tensor]:
        cache = KVCache.for_model(model, max_tokens=64, page_size=16)
        pages = cache.allocator.alloc(4)
        out = [model.forward(ForwardBatch.with_cache([prompt], [0], [pages], cache))]
        for i, tok in enumerate((7, 11, 13)):
            out.append(model.forward(ForwardBatch.with_cache([[tok]], [len(prompt) + i], [pages], cache)))
        return [o.float() for o in out]

    with torch.no_grad():
        fused = run()
        monkeypatch.setenv("TRELLM_OPS", "reference")
        ref = run()
        monkeypatch.delenv("TRELLM_OPS")
        for a, b in zip(fused, ref):
            assert rel_err(a, b) < 1e-2

        # The same decode steps replayed from a CUDA graph.
        cache = KVCache.for_model(model, max_tokens=128, page_size=16)  # 4 pages + the runner's scratch page
        pages = cache.allocator.alloc(4)
        runner = GraphRunner(model, cache, batch_sizes=(1,), max_context=64)
        model.forward(ForwardBatch.with_cache([prompt], [0], [pages], cache))
        for i, tok in enumerate((7, 11, 13)):
            logits = runner.forward(ForwardBatch.with_cache([[tok]], [len(prompt) + i], [pages], cache))
            assert runner.graphs, "the decode step was captured"
            assert rel_err(logits.float(), ref[i + 1]) < 1e-2


def test_paged_attention_splits_fill_whole_waves(ops, monkeypatch):
    """The split count keeps the grid in whole waves of the kernel's resident blocks. 32 decode tokens
    of 8 kv heads (256 blocks per split) over a 2048-token cache: on 132 SMs holding 3 blocks each, 3
    splits (2 waves of 811-key blocks) beat the occupancy-blind rule's 2 (2 waves of 1152)."""
    from trellm.kernels_cuda import binding

    lib, f16 = binding.lib(), binding.DTYPE_CODES[torch.float16]

    def model(groups: int, capacity: int, per_sm: int, sms: int = 132, min_keys: int = 128) -> int:
        costs = [(-(-groups * s // (sms * per_sm))) * (min_keys + capacity / s) for s in range(1, min(64, capacity // min_keys) + 1)]
        return 1 + min(range(len(costs)), key=lambda i: (costs[i], i))

    chosen = lib.trellm_paged_attention_splits_for(32, 32, 8, 128, f16, 16, 128, 132)
    assert chosen in {model(256, 2048, per_sm) for per_sm in range(1, 9)}
    assert model(256, 2048, 3) == 3
