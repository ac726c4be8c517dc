"""KV-cache quantization kernels (kernels_cuda/kv_quant.cu) held against trellm.ops.kv_quant's torch reference.

The packed format must be the reference's exactly (a cache written by one path is read by the other).
Codes and scales are expected bit-identical; the only admitted difference is a code off by one where the
float32 Hadamard sum of a group is inexact (inputs spanning more than ~19 binades), where cuBLAS's
summation order and the kernel's butterflies may round differently. Dequantized values agree to float32
rounding (the kernel scales once after an exact transform, the reference rounds every term), i.e. within
one unit in the last place of fp16/bf16.

GPU tests are marked ``cuda``; the CPU tests at the end check the packing scheme the kernel uses, the
argument checks, and that the file compiles with nvcc.
"""
from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from trellm.ops.kv_quant import GROUP, _hadamard32, _pack, _unpack, bit_planes, kv_dequantize, kv_quantize



def gpu(test):
    """Mark a test ``cuda`` and skip it without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


BITS = tuple(range(2, 9))
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
# Off-by-one codes admitted per quantized value (see the module docstring); zero is what we expect.
CODE_MISMATCH_RATE = 1e-4


@pytest.fixture(scope="module")
def kb():
    pytest.importorskip("cffi")
    from trellm.kernels_cuda import binding
    from trellm.kernels_cuda import ops as cuda_ops  # noqa: F401  (registers the implementations)

    binding.lib()
    return binding


def kv_rows(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0, device: str = "cuda") -> torch.Tensor:
    """[tokens, heads*head_dim] K-like rows: normal values, a few outlier channels, one all-zero token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads * head_dim, generator=g)
    x[:, 3] *= 30
    x[:, heads * head_dim // 2 + 7] *= -12
    if tokens > 2:
        x[1] = 0  # all-zero groups: scale 0, codes 0 (the reference's 0/0)
    return x.to(device=device, dtype=dtype)


def assert_same_codes(packed: torch.Tensor, ref_packed: torch.Tensor, bits: int) -> None:
    assert packed.dtype == torch.int32 and packed.shape == ref_packed.shape
    codes = _unpack(packed.reshape(-1, bits).cpu(), bits)
    ref = _unpack(ref_packed.reshape(-1, bits).cpu(), bits)
    diff = (codes - ref).abs()
    assert diff.max().item() <= 1, f"codes differ by up to {diff.max().item()}"
    rate = (diff != 0).double().mean().item()
    assert rate <= CODE_MISMATCH_RATE, f"{rate:.2e} of the codes differ"


def assert_same_scales(scales: torch.Tensor, ref: torch.Tensor) -> None:
    assert scales.dtype == torch.float16 and scales.shape == ref.shape
    same = scales.view(torch.int16) == ref.view(torch.int16)
    assert same.double().mean().item() >= 1 - CODE_MISMATCH_RATE * 32, "scales differ"
    torch.testing.assert_close(scales.float(), ref.float(), rtol=2**-10, atol=0)


def exact_dequant(packed: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """The format's decoded values in float64 (no rounding): H32 (codes - half + 1/2) * scale / (sqrt(32) half)."""
    half = 1 << (bits - 1)
    rows, groups = scales.shape
    m = _unpack(packed.reshape(-1, bits).cpu(), bits).double() - (half - 0.5)
    y = (m @ _hadamard32("cpu").double()) * (scales.cpu().double().reshape(-1, 1) / (math.sqrt(GROUP) * half))
    return y.view(rows, groups * GROUP)


def check_dequant(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bits: int) -> None:
    """out [R, D] decoded from packed [R, D/32*bits] / scales [R, D/32]: within one unit in the last place of
    the exact value (>= 99.9% of it correctly rounded), and of the torch reference up to the reference's own
    float32 error (it rounds each term before its Hadamard sums: a few 1e-7 of the group's scale, more where
    the sum cancels)."""
    rows, groups = scales.shape
    assert out.shape == (rows, groups * GROUP) and torch.isfinite(out).all()
    ulp = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 2**-21}[out.dtype]
    step = torch.finfo(out.dtype).smallest_normal * torch.finfo(out.dtype).eps  # the subnormal spacing
    group_scale = scales.cpu().double().repeat_interleave(GROUP, dim=1)
    got = out.cpu().double()
    exact = exact_dequant(packed, scales, bits)
    torch.testing.assert_close(got, exact, rtol=ulp, atol=step + 2**-20 * group_scale.max().item())
    assert ((got - exact).abs() <= ulp * exact.abs() + 2**-20 * group_scale + step).all()
    if out.dtype != torch.float32:
        rounded = (out.cpu() == exact.to(out.dtype)).double().mean().item()
        assert rounded >= 0.999, f"only {rounded:.4f} of the values are the correctly rounded result"
    ref = kv_dequantize.reference(packed, scales, bits, out.dtype).cpu().double()
    assert ((got - ref).abs() <= ulp * ref.abs() + 2**-12 * group_scale + step).all()


# ---------------------------------------------------------------------------------------------
# Kernels against the reference ops


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", BITS)
def test_quantize_matches_reference(kb, bits, head_dim, dtype):
    x = kv_rows(37, 2, head_dim, dtype, seed=bits * 1000 + head_dim)
    packed, scales = kb.kv_quantize(x, bits)
    ref_packed, ref_scales = kv_quantize.reference(x, bits)
    assert_same_scales(scales, ref_scales)
    assert_same_codes(packed, ref_packed, bits)


@gpu
@pytest.mark.parametrize("dtype", DTYPES + (torch.float32,), ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_matches_reference(kb, bits, head_dim, dtype):
    x = kv_rows(29, 2, head_dim, torch.float32, seed=bits * 7 + head_dim)
    packed, scales = kv_quantize.reference(x, bits)
    check_dequant(kb.kv_dequantize(packed, scales, bits, dtype), packed, scales, bits)


@gpu
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_every_bit_pattern(kb, bits):
    """Random words exercise every code in every plane; scales span fp16's range (subnormals included)."""
    g = torch.Generator().manual_seed(bits)
    rows, groups = 64, 8
    packed = torch.randint(-(2**31), 2**31, (rows, groups * bits), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(rows, groups, generator=g) * 40 - 30).exp2().half()
    scales[0, 0] = 0
    packed, scales = packed.cuda(), scales.cuda()
    for dtype in (torch.float32, torch.float16):
        check_dequant(kb.kv_dequantize(packed, scales, bits, dtype), packed, scales, bits)


@gpu
@pytest.mark.parametrize("tokens", (1, 3, 7, 33, 1000))
def test_odd_token_counts_and_fp32_input(kb, tokens):
    """Warps whose last groups fall past the end (1..7 groups of 8), and float32 input (two 16-byte loads)."""
    for dtype in (torch.float32, torch.float16):
        x = kv_rows(tokens, 1, 96, dtype, seed=tokens)  # 3 groups per row
        for bits in (3, 8):
            packed, scales = kb.kv_quantize(x, bits)
            ref_packed, ref_scales = kv_quantize.reference(x, bits)
            assert_same_scales(scales, ref_scales)
            assert_same_codes(packed, ref_packed, bits)
            check_dequant(kb.kv_dequantize(packed, scales, bits, dtype), packed, scales, bits)


@gpu
def test_unaligned_tensors_take_the_scalar_path(kb):
    tokens, dim, bits = 9, 128, 5
    x = kv_rows(tokens, 1, dim, torch.bfloat16)
    buf = torch.empty(tokens * dim + 1, dtype=torch.bfloat16, device="cuda")
    shifted = buf[1:].view(tokens, dim)  # contiguous, 2 bytes past a 16-byte boundary
    shifted.copy_(x)
    packed, scales = kb.kv_quantize(shifted, bits)
    packed_a, scales_a = kb.kv_quantize(x, bits)
    assert torch.equal(packed, packed_a) and torch.equal(scales, scales_a)
    out = torch.empty(tokens * dim + 1, dtype=torch.bfloat16, device="cuda")[1:].view(tokens, dim)
    out.copy_(kb.kv_dequantize(packed, scales, bits, torch.bfloat16))
    assert torch.equal(out, kb.kv_dequantize(packed_a, scales_a, bits, torch.bfloat16))


@gpu
@pytest.mark.parametrize("bits", (2, 4, 7))
def test_quantize_store_at_odd_slots(kb, bits):
    """Tokens land at unsorted slots across pages; other rows stay untouched; a negative slot is skipped."""
    num_pages, page_size, dim = 6, 16, 256
    slots = torch.tensor([17, 3, 95, 40, 41, 0, 63, 64, 5], device="cuda")
    x = kv_rows(slots.numel(), 2, dim // 2, torch.float16, seed=bits)
    packed_pages = torch.full((num_pages, page_size, dim // GROUP * bits), 0x5A5A5A5A, dtype=torch.int32, device="cuda")
    scale_pages = torch.full((num_pages, page_size, dim // GROUP), 7.0, dtype=torch.float16, device="cuda")
    expect_packed, expect_scales = packed_pages.clone(), scale_pages.clone()
    ref_packed, ref_scales = kv_quantize.reference(x, bits)
    expect_packed.view(-1, expect_packed.shape[-1])[slots] = ref_packed
    expect_scales.view(-1, expect_scales.shape[-1])[slots] = ref_scales

    kb.kv_quantize_store(x, bits, packed_pages, scale_pages, slots)
    assert_same_scales(scale_pages, expect_scales)
    assert_same_codes(packed_pages, expect_packed, bits)

    skipped = torch.tensor([-1, 2], device="cuda")
    before = packed_pages.clone()
    kb.kv_quantize_store(x[:2], bits, packed_pages, scale_pages, skipped)
    assert torch.equal(packed_pages.view(-1, packed_pages.shape[-1])[num_pages * page_size - 1],
                       before.view(-1, before.shape[-1])[num_pages * page_size - 1])
    assert_same_codes(packed_pages.view(-1, packed_pages.shape[-1])[2], ref_packed[1], bits)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", (3, 4, 8))
def test_dequantize_pages_gathers_in_one_launch(kb, bits, dtype):
    num_pages, page_size, dim = 7, 16, 4 * 128
    x = kv_rows(num_pages * page_size, 4, 128, dtype, seed=bits)
    packed, scales = kv_quantize.reference(x, bits)
    packed_pages = packed.view(num_pages, page_size, -1)
    scale_pages = scales.view(num_pages, page_size, -1)
    pages = torch.tensor([5, 0, 3, 3, 6], device="cuda")
    out = kb.kv_dequantize_pages(packed_pages, scale_pages, pages, bits, dtype)
    assert out.shape == (pages.numel(), page_size, dim)
    check_dequant(out.view(-1, dim), packed_pages[pages].reshape(-1, packed.shape[1]),
                  scale_pages[pages].reshape(-1, scales.shape[1]), bits)
    # a page index outside the cache dequantizes to zeros instead of reading past it
    out = kb.kv_dequantize_pages(packed_pages, scale_pages, torch.tensor([1, num_pages], device="cuda"), bits, dtype)
    assert (out[1] == 0).all()


@gpu
def test_graph_capture_and_op_dispatch(kb):
    """The ops dispatch CUDA tensors to the kernels, and both kernels replay inside a CUDA graph."""
    from trellm import ops

    assert "cuda" in ops.kv_quantize.impls and "cuda" in ops.kv_dequantize.impls
    x = kv_rows(8, 8, 128, torch.float16)
    static_out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        ops.kv_dequantize(*ops.kv_quantize(x, 4), 4, torch.float16)  # warm-up outside capture
        with torch.cuda.graph(g, stream=s):
            static_out.copy_(ops.kv_dequantize(*ops.kv_quantize(x, 4), 4, torch.float16))
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(kv_rows(8, 8, 128, torch.float16, seed=5))
    g.replay()
    torch.cuda.synchronize()
    check_dequant(static_out, *kv_quantize.reference(x, 4), 4)


@gpu
def test_cpu_written_cache_reads_on_cuda(kb):
    """Format compatibility across devices: codes made by the CPU reference decode on the GPU kernel."""
    x = kv_rows(20, 2, 128, torch.float32, device="cpu")
    for bits in BITS:
        packed, scales = kv_quantize.reference(x, bits)
        ref = kv_dequantize.reference(packed, scales, bits, torch.float32)
        out = kb.kv_dequantize(packed.cuda(), scales.cuda(), bits, torch.float32).cpu()
        check_dequant(out, packed, scales, bits)
        gpu_packed, gpu_scales = kb.kv_quantize(x.cuda(), bits)
        back = kv_dequantize.reference(gpu_packed.cpu(), gpu_scales.cpu(), bits, torch.float32)
        assert ((back - x).norm() / x.norm()).item() < 1.5 * ((ref - x).norm() / x.norm()).item() + 1e-6


# ---------------------------------------------------------------------------------------------
# The quantized paged cache, filled and read by the kernels vs by the references


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", ((4, 4), (3, 6), (8, 8)))
def test_quantized_cache_cuda_path_matches_reference_path(kb, bits, dtype, monkeypatch):
    """Same cache bytes (up to the admitted off-by-one codes), attention outputs within the paged
    attention kernel's own tolerance of the all-reference path, and cross-reading works."""
    from trellm.batch import ForwardBatch
    from trellm.cache.quantized import QuantizedKVCacheLayer

    k_bits, v_bits = bits
    pages, page_size, heads, dim = 12, 16, 2, 128

    class Cache:
        device, page_size = torch.device("cuda"), 16

    # a prefill of 37 tokens over scattered pages next to a one-token decode
    batch = ForwardBatch.with_cache([list(range(37)), [1]], [0, 20], [[9, 2, 7], [4, 11]], Cache(), all_logits=True)
    g = torch.Generator().manual_seed(k_bits)
    k = torch.randn(batch.num_tokens, heads, dim, generator=g).to("cuda", dtype)
    v = torch.randn(batch.num_tokens, heads, dim, generator=g).to("cuda", dtype)
    q = torch.randn(batch.num_tokens, 8, dim, generator=g).to("cuda", dtype)
    scale = 1 / math.sqrt(dim)

    def layer():
        return QuantizedKVCacheLayer(pages, page_size, heads, dim, dim, dtype, "cuda", k_bits=k_bits, v_bits=v_bits)

    cuda_layer, ref_layer = layer(), layer()
    cuda_layer.store(k, v, batch.slots)
    out_cuda = cuda_layer.attend(q, batch, scale)
    monkeypatch.setenv("TRELLM_OPS", "reference")
    ref_layer.store(k, v, batch.slots)
    out_ref = ref_layer.attend(q, batch, scale)
    out_cross = cuda_layer.attend(q, batch, scale)  # kernel-written cache, reference reader
    monkeypatch.delenv("TRELLM_OPS")
    out_cross2 = ref_layer.attend(q, batch, scale)  # reference-written cache, kernel reader

    for t, r, b in ((cuda_layer.qk, ref_layer.qk, k_bits), (cuda_layer.qv, ref_layer.qv, v_bits)):
        assert_same_codes(t, r, b)
    assert_same_scales(cuda_layer.sk, ref_layer.sk)
    assert_same_scales(cuda_layer.sv, ref_layer.sv)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    tol = 5e-3 if dtype == torch.float16 else 2e-2
    assert rel(out_cuda, out_ref) < tol
    assert rel(out_cross, out_ref) < tol
    assert rel(out_cross2, out_cuda) < tol


# ---------------------------------------------------------------------------------------------
# CPU: the kernel's packing scheme, argument checks, the build


def lane_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's packing, lane by lane (pack_plane in kv_quant.cu): codes [32] -> int64 words [bits]."""
    words = [0] * bits
    for w in (8, 4, 2, 1):
        if not bits & w:
            continue
        word_offset, shift = bits & ~(2 * w - 1), bits & (w - 1)
        for q in range(4):  # lane q of the quad holds values 8q..8q+7
            lane_words = w // 4 if w >= 4 else 1
            part = [0] * lane_words
            base_bit = 0 if w >= 4 else (8 * q * w) & 31
            for i in range(8):
                val = (int(codes[8 * q + i]) >> shift) & ((1 << w) - 1)
                part[(i * w) >> 5] |= val << (base_bit + ((i * w) & 31))
            first = q * lane_words if w >= 4 else (q * w) // 4
            for k in range(lane_words):
                words[word_offset + first + k] |= part[k]  # the OR across the quad for w < 4
    return torch.tensor([wd - (1 << 32) if wd >= 1 << 31 else wd for wd in words])


@pytest.mark.parametrize("bits", BITS)
def test_kernel_packing_scheme_is_the_reference_format(bits):
    g = torch.Generator().manual_seed(bits)
    for _ in range(8):
        codes = torch.randint(0, 1 << bits, (GROUP,), generator=g)
        assert torch.equal(lane_pack(codes, bits), _pack(codes[None], bits)[0].long())
    assert sum(bit_planes(bits)) == bits and all(bits & w for w in bit_planes(bits))


def test_binding_rejects_bad_arguments():
    pytest.importorskip("cffi")
    from trellm.kernels_cuda import binding

    with pytest.raises(binding.KernelArgumentError, match="bits"):
        binding.kv_quantize(torch.zeros(2, 64), 9)
    with pytest.raises(binding.KernelArgumentError, match="CUDA device"):
        binding.kv_quantize(torch.zeros(2, 64), 4)
    with pytest.raises(binding.KernelArgumentError, match="CUDA device"):
        binding.kv_dequantize(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.float16), 4)


def test_abi_declares_the_entry_points():
    pytest.importorskip("cffi")
    from trellm.kernels_cuda import binding

    text = binding.abi_declarations()
    assert "trellm_kv_quantize(" in text and "trellm_kv_dequantize(" in text


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kv_quant_cu_compiles_for_sm90(tmp_path):
    from trellm.kernels_cuda import build

    src = build.SOURCE_DIR / "kv_quant.cu"
    cmd = build.compile_command(build.find_nvcc(), src, tmp_path / "kv_quant.o", ["sm_90"])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert Path(tmp_path / "kv_quant.o").stat().st_size > 0


@gpu
@pytest.mark.parametrize("bits", (2, 5, 8))
def test_fused_cache_ops_when_declared(kb, bits):
    """kv_quantize_store / kv_dequantize_pages (once core/ops/kv_quant.py declares them) against their references."""
    from trellm.ops import kv_quant as kvq

    if not (hasattr(kvq, "kv_quantize_store") and hasattr(kvq, "kv_dequantize_pages")):
        pytest.skip("core/ops/kv_quant.py does not declare the fused cache ops")
    num_pages, page_size, dim = 5, 16, 256
    x = kv_rows(21, 2, dim // 2, torch.bfloat16, seed=bits)
    slots = torch.randperm(num_pages * page_size, device="cuda")[:21]
    packed = torch.zeros(num_pages, page_size, dim // GROUP * bits, dtype=torch.int32, device="cuda")
    scales = torch.zeros(num_pages, page_size, dim // GROUP, dtype=torch.float16, device="cuda")
    kvq.kv_quantize_store.impls["cuda"](x, bits, packed, scales, slots)
    expect_packed, expect_scales = torch.zeros_like(packed), torch.zeros_like(scales)
    ref_packed, ref_scales = kv_quantize.reference(x, bits)
    expect_packed.view(-1, expect_packed.shape[-1])[slots] = ref_packed
    expect_scales.view(-1, expect_scales.shape[-1])[slots] = ref_scales
    assert_same_codes(packed, expect_packed, bits)
    assert_same_scales(scales, expect_scales)
    pages = torch.tensor([4, 1, 1, 0], device="cuda")
    out = kvq.kv_dequantize_pages.impls["cuda"](expect_packed, expect_scales, pages, bits, torch.bfloat16)
    check_dequant(out.view(-1, dim), expect_packed[pages].view(-1, ref_packed.shape[1]),
                  expect_scales[pages].view(-1, ref_scales.shape[1]), bits)
