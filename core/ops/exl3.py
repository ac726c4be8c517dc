"""EXL3 trellis ops: codebooks, tile (un)packing, Hadamard, matmul and the Viterbi tile encoder.

Torch references, device-agnostic; ``trellm.kernels_cuda`` registers faster CUDA versions with the
same signatures. Format facts (bit layout, tile permutation, codebooks) follow
``shared/exl3_format.md`` sections 2-4:

* a 16x16 tile holds 256 K-bit codes as a circular MSB-first bitstream read from the little-endian
  uint32 view of its 16*K int16 words;
* the weight at trellis position p decodes from the 16-bit state ending at code p,
  ``state_p = ((state_{p-1} << K) | code_p) & 0xFFFF`` (tail-biting: state_{-1} = state_255);
* position p sits at tile element (row, col) of the mma.m16n8k16 B-fragment layout.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import op, route_from_env
from .dense import group_sum_squares
from .projection import RowNorm

__all__ = [
    "CODEBOOKS",
    "CODEBOOK_MULTIPLIERS",
    "TILE_PERM",
    "codebook_lut",
    "exl3_codebook_decode",
    "exl3_decode_tiles",
    "exl3_matmul",
    "hadamard_128",
    "hadamard_matrix",
    "pack_trellis",
    "trellis_viterbi",
    "unpack_trellis",
]

CODEBOOKS = ("3inst", "mcg", "mul1")

# The locked multipliers of the marker codebooks (the value stored in the `.mcg` / `.mul1` scalar).
CODEBOOK_MULTIPLIERS = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}
_MASK32 = 0xFFFFFFFF

MUL1_GEMV_ENV = "TRELLM_MUL1_GEMV"
MUL1_GEMV_ROUTES = ("fma", "split")


def mul1_gemv_route() -> str:
    """``TRELLM_MUL1_GEMV``, how the CUDA in-register EXL3 matmuls (GEMV, mid-size, MoE pairs) decode MUL1: "fma",
    each weight as the format's fp16 fma of its hash's byte sum; "split" (default), the byte sum straight into
    split-halves mma operands and the fma's constants applied to each k-slice's sum (the integer work of MCG's
    decode; the weights unrounded); the kernels' binding reads it at each launch. On the H200 (2026-12-05,
    ``bench_exl3_matmul.py --routes``, 4 bpw, 1 row) split takes 21.6 us for 4096x14336 against 22.3 for fma
    (MCG 19.6) and 135 us for the 128256-wide head against 145 (MCG 123)."""
    return route_from_env(MUL1_GEMV_ENV, MUL1_GEMV_ROUTES, "split")


def _tile_permutation() -> torch.Tensor:
    """perm[p] = row*16 + col of trellis position p inside a 16x16 tile (B-fragment layout)."""
    row_off = (0, 1, 8, 9, 0, 1, 8, 9)
    col_off = (0, 0, 0, 0, 8, 8, 8, 8)
    perm = []
    for p in range(256):
        lane, e = divmod(p, 8)
        r = (lane % 4) * 2 + row_off[e]
        c = lane // 4 + col_off[e]
        perm.append(r * 16 + c)
    return torch.tensor(perm, dtype=torch.long)


TILE_PERM = _tile_permutation()
TILE_PERM_INV = torch.argsort(TILE_PERM)


def _check_codebook(codebook: str) -> None:
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {', '.join(CODEBOOKS)}")


def _u16_to_f16(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret integers 0..65535 as fp16 bit patterns."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    return signed.to(torch.int16).view(torch.float16)


def _decode_states(states: torch.Tensor, codebook: str) -> torch.Tensor:
    x = states.to(torch.int64) & 0xFFFF
    if codebook == "mul1":
        x = (x * CODEBOOK_MULTIPLIERS["mul1"]) & _MASK32
        byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        h = (1024 + byte_sum).to(torch.float64)
        k_inv = _u16_to_f16(torch.tensor(0x1EEE)).to(torch.float64)
        k_bias = _u16_to_f16(torch.tensor(0xC931)).to(torch.float64)
        # h*k_inv + k_bias is exact in float64: one rounding to fp16, like the fp16 fma of the kernel.
        return (h * k_inv + k_bias).to(torch.float16)
    if codebook == "3inst":
        x = (x * 89226354 + 64248484) & _MASK32
    else:
        x = (x * CODEBOOK_MULTIPLIERS["mcg"]) & _MASK32
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = _u16_to_f16(x & 0xFFFF).to(torch.float32)
    hi = _u16_to_f16(x >> 16).to(torch.float32)
    # Both halves have |h| in [0.125, 2): their float32 sum is exact, so one rounding to fp16.
    return (lo + hi).to(torch.float16)


_LUT_CACHE: dict[tuple[str, str, torch.dtype], torch.Tensor] = {}


def codebook_lut(codebook: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The decoded value of every 16-bit state, [65536] (cached per device and dtype)."""
    _check_codebook(codebook)
    device = torch.device(device)
    key = (codebook, str(device), dtype)
    lut = _LUT_CACHE.get(key)
    if lut is None:
        lut = _decode_states(torch.arange(65536), codebook).to(device=device, dtype=dtype)
        _LUT_CACHE[key] = lut
    return lut


@op
def exl3_codebook_decode(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """fp16 value of each 16-bit trellis state (int32 tensor, any shape)."""
    lut = codebook_lut(codebook, states.device)
    return lut[(states.to(torch.int64) & 0xFFFF)]


# ---------------------------------------------------------------------------------------------
# Packing: 16-bit states <-> int16 trellis words


def _bit_weights(nbits: int, device: torch.device) -> torch.Tensor:
    return 1 << torch.arange(nbits - 1, -1, -1, device=device, dtype=torch.int64)


def unpack_trellis(trellis: torch.Tensor) -> torch.Tensor:
    """int16 [..., 16*K] tile words -> int32 [..., 256] full 16-bit states in position order."""
    if trellis.dtype != torch.int16 or trellis.shape[-1] % 16 != 0:
        raise ValueError(f"trellis must be int16 [..., 16*K], got {trellis.dtype} {list(trellis.shape)}")
    K = trellis.shape[-1] // 16
    lead = trellis.shape[:-1]
    words = trellis.to(torch.int64) & 0xFFFF
    # The stream reads the uint32 view MSB first: swap each int16 pair, then read 16-bit words MSB first.
    words = words.reshape(*lead, 8 * K, 2).flip(-1).reshape(*lead, 16 * K)
    bits = (words.unsqueeze(-1) >> torch.arange(15, -1, -1, device=trellis.device)) & 1
    codes = (bits.reshape(*lead, 256, K) * _bit_weights(K, trellis.device)).sum(-1)
    # state_p gathers code_p, code_{p-1}, ... (circular), newest in the low K bits.
    states = torch.zeros_like(codes)
    for i in range((16 + K - 1) // K):
        states |= torch.roll(codes, shifts=i, dims=-1) << (K * i)
    return (states & 0xFFFF).to(torch.int32)


def pack_trellis(states: torch.Tensor, K: int) -> torch.Tensor:
    """int [..., 256] states (only their low K bits, the codes, are kept) -> int16 [..., 16*K]."""
    if not 1 <= K <= 8:
        raise ValueError(f"K must be in 1..8, got {K}")
    if states.shape[-1] != 256:
        raise ValueError(f"states must be [..., 256], got {list(states.shape)}")
    lead = states.shape[:-1]
    codes = states.to(torch.int64) & ((1 << K) - 1)
    bits = (codes.unsqueeze(-1) >> torch.arange(K - 1, -1, -1, device=states.device)) & 1
    bits = bits.reshape(*lead, 16 * K, 16)
    words = (bits * _bit_weights(16, states.device)).sum(-1)
    words = words.reshape(*lead, 8 * K, 2).flip(-1).reshape(*lead, 16 * K)
    words = torch.where(words >= 0x8000, words - 0x10000, words)
    return words.to(torch.int16)


def tiles_to_matrix(tiles: torch.Tensor) -> torch.Tensor:
    """[k/16, n/16, 256] values in trellis-position order -> [k, n] matrix."""
    tk, tn, _ = tiles.shape
    row_major = tiles[..., TILE_PERM_INV.to(tiles.device)]
    return row_major.reshape(tk, tn, 16, 16).permute(0, 2, 1, 3).reshape(tk * 16, tn * 16)


def matrix_to_tiles(w: torch.Tensor) -> torch.Tensor:
    """[k, n] matrix -> [k/16, n/16, 256] values in trellis-position order."""
    k, n = w.shape
    row_major = w.reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3).reshape(k // 16, n // 16, 256)
    return row_major[..., TILE_PERM.to(w.device)]


@op
def exl3_decode_tiles(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """int16 trellis [k/16, n/16, 16*K] -> fp16 W_hat [k, n] (no Hadamards, no scales)."""
    if trellis.dim() != 3:
        raise ValueError(f"trellis must be 3-D [k/16, n/16, 16*K], got {list(trellis.shape)}")
    values = exl3_codebook_decode.reference(unpack_trellis(trellis), codebook)
    return tiles_to_matrix(values)


# ---------------------------------------------------------------------------------------------
# Hadamard and matmul

_HAD_CACHE: dict[str, torch.Tensor] = {}


def hadamard_matrix(device: torch.device | str = "cpu") -> torch.Tensor:
    """Natural-order Sylvester H_128 / sqrt(128), float32 (symmetric and orthonormal)."""
    device = torch.device(device)
    h = _HAD_CACHE.get(str(device))
    if h is None:
        idx = torch.arange(128)
        parity = torch.zeros(128, 128, dtype=torch.int64)
        anded = idx[:, None] & idx[None, :]
        for b in range(7):
            parity ^= (anded >> b) & 1
        h = ((1 - 2 * parity).to(torch.float32) / math.sqrt(128)).to(device)
        _HAD_CACHE[str(device)] = h
    return h


@op
def hadamard_128(x: torch.Tensor) -> torch.Tensor:
    """Block-diagonal 128-point Hadamard along the last dim (orthonormal), float32 math, same dtype."""
    d = x.shape[-1]
    if d % 128 != 0:
        raise ValueError(f"hadamard_128 needs the last dim to be a multiple of 128, got {d}")
    xf = x.float().reshape(*x.shape[:-1], d // 128, 128)
    return (xf @ hadamard_matrix(x.device)).reshape(x.shape).to(x.dtype)


@op
def exl3_matmul(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = hadamard_128(hadamard_128(x * suh) @ W_hat) * svh (+ bias), float32 math, in x.dtype."""
    w_hat = exl3_decode_tiles.reference(trellis, codebook).float()
    xh = hadamard_128.reference(x.float() * suh.float())
    y = hadamard_128.reference(xh @ w_hat) * svh.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@op
def exl3_matmul_add(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``h = exl3_matmul(x, ...) + residual`` (a sub-layer's last projection and the residual add, each
    rounded to x.dtype) and its sums of squares per row and 128-column group, float32 [rows, n / 128]: the
    next RMSNorm's input (:class:`RowNorm`). x [rows, k] and residual [rows, n].

    A backend may add the residual and sum the squares in the matmul's finishing step (the CUDA GEMV does,
    up to 16 rows). Where summing would cost a pass of its own (the CUDA GEMM path for many rows), it may
    return None for the sums: the next norm then reads h itself.
    """
    h = exl3_matmul.reference(x, trellis, suh, svh, codebook, bias) + residual
    return h, group_sum_squares(h)


@op
def exl3_matmul_group(
    x: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    codebook: str,
    row_norm: RowNorm | None = None,
) -> list[torch.Tensor]:
    """``exl3_matmul`` of one x by each (trellis, suh, svh, bias) part (q/k/v, gate/up); with ``row_norm``,
    of ``row_norm.apply(x)`` (the block's RMSNorm first).

    A backend may run the parts in one launch (the CUDA GEMV does, for equal K and up to 16 rows), and
    the norm in its input transform.
    """
    if row_norm is not None:
        x = row_norm.apply(x, reference=True)
    return [exl3_matmul.reference(x, trellis, suh, svh, codebook, bias) for trellis, suh, svh, bias in parts]


@op
def exl3_qkv_rope_write_kv(
    x: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    codebook: str,
    head_dim: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slots: torch.Tensor,
    interleaved: bool = False,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    norm_unit_offset: bool = False,
    row_norm: RowNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention layer's q/k/v projections of x [T, k] (the three parts of :func:`exl3_matmul_group`,
    ``row_norm`` as there), split into heads of ``head_dim``, then :func:`rotary_qk_write_kv`: returns the
    rotated q [T, Hq, D] and k [T, Hkv, D], with k and v stored at ``slots``.

    A backend may do it in one launch (the CUDA GEMV finishes each 128-wide head in the warp that
    computes it), so q and k never go through memory before they are rotated.
    """
    from .attention import rotary_qk_write_kv

    q, k, v = exl3_matmul_group.reference(x, parts, codebook, row_norm)
    t = x.shape[0]
    q, k, v = (y.reshape(t, -1, head_dim) for y in (q, k, v))
    return rotary_qk_write_kv.reference(q, k, v, cos_table, sin_table, positions, k_pages, v_pages, slots, interleaved,
                                        q_norm, k_norm, norm_eps, norm_unit_offset)


@op
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
    """``exl3_matmul(gated_activation(gate, up, activation), ...)``: a gated MLP's down projection.

    A backend may apply the activation in the matmul's input transform: one launch, and the
    activation's output never goes through memory.
    """
    from .dense import gated_activation

    x = gated_activation.reference(gate, up, activation)
    return exl3_matmul.reference(x, trellis, suh, svh, codebook, bias)


@op
def exl3_matmul_gated_add(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`exl3_matmul_add` of ``gated_activation(gate, up, activation)``: a gated MLP's down projection
    and the residual add, with the sums of squares for the next RMSNorm (or None, as there)."""
    h = exl3_matmul_gated.reference(gate, up, activation, trellis, suh, svh, codebook, bias) + residual
    return h, group_sum_squares(h)


# ---------------------------------------------------------------------------------------------
# Viterbi tile encoder


def _viterbi_pass(
    targets: torch.Tensor,
    positions: list[int],
    start_cost: torch.Tensor,
    K: int,
    lut: torch.Tensor,
    keep_from: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the trellis over ``positions``; returns final node costs and the back-pointers of steps >= keep_from.

    A node is the low 16-K bits of a state (what the next state inherits). A state s splits into
    (k = top K bits, hi = middle 16-2K bits, lo = low K bits); its in-node is k<<(16-2K) | hi and its
    out-node is hi<<K | lo, so the previous cost broadcasts over lo without any gather.
    """
    n = targets.shape[0]
    nk, nhi = 1 << K, 1 << (16 - 2 * K)
    lut4 = lut.view(nk, nhi, nk)
    lut_sq4 = (lut * lut).view(nk, nhi, nk)
    cost = start_cost
    cand = torch.empty(n, nk, nhi, nk, device=targets.device, dtype=torch.float32)
    best = torch.empty(n, nhi, nk, device=targets.device, dtype=torch.float32)
    arg = torch.empty(n, nhi, nk, device=targets.device, dtype=torch.int64)
    backptr = torch.empty(len(positions) - keep_from, n, nhi * nk, device=targets.device, dtype=torch.uint8)
    minus_two_w = targets * -2.0
    for step, p in enumerate(positions):
        # (decode(s) - w)^2 without the w^2 term, which is the same for every state of this step.
        torch.add(cost.view(n, nk, nhi, 1), lut_sq4, out=cand)
        cand.addcmul_(minus_two_w[:, p].view(n, 1, 1, 1), lut4)
        torch.min(cand, dim=1, out=(best, arg))
        if step >= keep_from:
            backptr[step - keep_from].copy_(arg.view(n, -1))
        cost = best.view(n, -1)  # read fully into cand before the next min overwrites it
    return cost, backptr


def _backtrack(backptr: torch.Tensor, end_nodes: torch.Tensor, K: int) -> torch.Tensor:
    """Follow back-pointers from ``end_nodes``; returns the full states of the stored steps, oldest first."""
    steps, n, _ = backptr.shape
    states = torch.empty(steps, n, dtype=torch.int64, device=backptr.device)
    node = end_nodes.to(torch.int64)
    rows = torch.arange(n, device=backptr.device)
    for s in range(steps - 1, -1, -1):
        k = backptr[s, rows, node].to(torch.int64)
        state = (k << (16 - K)) | node
        states[s] = state
        node = state >> K
    return states


@op
def trellis_viterbi(targets: torch.Tensor, K: int, codebook: str) -> torch.Tensor:
    """Tail-biting Viterbi: per tile [N, 256] (position order), the 16-bit states minimising the squared error.

    Two passes: pass 1 starts mid-tile (position 128) from free nodes and backtracks to find the
    node entering position 0; pass 2 forces the ring to start and end on that node.
    """
    if not 1 <= K <= 8:
        raise ValueError(f"K must be in 1..8, got {K}")
    if targets.dim() != 2 or targets.shape[1] != 256:
        raise ValueError(f"targets must be [N, 256], got {list(targets.shape)}")
    targets = targets.float()
    n, dev = targets.shape[0], targets.device
    if n == 0:
        return torch.empty(0, 256, dtype=torch.int32, device=dev)
    lut = codebook_lut(codebook, dev, torch.float32)
    nodes = 1 << (16 - K)

    # Pass 1: positions 128..255, 0..127; keep the back-pointers of 0..127 only.
    order = list(range(128, 256)) + list(range(128))
    zero = torch.zeros(n, nodes, device=dev)
    cost, backptr = _viterbi_pass(targets, order, zero, K, lut, keep_from=128)
    states_head = _backtrack(backptr, cost.argmin(dim=1), K)
    ring_node = states_head[0] >> K  # in-node of state_0 == out-node of state_255
    del backptr

    # Pass 2: start from ring_node only, end on it.
    start = torch.full((n, nodes), float("inf"), device=dev)
    start.scatter_(1, ring_node.view(n, 1), 0.0)
    _, backptr = _viterbi_pass(targets, list(range(256)), start, K, lut, keep_from=0)
    states = _backtrack(backptr, ring_node, K)
    return states.t().contiguous().to(torch.int32)
