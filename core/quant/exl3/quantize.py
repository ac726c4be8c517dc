"""The EXL3 quantizer (QTIP / QuIP#-style): regularize, block-LDL, LDLQ with Viterbi tile encoding.

For a weight W [in, out] (y = x @ W) and the Hessian H = E[x x^T] of its input:

1. random signs and channel scales: W = diag(su) Had W_reg Had diag(sv), so W_reg is roughly
   iid Gaussian with the codebook's RMS (su, sv end up in the stored ``suh``/``svh``);
2. the Hessian in the same basis, H_reg = Had diag(su) H diag(su) Had, damped, block-LDL factored
   with 16x16 blocks (H_reg = U D U^T, U unit block-lower);
3. LDLQ: 16-row strips from last to first; each strip is quantized (one Viterbi call over its
   n/16 tiles) after adding the feedback U[later rows, strip]^T (W_reg - Q)[later rows], which makes
   each strip's error independent in the H-weighted loss.

Linears sharing an input (q/k/v, gate/up) are quantized as one matrix (concatenated along out)
with one su, so every strip is one large batch of tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...ops.exl3 import CODEBOOKS, hadamard_128, matrix_to_tiles, pack_trellis, tiles_to_matrix
from .viterbi import encode_tiles

CODEBOOK_SCALE = 1.24371088  # RMS of the 3INST codebook; W_reg rows are normalized to it
DAMPING = 0.025  # times mean(diag(H)), added to the diagonal
PAD = 128


def padded(n: int) -> int:
    return (n + PAD - 1) // PAD * PAD


@dataclass
class QuantizedTensors:
    """One quantized linear in EXL3 storage layout (padded dims)."""

    trellis: torch.Tensor  # int16 [k/16, n/16, 16K]
    suh: torch.Tensor  # fp16 [k]
    svh: torch.Tensor  # fp16 [n]
    codebook: str
    bias: torch.Tensor | None = None  # fp16 [n]

    @property
    def bits(self) -> int:
        return self.trellis.shape[-1] // 16

    def state_dict(self, key: str) -> dict[str, torch.Tensor]:
        from .format import MARKER_VALUES

        out = {f"{key}.trellis": self.trellis, f"{key}.suh": self.suh, f"{key}.svh": self.svh}
        if self.bias is not None:
            out[f"{key}.bias"] = self.bias
        if self.codebook in MARKER_VALUES:
            out[f"{key}.{self.codebook}"] = torch.tensor(MARKER_VALUES[self.codebook], dtype=torch.int32)
        return out


@dataclass
class QuantStats:
    bits: int
    numel: int  # unpadded weights quantized
    proxy_error: float  # tr(E H E^T) / tr(W H W^T) in the regularized domain
    scale: float  # the global scale g
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _had_rows(x: torch.Tensor) -> torch.Tensor:
    """Had @ x: the block Hadamard along dim 0."""
    return hadamard_128(x.t().contiguous()).t().contiguous()


def _random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1


def block_ldl(hessian: torch.Tensor, block: int = 16, max_tries: int = 10) -> torch.Tensor:
    """U with H = U D U^T, U unit block-lower (16x16 blocks), returned with its diagonal blocks zeroed."""
    k = hessian.shape[0]
    h = hessian.clone()
    bump = DAMPING * h.diagonal().mean().clamp_min(1e-20)
    for _ in range(max_tries):
        chol, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            break
        h.diagonal().add_(2 * bump)  # not positive definite: damp harder and retry
    else:
        raise ValueError(f"Hessian ({k}x{k}) is not positive definite even after {max_tries} damping steps")
    nb = k // block
    diag_blocks = chol.view(nb, block, nb, block).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [nb, 16, 16]
    inv = torch.linalg.inv(diag_blocks)
    u = (chol.view(k, nb, block).unsqueeze(-2) @ inv.unsqueeze(0)).reshape(k, k)  # L @ blockdiag(D_i^-1)
    u.view(nb, block, nb, block).diagonal(dim1=0, dim2=2).zero_()
    return u


def _search_scale(w_reg: torch.Tensor, K: int, codebook: str, generator: torch.Generator, max_tiles: int = 48) -> float:
    """Global scale g minimising the tile quantization MSE of a tile sample (coarse grid, fine grid, parabola)."""
    tiles = matrix_to_tiles(w_reg).reshape(-1, 256)
    n = tiles.shape[0]
    max_tiles = max(8, min(max_tiles, n // 8))  # the search costs ~7 encodes of the sample: keep it small
    if n > max_tiles:
        rms = tiles.pow(2).mean(1)
        order = torch.argsort(rms)
        extremes = torch.cat([order[: max_tiles // 8], order[-(max_tiles // 8) :]])
        rand = torch.randperm(n, generator=generator)[: max_tiles - extremes.numel()].to(tiles.device)
        tiles = tiles[torch.cat([extremes, rand]).unique()]

    def err(s: float) -> float:
        _, vals = encode_tiles(tiles * s, K, codebook)
        return (vals / s - tiles).pow(2).mean().item()

    coarse = [0.6, 0.8, 1.0, 1.2, 1.4]
    errs = [err(s) for s in coarse]
    best = coarse[min(range(len(coarse)), key=errs.__getitem__)]
    step = 0.1
    pts = [best - step, best, best + step]
    e = [err(s) if s not in coarse else errs[coarse.index(s)] for s in pts]
    denom = e[0] - 2 * e[1] + e[2]
    offset = 0.0 if denom <= 0 else max(-0.5, min(0.5, 0.5 * (e[0] - e[2]) / denom))
    return max(best + offset * step, 0.01)


def quantize_group(
    weights: list[torch.Tensor],
    hessian: torch.Tensor | None,
    bits: int,
    codebook: str = "mul1",
    seed: int = 0,
    biases: list[torch.Tensor | None] | None = None,
    out_scales: bool = True,
    scale_search: bool = True,
    device: torch.device | str | None = None,
) -> tuple[list[QuantizedTensors], QuantStats]:
    """Quantize linears that share one input (HF weights [out_i, in]) to EXL3 at ``bits`` per weight.

    ``hessian`` is E[x x^T] [in, in] of the shared input (None: no calibration, plain tile rounding).
    """
    import time

    t0 = time.perf_counter()
    if not 1 <= bits <= 8:
        raise ValueError(f"EXL3 bits per weight must be an integer in 1..8, got {bits}")
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {', '.join(CODEBOOKS)}")
    in_features = weights[0].shape[1]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != in_features:
            raise ValueError(f"grouped weights must be [out, {in_features}], got {list(w.shape)}")
    device = torch.device(device) if device is not None else weights[0].device
    biases = biases or [None] * len(weights)
    gen = torch.Generator().manual_seed(seed)
    k = padded(in_features)
    outs = [w.shape[0] for w in weights]
    widths = [padded(o) for o in outs]
    n = sum(widths)

    # W [k, n]: the weights transposed to (in, out), zero-padded, side by side.
    w = torch.zeros(k, n, device=device)
    col = 0
    for wi, width in zip(weights, widths):
        w[:in_features, col : col + wi.shape[0]] = wi.t().to(device=device, dtype=torch.float32)
        col += width

    h = torch.zeros(k, k, device=device)
    calibrated = hessian is not None and bool(torch.isfinite(hessian).all()) and hessian.diagonal().mean() > 1e-20
    if calibrated:
        h[:in_features, :in_features] = hessian.to(device=device, dtype=torch.float32)
    else:
        h.diagonal().fill_(1.0)
    h.diagonal().add_(DAMPING * h.diagonal().mean())

    # Output side: random signs times the normalized column RMS.
    col_rms = w.pow(2).mean(0).sqrt()
    zero_cols = col_rms == 0
    sv = _random_signs(n, gen).to(device)
    if out_scales:
        mean_rms = col_rms[~zero_cols].mean() if (~zero_cols).any() else torch.tensor(1.0, device=device)
        sv = sv * torch.where(zero_cols, torch.ones_like(col_rms), col_rms / mean_rms)
    w_reg = hadamard_128(w / sv)
    # Input side: random signs times the row RMS, normalized to the codebook RMS.
    row_rms = w_reg.pow(2).mean(1).sqrt()
    row_rms = torch.where(row_rms == 0, torch.full_like(row_rms, 0.1), row_rms)
    su = _random_signs(k, gen).to(device) * row_rms / CODEBOOK_SCALE
    w_reg = _had_rows(w_reg / su[:, None])

    g = _search_scale(w_reg, bits, codebook, gen) if scale_search else 1.0
    w_reg = w_reg * g
    su = su / g

    h_reg = _had_rows(hadamard_128(h * su[:, None] * su[None, :]))
    h_reg = 0.5 * (h_reg + h_reg.t())
    u = block_ldl(h_reg) if calibrated else torch.zeros(k, k, device=device)

    q = torch.zeros_like(w_reg)
    states = torch.empty(k // 16, n // 16, 256, dtype=torch.int32, device=device)
    for strip in range(k // 16 - 1, -1, -1):
        rows = slice(16 * strip, 16 * strip + 16)
        after = 16 * strip + 16
        target = w_reg[rows]
        if calibrated and after < k:
            target = target + u[after:, rows].t() @ (w_reg[after:] - q[after:])
        s, vals = encode_tiles(matrix_to_tiles(target).reshape(-1, 256), bits, codebook)
        states[strip] = s
        q[rows] = tiles_to_matrix(vals.view(1, n // 16, 256))

    err = w_reg - q
    proxy = (torch.trace(err.t() @ h_reg @ err) / torch.trace(w_reg.t() @ h_reg @ w_reg).clamp_min(1e-30)).item()
    trellis = pack_trellis(states, bits)
    suh = su.half()
    svh = torch.where(zero_cols, torch.zeros_like(sv), sv).half()

    results = []
    col = 0
    for out, width, b in zip(outs, widths, biases):
        bias = None
        if b is not None:
            bias = torch.zeros(width, dtype=torch.float16, device=device)
            bias[:out] = b.to(device=device, dtype=torch.float16)
        results.append(
            QuantizedTensors(
                trellis=trellis[:, col // 16 : (col + width) // 16].contiguous(),
                suh=suh.clone(),
                svh=svh[col : col + width].contiguous(),
                codebook=codebook,
                bias=bias,
            )
        )
        col += width
    numel = in_features * sum(outs)
    return results, QuantStats(bits, numel, proxy, g, time.perf_counter() - t0)


def dequantize(qt: QuantizedTensors) -> torch.Tensor:
    """The dense weight [k, n] (in, out) of stored EXL3 tensors, float32."""
    from ...ops.exl3 import exl3_decode_tiles

    w_hat = exl3_decode_tiles(qt.trellis, qt.codebook).float()
    w = _had_rows(hadamard_128(w_hat))
    return w * qt.suh.float()[:, None] * qt.svh.float()[None, :]


def relative_mse(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return ((reference - approx).pow(2).sum() / reference.pow(2).sum().clamp_min(1e-30)).item()


def rate_distortion_bound(bits: int) -> float:
    """Distortion-rate bound of a unit Gaussian source: D(R) = 2^(-2R)."""
    return math.pow(2.0, -2 * bits)
