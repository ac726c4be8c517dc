"""Every CUDA kernel held against its torch reference op (llama.cpp's test-backend-ops idea).

GPU only: skipped without CUDA. Fresh random inputs per check; outputs compared by relative
Frobenius error against the float32/float64 reference, bit-exact where the format demands it.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GOLDEN = Path(__file__).parent / "data" / "golden"
CODEBOOKS = ("3inst", "mcg", "mul1")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def cuda_impl(op):
    impl = op.impls.get("cuda")
    assert impl is not None, f"{op.name} has no CUDA implementation registered"
    return impl


# ---------------------------------------------------------------------------------------------
# Plumbing: launch, errors, graphs


def test_fill_and_graph_replay(kb):
    out = torch.full((1 << 20,), -1.0, device="cuda")
    kb.fill_f32(out, 3.5)
    torch.cuda.synchronize()
    assert (out == 3.5).all()

    # Captured on torch's current (side) stream, replayed with a changed input.
    x = torch.randn(4, 4096, device="cuda", dtype=torch.float16)
    y = torch.empty(4, 4096, device="cuda", dtype=torch.float16)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kb.hadamard_128(x)  # warm-up outside capture
        with torch.cuda.graph(g, stream=s):
            y.copy_(kb.hadamard_128(x))
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    from trellm.ops.exl3 import hadamard_128

    assert rel_err(y, hadamard_128.reference(x)) < 2e-3


def test_errors_carry_text(kb):
    from trellm.kernels_cuda.binding import KernelArgumentError, KernelError

    with pytest.raises(KernelArgumentError, match="last dim 100"):
        kb.hadamard_128(torch.zeros(2, 100, device="cuda"))
    with pytest.raises(KernelArgumentError, match="contiguous"):
        kb.hadamard_128(torch.zeros(256, 4, device="cuda").t())
    with pytest.raises(KernelArgumentError, match="CUDA device"):
        kb.fill_f32(torch.zeros(4), 1.0)
    # The library's own checks come back as KernelError with its text.
    null = kb.ffi().NULL
    rc = kb.lib().trellm_hadamard_128(null, 0, null, 0, 4, 100, null, null, null, kb._stream())
    assert kb.error_string(rc) == "unsupported or inconsistent shape"
    with pytest.raises(KernelError, match="unsupported or inconsistent shape"):
        kb._check(rc, "hadamard_128")
    with pytest.raises(KernelArgumentError, match="rows"):
        t = torch.zeros(8, 8, 64, dtype=torch.int16, device="cuda")
        h = torch.zeros(128, dtype=torch.float16, device="cuda")
        kb.exl3_matmul_small(torch.zeros(33, 128, device="cuda"), t, h, h, "mcg")
    assert "invalid" in kb.error_string(1).lower()  # cudaErrorInvalidValue from the CUDA runtime


# ---------------------------------------------------------------------------------------------
# EXL3


def _random_layer(k: int, n: int, K: int, device="cuda"):
    g = torch.Generator().manual_seed(k * 7 + n * 3 + K)
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), generator=g, dtype=torch.int32).to(torch.int16)
    suh = (torch.randn(k, generator=g) * 0.05).half()
    svh = (torch.rand(n, generator=g) + 0.5).half() * torch.sign(torch.randn(n, generator=g)).half()
    bias = torch.randn(n, generator=g).half()
    return trellis.to(device), suh.to(device), svh.to(device), bias.to(device)


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_codebook_decode_all_states(ops, codebook):
    from safetensors.torch import load_file

    states = torch.arange(65536, dtype=torch.int32, device="cuda")
    out = cuda_impl(ops.exl3.exl3_codebook_decode)(states, codebook)
    ref = ops.exl3.exl3_codebook_decode.reference(states.cpu(), codebook)
    assert torch.equal(out.cpu().view(torch.int16), ref.view(torch.int16))
    golden = GOLDEN / "exl3_codebooks_all_states.safetensors"
    if golden.exists():
        want = load_file(str(golden))[f"codebook.{codebook}"]
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("K", range(1, 9))
def test_decode_tiles_bit_exact(ops, K, codebook):
    trellis, *_ = _random_layer(256, 384, K)
    out = cuda_impl(ops.exl3.exl3_decode_tiles)(trellis, codebook)
    ref = ops.exl3.exl3_decode_tiles.reference(trellis.cpu(), codebook)
    assert torch.equal(out.cpu().view(torch.int16), ref.view(torch.int16))


def test_golden_vectors(ops):
    from safetensors.torch import load_file

    files = sorted(GOLDEN.glob("exl3_k*_256x256.safetensors"))
    if not files:
        pytest.skip("no golden vectors")
    for f in files:
        d = load_file(str(f))
        cb = "mcg" if "layer.mcg" in d else "mul1" if "layer.mul1" in d else "3inst"
        trellis = d["layer.trellis"].cuda()
        w_hat = cuda_impl(ops.exl3.exl3_decode_tiles)(trellis, cb)
        assert torch.equal(w_hat.cpu().view(torch.int16), d["expected.w_hat"].view(torch.int16)), f.name
        x = d["probe.x"].cuda()
        for dtype in (torch.float16, torch.float32):
            y = cuda_impl(ops.exl3.exl3_matmul)(x.to(dtype), trellis, d["layer.suh"].cuda(), d["layer.svh"].cuda(), cb)
            assert rel_err(y.cpu(), d["probe.y"]) < 5e-3, (f.name, dtype)


@pytest.mark.parametrize("codebook", CODEBOOKS + ("mul1_split",))
@pytest.mark.parametrize("K", range(1, 9))
@pytest.mark.parametrize("k, rows", [(512, (1, 5, 8)), (2048, (1, 5, 16)), (1664, (3, 12))],
                         ids=["one-slice", "sliced-k", "short-last-slice"])
def test_exl3_matmul_gemv_all_k(kb, ops, K, codebook, k, rows):
    # The GEMV itself at every row count it takes (the op routes 9..16 rows to the mid-size matmul by default).
    # k = 2048: two or four k-slices, whose sums meet in the epilogue (global partials and arrival counters);
    # k = 1664: a last slice of fewer 128-chunks. "mul1_split" is MUL1 on the split-halves decode, which sums
    # each slice's x for the codebook's offset: held against MUL1's reference.
    n = 384
    trellis, suh, svh, bias = _random_layer(k, n, K)
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        y = kb.exl3_matmul_small(x, trellis, suh, svh, codebook, bias)
        ref = ops.exl3.exl3_matmul.reference(x.float(), trellis, suh, svh, codebook.removesuffix("_split"), bias)
        assert y.dtype == torch.float16 and y.shape == (m, n)
        assert rel_err(y, ref) < 3e-3, (m, K, codebook)


def test_mul1_split_route_reaches_every_matmul_entry(ops, monkeypatch):
    # TRELLM_MUL1_GEMV=split takes every in-register matmul entry of the ops (plain, gated, residual add, q/k/v
    # group, q/k/v + RoPE + KV write; the GEMV's rows and the mid route's up to 8) onto the split decode: each
    # result near MUL1's reference and not bit-equal to the "fma" route's (the split route multiplies by the
    # unrounded weights, so equality would mean it was not taken). At 12 rows (two row groups of the mid route)
    # MUL1 keeps its own decode. A bad value is refused by name.
    from trellm.ops.exl3 import MUL1_GEMV_ENV
    from trellm.ops.exl3 import (exl3_matmul, exl3_matmul_add, exl3_matmul_gated, exl3_matmul_gated_add,
                                 exl3_matmul_group, exl3_qkv_rope_write_kv)

    torch.manual_seed(11)
    k_in, hq, hkv, d = 1024, 4, 2, 128
    layer = _random_layer(k_in, 512, 4)
    qkv = [_random_layer(k_in, n, 4) for n in (hq * d, hkv * d, hkv * d)]
    half = d // 2
    ang = torch.arange(16, device="cuda").float()[:, None] / (10000 ** (torch.arange(half, device="cuda").float() / half))
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()

    def calls(rows: int) -> dict:
        torch.manual_seed(rows)
        x, gate, up = (torch.randn(rows, k_in, device="cuda", dtype=torch.float16) for _ in range(3))
        residual = torch.randn(rows, 512, device="cuda", dtype=torch.float16)
        pages = [torch.zeros(2, 16, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2)]
        positions = torch.arange(rows, device="cuda")
        return {
            "matmul": lambda: cuda_impl(exl3_matmul)(x, *layer[:3], "mul1", layer[3]),
            "gated": lambda: cuda_impl(exl3_matmul_gated)(gate, up, "silu", *layer[:3], "mul1", None),
            "add": lambda: cuda_impl(exl3_matmul_add)(x, *layer[:3], "mul1", layer[3], residual)[0],
            "gated_add": lambda: cuda_impl(exl3_matmul_gated_add)(gate, up, "silu", *layer[:3], "mul1", None, residual)[0],
            "group": lambda: torch.cat(cuda_impl(exl3_matmul_group)(x, qkv, "mul1"), dim=-1),
            "qkv_rope": lambda: torch.cat([t.reshape(rows, -1) for t in cuda_impl(exl3_qkv_rope_write_kv)(
                x, qkv, "mul1", d, cos, sin, positions, *pages, positions)], dim=-1),
        }

    for rows, split in ((1, True), (5, True), (7, True), (12, False)):
        monkeypatch.setenv(MUL1_GEMV_ENV, "fma")
        fma = {name: call() for name, call in calls(rows).items()}
        monkeypatch.setenv(MUL1_GEMV_ENV, "split")
        results = {name: call() for name, call in calls(rows).items()}
        for name in fma:
            assert rel_err(results[name], fma[name]) < 3e-3, (name, rows)
            assert torch.equal(results[name], fma[name]) != split, (name, rows, "split route taken" if split else "mul1's own")
    monkeypatch.setenv(MUL1_GEMV_ENV, "fast")
    with pytest.raises(ValueError, match=MUL1_GEMV_ENV):
        cuda_impl(exl3_matmul)(torch.randn(1, k_in, device="cuda", dtype=torch.float16), *layer[:3], "mul1")


@pytest.mark.parametrize("codebook", CODEBOOKS + ("mul1_split",))
@pytest.mark.parametrize("K", range(1, 9))
def test_exl3_matmul_mid_all_k(kb, ops, K, codebook, monkeypatch):
    # The mid-size route (trellis decoded in registers against packed x fragments): every K and codebook,
    # row counts for each of its row-group sizes (1, 2, 4, 8 groups of 8) and their edges, k split into several
    # slices. "mul1_split" (MUL1's split-halves decode, x summed in the pack for the offset) runs up to 8 rows
    # (one row group) and is MUL1's own decode above: bit-equal to "mul1" (its default fma route) there.
    from trellm.ops.exl3 import MUL1_GEMV_ENV

    monkeypatch.delenv(MUL1_GEMV_ENV, raising=False)  # "mul1" is the fma route
    k, n = 2048, 384
    trellis, suh, svh, bias = _random_layer(k, n, K)
    for m in (1, 6, 8, 9, 16, 17, 33, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        y = kb.exl3_matmul_mid(x, trellis, suh, svh, codebook, bias)
        ref = ops.exl3.exl3_matmul.reference(x.float(), trellis, suh, svh, codebook.removesuffix("_split"), bias)
        assert y.dtype == torch.float16 and y.shape == (m, n)
        assert rel_err(y, ref) < 3e-3, (m, K, codebook)
        if codebook == "mul1_split":
            assert torch.equal(y, kb.exl3_matmul_mid(x, trellis, suh, svh, "mul1", bias)) == (m > 8), (m, K)


@pytest.mark.parametrize("codebook", ["3inst", "mul1"])
@pytest.mark.parametrize("K", [2, 4])
def test_exl3_matmul_mid_multi_parts(kb, ops, K, codebook):
    # Several parts in one call, the units of all parts split evenly over one wave of blocks: k = 4096 and
    # 48 groups (q/k/v-like) make ~6 units per block, so blocks cross group and part boundaries and a group's
    # sum meets up to three blocks' partials; k = 512 with 3 groups leaves one unit per block. Against the
    # reference and against one call per part (other block boundaries, so close, not bit-equal).
    for k, ns in ((4096, (4096, 1024, 1024)), (512, (128, 256))):
        parts = [_random_layer(k, n, K) for n in ns]
        parts = [(t, suh, svh, bias if i != 1 else None) for i, (t, suh, svh, bias) in enumerate(parts)]
        for m in (7, 17, 40, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ys = kb.exl3_matmul_mid_multi(x, parts, codebook)
            assert [tuple(y.shape) for y in ys] == [(m, n) for n in ns] and all(y.dtype == x.dtype for y in ys)
            for (trellis, suh, svh, bias), y in zip(parts, ys):
                ref = ops.exl3.exl3_matmul.reference(x.float(), trellis, suh, svh, codebook, bias)
                alone = kb.exl3_matmul_mid(x, trellis, suh, svh, codebook, bias)
                assert rel_err(y, ref) < 1e-2 and rel_err(y, alone) < 8e-3, (k, m, K, codebook)


def test_exl3_matmul_group_mid_rows(ops):
    # exl3_matmul_group above the GEMV's rows: one mid-size call for all parts, with the row norm applied
    # first; leading dims kept.
    from trellm.ops import RowNorm
    from trellm.ops.dense import group_sum_squares

    parts = [_random_layer(1024, n, 4) for n in (512, 256)]
    for rows in (6, 24, 64):
        h = torch.randn(2, rows // 2, 1024, device="cuda", dtype=torch.float16)
        norm = RowNorm(group_sum_squares(h.reshape(rows, -1)), None, 1e-6, False)
        for row_norm in (None, norm):
            ys = cuda_impl(ops.exl3.exl3_matmul_group)(h, parts, "mcg", row_norm)
            ys_ref = ops.exl3.exl3_matmul_group.reference(h.float(), parts, "mcg", row_norm)
            for y, y_ref in zip(ys, ys_ref):
                assert y.shape == (2, rows // 2, y_ref.shape[-1]) and rel_err(y, y_ref) < 3e-3, (rows, row_norm)


def test_exl3_matmul_mid_rejects_bad_rows(kb):
    from trellm.kernels_cuda.binding import KernelArgumentError

    trellis, suh, svh, _ = _random_layer(256, 128, 4)
    with pytest.raises(KernelArgumentError, match="65 rows"):
        kb.exl3_matmul_mid(torch.zeros(65, 256, device="cuda", dtype=torch.float16), trellis, suh, svh, "mcg")
    other = _random_layer(256, 128, 3)
    with pytest.raises(KernelArgumentError, match="bits per weight differ"):
        kb.exl3_matmul_mid_multi(torch.zeros(20, 256, device="cuda", dtype=torch.float16),
                                 [(trellis, suh, svh, None), other], "mcg")


@pytest.mark.parametrize("m", [1, 2, 7, 9, 16, 17, 32, 33, 64, 65, 100])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_exl3_matmul_rows_and_dtypes(ops, m, dtype):
    k, n, K = 4096, 1024, 4
    trellis, suh, svh, bias = _random_layer(k, n, K)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    y = cuda_impl(ops.exl3.exl3_matmul)(x, trellis, suh, svh, "mcg", bias if m % 2 else None)
    ref = ops.exl3.exl3_matmul.reference(x.float(), trellis, suh, svh, "mcg", bias if m % 2 else None)
    assert y.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 3e-3
    assert rel_err(y, ref) < tol


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exl3_matmul_gated(kb, ops, activation, dtype):
    # The down projection of act(gate) * up: the GEMV's rows (where it may apply the activation in its input
    # transform), then the mid-size route.
    k, n, K = 4096, 1024, 4
    trellis, suh, svh, bias = _random_layer(k, n, K)
    for m in (1, 5, 16, 40):
        gate = torch.randn(m, k, device="cuda", dtype=dtype)
        up = torch.randn(m, k, device="cuda", dtype=dtype)
        y = cuda_impl(ops.exl3.exl3_matmul_gated)(gate, up, activation, trellis, suh, svh, "mcg", bias)
        ref = ops.exl3.exl3_matmul_gated.reference(gate.float(), up.float(), activation, trellis, suh, svh, "mcg", bias)
        assert y.dtype == dtype and y.shape == (m, n)
        assert rel_err(y, ref) < (1e-2 if dtype == torch.bfloat16 else 3e-3), (m, activation)
        # the fused GEMV rounds act(gate) * up as the separate kernel does: the same bits as the two ops
        composed = cuda_impl(ops.exl3.exl3_matmul)(cuda_impl(ops.gated_activation)(gate, up, activation), trellis,
                                                   suh, svh, "mcg", bias)
        assert torch.equal(y, composed), (m, activation)
        if m <= 16:  # the fused GEMV itself at every row count it takes, whatever the op routes there
            fused = kb.exl3_matmul_small_gated(gate, up, activation, trellis, suh, svh, "mcg", bias)
            gemv = kb.exl3_matmul_small(cuda_impl(ops.gated_activation)(gate, up, activation), trellis, suh, svh,
                                        "mcg", bias)
            assert torch.equal(fused, gemv), (m, activation)


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("K", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_exl3_matmul_group_one_launch(ops, K, codebook, m):
    # q/k/v-like parts of different widths, one with a bias: every part matches its own reference.
    k = 1024
    parts = [_random_layer(k, n, K) for n in (1024, 256, 384)]
    parts = [(t, suh, svh, bias if i == 1 else None) for i, (t, suh, svh, bias) in enumerate(parts)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ys = cuda_impl(ops.exl3.exl3_matmul_group)(x, parts, codebook)
    assert [tuple(y.shape) for y in ys] == [(m, 1024), (m, 256), (m, 384)]
    for y, (t, suh, svh, bias) in zip(ys, parts):
        ref = ops.exl3.exl3_matmul.reference(x.float(), t, suh, svh, codebook, bias)
        assert y.dtype == torch.bfloat16 and rel_err(y, ref) < 1e-2, (K, codebook, m)


def test_exl3_matmul_group_mixed_bits_and_misaligned(ops):
    # Parts of different K cannot share a launch (one by one instead); a trellis view that is not
    # 16-byte aligned is copied for the kernel's 16-byte loads rather than rejected.
    a, b = _random_layer(512, 256, 3), _random_layer(512, 384, 4)
    x = torch.randn(2, 512, device="cuda", dtype=torch.float16)
    ys = cuda_impl(ops.exl3.exl3_matmul_group)(x, [a, b], "3inst")
    for y, p in zip(ys, (a, b)):
        assert rel_err(y, ops.exl3.exl3_matmul.reference(x.float(), *p[:3], "3inst", p[3])) < 3e-3
    t, suh, svh, _ = _random_layer(512, 256, 2)
    flat = torch.cat([torch.zeros(1, dtype=torch.int16, device="cuda"), t.flatten()])
    shifted = flat[1:].view(t.shape)
    assert shifted.data_ptr() % 16
    y = cuda_impl(ops.exl3.exl3_matmul)(x, shifted, suh, svh, "mcg")
    assert rel_err(y, ops.exl3.exl3_matmul.reference(x.float(), t, suh, svh, "mcg")) < 3e-3


def test_exl3_matmul_graph_capture(ops):
    k, n = 4096, 14336
    trellis, suh, svh, _ = _random_layer(k, n, 4)
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    fn = cuda_impl(ops.exl3.exl3_matmul)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        fn(x, trellis, suh, svh, "mul1")
        with torch.cuda.graph(g, stream=s):
            y = fn(x, trellis, suh, svh, "mul1")
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    ref = ops.exl3.exl3_matmul.reference(x.float(), trellis, suh, svh, "mul1")
    assert rel_err(y, ref) < 3e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_hadamard_128(ops, dtype):
    x = torch.randn(3, 5, 1024, device="cuda", dtype=dtype)
    out = cuda_impl(ops.exl3.hadamard_128)(x)
    ref = ops.exl3.hadamard_128.reference(x)
    assert out.dtype == dtype
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3 if dtype == torch.float16 else 1e-6)


# ---------------------------------------------------------------------------------------------
# Dense ops


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [64, 4096, 5120])
def test_rms_norm(ops, dtype, dim):
    x = torch.randn(7, dim, device="cuda", dtype=dtype) * 3
    w = torch.randn(dim, device="cuda", dtype=dtype)
    for unit_offset in (False, True):
        out = cuda_impl(ops.rms_norm)(x, w, 1e-6, unit_offset)
        ref = ops.rms_norm.reference(x, w, 1e-6, unit_offset)
        assert rel_err(out, ref) < (8e-3 if dtype == torch.bfloat16 else 1e-3 if dtype == torch.float16 else 1e-6)
    out = cuda_impl(ops.rms_norm)(x, None, 1e-5)
    assert rel_err(out, ops.rms_norm.reference(x, None, 1e-5)) < 8e-3
    w32 = torch.randn(dim, device="cuda")
    out = cuda_impl(ops.rms_norm)(x, w32, 1e-6)
    assert rel_err(out, ops.rms_norm.reference(x, w32, 1e-6)) < 8e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_rms_norm(ops, dtype):
    x = torch.randn(2, 9, 4096, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    y, h = cuda_impl(ops.add_rms_norm)(x, r, w, 1e-6)
    y_ref, h_ref = ops.add_rms_norm.reference(x, r, w, 1e-6)
    assert torch.equal(h, h_ref)
    assert rel_err(y, y_ref) < (8e-3 if dtype == torch.bfloat16 else 1e-3)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot_frac", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rotary_embedding(ops, interleaved, rot_frac, dtype):
    tokens, heads, head_dim = 11, 8, 128
    half = int(head_dim * rot_frac) // 2
    x = torch.randn(tokens, heads, head_dim, device="cuda", dtype=dtype)
    pos = torch.arange(tokens, device="cuda").float()[:, None] * 37
    inv = 1.0 / (10000 ** (torch.arange(half, device="cuda").float() / half))
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
    out = cuda_impl(ops.rotary_embedding)(x, cos, sin, interleaved)
    ref = ops.rotary_embedding.reference(x, cos, sin, interleaved)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < (8e-3 if dtype == torch.bfloat16 else 1e-3 if dtype == torch.float16 else 1e-6)


@pytest.mark.parametrize("dim", [1000, 999])  # 16-byte vector path, scalar path
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu", "relu2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gated_activation(ops, activation, dtype, dim):
    gu = torch.randn(13, 2 * dim, device="cuda", dtype=dtype) * 2
    gate, up = gu[:, :dim], gu[:, dim:]  # strided views of a fused projection
    out = cuda_impl(ops.gated_activation)(gate, up, activation)
    ref = ops.gated_activation.reference(gate, up, activation)
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3 if dtype == torch.float16 else 1e-5)


# ---------------------------------------------------------------------------------------------
# Paged KV cache and attention


def _paged_setup(dtype, ctx_lens, q_lens, hq=8, hkv=2, d=128, page_size=16, seed=0):
    torch.manual_seed(seed)
    batch = len(ctx_lens)
    max_blocks = max((c + page_size - 1) // page_size for c in ctx_lens)
    num_pages = batch * max_blocks + 3
    k_pages = torch.randn(num_pages, page_size, hkv, d, device="cuda", dtype=dtype)
    v_pages = torch.randn_like(k_pages)
    perm = torch.randperm(num_pages, device="cuda")[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    q = torch.randn(int(sum(q_lens)), hq, d, device="cuda", dtype=dtype)
    return q, k_pages, v_pages, perm, cu, torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    [
        dict(ctx=[1, 17, 300, 64], q=[1, 1, 1, 1]),  # decode
        dict(ctx=[40, 77], q=[40, 13]),  # prefill + chunked prefill
        dict(ctx=[200, 33], q=[1, 5], window=32),
        dict(ctx=[90], q=[3], softcap=30.0, sinks=True),
        dict(ctx=[50, 50], q=[1, 1], hq=32, hkv=2, d=64),  # group of 16 heads
        dict(ctx=[1000], q=[1], window=300, softcap=20.0, sinks=True),  # key splits + merge
        dict(ctx=[3000, 5], q=[2, 5], d=256),
    ],
)
def test_paged_attention(ops, dtype, case):
    q, kp, vp, bt, cu, cl = _paged_setup(
        dtype, case["ctx"], case["q"], hq=case.get("hq", 8), hkv=case.get("hkv", 2), d=case.get("d", 128)
    )
    sinks = torch.randn(q.shape[1], device="cuda") if case.get("sinks") else None
    kw = dict(sliding_window=case.get("window", 0), softcap=case.get("softcap", 0.0), sinks=sinks)
    out = cuda_impl(ops.paged_attention)(q, kp, vp, bt, cu, cl, None, **kw)
    ref = ops.paged_attention.reference(q, kp, vp, bt, cu, cl, None, **kw)
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_write_kv_pages(ops, dtype):
    pages, page_size, hkv, d = 10, 16, 4, 64
    kp = torch.randn(pages, page_size, hkv, d, device="cuda", dtype=dtype)
    vp = torch.randn_like(kp)
    kp_ref, vp_ref = kp.clone(), vp.clone()
    slots = torch.randperm(pages * page_size, device="cuda")[:23]
    k = torch.randn(23, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    cuda_impl(ops.write_kv_pages)(k, v, kp, vp, slots)
    ops.write_kv_pages.reference(k, v, kp_ref, vp_ref, slots)
    assert torch.equal(kp, kp_ref) and torch.equal(vp, vp_ref)


def test_dispatch_picks_cuda(ops):
    x = torch.randn(2, 256, device="cuda", dtype=torch.float16)
    assert "cuda" in ops.rms_norm.impls
    assert rel_err(ops.rms_norm(x, None, 1e-6), ops.rms_norm.reference(x, None, 1e-6)) < 1e-3


def test_exl3_matmul_wide_layer_paths_agree(ops):
    # A wide layer makes the fused kernel walk runs of several 128-column groups per block; the
    # decode + cuBLAS path (M > 64, built on the bit-exact tile decoder) is the cross-check for it and
    # for the mid-size route (17..64 rows).
    k, n = 4096, 36864
    trellis, suh, svh, bias = _random_layer(k, n, 2)
    x = torch.randn(80, k, device="cuda", dtype=torch.float16)
    fn = cuda_impl(ops.exl3.exl3_matmul)
    y_wide = fn(x, trellis, suh, svh, "3inst", bias)
    for rows in (1, 8, 16, 40, 64):
        y = fn(x[:rows], trellis, suh, svh, "3inst", bias)
        assert rel_err(y, y_wide[:rows]) < 2e-3, rows


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 6, 7, 8])
def test_trellis_viterbi(ops, K):
    codebook = ("3inst", "mcg", "mul1")[K % 3]
    torch.manual_seed(K)
    targets = torch.randn(6, 256, device="cuda") * 1.2
    states = cuda_impl(ops.exl3.trellis_viterbi)(targets, K, codebook)
    ref = ops.exl3.trellis_viterbi.reference(targets, K, codebook)
    mask = (1 << (16 - K)) - 1
    # a valid tail-biting path: each state inherits the previous one's low 16-K bits, round the ring
    prev = torch.roll(states, 1, dims=1)
    assert torch.equal(states >> K, prev & mask)
    lut = ops.exl3.codebook_lut(codebook, "cuda", torch.float32)
    err = ((lut[states.long()] - targets) ** 2).sum(1)
    err_ref = ((lut[ref.long()] - targets) ** 2).sum(1)
    # the same two-pass search: the same or an equally good path (float rounding may break near-ties)
    assert torch.all(err <= err_ref * 1.02 + 1e-4), (err, err_ref)
    assert (states == ref).float().mean() > 0.5
