"""cffi (ABI mode) binding of the kernel library.

``ffi.cdef`` reads the ABI block of ``trellm_kernels.h``; ``dlopen`` loads the library that
:func:`trellm.kernels_cuda.build.build` made for the current GPU. Every wrapper checks shapes, dtypes,
devices and contiguity before the call, launches on torch's current stream (so calls can be captured
in a CUDA graph), and turns a non-zero return code into :class:`KernelError` with the CUDA error text.
"""
from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from trellm.errors import TrellmError
from trellm.ops.exl3 import mul1_gemv_route

from . import build as _build

HEADER = Path(__file__).resolve().parent / "trellm_kernels.h"

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
CODEBOOK_CODES = {"3inst": 0, "mcg": 1, "mul1": 2}
# The EXL3 matmuls that decode in registers (the GEMV, the mid-size matmul for up to 8 rows, the MoE pairs) also
# take "mul1_split": MUL1 through the split-halves decode (common.cuh, CB_MUL1_SPLIT). "mul1" takes the route
# TRELLM_MUL1_GEMV picks (_matmul_codebook_code). The mid-size matmul above 8 rows decodes MUL1 as MUL1 either way.
MATMUL_CODEBOOK_CODES = {**CODEBOOK_CODES, "mul1_split": 3}
ACTIVATION_CODES = {
    "silu": 0, "swish": 0,
    "gelu": 1,
    "gelu_tanh": 2, "gelu_pytorch_tanh": 2, "gelu_new": 2,
    "relu": 3,
    "relu2": 4,
}


class KernelError(TrellmError, RuntimeError):
    """A kernel rejected its arguments or its launch failed; carries the library's error text."""


class KernelArgumentError(TrellmError, ValueError):
    """A tensor handed to a kernel has the wrong shape, dtype, device or layout."""


def abi_declarations() -> str:
    """The cdef text: the header's ABI block, comments removed."""
    text = HEADER.read_text()
    m = re.search(r"/\* ABI BEGIN \*/(.*)/\* ABI END \*/", text, re.S)
    if m is None:
        raise KernelError(f"{HEADER}: ABI BEGIN/END markers not found")
    return re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)


_state_lock = threading.Lock()
_ffi = None
_lib = None


def ffi():
    global _ffi
    if _ffi is None:
        import cffi

        f = cffi.FFI()
        f.cdef(abi_declarations())
        _ffi = f
    return _ffi


def lib():
    """The loaded library: the prebuilt one that fits the device, else built for it on first use."""
    global _lib
    if _lib is None:
        with _state_lock:
            if _lib is None:
                path = _build.library()
                _lib = ffi().dlopen(str(path))
    return _lib


def load_library(path: str | Path) -> None:
    """Use an already built library (tests, ahead-of-time builds)."""
    global _lib
    with _state_lock:
        _lib = ffi().dlopen(str(path))


def error_string(code: int) -> str:
    return ffi().string(lib().trellm_error_string(code)).decode()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise KernelError(f"{what}: {error_string(rc)} (code {rc})")


def _stream():
    return ffi().cast("cudaStream_t", torch.cuda.current_stream().cuda_stream)


def _ptr(t: torch.Tensor | None, ctype: str = "void *"):
    if t is None:
        return ffi().NULL
    return ffi().cast(ctype, t.data_ptr())


def expect(
    t: torch.Tensor | None,
    name: str,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    device: torch.device | None = None,
    contiguous: bool = True,
    optional: bool = False,
) -> None:
    """Raise KernelArgumentError naming ``name`` unless ``t`` fits (``None`` in shape = any size)."""
    if t is None:
        if optional:
            return
        raise KernelArgumentError(f"{name}: a tensor is required")
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise KernelArgumentError(f"{name}: must be on a CUDA device, got {t.device}")
    if device is not None and t.device != device:
        raise KernelArgumentError(f"{name}: on {t.device}, but the other arguments are on {device}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            raise KernelArgumentError(f"{name}: dtype {t.dtype}, expected {' or '.join(map(str, allowed))}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise KernelArgumentError(f"{name}: shape {list(t.shape)}, expected {want}")
    if contiguous and not t.is_contiguous():
        raise KernelArgumentError(f"{name}: must be contiguous (strides {t.stride()})")


def _dtype_code(t: torch.Tensor, name: str) -> int:
    try:
        return DTYPE_CODES[t.dtype]
    except KeyError:
        raise KernelArgumentError(f"{name}: dtype {t.dtype} not supported (float16, bfloat16, float32)") from None


def _codebook_code(codebook: str, codes: dict[str, int] = CODEBOOK_CODES) -> int:
    try:
        return codes[codebook]
    except KeyError:
        raise KernelArgumentError(f"codebook {codebook!r} unknown; expected one of {sorted(codes)}") from None


def _matmul_codebook_code(codebook: str) -> int:
    """The codebook code of an in-register EXL3 matmul launch: "mul1" on the route ``mul1_gemv_route`` picks."""
    if codebook == "mul1" and mul1_gemv_route() == "split":
        codebook = "mul1_split"
    return _codebook_code(codebook, MATMUL_CODEBOOK_CODES)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# ---------------------------------------------------------------------------------------------
# Wrappers


def set_pdl(enabled: bool) -> bool:
    """Programmatic dependent launch of the EXL3 GEMV on/off (on by default on sm_90+, off with
    TRELLM_PDL=0); returns the NEW state (False where the GPU has none), not the previous one."""
    return bool(lib().trellm_set_pdl(int(enabled)))


def fill_f32(out: torch.Tensor, value: float) -> torch.Tensor:
    expect(out, "out", dtype=torch.float32)
    _check(lib().trellm_fill_f32(_ptr(out, "float *"), out.numel(), float(value), _stream()), "fill_f32")
    return out


def hadamard_128(
    x: torch.Tensor,
    *,
    pre: torch.Tensor | None = None,
    post: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = H128_blocks(x * pre) * post + bias along the last dim (pre/post/bias fp16 [dim])."""
    expect(x, "x", dtype=_FLOATS)
    dim = x.shape[-1] if x.dim() else 0
    if dim == 0 or dim % 128:
        raise KernelArgumentError(f"x: last dim {dim} is not a positive multiple of 128")
    for t, name in ((pre, "pre"), (post, "post"), (bias, "bias")):
        expect(t, name, dtype=torch.float16, shape=(dim,), device=x.device, optional=True)
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    rows = x.numel() // dim
    rc = lib().trellm_hadamard_128(
        _ptr(x), DTYPE_CODES[x.dtype], _ptr(y), _dtype_code(y, "out_dtype"), rows, dim,
        _ptr(pre), _ptr(post), _ptr(bias), _stream(),
    )
    _check(rc, "hadamard_128")
    return y


def _trellis_dims(trellis: torch.Tensor) -> tuple[int, int, int]:
    expect(trellis, "trellis", dtype=torch.int16)
    if trellis.dim() != 3 or trellis.shape[2] % 16 or not 1 <= trellis.shape[2] // 16 <= 8:
        raise KernelArgumentError(f"trellis: shape {list(trellis.shape)}, expected [k/16, n/16, 16*K] with K in 1..8")
    return trellis.shape[0] * 16, trellis.shape[1] * 16, trellis.shape[2] // 16


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, groups: int) -> torch.Tensor:
    """Per-device zeroed int32 arrival counters of the fused matmul (each call leaves them zero)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < groups:
        c = torch.zeros(max(groups, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c


EXL3_SMALL_MAX_ROWS = 16
EXL3_MID_MAX_ROWS = 64  # trellm_exl3_matmul_mid (MID_MAX_ROWS in exl3_gemm_mid.cuh)


def _gemv_scratch(m: int, k: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The small-batch matmul's float32 partial-sum workspace and its arrival counters, for n outputs in all."""
    workspace = torch.empty(lib().trellm_exl3_matmul_small_workspace(m, k, n), dtype=torch.float32, device=device)
    return workspace, _counters(device, n // 128)


def _check_exl3_part(x: torch.Tensor, trellis: torch.Tensor, suh, svh, bias, name: str = "",
                     max_rows: int = EXL3_SMALL_MAX_ROWS, route: str = "the fused small-batch path") -> tuple[int, int]:
    """Validate one (trellis, suh, svh, bias) against x [m, k] of 1..max_rows rows; returns (n, K)."""
    k, n, K = _trellis_dims(trellis)
    if k % 128 or n % 128:
        raise KernelArgumentError(f"{name}trellis: k={k}, n={n} must be multiples of 128")
    expect(x, "x", dtype=_FLOATS, shape=(None, k), device=trellis.device)
    m = x.shape[0]
    if not 1 <= m <= max_rows:
        raise KernelArgumentError(f"x: {m} rows; {route} takes 1..{max_rows}")
    expect(suh, f"{name}suh", dtype=torch.float16, shape=(k,), device=x.device)
    expect(svh, f"{name}svh", dtype=torch.float16, shape=(n,), device=x.device)
    expect(bias, f"{name}bias", dtype=torch.float16, shape=(n,), device=x.device, optional=True)
    return n, K


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # The kernel streams trellis chunks with 16-byte copies (cp.async) and reads x and suh 4 elements
    # at a time; a fresh allocation is aligned.
    return t.clone() if t.data_ptr() % 16 else t


def _residual_stream(x: torch.Tensor, y: torch.Tensor, residual=None, row_norm=None) -> tuple:
    """The C ABI's ``rs`` argument for x [m, k] -> y [m, n], and the ssq_out it fills (None without residual).

    ``residual`` [m, n] (y's dtype) is added to y, whose squares are then summed per row and 128-column group
    into ssq_out [m, n/128]; ``row_norm`` (ssq [m, k/128] float32, weight [k] of x's dtype or None, eps,
    unit_offset) makes the input rms_norm(x). The third item keeps what the struct points to alive.
    """
    if residual is None and row_norm is None:
        return ffi().NULL, None, ()
    (m, k), n = x.shape, y.shape[1]
    rs = ffi().new("trellm_residual_stream *")
    ssq_out, keep = None, []
    if residual is not None:
        expect(residual, "residual", dtype=y.dtype, shape=(m, n), device=x.device)
        residual = _aligned(residual)
        ssq_out = torch.empty(m, n // 128, dtype=torch.float32, device=x.device)
        rs.residual, rs.ssq_out = _ptr(residual), _ptr(ssq_out, "float *")
        keep.append(residual)
    if row_norm is not None:
        ssq, weight, eps, unit_offset = row_norm.ssq, row_norm.weight, row_norm.eps, row_norm.unit_offset
        expect(ssq, "row_norm.ssq", dtype=torch.float32, shape=(m, k // 128), device=x.device)
        expect(weight, "row_norm.weight", dtype=x.dtype, shape=(k,), device=x.device, optional=True)
        if not eps >= 0.0:
            raise KernelArgumentError(f"row_norm.eps: {eps} is not >= 0")
        weight = None if weight is None else _aligned(weight)
        rs.ssq_in, rs.norm_weight = _ptr(ssq, "float *"), _ptr(weight)
        rs.norm_eps, rs.norm_unit_offset = float(eps), int(bool(unit_offset))
        keep.append(weight)
    return rs, ssq_out, keep


def exl3_matmul_small(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
):
    """y [m, n] = H128(H128(x * suh) @ W_hat) * svh (+ bias) in one launch, for 1..16 rows of x [m, k].

    With ``residual`` [m, n]: ``(y + residual, ssq)``, the add rounded as its own op would round it and ssq
    [m, n/128] float32 the sums of squares of the result per row and 128-column group (see
    ``exl3_matmul_small_multi``'s ``row_norm``)."""
    n, K = _check_exl3_part(x, trellis, suh, svh, bias)
    trellis, x, suh = _aligned(trellis), _aligned(x), _aligned(suh)
    m, k = x.shape
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    rs, ssq, _keep = _residual_stream(x, y, residual)
    workspace, counters = _gemv_scratch(m, k, n, x.device)
    rc = lib().trellm_exl3_matmul_small(
        _ptr(x), DTYPE_CODES[x.dtype], _ptr(suh), _ptr(trellis, "int16_t *"), _ptr(svh), _ptr(bias), _ptr(y),
        _dtype_code(y, "out_dtype"), _ptr(workspace, "float *"), _ptr(counters, "int32_t *"), counters.numel(),
        m, k, n, K, _matmul_codebook_code(codebook), rs, _num_sms(x.device), _stream(),
    )
    _check(rc, "exl3_matmul_small")
    return y if residual is None else (y, ssq)


def exl3_matmul_mid(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
):
    """y [m, n] = H128(H128(x * suh) @ W_hat) * svh (+ bias) for 1..64 rows of x [m, k], the trellis decoded in
    registers against tensor-core fragments of x (three launches; the route for a batched decode step).
    ``residual`` as in :func:`exl3_matmul_small`: returns (y, ssq) then."""
    ys, ssq = _mid_call(x, [(trellis, suh, svh, bias)], codebook, out_dtype, residual=residual)
    return ys[0] if residual is None else (ys[0], ssq)


def exl3_matmul_mid_multi(
    x: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    codebook: str,
    out_dtype: torch.dtype | None = None,
    row_norm=None,
) -> list[torch.Tensor]:
    """``exl3_matmul_mid`` of one x by 1..4 (trellis, suh, svh, bias) parts of the same K in one call (three
    launches for all parts, q/k/v or gate/up), the work of every part split evenly over one wave of blocks.
    ``row_norm`` as in :func:`exl3_matmul_small_multi` (the pack launch norms x)."""
    return _mid_call(x, parts, codebook, out_dtype, row_norm=row_norm)[0]


def _checked_mid_parts(x: torch.Tensor, parts) -> tuple[torch.Tensor, list, list[int], int]:
    """:func:`_checked_parts` for one call of the mid-size matmul (up to 64 rows)."""
    return _checked_parts(x, parts, max_rows=EXL3_MID_MAX_ROWS, route="the mid-size matmul")


def _mid_workspace(m: int, k: int, n_array, parts: int, sms: int, device: torch.device) -> torch.Tensor:
    """The float32 workspace of one mid-size call (packed x and the partials; its size from the library)."""
    return torch.empty(lib().trellm_exl3_matmul_mid_workspace(m, k, parts, n_array, sms), dtype=torch.float32,
                       device=device)


def _mid_call(x, parts, codebook, out_dtype, residual=None, row_norm=None) -> tuple[list, torch.Tensor | None]:
    """One trellm_exl3_matmul_mid call: the outputs, and the sums of squares when ``residual`` is given."""
    x, parts, ns, K = _checked_mid_parts(x, parts)
    m, k = x.shape
    dtype = out_dtype or x.dtype
    ys = [torch.empty(m, n, dtype=dtype, device=x.device) for n in ns]
    rs, ssq, _keep = _residual_stream(x, ys[0], residual, row_norm)
    sms = _num_sms(x.device)
    n_array = ffi().new("int64_t[]", ns)
    workspace = _mid_workspace(m, k, n_array, len(parts), sms, x.device)
    rc = lib().trellm_exl3_matmul_mid(
        _ptr(x), DTYPE_CODES[x.dtype], len(parts), *_part_arrays(parts, ys), n_array, _dtype_code(ys[0], "out_dtype"),
        _ptr(workspace, "float *"), workspace.numel(), m, k, K, _matmul_codebook_code(codebook), rs,
        sms, _stream(),
    )
    _check(rc, "exl3_matmul_mid")
    return ys, ssq


def exl3_matmul_small_gated(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
):
    """``exl3_matmul_small(act(gate) * up, ...)`` in one launch: the GEMV applies the activation in its
    input transform, rounded as ``gated_activation`` rounds it (the same result, one launch fewer).
    ``residual`` as in :func:`exl3_matmul_small`."""
    n, K = _check_exl3_part(gate, trellis, suh, svh, bias)
    expect(up, "up", dtype=gate.dtype, shape=tuple(gate.shape), device=gate.device)
    if activation not in ACTIVATION_CODES:
        raise KernelArgumentError(f"activation {activation!r} unsupported; supported: {sorted(ACTIVATION_CODES)}")
    trellis, gate, up, suh = _aligned(trellis), _aligned(gate), _aligned(up), _aligned(suh)
    m, k = gate.shape
    y = torch.empty(m, n, dtype=gate.dtype, device=gate.device)
    rs, ssq, _keep = _residual_stream(gate, y, residual)
    workspace, counters = _gemv_scratch(m, k, n, gate.device)
    rc = lib().trellm_exl3_matmul_small_gated(
        _ptr(gate), _ptr(up), ACTIVATION_CODES[activation], DTYPE_CODES[gate.dtype], _ptr(suh),
        _ptr(trellis, "int16_t *"), _ptr(svh), _ptr(bias), _ptr(y), DTYPE_CODES[y.dtype], _ptr(workspace, "float *"),
        _ptr(counters, "int32_t *"), counters.numel(), m, k, n, K, _matmul_codebook_code(codebook), rs,
        _num_sms(gate.device), _stream(),
    )
    _check(rc, "exl3_matmul_small_gated")
    return y if residual is None else (y, ssq)


EXL3_MAX_PARTS = 4


def _checked_parts(x: torch.Tensor, parts, max_rows: int = EXL3_SMALL_MAX_ROWS,
                   route: str = "the fused small-batch path") -> tuple[torch.Tensor, list, list[int], int]:
    """x and 1..4 (trellis, suh, svh, bias) parts of one K for one call of the GEMV (or the mid-size matmul):
    checked and 16-byte aligned, with each part's n and the common K."""
    if not 1 <= len(parts) <= EXL3_MAX_PARTS:
        raise KernelArgumentError(f"parts: {len(parts)} given, 1..{EXL3_MAX_PARTS} supported")
    ns, Ks = [], []
    for i, (trellis, suh, svh, bias) in enumerate(parts):
        n, K = _check_exl3_part(x, trellis, suh, svh, bias, f"part {i}: ", max_rows, route)
        ns.append(n)
        Ks.append(K)
    if len(set(Ks)) != 1:
        raise KernelArgumentError(f"parts: bits per weight differ ({Ks}); one launch needs one K")
    parts = [(_aligned(trellis), _aligned(suh), svh, bias) for trellis, suh, svh, bias in parts]
    return _aligned(x), parts, ns, Ks[0]


def _part_arrays(parts, ys: list[torch.Tensor]) -> list:
    """The per-part pointer arrays of the C ABI: suh, trellis, svh, bias, y."""
    f = ffi()
    return [
        f.new("void *[]", [_ptr(p[1]) for p in parts]),
        f.new("int16_t *[]", [_ptr(p[0], "int16_t *") for p in parts]),
        f.new("void *[]", [_ptr(p[2]) for p in parts]),
        f.new("void *[]", [_ptr(p[3]) for p in parts]),
        f.new("void *[]", [_ptr(y) for y in ys]),
    ]


def exl3_matmul_small_multi(
    x: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    codebook: str,
    out_dtype: torch.dtype | None = None,
    row_norm=None,
) -> list[torch.Tensor]:
    """``exl3_matmul_small`` of one x by 1..4 (trellis, suh, svh, bias) parts of the same K in ONE launch
    (q/k/v, gate/up): one kernel instead of several small ones, and one wave of blocks across all parts.

    ``row_norm`` (ssq, weight, eps, unit_offset): the parts multiply rms_norm(x) (scaled by weight), the
    sums of x's squares taken from ssq [m, k/128] (what ``exl3_matmul_small(residual=...)`` returned with x)."""
    x, parts, ns, K = _checked_parts(x, parts)
    m, k = x.shape
    dtype = out_dtype or x.dtype
    ys = [torch.empty(m, n, dtype=dtype, device=x.device) for n in ns]
    rs, _, _keep = _residual_stream(x, ys[0], row_norm=row_norm)
    workspace, counters = _gemv_scratch(m, k, sum(ns), x.device)
    rc = lib().trellm_exl3_matmul_small_multi(
        _ptr(x), DTYPE_CODES[x.dtype], len(parts), *_part_arrays(parts, ys),
        ffi().new("int64_t[]", ns), _dtype_code(ys[0], "out_dtype"), _ptr(workspace, "float *"),
        _ptr(counters, "int32_t *"), counters.numel(), m, k, K, _matmul_codebook_code(codebook), rs,
        _num_sms(x.device), _stream(),
    )
    _check(rc, "exl3_matmul_small_multi")
    return ys


def _check_rope_args(dtype, device, tokens: int, hkv: int, d: int, cos_table, sin_table, positions, q_norm, k_norm,
                     k_pages, v_pages, slots) -> tuple[int, int]:
    """The RoPE, per-head norm and KV-page arguments of the fused RoPE launches (``rotary_qk`` and the
    q/k/v GEMV's epilogue), for ``tokens`` rows of ``hkv`` kv heads of ``d`` dims: (table_len, rotated half)."""
    expect(cos_table, "cos_table", dtype=torch.float32, shape=(None, None), device=device)
    table_len, half = cos_table.shape
    expect(sin_table, "sin_table", dtype=torch.float32, shape=(table_len, half), device=device)
    if table_len == 0:
        raise KernelArgumentError(f"cos_table: shape {list(cos_table.shape)} holds no positions")
    expect(positions, "positions", dtype=torch.int64, shape=(tokens,), device=device)
    if (q_norm is None) != (k_norm is None):
        raise KernelArgumentError("q_norm / k_norm: give both or neither")
    expect(q_norm, "q_norm", dtype=dtype, shape=(d,), device=device, optional=True)
    expect(k_norm, "k_norm", dtype=dtype, shape=(d,), device=device, optional=True)
    if k_pages is not None:
        expect(k_pages, "k_pages", dtype=dtype, shape=(None, None, hkv, d), device=device)
        expect(v_pages, "v_pages", dtype=dtype, shape=tuple(k_pages.shape), device=device)
        expect(slots, "slots", dtype=torch.int64, shape=(tokens,), device=device)
    return table_len, half


def exl3_matmul_qkv_rope(
    x: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    codebook: str,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool = False,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    norm_unit_offset: bool = False,
    k_pages: torch.Tensor | None = None,
    v_pages: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    row_norm=None,
    route: str = "small",
) -> list[torch.Tensor]:
    """The q/k/v projections of x by three parts in one call, finished as :func:`rotary_qk` finishes them
    (per-head RMSNorm, RoPE; k and v stored at ``slots`` of the pages when given): [q, k, v], each
    [m, heads * 128], q and k rotated. 128-wide heads only. ``row_norm`` as in :func:`exl3_matmul_small_multi`.
    ``route``: "small", the GEMV (1..16 rows, one launch, its finishing warp does the epilogue), or "mid", the
    mid-size matmul (1..64 rows, three launches, its finish launch does it)."""
    if route not in ("small", "mid"):
        raise KernelArgumentError(f"route {route!r}: expected 'small' or 'mid'")
    if len(parts) != 3:
        raise KernelArgumentError(f"parts: {len(parts)} given; q/k/v need 3")
    expect(x, "x", dtype=(torch.float16, torch.bfloat16), shape=(None, None))
    x, parts, ns, K = _checked_mid_parts(x, parts) if route == "mid" else _checked_parts(x, parts)
    m, k = x.shape
    if ns[0] % 128 or ns[1] % 128 or ns[2] != ns[1]:
        raise KernelArgumentError(f"parts: widths {ns} are not q/k/v of 128-wide heads (n_k == n_v)")
    hkv = ns[1] // 128
    table_len, half = _check_rope_args(x.dtype, x.device, m, hkv, 128, cos_table, sin_table, positions, q_norm,
                                       k_norm, k_pages, v_pages, slots)
    if half % 4 or not 0 < 2 * half <= 128:
        raise KernelArgumentError(f"cos_table: shape {list(cos_table.shape)} does not fit 128-wide heads (rotated half a multiple of 4)")
    ys = [torch.empty(m, n, dtype=x.dtype, device=x.device) for n in ns]
    rs, _, _keep = _residual_stream(x, ys[0], row_norm=row_norm)
    sms = _num_sms(x.device)
    n_array = ffi().new("int64_t[]", ns)
    if route == "mid":
        workspace = _mid_workspace(m, k, n_array, 3, sms, x.device)
        scratch = (_ptr(workspace, "float *"), workspace.numel())
        call = lib().trellm_exl3_matmul_mid_qkv_rope
    else:
        workspace, counters = _gemv_scratch(m, k, sum(ns), x.device)
        scratch = (_ptr(workspace, "float *"), _ptr(counters, "int32_t *"), counters.numel())
        call = lib().trellm_exl3_matmul_small_qkv_rope
    rc = call(
        _ptr(x), DTYPE_CODES[x.dtype], *_part_arrays(parts, ys), n_array, *scratch, m, k, K,
        _matmul_codebook_code(codebook),
        _ptr(positions, "int64_t *"), _ptr(cos_table, "float *"), _ptr(sin_table, "float *"), table_len, half,
        int(bool(interleaved)), _ptr(q_norm), _ptr(k_norm), float(norm_eps), int(bool(norm_unit_offset)),
        _ptr(k_pages), _ptr(v_pages if k_pages is not None else None),
        _ptr(slots if k_pages is not None else None, "int64_t *"), rs, sms, _stream(),
    )
    _check(rc, f"exl3_matmul_qkv_rope ({route})")
    return ys


def exl3_decode_tiles(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    k, n, K = _trellis_dims(trellis)
    w = torch.empty(k, n, dtype=torch.float16, device=trellis.device)
    rc = lib().trellm_exl3_decode_tiles(_ptr(trellis, "int16_t *"), _ptr(w), k, n, K, _codebook_code(codebook), _stream())
    _check(rc, "exl3_decode_tiles")
    return w


def exl3_codebook_decode(states: torch.Tensor, codebook: str) -> torch.Tensor:
    expect(states, "states", dtype=torch.int32)
    out = torch.empty(states.shape, dtype=torch.float16, device=states.device)
    rc = lib().trellm_exl3_codebook_decode(
        _ptr(states, "int32_t *"), _ptr(out), states.numel(), _codebook_code(codebook), _stream()
    )
    _check(rc, "exl3_codebook_decode")
    return out


def trellis_viterbi(targets: torch.Tensor, K: int, codebook: str) -> torch.Tensor:
    """int32 [N, 256] tail-biting Viterbi states of float32 targets [N, 256] (position order)."""
    expect(targets, "targets", dtype=torch.float32, shape=(None, 256))
    if not 1 <= K <= 8:
        raise KernelArgumentError(f"K must be in 1..8, got {K}")
    tiles = targets.shape[0]
    states = torch.empty(tiles, 256, dtype=torch.int32, device=targets.device)
    sms = _num_sms(targets.device)
    scratch = torch.empty(max(1, lib().trellm_viterbi_scratch_bytes(tiles, K, sms)), dtype=torch.uint8,
                          device=targets.device)
    rc = lib().trellm_trellis_viterbi(
        _ptr(targets, "float *"), _ptr(states, "int32_t *"), tiles, K, _codebook_code(codebook), _ptr(scratch), sms,
        _stream(),
    )
    _check(rc, "trellis_viterbi")
    return states


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    unit_offset: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) or, with ``residual``, (rms_norm(x + residual), x + residual)."""
    expect(x, "x", dtype=_FLOATS)
    dim = x.shape[-1]
    expect(weight, "weight", dtype=_FLOATS, shape=(dim,), device=x.device, optional=True)
    expect(residual, "residual", dtype=x.dtype, shape=tuple(x.shape), device=x.device, optional=True)
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else None
    rows = x.numel() // dim if dim else 0
    w_code = DTYPE_CODES[weight.dtype] if weight is not None else 0
    rc = lib().trellm_rms_norm(
        _ptr(x), _ptr(residual), _ptr(weight), _ptr(y), _ptr(h), rows, dim, DTYPE_CODES[x.dtype], w_code,
        float(eps), int(bool(unit_offset)), _stream(),
    )
    _check(rc, "rms_norm")
    return (y, h) if residual is not None else y


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    expect(x, "x", dtype=_FLOATS, shape=(None, None, None))
    tokens, heads, head_dim = x.shape
    expect(cos, "cos", dtype=torch.float32, shape=(tokens, None), device=x.device)
    half = cos.shape[1]
    expect(sin, "sin", dtype=torch.float32, shape=(tokens, half), device=x.device)
    if 2 * half > head_dim:
        raise KernelArgumentError(f"cos: rotary half-dim {half} exceeds head_dim/2 = {head_dim / 2}")
    y = torch.empty_like(x)
    rc = lib().trellm_rotary_embedding(
        _ptr(x), _ptr(y), _ptr(cos, "float *"), _ptr(sin, "float *"), tokens, heads, head_dim, half,
        int(bool(interleaved)), DTYPE_CODES[x.dtype], _stream(),
    )
    _check(rc, "rotary_embedding")
    return y


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for 2-D gate/up whose rows may be strided (views of a fused gate_up)."""
    expect(gate, "gate", dtype=_FLOATS, shape=(None, None), contiguous=False)
    expect(up, "up", dtype=gate.dtype, shape=tuple(gate.shape), device=gate.device, contiguous=False)
    for t, name in ((gate, "gate"), (up, "up")):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise KernelArgumentError(f"{name}: the last dim must be contiguous (strides {t.stride()})")
    if activation not in ACTIVATION_CODES:
        raise KernelArgumentError(f"activation {activation!r} unsupported; supported: {sorted(ACTIVATION_CODES)}")
    rows, dim = gate.shape
    out = torch.empty(rows, dim, dtype=gate.dtype, device=gate.device)
    rc = lib().trellm_gated_activation(
        _ptr(gate), gate.stride(0), _ptr(up), up.stride(0), _ptr(out), rows, dim, DTYPE_CODES[gate.dtype],
        ACTIVATION_CODES[activation], _stream(),
    )
    _check(rc, "gated_activation")
    return out


def write_kv_pages(
    k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor
) -> None:
    expect(k_pages, "k_pages", dtype=_FLOATS, shape=(None, None, None, None))
    _, _, hkv, d = k_pages.shape
    expect(v_pages, "v_pages", dtype=k_pages.dtype, shape=tuple(k_pages.shape), device=k_pages.device)
    expect(k, "k", dtype=k_pages.dtype, shape=(None, hkv, d), device=k_pages.device)
    tokens = k.shape[0]
    expect(v, "v", dtype=k_pages.dtype, shape=(tokens, hkv, d), device=k_pages.device)
    expect(slots, "slots", dtype=torch.int64, shape=(tokens,), device=k_pages.device)
    rc = lib().trellm_write_kv_pages(
        _ptr(k), _ptr(v), _ptr(k_pages), _ptr(v_pages), _ptr(slots, "int64_t *"), tokens, hkv * d,
        DTYPE_CODES[k_pages.dtype], _stream(),
    )
    _check(rc, "write_kv_pages")


ATTENTION_HEAD_DIMS = (64, 96, 128, 160, 192, 256)


def _attention_args(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
    cu_seqlens: torch.Tensor, context_lens: torch.Tensor, sinks: torch.Tensor | None, *,
    dtypes: tuple[torch.dtype, ...], head_dims: tuple[int, ...], kernel: str,
    max_group: int | None = None, align: int | None = None,
) -> tuple[int, int, int, int, int, int, int]:
    """Check the paged-attention arguments once for both kernels, whose limits differ: q's ``dtypes``,
    ``head_dims``, at most ``max_group`` query heads per kv head, q/k/v data ``align``-byte aligned.
    ``kernel`` names the kernel in the errors. Returns (tokens, batch, hq, hkv, head_dim, page_size,
    max_blocks)."""
    expect(q, "q", dtype=dtypes, shape=(None, None, None))
    tokens, hq, d = q.shape
    expect(k_pages, "k_pages", dtype=q.dtype, shape=(None, None, None, d), device=q.device)
    expect(v_pages, "v_pages", dtype=q.dtype, shape=tuple(k_pages.shape), device=q.device)
    _, page_size, hkv, _ = k_pages.shape
    if hq % hkv:
        raise KernelArgumentError(f"q: {hq} heads is not a multiple of the cache's {hkv} kv heads")
    if max_group is not None and hq // hkv > max_group:
        raise KernelArgumentError(f"q: {hq // hkv} query heads per kv head; the {kernel} takes <= {max_group}")
    if d not in head_dims:
        raise KernelArgumentError(f"q: head_dim {d} unsupported by the {kernel}; supported: {head_dims}")
    if align is not None:
        for t, name in ((q, "q"), (k_pages, "k_pages"), (v_pages, "v_pages")):
            if t.data_ptr() % align:
                raise KernelArgumentError(f"{name}: data must be {align}-byte aligned (address {t.data_ptr():#x})")
    expect(block_table, "block_table", dtype=torch.int32, shape=(None, None), device=q.device)
    batch, max_blocks = block_table.shape
    expect(cu_seqlens, "cu_seqlens", dtype=torch.int32, shape=(batch + 1,), device=q.device)
    expect(context_lens, "context_lens", dtype=torch.int32, shape=(batch,), device=q.device)
    expect(sinks, "sinks", dtype=torch.float32, shape=(hq,), device=q.device, optional=True)
    return tokens, batch, hq, hkv, d, page_size, max_blocks


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    tokens, batch, hq, hkv, d, page_size, max_blocks = _attention_args(
        q, k_pages, v_pages, block_table, cu_seqlens, context_lens, sinks,
        dtypes=_FLOATS, head_dims=ATTENTION_HEAD_DIMS, kernel="kernel",
    )
    out = torch.empty_like(q)
    splits = lib().trellm_paged_attention_splits_for(tokens, hq, hkv, d, DTYPE_CODES[q.dtype], page_size, max_blocks,
                                                     _num_sms(q.device))
    workspace = None
    if splits > 1:
        workspace = torch.empty(tokens * hq * splits * (d + 2), dtype=torch.float32, device=q.device)
    rc = lib().trellm_paged_attention(
        _ptr(q), _ptr(k_pages), _ptr(v_pages), _ptr(block_table, "int32_t *"), _ptr(cu_seqlens, "int32_t *"),
        _ptr(context_lens, "int32_t *"), _ptr(sinks, "float *"), _ptr(out), _ptr(workspace, "float *"), splits,
        tokens, batch, hq, hkv, d, page_size, max_blocks, float(scale), int(sliding_window), float(softcap),
        DTYPE_CODES[q.dtype], _stream(),
    )
    _check(rc, "paged_attention")
    return out


PREFILL_HEAD_DIMS = (64, 96, 128, 160, 192, 256)
PREFILL_MAX_GROUP = 64  # query heads per kv head: one token's heads must fit a 64-row tile


def paged_attention_prefill(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_attention` through the tiled tensor-core prefill kernel (fp16/bf16): each K/V tile is
    read once per 64 query rows instead of once per query token."""
    tokens, batch, hq, hkv, d, page_size, max_blocks = _attention_args(
        q, k_pages, v_pages, block_table, cu_seqlens, context_lens, sinks,
        dtypes=(torch.float16, torch.bfloat16), head_dims=PREFILL_HEAD_DIMS, kernel="prefill kernel",
        max_group=PREFILL_MAX_GROUP, align=16,
    )
    out = torch.empty_like(q)
    rc = lib().trellm_paged_attention_prefill(
        _ptr(q), _ptr(k_pages), _ptr(v_pages), _ptr(block_table, "int32_t *"), _ptr(cu_seqlens, "int32_t *"),
        _ptr(context_lens, "int32_t *"), _ptr(sinks, "float *"), _ptr(out), tokens, batch, hq, hkv, d, page_size,
        max_blocks, float(scale), int(sliding_window), float(softcap), DTYPE_CODES[q.dtype], _stream(),
    )
    _check(rc, "paged_attention_prefill")
    return out


# ---- KV-cache quantization (kv_quant.cu; the format of trellm.ops.kv_quant) ----------------------

KV_QUANT_GROUP = 32


def _kv_bits(bits: int) -> int:
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise KernelArgumentError(f"bits: KV cache bits must be an int in 2..8, got {bits!r}")
    return bits


def _kv_dim(t: torch.Tensor, name: str) -> int:
    dim = t.shape[-1] if t.dim() else 0
    if dim == 0 or dim % KV_QUANT_GROUP:
        raise KernelArgumentError(f"{name}: last dim {dim} is not a positive multiple of {KV_QUANT_GROUP}")
    return dim


def kv_quantize_store(
    x: torch.Tensor, bits: int, packed_rows: torch.Tensor, scale_rows: torch.Tensor, slots: torch.Tensor | None
) -> None:
    """Quantize x [T, D] into rows slots[t] (int64; negative = skipped) of packed_rows int32 [..., D/32*bits]
    and scale_rows fp16 [..., D/32] (the leading dims are flattened into rows); row t when slots is None."""
    bits = _kv_bits(bits)
    expect(x, "x", dtype=_FLOATS, shape=(None, None))
    tokens, dim = x.shape[0], _kv_dim(x, "x")
    groups = dim // KV_QUANT_GROUP
    expect(packed_rows, "packed_rows", dtype=torch.int32, device=x.device)
    expect(scale_rows, "scale_rows", dtype=torch.float16, device=x.device)
    if packed_rows.dim() < 1 or packed_rows.shape[-1] != groups * bits:
        raise KernelArgumentError(
            f"packed_rows: shape {list(packed_rows.shape)}, expected rows of {groups * bits} int32 words "
            f"({dim} values at {bits} bits)"
        )
    rows = packed_rows.numel() // (groups * bits)
    if scale_rows.dim() < 1 or scale_rows.shape[-1] != groups or scale_rows.numel() // groups != rows:
        raise KernelArgumentError(f"scale_rows: shape {list(scale_rows.shape)}, expected {rows} rows of {groups} scales")
    if slots is None:
        if rows < tokens:
            raise KernelArgumentError(f"packed_rows: {rows} rows for {tokens} tokens")
    else:
        expect(slots, "slots", dtype=torch.int64, shape=(tokens,), device=x.device)
    rc = lib().trellm_kv_quantize(
        _ptr(x), DTYPE_CODES[x.dtype], _ptr(packed_rows, "int32_t *"), _ptr(scale_rows), _ptr(slots, "int64_t *"),
        tokens, dim, rows, bits, _stream(),
    )
    _check(rc, "kv_quantize")


def kv_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (packed int32 [T, D/32*bits], scales fp16 [T, D/32]), as trellm.ops.kv_quantize."""
    bits = _kv_bits(bits)
    expect(x, "x", dtype=_FLOATS, shape=(None, None))
    groups = _kv_dim(x, "x") // KV_QUANT_GROUP
    packed = torch.empty(x.shape[0], groups * bits, dtype=torch.int32, device=x.device)
    scales = torch.empty(x.shape[0], groups, dtype=torch.float16, device=x.device)
    kv_quantize_store(x, bits, packed, scales, None)
    return packed, scales


def _kv_dequantize(packed: torch.Tensor, scales: torch.Tensor, pages: torch.Tensor | None, page_size: int,
                   rows: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    groups = scales.shape[-1]
    src_rows = scales.numel() // groups
    out = torch.empty(rows, groups * KV_QUANT_GROUP, dtype=dtype, device=packed.device)
    rc = lib().trellm_kv_dequantize(
        _ptr(packed, "int32_t *"), _ptr(scales), _ptr(pages, "int64_t *"), page_size, src_rows, _ptr(out),
        _dtype_code(out, "dtype"), rows, groups * KV_QUANT_GROUP, bits, _stream(),
    )
    _check(rc, "kv_dequantize")
    return out


def kv_dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """(packed int32 [T, D/32*bits], scales fp16 [T, D/32]) -> [T, D] in ``dtype``, as trellm.ops.kv_dequantize."""
    bits = _kv_bits(bits)
    expect(scales, "scales", dtype=torch.float16, shape=(None, None))
    tokens, groups = scales.shape
    if groups == 0:
        raise KernelArgumentError("scales: no groups (shape [T, 0])")
    expect(packed, "packed", dtype=torch.int32, shape=(tokens, groups * bits), device=scales.device)
    return _kv_dequantize(packed, scales, None, 1, tokens, bits, dtype)


def kv_dequantize_pages(packed_pages: torch.Tensor, scale_pages: torch.Tensor, pages: torch.Tensor, bits: int,
                        dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Dequantize whole cache pages in one launch: packed_pages int32 [P, S, D/32*bits], scale_pages fp16
    [P, S, D/32], pages int64 [n] -> [n, S, D] in ``dtype`` (the gather and the dequantization fused)."""
    bits = _kv_bits(bits)
    expect(scale_pages, "scale_pages", dtype=torch.float16, shape=(None, None, None))
    num_pages, page_size, groups = scale_pages.shape
    if groups == 0 or page_size == 0:
        raise KernelArgumentError(f"scale_pages: shape {list(scale_pages.shape)} has no rows or no groups")
    expect(packed_pages, "packed_pages", dtype=torch.int32, shape=(num_pages, page_size, groups * bits),
           device=scale_pages.device)
    expect(pages, "pages", dtype=torch.int64, shape=(None,), device=scale_pages.device)
    n = pages.shape[0]
    out = _kv_dequantize(packed_pages, scale_pages, pages, page_size, n * page_size, bits, dtype)
    return out.view(n, page_size, groups * KV_QUANT_GROUP)


# ---- MoE decode and gated delta net decode (moe.cu, deltanet.cu) ------------------------------------

MOE_MODES = {"plain": 0, "silu_gated": 1, "combine": 2}


def moe_exl3_counters(pairs: int, top_k: int, mode: str, n: int) -> int:
    """Arrival counters a one-launch ``moe_exl3_matmul`` needs: one per (item, 128-column group) it finishes."""
    return lib().trellm_moe_exl3_counters(pairs, top_k, MOE_MODES[mode], n)


def moe_exl3_matmul(
    x: torch.Tensor,
    expert_of: torch.Tensor,
    table: torch.Tensor,
    k: int,
    n: int,
    K: int,
    codebook: str,
    pairs_per_row: int = 1,
    mode: str = "plain",
    pair_weights: torch.Tensor | None = None,
    top_k: int = 1,
    out_dtype: torch.dtype | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """EXL3 matmuls of (row, expert) pairs with the expert ids read on the device (no host sync).

    ``table`` int64 [matrices, experts, 4] = {trellis, suh, svh, bias or 0} pointers of tensors that
    stay alive as long as the table. Returns [matrices, pairs, n] ("plain"), [pairs, n]
    ("silu_gated": silu(matrix 0) * matrix 1) or [pairs / top_k, n] ("combine": routing-weighted sum).
    ``counters``: int32, all zero, at least :func:`moe_exl3_counters` long: one launch instead of two (the
    kernel leaves them zero; one stream at a time may use a buffer).
    """
    if k % 128 or n % 128 or k <= 0 or n <= 0:
        raise KernelArgumentError(f"expert weights: k={k}, n={n} must be positive multiples of 128")
    expect(x, "x", dtype=_FLOATS, shape=(None, k))
    expect(table, "table", dtype=torch.int64, shape=(None, None, 4), device=x.device)
    matrices, num_experts = table.shape[0], table.shape[1]
    expect(expert_of, "expert_of", dtype=torch.int64, shape=(None,), device=x.device)
    pairs = expert_of.shape[0]
    if mode not in MOE_MODES:
        raise KernelArgumentError(f"mode {mode!r} unknown; expected one of {sorted(MOE_MODES)}")
    if pairs == 0 or pairs_per_row < 1 or (pairs + pairs_per_row - 1) // pairs_per_row > x.shape[0]:
        raise KernelArgumentError(f"expert_of: {pairs} pairs at {pairs_per_row} per row do not fit x's {x.shape[0]} rows")
    dtype = out_dtype or x.dtype
    if mode == "plain":
        y = torch.empty(matrices, pairs, n, dtype=dtype, device=x.device)
    elif mode == "silu_gated":
        if matrices != 2:
            raise KernelArgumentError(f"table: silu_gated needs 2 matrices (gate, up), got {matrices}")
        y = torch.empty(pairs, n, dtype=dtype, device=x.device)
    else:
        if matrices != 1 or top_k < 1 or pairs % top_k:
            raise KernelArgumentError(f"combine needs 1 matrix and pairs ({pairs}) a multiple of top_k ({top_k})")
        expect(pair_weights, "pair_weights", dtype=torch.float32, shape=(pairs,), device=x.device)
        y = torch.empty(pairs // top_k, n, dtype=dtype, device=x.device)
    if counters is not None:
        expect(counters, "counters", dtype=torch.int32, shape=(None,), device=x.device)
        need = moe_exl3_counters(pairs, top_k, mode, n)
        if counters.numel() < need:
            raise KernelArgumentError(f"counters: {counters.numel()} of them, this call needs {need}")
    sms = _num_sms(x.device)
    workspace = torch.empty(lib().trellm_moe_exl3_workspace(pairs, matrices, k, n, sms), dtype=torch.float32,
                            device=x.device)
    rc = lib().trellm_moe_exl3_matmul(
        _ptr(x), DTYPE_CODES[x.dtype], _ptr(expert_of, "int64_t *"), _ptr(table, "uint64_t *"),
        _ptr(workspace, "float *"), _ptr(counters, "int *"), _ptr(pair_weights, "float *"), _ptr(y),
        _dtype_code(y, "out_dtype"),
        MOE_MODES[mode], pairs, pairs_per_row, top_k, matrices, num_experts, k, n, K,
        _matmul_codebook_code(codebook), sms,
        _stream(),
    )
    _check(rc, "moe_exl3_matmul")
    return y


def moe_dense_matmul(
    x: torch.Tensor,
    expert_of: torch.Tensor,
    weight_table: torch.Tensor,
    n: int,
    bias_table: torch.Tensor | None = None,
    pairs_per_row: int = 1,
) -> torch.Tensor:
    """y [pairs, n] = W_{expert_of[p]} x[p // pairs_per_row] (+ bias) for dense [n, k] expert weights.

    ``weight_table`` / ``bias_table`` int64 [experts] device pointers (bias 0 = none) in x's dtype.
    """
    expect(x, "x", dtype=_FLOATS, shape=(None, None))
    k = x.shape[1]
    if k % (4 if x.dtype == torch.float32 else 8) or x.data_ptr() % 16:
        raise KernelArgumentError(f"x: k={k} must be a multiple of 16 bytes and x 16-byte aligned")
    expect(expert_of, "expert_of", dtype=torch.int64, shape=(None,), device=x.device)
    expect(weight_table, "weight_table", dtype=torch.int64, shape=(None,), device=x.device)
    expect(bias_table, "bias_table", dtype=torch.int64, shape=tuple(weight_table.shape), device=x.device, optional=True)
    pairs = expert_of.shape[0]
    if pairs == 0 or pairs_per_row < 1 or (pairs + pairs_per_row - 1) // pairs_per_row > x.shape[0]:
        raise KernelArgumentError(f"expert_of: {pairs} pairs at {pairs_per_row} per row do not fit x's {x.shape[0]} rows")
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    rc = lib().trellm_moe_dense_matmul(
        _ptr(x), _ptr(expert_of, "int64_t *"), _ptr(weight_table, "uint64_t *"), _ptr(bias_table, "uint64_t *"),
        _ptr(y), DTYPE_CODES[x.dtype], pairs, pairs_per_row, weight_table.shape[0], k, n, _stream(),
    )
    _check(rc, "moe_dense_matmul")
    return y


DELTA_RULE_KEY_DIMS = (64, 128, 256)


def gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step: q/k [B, H, Dk], v [B, H, Dv], g/beta float32 [B, H], state float32 [B, H, Dk, Dv]."""
    expect(v, "v", dtype=_FLOATS, shape=(None, None, None))
    b, h, dv = v.shape
    expect(q, "q", dtype=_FLOATS, shape=(b, h, None), device=v.device)
    dk = q.shape[2]
    expect(k, "k", dtype=_FLOATS, shape=(b, h, dk), device=v.device)
    expect(g, "g", dtype=torch.float32, shape=(b, h), device=v.device)
    expect(beta, "beta", dtype=torch.float32, shape=(b, h), device=v.device)
    expect(state, "state", dtype=torch.float32, shape=(b, h, dk, dv), device=v.device)
    if dk not in DELTA_RULE_KEY_DIMS or dv % 32:
        raise KernelArgumentError(f"q/v: key dim {dk} (supported {DELTA_RULE_KEY_DIMS}), value dim {dv} (multiple of 32)")
    out = torch.empty_like(v)
    new_state = torch.empty_like(state)
    rc = lib().trellm_gated_delta_rule_step(
        _ptr(q), DTYPE_CODES[q.dtype], _ptr(k), DTYPE_CODES[k.dtype], _ptr(v), DTYPE_CODES[v.dtype],
        _ptr(g, "float *"), _ptr(beta, "float *"), _ptr(state, "float *"), _ptr(new_state, "float *"), _ptr(out),
        b * h, dk, dv, float(dk**-0.5), _stream(),
    )
    _check(rc, "gated_delta_rule_step")
    return out, new_state


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor, silu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One conv step: x [B, C], weight [C, W] (W <= 8), bias [C] or None, states [B, C, W-1]."""
    expect(x, "x", dtype=_FLOATS, shape=(None, None))
    b, c = x.shape
    expect(weight, "weight", dtype=_FLOATS, shape=(c, None), device=x.device)
    width = weight.shape[1]
    if not 1 <= width <= 8:
        raise KernelArgumentError(f"weight: conv width {width} unsupported (1..8)")
    expect(bias, "bias", dtype=_FLOATS, shape=(c,), device=x.device, optional=True)
    expect(states, "states", dtype=_FLOATS, shape=(b, c, width - 1), device=x.device)
    out = torch.empty_like(x)
    new_states = torch.empty_like(states)
    rc = lib().trellm_causal_conv1d_step(
        _ptr(x), DTYPE_CODES[x.dtype], _ptr(weight), DTYPE_CODES[weight.dtype], _ptr(bias),
        DTYPE_CODES[bias.dtype] if bias is not None else 0, _ptr(states), DTYPE_CODES[states.dtype], _ptr(out),
        _ptr(new_states), b, c, width, int(bool(silu)), _stream(),
    )
    _check(rc, "causal_conv1d_step")
    return out, new_states


# ---- fused RoPE (decode-step fusion) ------------------------------------------------------------------
ROPE_MAX_HEAD_DIM = 1024


def rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool = False,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    norm_unit_offset: bool = False,
    v: torch.Tensor | None = None,
    k_pages: torch.Tensor | None = None,
    v_pages: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) head-RMS-normed (optional) and rotated by position in one launch; with ``k_pages`` the rotated
    k and ``v`` are also stored at ``slots`` of the paged cache."""
    expect(q, "q", dtype=_FLOATS, shape=(None, None, None))
    tokens, hq, d = q.shape
    if d > ROPE_MAX_HEAD_DIM:
        raise KernelArgumentError(f"q: head_dim {d} exceeds the kernel's {ROPE_MAX_HEAD_DIM}")
    expect(k, "k", dtype=q.dtype, shape=(tokens, None, d), device=q.device)
    hkv = k.shape[1]
    table_len, half = _check_rope_args(q.dtype, q.device, tokens, hkv, d, cos_table, sin_table, positions, q_norm,
                                       k_norm, k_pages, v_pages, slots)
    if 2 * half > d:
        raise KernelArgumentError(f"cos_table: shape {list(cos_table.shape)} does not fit head_dim {d}")
    if k_pages is not None:
        expect(v, "v", dtype=q.dtype, shape=(tokens, hkv, d), device=q.device)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rc = lib().trellm_rotary_qk(
        _ptr(q), _ptr(k), _ptr(q_out), _ptr(k_out), _ptr(positions, "int64_t *"), _ptr(cos_table, "float *"),
        _ptr(sin_table, "float *"), table_len, _ptr(q_norm), _ptr(k_norm), float(norm_eps), int(bool(norm_unit_offset)),
        _ptr(v if k_pages is not None else None), _ptr(k_pages), _ptr(v_pages if k_pages is not None else None),
        _ptr(slots if k_pages is not None else None, "int64_t *"), tokens, hq, hkv, d, half, int(bool(interleaved)),
        DTYPE_CODES[q.dtype], _stream(),
    )
    _check(rc, "rotary_qk")
    return q_out, k_out
# ---- end fused RoPE -----------------------------------------------------------------------------------


def _fresh_mask(fresh: torch.Tensor | None, batch: int, device: torch.device):
    expect(fresh, "fresh", dtype=torch.bool, shape=(batch,), device=device, optional=True)
    return _ptr(fresh.view(torch.uint8) if fresh is not None else None, "uint8_t *")


def gated_delta_rule_step_slots(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
    slots: torch.Tensor, fresh: torch.Tensor | None = None,
) -> torch.Tensor:
    """One recurrent step updating states[slots] (float32 [S, H, Dk, Dv]) in place; returns out [B, H, Dv]."""
    return _delta_rule_step_slots("gated_delta_rule_step_slots", q, k, v, g, beta, states, slots, fresh, key_decay=False)


def kda_step_slots(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
    slots: torch.Tensor, fresh: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`gated_delta_rule_step_slots` with KDA's decay per key channel, g float32 [B, H, Dk]."""
    return _delta_rule_step_slots("kda_step_slots", q, k, v, g, beta, states, slots, fresh, key_decay=True)


def _delta_rule_step_slots(entry: str, q, k, v, g, beta, states, slots, fresh, key_decay: bool) -> torch.Tensor:
    """The checks and launch of ``trellm_{entry}``: g [B, H] (a decay per head) or, ``key_decay``, [B, H, Dk]."""
    expect(v, "v", dtype=_FLOATS, shape=(None, None, None))
    b, h, dv = v.shape
    expect(states, "states", dtype=torch.float32, shape=(None, h, None, dv), device=v.device)
    dk = states.shape[2]
    for t, name in ((q, "q"), (k, "k")):
        expect(t, name, dtype=_FLOATS, shape=(b, h, dk), device=v.device)
    expect(g, "g", dtype=torch.float32, shape=(b, h, dk) if key_decay else (b, h), device=v.device)
    expect(beta, "beta", dtype=torch.float32, shape=(b, h), device=v.device)
    expect(slots, "slots", dtype=torch.int64, shape=(b,), device=v.device)
    if dk not in DELTA_RULE_KEY_DIMS or dv % 32:
        raise KernelArgumentError(f"states: key dim {dk} (supported {DELTA_RULE_KEY_DIMS}), value dim {dv} (multiple of 32)")
    out = torch.empty_like(v)
    rc = getattr(lib(), f"trellm_{entry}")(
        _ptr(q), DTYPE_CODES[q.dtype], _ptr(k), DTYPE_CODES[k.dtype], _ptr(v), DTYPE_CODES[v.dtype],
        _ptr(g, "float *"), _ptr(beta, "float *"), _ptr(states, "float *"), _ptr(slots, "int64_t *"),
        _fresh_mask(fresh, b, v.device), _ptr(out), b, h, dk, dv, float(dk**-0.5), _stream(),
    )
    _check(rc, entry)
    return out


def gated_delta_net_step_slots(
    mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None, num_k_heads: int, head_k_dim: int,
    beta_scale: float = 1.0, l2_eps: float = 1e-6,
) -> torch.Tensor:
    """A gated delta net's decode step from its raw inputs (``trellm.ops.gated_delta_net_step_slots``): mixed
    [B, 2 * Hk * Dk + Hv * Dv] = q | k | v, gates a and b [B, Hv] (one dtype), A_log and dt_bias float32 [Hv];
    updates states[slots] (float32 [S, Hv, Dk, Dv]) in place and returns out [B, Hv, Dv] in mixed's dtype."""
    batch, heads, dv = _check_raw_delta_inputs(mixed, states, slots, num_k_heads, head_k_dim)
    expect(a, "a", dtype=_FLOATS, shape=(batch, heads), device=mixed.device)
    expect(b, "b", dtype=a.dtype, shape=(batch, heads), device=mixed.device)
    for t, name in ((A_log, "A_log"), (dt_bias, "dt_bias")):
        expect(t, name, dtype=torch.float32, shape=(heads,), device=mixed.device)
    out = torch.empty(batch, heads, dv, dtype=mixed.dtype, device=mixed.device)
    rc = lib().trellm_gated_delta_net_step_slots(
        _ptr(mixed), DTYPE_CODES[mixed.dtype], mixed.shape[1], _ptr(a), _ptr(b), DTYPE_CODES[a.dtype],
        _ptr(A_log, "float *"), _ptr(dt_bias, "float *"), float(beta_scale), float(l2_eps), _ptr(states, "float *"),
        _ptr(slots, "int64_t *"), _fresh_mask(fresh, batch, mixed.device), _ptr(out), batch, num_k_heads, heads,
        head_k_dim, dv, float(head_k_dim**-0.5), _stream(),
    )
    _check(rc, "gated_delta_net_step_slots")
    return out


def _check_raw_delta_inputs(mixed: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, num_k_heads: int,
                            head_k_dim: int) -> tuple[int, int, int]:
    """(batch, value heads, value dim) of a delta-rule layer's raw decode inputs, after checking mixed = q | k | v
    against the state slots (float32 [S, Hv, Dk, Dv]) and the slot ids."""
    expect(mixed, "mixed", dtype=_FLOATS, shape=(None, None))
    batch = mixed.shape[0]
    expect(states, "states", dtype=torch.float32, shape=(None, None, head_k_dim, None), device=mixed.device)
    heads, dv = states.shape[1], states.shape[3]
    if num_k_heads < 1 or heads % num_k_heads or mixed.shape[1] != 2 * num_k_heads * head_k_dim + heads * dv:
        raise KernelArgumentError(f"mixed: {mixed.shape[1]} columns, expected q | k | v of {num_k_heads} key heads of "
                                  f"{head_k_dim} and {heads} value heads of {dv} (states {list(states.shape)})")
    expect(slots, "slots", dtype=torch.int64, shape=(batch,), device=mixed.device)
    if head_k_dim not in DELTA_RULE_KEY_DIMS or dv % 32:
        raise KernelArgumentError(f"states: key dim {head_k_dim} (supported {DELTA_RULE_KEY_DIMS}), value dim {dv} (multiple of 32)")
    return batch, heads, dv


def kimi_delta_attention_step_slots(
    mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None, num_k_heads: int, head_k_dim: int,
    lower_bound: float | None, l2_eps: float = 1e-6,
) -> torch.Tensor:
    """A KDA layer's decode step from its raw inputs (``trellm.ops.kimi_delta_attention_step_slots``): mixed
    [B, 2 * Hk * Dk + Hv * Dv] = q | k | v, the forget-gate input f [B, Hv * Dk] and beta's b [B, Hv] (one dtype),
    A_log float32 [Hv], dt_bias float32 [Hv * Dk]; updates states[slots] (float32 [S, Hv, Dk, Dv]) in place and
    returns out [B, Hv, Dv] in mixed's dtype. ``lower_bound`` None: the softplus decay."""
    batch, heads, dv = _check_raw_delta_inputs(mixed, states, slots, num_k_heads, head_k_dim)
    expect(f, "f", dtype=_FLOATS, shape=(batch, heads * head_k_dim), device=mixed.device)
    expect(b, "b", dtype=f.dtype, shape=(batch, heads), device=mixed.device)
    expect(A_log, "A_log", dtype=torch.float32, shape=(heads,), device=mixed.device)
    expect(dt_bias, "dt_bias", dtype=torch.float32, shape=(heads * head_k_dim,), device=mixed.device)
    out = torch.empty(batch, heads, dv, dtype=mixed.dtype, device=mixed.device)
    rc = lib().trellm_kimi_delta_attention_step_slots(
        _ptr(mixed), DTYPE_CODES[mixed.dtype], mixed.shape[1], _ptr(f), _ptr(b), DTYPE_CODES[f.dtype],
        _ptr(A_log, "float *"), _ptr(dt_bias, "float *"), int(lower_bound is not None),
        float(lower_bound if lower_bound is not None else 0.0), float(l2_eps), _ptr(states, "float *"),
        _ptr(slots, "int64_t *"), _fresh_mask(fresh, batch, mixed.device), _ptr(out), batch, num_k_heads, heads,
        head_k_dim, dv, float(head_k_dim**-0.5), _stream(),
    )
    _check(rc, "kimi_delta_attention_step_slots")
    return out


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float, sigmoid_gate: bool) -> torch.Tensor:
    """``trellm.ops.gated_rms_norm`` over x's last dim: x and gate of one shape, weight [dim]; y in x's dtype."""
    expect(x, "x", dtype=_FLOATS)
    dim = x.shape[-1]
    expect(weight, "weight", dtype=_FLOATS, shape=(dim,), device=x.device)
    expect(gate, "gate", dtype=_FLOATS, shape=tuple(x.shape), device=x.device)
    y = torch.empty_like(x)
    rc = lib().trellm_gated_rms_norm(
        _ptr(x), DTYPE_CODES[x.dtype], _ptr(weight), DTYPE_CODES[weight.dtype], _ptr(gate), DTYPE_CODES[gate.dtype],
        _ptr(y), x.numel() // max(dim, 1), dim, float(eps), int(bool(sigmoid_gate)), _stream(),
    )
    _check(rc, "gated_rms_norm")
    return y


def causal_conv1d_step_slots(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor, slots: torch.Tensor,
    fresh: torch.Tensor | None, silu: bool,
) -> torch.Tensor:
    """One conv step updating states[slots] ([S, C, W-1]) in place; returns out [B, C]."""
    expect(x, "x", dtype=_FLOATS, shape=(None, None))
    b, c = x.shape
    expect(weight, "weight", dtype=_FLOATS, shape=(c, None), device=x.device)
    width = weight.shape[1]
    if not 1 <= width <= 8:
        raise KernelArgumentError(f"weight: conv width {width} unsupported (1..8)")
    expect(bias, "bias", dtype=_FLOATS, shape=(c,), device=x.device, optional=True)
    expect(states, "states", dtype=_FLOATS, shape=(None, c, width - 1), device=x.device)
    expect(slots, "slots", dtype=torch.int64, shape=(b,), device=x.device)
    out = torch.empty_like(x)
    rc = lib().trellm_causal_conv1d_step_slots(
        _ptr(x), DTYPE_CODES[x.dtype], _ptr(weight), DTYPE_CODES[weight.dtype], _ptr(bias),
        DTYPE_CODES[bias.dtype] if bias is not None else 0, _ptr(states), DTYPE_CODES[states.dtype],
        _ptr(slots, "int64_t *"), _fresh_mask(fresh, b, x.device), _ptr(out), b, c, width, int(bool(silu)), _stream(),
    )
    _check(rc, "causal_conv1d_step_slots")
    return out


HC_MAX_STREAMS = 8  # TRELLM_HC_MAX_STREAMS


def hyper_connection_weights(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``trellm.ops.hyper_connection_weights`` in two launches: (block_input [T, D] in streams' dtype, post [T, N],
    comb [T, N, N] float32) from streams [T, N, D] (D % 4 == 0) and float32 fn, base, scale; streams and fn
    16-byte aligned."""
    expect(streams, "streams", dtype=_FLOATS, shape=(None, None, None))
    t, n, d = streams.shape
    if not 1 <= n <= HC_MAX_STREAMS or d % 4 or t > 65535 or streams.data_ptr() % 16:
        raise KernelArgumentError(f"streams: shape {list(streams.shape)} (at most {HC_MAX_STREAMS} streams, width a "
                                  f"multiple of 4, 65535 tokens) and a 16-byte aligned start")
    mixes = (2 + n) * n
    expect(fn, "fn", dtype=torch.float32, shape=(mixes, n * d), device=streams.device)
    if fn.data_ptr() % 16:
        raise KernelArgumentError("fn: the mix kernel reads it 16 bytes at a time; its start is not 16-byte aligned")
    expect(base, "base", dtype=torch.float32, shape=(mixes,), device=streams.device)
    expect(scale, "scale", dtype=torch.float32, shape=(3,), device=streams.device)
    if sinkhorn_iters < 0:
        raise KernelArgumentError(f"sinkhorn_iters: {sinkhorn_iters} (>= 0)")
    raw = torch.empty(t, mixes, dtype=torch.float32, device=streams.device)
    post = torch.empty(t, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=streams.device)
    block_input = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    rc = lib().trellm_hyper_connection_weights(
        _ptr(streams), DTYPE_CODES[streams.dtype], _ptr(fn, "float *"), _ptr(base, "float *"), _ptr(scale, "float *"),
        _ptr(raw, "float *"), _ptr(post, "float *"), _ptr(comb, "float *"), _ptr(block_input), t, n, d,
        int(sinkhorn_iters), float(eps), float(norm_eps), _stream(),
    )
    _check(rc, "hyper_connection_weights")
    return block_input, post, comb


def hyper_connection_merge(streams: torch.Tensor, block_output: torch.Tensor, post: torch.Tensor,
                           comb: torch.Tensor) -> torch.Tensor:
    """``trellm.ops.hyper_connection_merge`` in one launch: the new streams [T, N, D] in streams' dtype."""
    expect(streams, "streams", dtype=_FLOATS, shape=(None, None, None))
    t, n, d = streams.shape
    if not 1 <= n <= HC_MAX_STREAMS:
        raise KernelArgumentError(f"streams: {n} streams (at most {HC_MAX_STREAMS})")
    expect(block_output, "block_output", dtype=streams.dtype, shape=(t, d), device=streams.device)
    expect(post, "post", dtype=torch.float32, shape=(t, n), device=streams.device)
    expect(comb, "comb", dtype=torch.float32, shape=(t, n, n), device=streams.device)
    y = torch.empty_like(streams)
    rc = lib().trellm_hyper_connection_merge(
        _ptr(streams), _ptr(block_output), _ptr(post, "float *"), _ptr(comb, "float *"), _ptr(y),
        DTYPE_CODES[streams.dtype], t, n, d, _stream(),
    )
    _check(rc, "hyper_connection_merge")
    return y


ROUTER_MAX_EXPERTS = 1024


SHARED_PAIR_MODES = {None: 0, "one": 1, "sigmoid": 2}  # TRELLM_SHARED_PAIR_*


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool, scaling: float = 1.0,
                 shared: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], ids int64 [T, k]): softmax over the experts, the top k, optionally renormalised,
    times ``scaling``. ``shared`` "one" / "sigmoid": one more pair per row, [T, k + 1], for the shared expert
    (id = number of routed experts; weight 1, or sigmoid of logits' last column, which is then not an expert)."""
    expect(logits, "logits", dtype=_FLOATS, shape=(None, None))
    if shared not in SHARED_PAIR_MODES:
        raise KernelArgumentError(f"shared={shared!r}: expected one of {sorted(str(m) for m in SHARED_PAIR_MODES)}")
    tokens, columns = logits.shape
    experts = columns - (shared == "sigmoid")
    if not 1 <= experts <= ROUTER_MAX_EXPERTS or not 1 <= k <= experts:
        raise KernelArgumentError(f"logits: {experts} experts, top {k} (the kernel takes 1..{ROUTER_MAX_EXPERTS}, k <= experts)")
    out_k = k + (shared is not None)
    weights = torch.empty(tokens, out_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, out_k, dtype=torch.int64, device=logits.device)
    rc = lib().trellm_softmax_topk_shared(
        _ptr(logits), DTYPE_CODES[logits.dtype], _ptr(weights, "float *"), _ptr(ids, "int64_t *"), tokens, experts, k,
        int(bool(normalize)), float(scaling), SHARED_PAIR_MODES[shared], _stream(),
    )
    _check(rc, "softmax_topk")
    return weights, ids


LORA_MAX_RANK = 256  # TRELLM_LORA_MAX_RANK


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
             rank: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``trellm.ops.lora_add``: y + each row's update into ``out`` (y itself when None). x [rows, k], y and out
    [rows, n] (rows may be strided), a [S*rank, k], b [n, S*rank], all of one dtype; slots int64 [rows]."""
    expect(x, "x", dtype=_FLOATS, shape=(None, None), contiguous=False)
    rows, k = x.shape
    expect(y, "y", dtype=x.dtype, shape=(rows, None), device=x.device, contiguous=False)
    n = y.shape[1]
    if out is None:
        out = y
    expect(out, "out", dtype=x.dtype, shape=(rows, n), device=x.device, contiguous=False)
    for t, name in ((x, "x"), (y, "y"), (out, "out")):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise KernelArgumentError(f"{name}: the last dim must be contiguous (strides {t.stride()})")
    if not 1 <= rank <= LORA_MAX_RANK or a.dim() != 2 or a.shape[0] % rank:
        raise KernelArgumentError(f"rank {rank}: must be 1..{LORA_MAX_RANK} and divide a's {list(a.shape)} rows")
    width = a.shape[0]
    expect(a, "a", dtype=x.dtype, shape=(width, k), device=x.device)
    expect(b, "b", dtype=x.dtype, shape=(n, width), device=x.device)
    expect(slots, "slots", dtype=torch.int64, shape=(rows,), device=x.device)
    rc = lib().trellm_lora_add(
        _ptr(x), x.stride(0) if rows else k, _ptr(y), y.stride(0) if rows else n, _ptr(out), out.stride(0) if rows else n,
        _ptr(a), _ptr(b), _ptr(slots, "int64_t *"), rows, k, n, width // rank, rank, DTYPE_CODES[x.dtype], _stream(),
    )
    _check(rc, "lora_add")
    return out


LORA_MAX_PARTS = 4  # TRELLM_LORA_MAX_PARTS


def lora_add_parts(ys: Sequence[torch.Tensor], x: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
                   slots: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """``trellm.ops.lora_add_parts``: each ``ys[p] += `` its row's update by ``a[p]``, ``b[p]``, in ONE launch.
    x [rows, k]; ys[p] [rows, n_p] (rows may be strided); a[p] [S*rank, k], b[p] [n_p, S*rank]; one dtype."""
    expect(x, "x", dtype=_FLOATS, shape=(None, None), contiguous=False)
    rows, k = x.shape
    if not 1 <= len(ys) <= LORA_MAX_PARTS or len(a) != len(ys) or len(b) != len(ys):
        raise KernelArgumentError(f"parts: {len(ys)} outputs, {len(a)} A and {len(b)} B; 1..{LORA_MAX_PARTS} of each")
    if not 1 <= rank <= LORA_MAX_RANK or a[0].dim() != 2 or a[0].shape[0] % rank:
        raise KernelArgumentError(f"rank {rank}: must be 1..{LORA_MAX_RANK} and divide a's {list(a[0].shape)} rows")
    width = a[0].shape[0]
    for p, (y, ap, bp) in enumerate(zip(ys, a, b)):
        expect(y, f"ys[{p}]", dtype=x.dtype, shape=(rows, None), device=x.device, contiguous=False)
        expect(ap, f"a[{p}]", dtype=x.dtype, shape=(width, k), device=x.device)
        expect(bp, f"b[{p}]", dtype=x.dtype, shape=(y.shape[1], width), device=x.device)
    for t, name in ((x, "x"), *((y, f"ys[{p}]") for p, y in enumerate(ys))):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise KernelArgumentError(f"{name}: the last dim must be contiguous (strides {t.stride()})")
    expect(slots, "slots", dtype=torch.int64, shape=(rows,), device=x.device)
    f = ffi()
    rc = lib().trellm_lora_add_parts(
        _ptr(x), x.stride(0) if rows else k, len(ys), f.new("void *[]", [_ptr(y) for y in ys]),
        f.new("int64_t[]", [y.stride(0) if rows else y.shape[1] for y in ys]), f.new("void *[]", [_ptr(t) for t in a]),
        f.new("void *[]", [_ptr(t) for t in b]), f.new("int64_t[]", [y.shape[1] for y in ys]), _ptr(slots, "int64_t *"),
        rows, k, width // rank, rank, DTYPE_CODES[x.dtype], _stream(),
    )
    _check(rc, "lora_add_parts")
    return list(ys)


LORA_SPLIT_K = 512  # TRELLM_LORA_SPLIT_K


def lora_add_split(ys: Sequence[torch.Tensor], x: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
                   slots: torch.Tensor, rank: int, outs: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``lora_add_parts`` (``outs`` None: in place) or ``lora_add`` out of place (``outs[p]`` = ``ys[p]`` + update)
    as the split route's two launches: the shrink over many blocks, then the expand (``trellm_lora_add_split``).
    x [rows, k]; ys[p] and outs[p] [rows, n_p] (rows may be strided); a[p] [S*rank, k], b[p] [n_p, S*rank]."""
    expect(x, "x", dtype=_FLOATS, shape=(None, None), contiguous=False)
    rows, k = x.shape
    outs = list(ys) if outs is None else list(outs)
    if not 1 <= len(ys) <= LORA_MAX_PARTS or len(a) != len(ys) or len(b) != len(ys) or len(outs) != len(ys):
        raise KernelArgumentError(f"parts: {len(ys)} inputs, {len(outs)} outputs, {len(a)} A and {len(b)} B; "
                                  f"1..{LORA_MAX_PARTS} of each")
    if not 1 <= rank <= LORA_MAX_RANK or a[0].dim() != 2 or a[0].shape[0] % rank:
        raise KernelArgumentError(f"rank {rank}: must be 1..{LORA_MAX_RANK} and divide a's {list(a[0].shape)} rows")
    width = a[0].shape[0]
    for p, (y, out, ap, bp) in enumerate(zip(ys, outs, a, b)):
        expect(y, f"ys[{p}]", dtype=x.dtype, shape=(rows, None), device=x.device, contiguous=False)
        expect(out, f"outs[{p}]", dtype=x.dtype, shape=tuple(y.shape), device=x.device, contiguous=False)
        expect(ap, f"a[{p}]", dtype=x.dtype, shape=(width, k), device=x.device)
        expect(bp, f"b[{p}]", dtype=x.dtype, shape=(y.shape[1], width), device=x.device)
    named = [(x, "x"), *((y, f"ys[{p}]") for p, y in enumerate(ys)), *((o, f"outs[{p}]") for p, o in enumerate(outs))]
    for t, name in named:
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise KernelArgumentError(f"{name}: the last dim must be contiguous (strides {t.stride()})")
    expect(slots, "slots", dtype=torch.int64, shape=(rows,), device=x.device)
    splits = -(-k // LORA_SPLIT_K)
    workspace = torch.empty(rows * len(ys) * splits * rank, dtype=torch.float32, device=x.device)  # partial h
    f = ffi()

    def row_strides(ts: Sequence[torch.Tensor]):
        return f.new("int64_t[]", [t.stride(0) if rows else t.shape[1] for t in ts])

    rc = lib().trellm_lora_add_split(
        _ptr(x), x.stride(0) if rows else k, len(ys), f.new("void *[]", [_ptr(y) for y in ys]), row_strides(ys),
        f.new("void *[]", [_ptr(o) for o in outs]), row_strides(outs), f.new("void *[]", [_ptr(t) for t in a]),
        f.new("void *[]", [_ptr(t) for t in b]), f.new("int64_t[]", [y.shape[1] for y in ys]), _ptr(slots, "int64_t *"),
        _ptr(workspace, "float *"), rows, k, width // rank, rank, DTYPE_CODES[x.dtype], _stream(),
    )
    _check(rc, "lora_add_split")
    return outs


INDEX_MAX_HEADS, INDEX_MAX_DIM = 64, 128  # TRELLM_INDEX_MAX_HEADS, TRELLM_INDEX_MAX_DIM


def sparse_index_logits_takes(q: torch.Tensor, key_pages: torch.Tensor) -> bool:
    """Whether :func:`sparse_index_logits` takes these queries [T, H, D] and key pages [pages, page_size, D]: f16 or
    bf16 queries, keys of their dtype or float32, up to INDEX_MAX_HEADS heads of a multiple of 32 dims up to
    INDEX_MAX_DIM, the keys' dims contiguous and their rows 16-byte aligned."""
    return (
        q.dim() == 3 and key_pages.dim() == 3
        and q.dtype in (torch.float16, torch.bfloat16) and key_pages.dtype in (q.dtype, torch.float32)
        and 1 <= q.shape[1] <= INDEX_MAX_HEADS and q.shape[2] % 32 == 0 and 32 <= q.shape[2] <= INDEX_MAX_DIM
        and key_pages.shape[2] == q.shape[2] and key_pages.stride(2) == 1
        and key_pages.stride(0) % 8 == 0 and key_pages.stride(1) % 8 == 0 and key_pages.data_ptr() % 16 == 0
        and q.shape[0] <= 65535
    )


def sparse_index_logits(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, block_table: torch.Tensor,
                        cu_seqlens: torch.Tensor, key_counts: torch.Tensor, positions: torch.Tensor, scale: float,
                        rate: int) -> torch.Tensor:
    """``trellm.ops.sparse.index_logits`` in one launch: [T, W] float32 over the block table's whole width, -inf at
    the keys a token cannot see. q [T, H, D] contiguous, f16 or bf16; key_pages [pages, page_size, D] (strided pages
    and rows) of q's dtype or float32 (:func:`sparse_index_logits_takes`); weights float32 [T, H]; block_table int32 [B, max_pages];
    cu_seqlens int32 [B + 1]; key_counts int32 [B]; positions int64 [T]."""
    expect(q, "q", dtype=(torch.float16, torch.bfloat16), shape=(None, None, None))
    t, heads, dim = q.shape
    expect(key_pages, "key_pages", dtype=(q.dtype, torch.float32), shape=(None, None, dim), device=q.device,
           contiguous=False)
    if not sparse_index_logits_takes(q, key_pages) or q.data_ptr() % 16:
        raise KernelArgumentError(
            f"q {list(q.shape)} / key_pages {list(key_pages.shape)} strides {key_pages.stride()}: the kernel takes up "
            f"to {INDEX_MAX_HEADS} heads of 32..{INDEX_MAX_DIM} dims (a multiple of 32), 65535 tokens, keys with "
            f"contiguous dims, page and row strides multiples of 8 and 16-byte aligned starts")
    expect(weights, "weights", dtype=torch.float32, shape=(t, heads), device=q.device)
    expect(block_table, "block_table", dtype=torch.int32, shape=(None, None), device=q.device)
    batch = block_table.shape[0]
    if batch < 1:
        raise KernelArgumentError("block_table: no sequence (0 rows)")
    expect(cu_seqlens, "cu_seqlens", dtype=torch.int32, shape=(batch + 1,), device=q.device)
    expect(key_counts, "key_counts", dtype=torch.int32, shape=(batch,), device=q.device)
    expect(positions, "positions", dtype=torch.int64, shape=(t,), device=q.device)
    if rate < 1:
        raise KernelArgumentError(f"rate: {rate} (>= 1 tokens per key)")
    page_size = key_pages.shape[1]
    logits = torch.empty(t, block_table.shape[1] * page_size, dtype=torch.float32, device=q.device)
    rc = lib().trellm_sparse_index_logits(
        _ptr(q), DTYPE_CODES[q.dtype], _ptr(weights, "float *"), _ptr(key_pages), DTYPE_CODES[key_pages.dtype],
        _ptr(block_table, "int32_t *"),
        _ptr(cu_seqlens, "int32_t *"), _ptr(key_counts, "int32_t *"), _ptr(positions, "int64_t *"),
        _ptr(logits, "float *"), t, heads, dim, batch, page_size, key_pages.stride(0), key_pages.stride(1),
        block_table.shape[1], float(scale), int(rate), _stream(),
    )
    _check(rc, "sparse_index_logits")
    return logits
