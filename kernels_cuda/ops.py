"""Register the CUDA kernels as the ``"cuda"`` implementations of ``trellm.ops``.

Imported by ``trellm.ops.load_backends()`` when CUDA is available. Each implementation keeps its
op's signature and semantics; a case the kernel does not cover (an unusual dtype mix, an
unsupported head size) falls back to the op's torch reference rather than failing.
"""
from __future__ import annotations

import math

import torch

from trellm import ops as _ops
from trellm.ops import attention as _attention
from trellm.ops import dense as _dense
from trellm.ops import exl3 as _exl3
from trellm.ops import lora as _lora

from . import binding

# Build (or load from the cache) now, so a missing nvcc/cffi fails the backend import and
# load_backends() falls back to the references instead of failing at the first op call.
binding.lib()

# The mid-size route (binding.exl3_matmul_mid: the trellis decoded in registers against tensor-core fragments
# of x) for 6..64 rows, rather than the GEMV (<= 16 rows) or decode-to-fp16 + cuBLAS (> 64 rows). On the H200,
# 4 bpw, 2026-12-04c: against decode + cuBLAS 2.6x at 32 rows (4096->14336 34.0 vs 89.0 us, bf16 F.linear
# 33.2); against the GEMV at 16 rows 1.5x (29.6 vs 44.1 us; lm_head 204.5 vs 289.7). At 8 rows the two tie
# alone (29.0 vs 28.9), but the 8B decode step is faster on the mid route from batch 6 (4 bpw 4.66 -> 4.44 ms,
# 2 bpw 4.87 -> 4.36; batch 8 5.02 -> 4.46 and 5.20 -> 4.40) and slower at batch 5 (3.91 -> 4.43 ms), so the
# GEMV keeps 1..5 rows (NOTES 2026-12-04d). Both routes run the fused epilogues (residual add, RMSNorm, RoPE +
# KV write) in their finishing step.
EXL3_GEMV_MAX_ROWS = 5
EXL3_MID_MIN_ROWS = EXL3_GEMV_MAX_ROWS + 1
EXL3_MID_MAX_ROWS = binding.EXL3_MID_MAX_ROWS
# Above the GEMV's rows, exl3_matmul_group runs all parts in one mid-size call (three launches, one wave of blocks
# over every part); the mid route's finish adds the residual and sums the squares and its pack norms x from those
# sums, so a 6..64-row step keeps no add or RMSNorm launch between matmuls; and exl3_qkv_rope_write_kv's finish
# applies the per-head norm, RoPE and the KV-page stores as the GEMV's finishing warp does. Each measured faster
# than its baseline on the H200 (NOTES 2026-12-04c/d).
# Rows up to which a gated MLP's down projection applies the activation inside the GEMV's input
# transform. Measured on the H200 (14336 -> 4096, 4 bpw): 1.02x over the two kernels at 1 row, but
# 0.76x at 8 rows and 0.64x at 16, so more rows take gated_activation + the GEMV (NOTES, 2026-12-03d).
EXL3_GATED_FUSED_MAX_ROWS = 1

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@_exl3.hadamard_128.register("cuda")
def hadamard_128(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in _FLOATS or x.dim() == 0 or x.shape[-1] % 128:
        return _exl3.hadamard_128.reference(x)
    return binding.hadamard_128(x.contiguous())


@_exl3.exl3_codebook_decode.register("cuda")
def exl3_codebook_decode(states: torch.Tensor, codebook: str) -> torch.Tensor:
    return binding.exl3_codebook_decode(states.to(torch.int32).contiguous(), codebook)


@_exl3.exl3_decode_tiles.register("cuda")
def exl3_decode_tiles(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    return binding.exl3_decode_tiles(trellis.contiguous(), codebook)


def _f16(t: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous fp16 copy (or t itself) of an EXL3 layer's suh / svh / bias: what the GEMV reads."""
    return t.to(torch.float16).contiguous() if t is not None else None


@_exl3.exl3_matmul.register("cuda")
def exl3_matmul(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    if x.dtype not in _FLOATS or x.shape[-1] != k or k % 128 or n % 128:
        return _exl3.exl3_matmul.reference(x, trellis, suh, svh, codebook, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    suh16, svh16, bias16 = _f16(suh), _f16(svh), _f16(bias)
    if m < EXL3_MID_MIN_ROWS:
        y = binding.exl3_matmul_small(x2, trellis.contiguous(), suh16, svh16, codebook, bias16)
    elif m <= EXL3_MID_MAX_ROWS:
        y = binding.exl3_matmul_mid(x2, trellis.contiguous(), suh16, svh16, codebook, bias16)
    else:
        y = exl3_matmul_decoded(x2, trellis.contiguous(), suh16, svh16, codebook, bias16)
    return y.reshape(*lead, n)


def exl3_matmul_decoded(x2: torch.Tensor, trellis: torch.Tensor, suh16: torch.Tensor, svh16: torch.Tensor,
                        codebook: str, bias16: torch.Tensor | None = None) -> torch.Tensor:
    """exl3_matmul past EXL3_MID_MAX_ROWS rows of x2 [m, k]: W_hat decoded to fp16 (the bit-exact tile decoder),
    multiplied by cuBLAS, then H128 * svh + bias; the decode's cost is shared by all rows."""
    xh = binding.hadamard_128(x2, pre=suh16, out_dtype=torch.float16)
    acc = torch.matmul(xh, binding.exl3_decode_tiles(trellis, codebook))
    return binding.hadamard_128(acc, post=svh16, bias=bias16, out_dtype=x2.dtype)


@_exl3.exl3_matmul_gated.register("cuda")
def exl3_matmul_gated(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    fused = (
        gate.dtype in _FLOATS
        and up.dtype == gate.dtype
        and up.shape == gate.shape
        and gate.shape[-1] == k
        and k % 128 == 0
        and n % 128 == 0
        and activation in binding.ACTIVATION_CODES
        and 1 <= gate.numel() // k <= EXL3_GATED_FUSED_MAX_ROWS
    )
    if not fused:
        return exl3_matmul(gated_activation(gate, up, activation), trellis, suh, svh, codebook, bias)
    lead = gate.shape[:-1]
    y = binding.exl3_matmul_small_gated(gate.reshape(-1, k).contiguous(), up.reshape(-1, k).contiguous(), activation,
                                        trellis.contiguous(), _f16(suh), _f16(svh), codebook, _f16(bias))
    return y.reshape(*lead, n)


def _residual_fits(x: torch.Tensor, k: int, n: int, residual: torch.Tensor, min_rows: int = 1,
                   max_rows: int = EXL3_GEMV_MAX_ROWS) -> bool:
    """Whether the matmul adds ``residual`` itself: x [m, k] of min_rows..max_rows rows (the GEMV's by default),
    fp16 / bf16, residual [m, n] alike."""
    return (
        x.dim() == 2 and x.shape[1] == k and min_rows <= x.shape[0] <= max_rows
        and x.dtype in (torch.float16, torch.bfloat16) and k % 128 == 0 and n % 128 == 0
        and residual.shape == (x.shape[0], n) and residual.dtype == x.dtype
    )


@_exl3.exl3_matmul_add.register("cuda")
def exl3_matmul_add(x, trellis, suh, svh, codebook, bias, residual):
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    if _residual_fits(x, k, n, residual, EXL3_MID_MIN_ROWS, EXL3_MID_MAX_ROWS):
        return binding.exl3_matmul_mid(x.contiguous(), trellis.contiguous(), _f16(suh), _f16(svh), codebook,
                                       _f16(bias), residual=residual.contiguous())
    if not _residual_fits(x, k, n, residual):  # many rows (prefill): no sums; the next norm reads h itself
        return exl3_matmul(x, trellis, suh, svh, codebook, bias) + residual, None
    return binding.exl3_matmul_small(x.contiguous(), trellis.contiguous(), _f16(suh), _f16(svh), codebook, _f16(bias),
                                     residual=residual.contiguous())


@_exl3.exl3_matmul_gated_add.register("cuda")
def exl3_matmul_gated_add(gate, up, activation, trellis, suh, svh, codebook, bias, residual):
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    fused = (
        _residual_fits(gate, k, n, residual) and up.shape == gate.shape and up.dtype == gate.dtype
        and activation in binding.ACTIVATION_CODES and gate.shape[0] <= EXL3_GATED_FUSED_MAX_ROWS
    )
    if not fused:  # 2..5 rows: the activation's own launch, then the GEMV adds the residual and sums (1 launch)
        return exl3_matmul_add(gated_activation(gate, up, activation), trellis, suh, svh, codebook, bias, residual)
    return binding.exl3_matmul_small_gated(gate.contiguous(), up.contiguous(), activation, trellis.contiguous(),
                                           _f16(suh), _f16(svh), codebook, _f16(bias), residual=residual.contiguous())


def _row_norm_fits(x: torch.Tensor, row_norm) -> bool:
    """Whether the GEMV norms x [m, k] itself from ``row_norm``'s sums (their shape, the weight's dtype)."""
    if row_norm is None:
        return True
    w = row_norm.weight
    return (
        x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16)
        and row_norm.ssq.shape == (x.shape[0], x.shape[1] // 128) and row_norm.ssq.dtype == torch.float32
        and row_norm.ssq.is_contiguous()
        and (w is None or (w.dtype == x.dtype and w.shape == (x.shape[1],)))
        and row_norm.eps >= 0.0
    )


def _split_row_norm(x: torch.Tensor, row_norm):
    """(x, row_norm) for the GEMV or the mid-size pack: unchanged when it norms x itself (the sums fit), else the
    norm applied here first (the rms_norm kernel) and none left for the matmul."""
    if row_norm is None or _row_norm_fits(x, row_norm):
        return x, row_norm
    return row_norm.apply(x), None


def _one_call(x: torch.Tensor, parts, min_rows: int, max_rows: int) -> bool:
    """Whether x [..., k] by all these parts goes to one call of a multi-part route: min_rows..max_rows rows,
    one K, k and every n multiples of 128."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    return (
        1 <= len(parts) <= binding.EXL3_MAX_PARTS
        and x.dtype in _FLOATS
        and min_rows <= m <= max_rows
        and k % 128 == 0
        and len({p[0].shape[2] for p in parts}) == 1
        and all(p[0].shape[0] * 16 == k and p[0].shape[1] % 8 == 0 for p in parts)
    )


def _gemv_one_launch(x: torch.Tensor, parts) -> bool:
    """Whether the small-batch GEMV takes x [..., k] by all these parts in one launch: its rows, one K."""
    return _one_call(x, parts, 1, EXL3_GEMV_MAX_ROWS)


def _gemv_parts(parts) -> list:
    """The parts as the GEMV and the mid-size matmul read them: contiguous trellis, fp16 suh / svh / bias."""
    return [(trellis.contiguous(), _f16(suh), _f16(svh), _f16(bias)) for trellis, suh, svh, bias in parts]


@_exl3.exl3_matmul_group.register("cuda")
def exl3_matmul_group(x: torch.Tensor, parts, codebook: str, row_norm=None) -> list[torch.Tensor]:
    lead = x.shape[:-1]
    if _gemv_one_launch(x, parts):
        x, row_norm = _split_row_norm(x, row_norm)
        ys = binding.exl3_matmul_small_multi(x.reshape(-1, x.shape[-1]).contiguous(), _gemv_parts(parts), codebook,
                                             row_norm=row_norm)
        return [y.reshape(*lead, y.shape[-1]) for y in ys]
    if _one_call(x, parts, EXL3_MID_MIN_ROWS, EXL3_MID_MAX_ROWS):
        x, row_norm = _split_row_norm(x, row_norm)
        ys = binding.exl3_matmul_mid_multi(x.reshape(-1, x.shape[-1]).contiguous(), _gemv_parts(parts), codebook,
                                           row_norm=row_norm)
        return [y.reshape(*lead, y.shape[-1]) for y in ys]
    if row_norm is not None:
        x = row_norm.apply(x)
    return [exl3_matmul(x, trellis, suh, svh, codebook, bias) for trellis, suh, svh, bias in parts]


@_exl3.exl3_qkv_rope_write_kv.register("cuda")
def exl3_qkv_rope_write_kv(x, parts, codebook, head_dim, cos_table, sin_table, positions, k_pages, v_pages, slots,
                           interleaved=False, q_norm=None, k_norm=None, norm_eps=1e-6, norm_unit_offset=False,
                           row_norm=None):
    t = x.shape[0]
    gemv = _gemv_one_launch(x, parts)
    mid = not gemv and _one_call(x, parts, EXL3_MID_MIN_ROWS, EXL3_MID_MAX_ROWS)
    fused = (
        len(parts) == 3
        and head_dim == 128
        and x.dim() == 2
        and x.dtype in (torch.float16, torch.bfloat16)
        and (gemv or mid)
        and parts[1][0].shape[1] == parts[2][0].shape[1]
        and cos_table.dim() == 2 and cos_table.shape[1] % 4 == 0 and 0 < 2 * cos_table.shape[1] <= head_dim
        and sin_table.shape == cos_table.shape and positions.dim() == 1
        and (q_norm is None) == (k_norm is None)
        and (q_norm is None or (q_norm.dtype == x.dtype and q_norm.numel() == head_dim and k_norm.dtype == x.dtype
                                and k_norm.numel() == head_dim))
        and k_pages.dtype == x.dtype and v_pages.shape == k_pages.shape and v_pages.dtype == x.dtype
        and k_pages.is_contiguous() and v_pages.is_contiguous()
        and k_pages.dim() == 4 and k_pages.shape[2:] == (parts[1][0].shape[1] * 16 // head_dim, head_dim)
    )
    if not fused:  # the two ops one after the other, each on its own kernels where they apply
        q, kk, v = (y.reshape(t, -1, head_dim) for y in exl3_matmul_group(x, parts, codebook, row_norm))
        return rotary_qk_write_kv(q, kk, v, cos_table, sin_table, positions, k_pages, v_pages, slots, interleaved,
                                  q_norm, k_norm, norm_eps, norm_unit_offset)
    x, row_norm = _split_row_norm(x, row_norm)
    c, s, p = _rope_tables(x, cos_table, sin_table, positions)
    q, kk, _ = binding.exl3_matmul_qkv_rope(
        x.contiguous(), _gemv_parts(parts), codebook, c, s, p, interleaved, _norm_weight(q_norm), _norm_weight(k_norm),
        norm_eps, norm_unit_offset, k_pages, v_pages, slots.to(device=x.device, dtype=torch.int64).contiguous(),
        row_norm=row_norm, route="small" if gemv else "mid",
    )
    return q.reshape(t, -1, head_dim), kk.reshape(t, -1, head_dim)


# ---- the projection seam: every fused route of trellm.ops.project ------------------------------------------
from trellm.ops import projection as _projection  # noqa: E402
from trellm.quant.exl3.format import EXL3Group, EXL3Linear  # noqa: E402


@_projection.project.register("cuda")
def project(x, weights, pre=None, post=None):
    """``trellm.ops.project`` on CUDA: the EXL3 routes that fuse a step into the matmul's launch; everything
    else (dense weights, padded EXL3 layers, steps no kernel takes) runs as the reference's unfused ops."""
    if isinstance(weights, EXL3Group):
        out = _project_exl3_group(x, weights, pre, post)
    elif isinstance(weights, EXL3Linear):
        out = _project_exl3(x, weights, pre, post)
    else:
        out = None
    return out if out is not None else _projection.project.reference(x, weights, pre, post)


def _project_exl3_group(x, group: EXL3Group, pre, post):
    """q/k/v or gate/up of one x in one exl3_matmul_group (one GEMV or mid-size launch up to 64 rows), the input
    RMSNorm applied from its sums inside it, and with RopeKV the heads finished in the same launch
    (exl3_qkv_rope_write_kv). None: not a route of this op (the reference runs)."""
    if isinstance(x, _projection.Normed):
        x, pre = x.x, x.norm
    if isinstance(pre, _projection.GatedAct):
        return None
    row_norm = pre if pre is not None and pre.ssq is not None and group.norms_input else None
    if pre is not None and row_norm is None:
        x = pre.apply(x)
    if post is None:
        return group.forward(x, row_norm)
    if not isinstance(post, _projection.RopeKV):
        return None
    if not group.unpadded or x.dim() != 2:  # the group's launch, then the RoPE + KV-write kernel
        return post.apply(*group.forward(x, row_norm))
    return _exl3.exl3_qkv_rope_write_kv(x, group.matmul_parts, group.codebook, post.head_dim, post.cos_table, post.sin_table,
                                  post.positions, post.k_pages, post.v_pages, post.slots, post.interleaved,
                                  post.q_norm, post.k_norm, post.norm_eps, post.norm_unit_offset, row_norm=row_norm)


def _project_exl3(x, w: EXL3Linear, pre, post):
    """One EXL3 projection: a gated MLP's down with the activation in the GEMV's input transform (1 row), and a
    sub-layer's last projection adding the residual and summing the squares in its finishing step
    (exl3_matmul_add / exl3_matmul_gated_add). None: not a route of this op."""
    x = _projection.tensor(x)
    if isinstance(pre, _projection.RowNorm):
        x, pre = pre.apply(x), None
    residual = post.h if isinstance(post, _projection.Residual) else None
    if residual is None and post is not None:
        return None
    args = (w.trellis, w.suh, w.svh, w.codebook, w.bias)
    if isinstance(pre, _projection.GatedAct):
        if residual is not None and w.unpadded:
            h, ssq = _exl3.exl3_matmul_gated_add(x.reshape(-1, x.shape[-1]), pre.up.reshape(-1, x.shape[-1]), pre.activation,
                                           *args, residual.reshape(-1, residual.shape[-1]))
            return _projection.Hidden(h.reshape(*x.shape[:-1], h.shape[-1]), ssq=ssq)
        y = w._rows_out(_exl3.exl3_matmul_gated(w._rows_in(x), w._rows_in(pre.up), pre.activation, *args), x.shape[:-1])
        return y if residual is None else _projection.Hidden(y, residual)
    if residual is None or not w.unpadded:
        return None
    h, ssq = _exl3.exl3_matmul_add(x.reshape(-1, x.shape[-1]), *args, residual.reshape(-1, residual.shape[-1]))
    return _projection.Hidden(h.reshape(*x.shape[:-1], h.shape[-1]), ssq=ssq)
# ---- end of the projection seam -------------------------------------------------------------------------------


@_exl3.trellis_viterbi.register("cuda")
def trellis_viterbi(targets: torch.Tensor, K: int, codebook: str) -> torch.Tensor:
    if targets.dim() != 2 or targets.shape[-1] != 256 or not 1 <= K <= 8:
        return _exl3.trellis_viterbi.reference(targets, K, codebook)
    return binding.trellis_viterbi(targets.to(torch.float32).contiguous(), K, codebook)


@_dense.rms_norm.register("cuda")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, unit_offset: bool = False) -> torch.Tensor:
    if x.dtype not in _FLOATS or x.numel() == 0 or (weight is not None and weight.dtype not in _FLOATS):
        return _dense.rms_norm.reference(x, weight, eps, unit_offset)
    w = weight.contiguous() if weight is not None else None
    return binding.rms_norm(x.contiguous(), w, eps, unit_offset)


@_dense.add_rms_norm.register("cuda")
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        x.dtype not in _FLOATS
        or residual.dtype != x.dtype
        or residual.shape != x.shape
        or x.numel() == 0
        or (weight is not None and weight.dtype not in _FLOATS)
    ):
        return _dense.add_rms_norm.reference(x, residual, weight, eps, unit_offset)
    w = weight.contiguous() if weight is not None else None
    return binding.rms_norm(x.contiguous(), w, eps, unit_offset, residual=residual.contiguous())


@_dense.rotary_embedding.register("cuda")
def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if x.dim() != 3 or x.dtype not in _FLOATS or cos.dim() != 2:
        return _dense.rotary_embedding.reference(x, cos, sin, interleaved)
    c = cos.to(torch.float32).contiguous()
    s = sin.to(torch.float32).contiguous()
    return binding.rotary_embedding(x.contiguous(), c, s, interleaved)


@_dense.gated_activation.register("cuda")
def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    if (
        gate.dtype not in _FLOATS
        or up.dtype != gate.dtype
        or up.shape != gate.shape
        or activation not in binding.ACTIVATION_CODES
        or gate.numel() == 0
    ):
        return _dense.gated_activation.reference(gate, up, activation)
    dim = gate.shape[-1]
    g2, u2 = gate.reshape(-1, dim), up.reshape(-1, dim)
    if dim > 1 and (g2.stride(1) != 1 or u2.stride(1) != 1):
        g2, u2 = g2.contiguous(), u2.contiguous()
    return binding.gated_activation(g2, u2, activation).reshape(gate.shape)


@_attention.write_kv_pages.register("cuda")
def write_kv_pages(
    k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor
) -> None:
    if (
        k_pages.dtype not in _FLOATS or v_pages.shape != k_pages.shape  # MLA: the latent's V is narrower than K
        or not (k_pages.is_contiguous() and v_pages.is_contiguous())
    ):
        return _attention.write_kv_pages.reference(k, v, k_pages, v_pages, slots)
    binding.write_kv_pages(
        k.to(k_pages.dtype).contiguous(),
        v.to(v_pages.dtype).contiguous(),
        k_pages,
        v_pages,
        slots.to(device=k_pages.device, dtype=torch.int64).contiguous(),
    )


# Prefill calls go through the tiled kernel (attention_prefill.cu) when the mean query length per
# sequence is at least this: only shapes are read (no host sync, so decode steps stay graph-capturable),
# and a mean of 16 guarantees some sequence fills a tile while decode steps (1 token per sequence) and
# speculative verification (a few) keep the per-token kernel, whose key splits spread long contexts.
TILED_PREFILL_MIN_MEAN_QUERY = 16
TILED_PREFILL_CALLS = 0  # calls that took the tiled path (tests assert the dispatch does not fall back)


def _tiled_prefill_ok(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor
) -> bool:
    """Whether this paged_attention call is a prefill the tiled kernel covers and is worth it for."""
    tokens, hq, d = q.shape
    hkv = k_pages.shape[2]
    batch = block_table.shape[0]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and d in binding.PREFILL_HEAD_DIMS
        and hq % hkv == 0
        and hq // hkv <= binding.PREFILL_MAX_GROUP
        and batch > 0
        and tokens >= TILED_PREFILL_MIN_MEAN_QUERY * batch
        and k_pages.data_ptr() % 16 == 0
        and v_pages.data_ptr() % 16 == 0
        and (not q.is_contiguous() or q.data_ptr() % 16 == 0)  # a copy made by .contiguous() is aligned
    )


@_attention.paged_attention.register("cuda")
def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    d = q.shape[-1]
    if (
        q.dim() != 3
        or q.dtype not in _FLOATS
        or k_pages.dtype != q.dtype
        or v_pages.dtype != q.dtype
        or v_pages.shape[-1] != d
        or d not in binding.ATTENTION_HEAD_DIMS
        or not (k_pages.is_contiguous() and v_pages.is_contiguous())
    ):
        return _attention.paged_attention.reference(
            q, k_pages, v_pages, block_table, cu_seqlens, context_lens, scale, sliding_window, softcap, sinks
        )
    dev = q.device
    kernel = binding.paged_attention
    if _tiled_prefill_ok(q, k_pages, v_pages, block_table):
        global TILED_PREFILL_CALLS
        TILED_PREFILL_CALLS += 1
        kernel = binding.paged_attention_prefill
    return kernel(
        q.contiguous(),
        k_pages,
        v_pages,
        block_table.to(device=dev, dtype=torch.int32).contiguous(),
        cu_seqlens.to(device=dev, dtype=torch.int32).contiguous(),
        context_lens.to(device=dev, dtype=torch.int32).contiguous(),
        scale if scale is not None else 1.0 / math.sqrt(d),
        int(sliding_window or 0),
        float(softcap or 0.0),
        sinks.to(device=dev, dtype=torch.float32).contiguous() if sinks is not None else None,
    )



# ---- KV-cache quantization (kv_quant.cu) ------------------------------------------------------------
from trellm.ops import kv_quant as _kv_quant  # noqa: E402


def _kv_bits_ok(bits) -> bool:
    return isinstance(bits, int) and 2 <= bits <= 8


@_kv_quant.kv_quantize.register("cuda")
def kv_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.dtype not in _FLOATS or x.shape[1] == 0 or x.shape[1] % _kv_quant.GROUP or not _kv_bits_ok(bits):
        return _kv_quant.kv_quantize.reference(x, bits)  # raises the reference's error for bad input
    return binding.kv_quantize(x.contiguous(), bits)


@_kv_quant.kv_dequantize.register("cuda")
def kv_dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    if (
        not _kv_bits_ok(bits)
        or scales.dim() != 2
        or scales.shape[1] == 0
        or scales.dtype != torch.float16
        or packed.dtype != torch.int32
        or tuple(packed.shape) != (scales.shape[0], scales.shape[1] * bits)
        or dtype not in _FLOATS
    ):
        return _kv_quant.kv_dequantize.reference(packed, scales, bits, dtype)
    return binding.kv_dequantize(packed.contiguous(), scales.contiguous(), bits, dtype)


# Fused cache paths (kv_quantize_store: quantize straight into the cache rows at slots; kv_dequantize_pages:
# gather + dequantize whole pages in one launch).
@_kv_quant.kv_quantize_store.register("cuda")
def kv_quantize_store(x: torch.Tensor, bits: int, packed_pages: torch.Tensor, scale_pages: torch.Tensor,
                      slots: torch.Tensor) -> None:
    if (
        x.dim() != 2 or x.dtype not in _FLOATS or x.shape[1] == 0 or x.shape[1] % _kv_quant.GROUP
        or not _kv_bits_ok(bits) or packed_pages.dtype != torch.int32 or scale_pages.dtype != torch.float16
        or not (packed_pages.is_contiguous() and scale_pages.is_contiguous())
    ):
        return _kv_quant.kv_quantize_store.reference(x, bits, packed_pages, scale_pages, slots)
    binding.kv_quantize_store(x.contiguous(), bits, packed_pages, scale_pages,
                              slots.to(device=x.device, dtype=torch.int64).contiguous())


@_kv_quant.kv_dequantize_pages.register("cuda")
def kv_dequantize_pages(packed_pages: torch.Tensor, scale_pages: torch.Tensor, pages: torch.Tensor, bits: int,
                        dtype: torch.dtype = torch.float16) -> torch.Tensor:
    if (
        not _kv_bits_ok(bits) or dtype not in _FLOATS or packed_pages.dtype != torch.int32
        or scale_pages.dtype != torch.float16 or scale_pages.dim() != 3
        or not (packed_pages.is_contiguous() and scale_pages.is_contiguous())
    ):
        return _kv_quant.kv_dequantize_pages.reference(packed_pages, scale_pages, pages, bits, dtype)
    return binding.kv_dequantize_pages(packed_pages, scale_pages,
                                       pages.to(device=packed_pages.device, dtype=torch.int64).contiguous(),
                                       bits, dtype)
# ---- end KV-cache quantization ------------------------------------------------------------------------


# ---- fused RoPE (decode-step fusion) ------------------------------------------------------------------
def _rotary_qk_cuda_ok(q, k, cos_table, sin_table, positions, q_norm, k_norm, pages=()) -> bool:
    """Whether the fused RoPE kernel covers these arguments (else the op's reference runs)."""
    if q.dim() != 3 or k.dim() != 3 or q.dtype not in _FLOATS or k.dtype != q.dtype or k.shape[0] != q.shape[0]:
        return False
    if k.shape[2] != q.shape[2] or q.shape[2] > binding.ROPE_MAX_HEAD_DIM or positions.dim() != 1:
        return False
    if cos_table.dim() != 2 or sin_table.shape != cos_table.shape or cos_table.shape[0] == 0:
        return False
    if 2 * cos_table.shape[1] > q.shape[2] or (q_norm is None) != (k_norm is None):
        return False
    if q_norm is not None and (q_norm.dtype != q.dtype or k_norm.dtype != q.dtype or q_norm.numel() != q.shape[2]
                               or k_norm.numel() != q.shape[2]):
        return False
    return all(p.dtype == q.dtype and p.is_contiguous() for p in pages)


def _rope_tables(q, cos_table, sin_table, positions):
    dev = q.device
    return (cos_table.to(device=dev, dtype=torch.float32).contiguous(),
            sin_table.to(device=dev, dtype=torch.float32).contiguous(),
            positions.to(device=dev, dtype=torch.int64).contiguous())


def _norm_weight(w):
    return w.reshape(-1).contiguous() if w is not None else None


@_attention.rotary_qk.register("cuda")
def rotary_qk(q, k, cos_table, sin_table, positions, interleaved=False, q_norm=None, k_norm=None, norm_eps=1e-6,
              norm_unit_offset=False):
    if not _rotary_qk_cuda_ok(q, k, cos_table, sin_table, positions, q_norm, k_norm):
        return _attention.rotary_qk.reference(q, k, cos_table, sin_table, positions, interleaved, q_norm, k_norm,
                                              norm_eps, norm_unit_offset)
    c, s, p = _rope_tables(q, cos_table, sin_table, positions)
    return binding.rotary_qk(q.contiguous(), k.contiguous(), c, s, p, interleaved, _norm_weight(q_norm),
                             _norm_weight(k_norm), norm_eps, norm_unit_offset)


@_attention.rotary_qk_write_kv.register("cuda")
def rotary_qk_write_kv(q, k, v, cos_table, sin_table, positions, k_pages, v_pages, slots, interleaved=False,
                       q_norm=None, k_norm=None, norm_eps=1e-6, norm_unit_offset=False):
    if (
        not _rotary_qk_cuda_ok(q, k, cos_table, sin_table, positions, q_norm, k_norm, (k_pages, v_pages))
        or v.dtype != q.dtype or v.shape != k.shape or k_pages.dim() != 4 or v_pages.shape != k_pages.shape
        or tuple(k_pages.shape[2:]) != tuple(k.shape[1:])
    ):
        return _attention.rotary_qk_write_kv.reference(q, k, v, cos_table, sin_table, positions, k_pages, v_pages,
                                                       slots, interleaved, q_norm, k_norm, norm_eps, norm_unit_offset)
    c, s, p = _rope_tables(q, cos_table, sin_table, positions)
    return binding.rotary_qk(q.contiguous(), k.contiguous(), c, s, p, interleaved, _norm_weight(q_norm),
                             _norm_weight(k_norm), norm_eps, norm_unit_offset, v=v.contiguous(), k_pages=k_pages,
                             v_pages=v_pages, slots=slots.to(device=q.device, dtype=torch.int64).contiguous())
# ---- end fused RoPE -----------------------------------------------------------------------------------


@_lora.lora_add.register("cuda")
def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, rank: int,
             out: torch.Tensor | None = None):
    if (
        x.dim() != 2
        or y.dim() != 2
        or a.dtype not in _FLOATS
        or y.dtype != a.dtype
        or b.dtype != a.dtype
        or not 1 <= rank <= binding.LORA_MAX_RANK
        or (x.shape[1] > 1 and x.stride(1) != 1)
        or (y.shape[1] > 1 and y.stride(1) != 1)
        or (out is not None and (out.shape != y.shape or out.dtype != y.dtype or (out.shape[1] > 1 and out.stride(1) != 1)))
    ):
        return _lora.lora_add.reference(y, x, a, b, slots, rank, out)
    x, a, b, slots = x.to(a.dtype), a.contiguous(), b.contiguous(), slots.to(torch.int64).contiguous()
    if _lora.lora_kernel_route() == "split":
        return binding.lora_add_split([y], x, [a], [b], slots, rank, outs=[y if out is None else out])[0]
    return binding.lora_add(y, x, a, b, slots, rank, out)


@_lora.lora_add_parts.register("cuda")
def lora_add_parts(ys: list[torch.Tensor], x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
                   slots: torch.Tensor, rank: int):
    dtype = a[0].dtype
    if (
        x.dim() != 2
        or not 1 <= len(ys) <= binding.LORA_MAX_PARTS
        or dtype not in _FLOATS
        or not 1 <= rank <= binding.LORA_MAX_RANK
        or (x.shape[1] > 1 and x.stride(1) != 1)
        or any(y.dim() != 2 or y.dtype != dtype or (y.shape[1] > 1 and y.stride(1) != 1) for y in ys)
        or any(t.dtype != dtype or t.shape != a[0].shape for t in a)
        or any(t.dtype != dtype for t in b)
    ):
        return _lora.lora_add_parts.reference(ys, x, a, b, slots, rank)
    args = (ys, x.to(dtype), [t.contiguous() for t in a], [t.contiguous() for t in b], slots.to(torch.int64).contiguous(), rank)
    if _lora.lora_kernel_route() == "split":
        return binding.lora_add_split(*args)
    return binding.lora_add_parts(*args)


REGISTERED = sorted(name for name, o in _ops._OPS.items() if "cuda" in o.impls)


# ---- MoE decode (sync-free expert pairs) and the gated-delta-net decode step ----------------------------

from trellm.ops import moe as _moe  # noqa: E402
from trellm.ops import deltanet as _deltanet  # noqa: E402

_DENSE_TABLES: dict[tuple, torch.Tensor] = {}


def _stacked_table(t: torch.Tensor) -> torch.Tensor:
    """int64 [E] device pointers of t[e] for a contiguous stacked tensor (cached: a function of ptr, shape, dtype)."""
    key = (t.data_ptr(), tuple(t.shape), t.dtype, t.device)
    table = _DENSE_TABLES.get(key)
    if table is None:
        stride = t[0].numel() * t.element_size()
        table = torch.arange(t.shape[0], dtype=torch.int64, device=t.device) * stride + t.data_ptr()
        _DENSE_TABLES[key] = table
    return table


@_moe.dense_experts_matmul.register("cuda")
def dense_experts_matmul(
    x: torch.Tensor, expert_of: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pairs_per_row: int
) -> torch.Tensor:
    k = x.shape[-1]
    if (
        x.dim() != 2
        or weight.dim() != 3
        or weight.dtype not in _FLOATS
        or x.dtype != weight.dtype
        or weight.shape[2] != k
        or not weight.is_contiguous()
        or weight.data_ptr() % 16
        or weight[0].numel() * weight.element_size() % 16
        or k % (4 if x.dtype == torch.float32 else 8)
        or expert_of.numel() == 0
        or (bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()))
    ):
        return _moe.dense_experts_matmul.reference(x, expert_of, weight, bias, pairs_per_row)
    return binding.moe_dense_matmul(
        x.contiguous(), expert_of.to(torch.int64).contiguous(), _stacked_table(weight), weight.shape[1],
        _stacked_table(bias) if bias is not None else None, pairs_per_row,
    )


MOE_COUNTERS_PER_DEVICE = 1 << 16  # covers 512 pairs (the sync-free limit) at n up to 16384
_MOE_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _moe_counters(device: torch.device, pairs: int, top_k: int, mode: str, n: int) -> torch.Tensor | None:
    """The zeroed arrival counters of a one-launch pair matmul in mode "one_launch", else None (two launches).
    One buffer per device, made once outside graph capture (the warm-up step before a capture makes it) and
    never replaced, since a captured graph keeps its address; the kernels leave it zero after every launch."""
    if _moe.moe_decode_mode() != "one_launch" or binding.moe_exl3_counters(pairs, top_k, mode, n) > MOE_COUNTERS_PER_DEVICE:
        return None
    counters = _MOE_COUNTERS.get(device)
    if counters is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        counters = _MOE_COUNTERS[device] = torch.zeros(MOE_COUNTERS_PER_DEVICE, dtype=torch.int32, device=device)
    return counters


def _exl3_set_ok(x: torch.Tensor, experts) -> bool:
    return x.dim() == 2 and x.dtype in _FLOATS and experts.gate_up_table.device == x.device


@_moe.exl3_experts_gate_up.register("cuda")
def exl3_experts_gate_up(x: torch.Tensor, expert_of: torch.Tensor, experts, pairs_per_row: int, activation: str = "silu"):
    k, n, bits, codebook = experts.dims(experts.up)
    if not _exl3_set_ok(x, experts) or x.shape[1] != k or expert_of.numel() == 0:
        return _moe.exl3_experts_gate_up.reference(x, expert_of, experts, pairs_per_row, activation)
    ids = expert_of.to(torch.int64).contiguous()
    if not experts.gate:  # no gate: act(up), the up matmuls in one plain launch
        up = binding.moe_exl3_matmul(x.contiguous(), ids, experts.gate_up_table, k, n, bits, codebook,
                                     pairs_per_row=pairs_per_row, mode="plain",
                                     counters=_moe_counters(x.device, ids.numel(), 1, "plain", n))[0]
        return _dense.activation_fn(activation)(up)
    if activation in ("silu", "swish"):
        return binding.moe_exl3_matmul(x.contiguous(), ids, experts.gate_up_table, k, n, bits, codebook,
                                       pairs_per_row=pairs_per_row, mode="silu_gated",
                                       counters=_moe_counters(x.device, ids.numel(), 1, "silu_gated", n))
    gate, up = binding.moe_exl3_matmul(x.contiguous(), ids, experts.gate_up_table, k, n, bits, codebook,
                                       pairs_per_row=pairs_per_row, mode="plain",
                                       counters=_moe_counters(x.device, ids.numel(), 1, "plain", n))
    return _ops.gated_activation(gate, up, activation)


@_moe.exl3_experts_down.register("cuda")
def exl3_experts_down(h: torch.Tensor, expert_of: torch.Tensor, experts, weights: torch.Tensor) -> torch.Tensor:
    k, n, bits, codebook = experts.dims(experts.down)
    if (
        not _exl3_set_ok(h, experts)
        or h.shape[1] != k
        or expert_of.numel() == 0
        or weights.numel() != expert_of.numel()
        or weights.shape[1] > 32  # one warp per pair of a token in the finishing kernel
    ):
        return _moe.exl3_experts_down.reference(h, expert_of, experts, weights)
    return binding.moe_exl3_matmul(
        h.contiguous(), expert_of.to(torch.int64).contiguous(), experts.down_table, k, n, bits, codebook,
        mode="combine", pair_weights=weights.reshape(-1).to(torch.float32).contiguous(), top_k=weights.shape[1],
        counters=_moe_counters(h.device, expert_of.numel(), weights.shape[1], "combine", n),
    )


@_deltanet.gated_delta_rule_step.register("cuda")
def gated_delta_rule_step(q, k, v, g, beta, state):
    if (
        v.dim() != 3
        or q.shape[-1] not in binding.DELTA_RULE_KEY_DIMS
        or v.shape[-1] % 32
        or q.shape != k.shape
        or q.shape[:2] != v.shape[:2]
        or any(t.dtype not in _FLOATS for t in (q, k, v))
    ):
        return _deltanet.gated_delta_rule_step.reference(q, k, v, g, beta, state)
    return binding.gated_delta_rule_step(
        q.contiguous(), k.contiguous(), v.contiguous(), g.to(torch.float32).contiguous(),
        beta.to(torch.float32).contiguous(), state.to(torch.float32).contiguous(),
    )


@_deltanet.causal_conv1d_step.register("cuda")
def causal_conv1d_step(x, weight, bias, states, activation="silu", dilation=1):
    if (
        activation not in (None, "silu")
        or dilation != 1  # the kernel's taps are consecutive (a dilated step: the reference, sync-free too)
        or x.dim() != 2
        or weight.dim() != 2
        or not 1 <= weight.shape[1] <= 8
        or any(t.dtype not in _FLOATS for t in (x, weight, states))
        or (bias is not None and bias.dtype not in _FLOATS)
    ):
        return _deltanet.causal_conv1d_step.reference(x, weight, bias, states, activation, dilation)
    return binding.causal_conv1d_step(
        x.contiguous(), weight.contiguous(), bias.contiguous() if bias is not None else None, states.contiguous(),
        activation == "silu",
    )


def _delta_slots_fit(states: torch.Tensor) -> bool:
    """Whether the delta-rule step kernel takes these state slots: float32 [S, H, Dk, Dv] in place (contiguous),
    Dk one of its key dims, Dv a multiple of 32."""
    return (
        states.dim() == 4
        and states.dtype == torch.float32
        and states.is_contiguous()
        and states.shape[2] in binding.DELTA_RULE_KEY_DIMS
        and states.shape[3] % 32 == 0
    )


@_deltanet.gated_delta_rule_step_slots.register("cuda")
def gated_delta_rule_step_slots(q, k, v, g, beta, states, slots, fresh=None):
    if v.dim() != 3 or not _delta_slots_fit(states) or any(t.dtype not in _FLOATS for t in (q, k, v)):
        return _deltanet.gated_delta_rule_step_slots.reference(q, k, v, g, beta, states, slots, fresh)
    return binding.gated_delta_rule_step_slots(
        q.contiguous(), k.contiguous(), v.contiguous(), g.to(torch.float32).contiguous(),
        beta.to(torch.float32).contiguous(), states, slots.to(torch.int64).contiguous(),
        fresh.to(torch.bool).contiguous() if fresh is not None else None,
    )


@_deltanet.gated_delta_net_step_slots.register("cuda")
def gated_delta_net_step_slots(mixed, a, b, A_log, dt_bias, states, slots, fresh=None, num_k_heads=1, head_k_dim=128,
                               beta_scale=1.0):
    if (
        mixed.dim() != 2
        or a.dim() != 2
        or not _delta_slots_fit(states)
        or mixed.dtype not in _FLOATS
        or a.dtype not in _FLOATS
        or b.dtype != a.dtype
    ):
        return _deltanet.gated_delta_net_step_slots.reference(mixed, a, b, A_log, dt_bias, states, slots, fresh, num_k_heads,
                                                              head_k_dim, beta_scale)
    return binding.gated_delta_net_step_slots(
        mixed.contiguous(), a.contiguous(), b.contiguous(), A_log.to(torch.float32).contiguous(),
        dt_bias.to(torch.float32).contiguous(), states, slots.to(torch.int64).contiguous(),
        fresh.to(torch.bool).contiguous() if fresh is not None else None, num_k_heads, head_k_dim, beta_scale,
    )


@_deltanet.kda_step_slots.register("cuda")
def kda_step_slots(q, k, v, g, beta, states, slots, fresh=None):
    """The KDA step kernel where ``TRELLM_KDA_DECODE`` is "kernel" or "fused" (reached on its default route too,
    so it stays on the reference until verified on a GPU)."""
    if (
        _deltanet.kda_decode_route() == "reference"
        or v.dim() != 3
        or not _delta_slots_fit(states)
        or any(t.dtype not in _FLOATS for t in (q, k, v))
    ):
        return _deltanet.kda_step_slots.reference(q, k, v, g, beta, states, slots, fresh)
    return binding.kda_step_slots(
        q.contiguous(), k.contiguous(), v.contiguous(), g.to(torch.float32).contiguous(),
        beta.to(torch.float32).contiguous(), states, slots.to(torch.int64).contiguous(),
        fresh.to(torch.bool).contiguous() if fresh is not None else None,
    )


@_deltanet.kimi_delta_attention_step_slots.register("cuda")
def kimi_delta_attention_step_slots(mixed, f, b, A_log, dt_bias, states, slots, fresh=None, num_k_heads=1,
                                    head_k_dim=128, lower_bound=-5.0):
    if (
        mixed.dim() != 2
        or f.dim() != 2
        or not _delta_slots_fit(states)
        or mixed.dtype not in _FLOATS
        or f.dtype not in _FLOATS
        or b.dtype != f.dtype
    ):
        return _deltanet.kimi_delta_attention_step_slots.reference(mixed, f, b, A_log, dt_bias, states, slots, fresh,
                                                                   num_k_heads, head_k_dim, lower_bound)
    return binding.kimi_delta_attention_step_slots(
        mixed.contiguous(), f.contiguous(), b.contiguous(), A_log.to(torch.float32).contiguous(),
        dt_bias.to(torch.float32).contiguous(), states, slots.to(torch.int64).contiguous(),
        fresh.to(torch.bool).contiguous() if fresh is not None else None, num_k_heads, head_k_dim, lower_bound,
    )


@_deltanet.gated_rms_norm.register("cuda")
def gated_rms_norm(x, weight, gate, eps, activation="silu"):
    if (
        activation not in ("silu", "sigmoid")
        or x.dim() == 0
        or x.shape[-1] == 0
        or gate.shape != x.shape
        or weight.shape != x.shape[-1:]
        or any(t.dtype not in _FLOATS for t in (x, weight, gate))
    ):
        return _deltanet.gated_rms_norm.reference(x, weight, gate, eps, activation)
    return binding.gated_rms_norm(x.contiguous(), weight.contiguous(), gate.contiguous(), eps, activation == "sigmoid")


@_deltanet.causal_conv1d_step_slots.register("cuda")
def causal_conv1d_step_slots(x, weight, bias, states, slots, fresh=None, activation="silu"):
    if (
        activation not in (None, "silu")
        or x.dim() != 2
        or weight.dim() != 2
        or not 1 <= weight.shape[1] <= 8
        or not states.is_contiguous()
        or any(t.dtype not in _FLOATS for t in (x, weight, states))
        or (bias is not None and bias.dtype not in _FLOATS)
    ):
        return _deltanet.causal_conv1d_step_slots.reference(x, weight, bias, states, slots, fresh, activation)
    return binding.causal_conv1d_step_slots(
        x.contiguous(), weight.contiguous(), bias.contiguous() if bias is not None else None, states,
        slots.to(torch.int64).contiguous(), fresh.to(torch.bool).contiguous() if fresh is not None else None,
        activation == "silu",
    )


@_moe.softmax_topk.register("cuda")
def softmax_topk(logits: torch.Tensor, k: int, normalize: bool = True):
    if logits.dim() != 2 or logits.dtype not in _FLOATS or not 1 <= k <= logits.shape[1] <= binding.ROUTER_MAX_EXPERTS:
        return _moe.softmax_topk.reference(logits, k, normalize)
    return binding.softmax_topk(logits.contiguous(), k, normalize)


@_moe.softmax_topk_shared.register("cuda")
def softmax_topk_shared(logits: torch.Tensor, k: int, normalize: bool = True, scaling: float = 1.0, shared: str = "sigmoid"):
    experts = logits.shape[-1] - (shared == "sigmoid") if logits.dim() == 2 else 0
    if (
        logits.dim() != 2
        or logits.dtype not in _FLOATS
        or shared not in _moe.SHARED_PAIR_MODES
        or not 1 <= k <= experts <= binding.ROUTER_MAX_EXPERTS
    ):
        return _moe.softmax_topk_shared.reference(logits, k, normalize, scaling, shared)
    return binding.softmax_topk(logits.contiguous(), k, normalize, scaling, shared)


# ---- hyper-connections (mHC: DeepSeek V4, GLM 5.3) ----------------------------------------------------

from trellm.ops import hyper as _hyper  # noqa: E402


def _hyper_kernel_takes(streams: torch.Tensor) -> bool:
    """Whether ``TRELLM_HYPER_CONNECTIONS`` picks the kernels and they take these streams [T, N, D]."""
    return (
        _hyper.hyper_connections_route() == "kernel"
        and streams.dim() == 3
        and streams.dtype in _FLOATS
        and 1 <= streams.shape[1] <= binding.HC_MAX_STREAMS
    )


# Tokens up to which a block's weights take the kernels (decode, draft verification): its mix kernel reads every
# token's streams once per mix row from the L2, which at prefill sizes costs more than torch's few launches and
# one matmul.
HC_KERNEL_MAX_TOKENS = 64


@_hyper.hyper_connection_weights.register("cuda")
def hyper_connection_weights(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps):
    if (
        not _hyper_kernel_takes(streams)
        or streams.shape[2] % 4
        or streams.shape[0] > HC_KERNEL_MAX_TOKENS
        or sinkhorn_iters < 0
    ):
        return _hyper.hyper_connection_weights.reference(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps)
    aligned = lambda t: t if t.data_ptr() % 16 == 0 else t.clone()  # noqa: E731  (the mix kernel's 16-byte loads)
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    return binding.hyper_connection_weights(aligned(streams.contiguous()), aligned(f32(fn)), f32(base), f32(scale),
                                            sinkhorn_iters, eps, norm_eps)


@_hyper.hyper_connection_merge.register("cuda")
def hyper_connection_merge(streams, block_output, post, comb):
    if not _hyper_kernel_takes(streams) or block_output.dtype != streams.dtype:
        return _hyper.hyper_connection_merge.reference(streams, block_output, post, comb)
    return binding.hyper_connection_merge(streams.contiguous(), block_output.contiguous(),
                                          post.to(torch.float32).contiguous(), comb.to(torch.float32).contiguous())


# ---- the DSA lightning indexer (DeepSeek V3.2 / V4, GLM 5) ---------------------------------------------------------

from trellm.ops import sparse as _sparse  # noqa: E402

# Tokens up to which the indexer's scores take the kernel (decode steps, draft verification: batch 64 with three
# draft tokens): it reads every visible key once per token, where a prefill's matmul shares them among its tokens,
# and its logits span the block table's whole width.
INDEX_KERNEL_MAX_TOKENS = 256


@_sparse.sparse_index_topk.register("cuda")
def sparse_index_topk(q, weights, key_pages, block_table, cu_seqlens, key_counts, positions, topk, scale, rate=1):
    """The logits kernel and torch's top-k (no host read at any context) where ``TRELLM_SPARSE_INDEX`` is "kernel"."""
    if (
        _sparse.sparse_index_route() != "kernel"
        or not 0 < q.shape[0] <= INDEX_KERNEL_MAX_TOKENS
        or block_table.shape[0] == 0
        or not binding.sparse_index_logits_takes(q, key_pages)
    ):
        return _sparse.sparse_index_topk.reference(q, weights, key_pages, block_table, cu_seqlens, key_counts, positions,
                                                   topk, scale, rate)
    logits = binding.sparse_index_logits(
        q.contiguous(), weights.to(torch.float32).contiguous(), key_pages, block_table.to(torch.int32).contiguous(),
        cu_seqlens.to(torch.int32).contiguous(), key_counts.to(torch.int32).contiguous(),
        positions.to(torch.int64).contiguous(), scale, rate,
    )
    return _sparse.top_visible(logits, topk)


REGISTERED = sorted(name for name, o in _ops._OPS.items() if "cuda" in o.impls)
