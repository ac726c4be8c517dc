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
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ...ops.exl3 import CODEBOOKS, TILE_PERM, hadamard_128, matrix_to_tiles, pack_trellis, tiles_to_matrix
from .viterbi import encode_tiles

CODEBOOK_SCALE = 1.24371088  # RMS of the 3INST codebook; W_reg rows are normalized to it
# How much LDLQ's feedback inflates the strips the tile encoder sees over the regularized weight the scale
# search samples, by K (RMS of all strip targets over RMS of the weight; grows with the error fed back).
# The search runs on the weight scaled up by this, so the encoder's actual inputs land where the codebook
# errs least. ExLlamaV3 1.6.5 measured the same effect on Qwen3-8B; trellm's own figures (QuantStats.extra
# "ldlq_drift", printed by benchmarks/exl3_cpu_proxy.py) agree on SmolLM2-135M.
LDLQ_DRIFT = {1: 1.08, 2: 1.018, 3: 1.004}
# Output-channel scales (``out_scales``): "always" gives every output column its RMS, "never" none, "auto"
# drops them for a linear whose per-column sensitivity (:func:`out_scale_loss_ratio`) predicts more loss
# with them than this factor times the loss without, "fit" derives the scales from the sensitivity.
OUT_SCALE_MODES = ("always", "never", "auto", "fit")
OUT_SCALES_MAX_RATIO = 1.05  # a margin over 1: the sensitivity is an estimate from calibration tokens
SENSITIVITY_FLOOR = 0.02  # added to the mean-normalized sensitivity in "fit": unseen channels get bounded scales
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
    proxy_error: float  # tr(E^T H E) / tr(W^T H W): relative output error on the calibration inputs
    scale: float  # the global scale g
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class PhaseClock:
    """Wall seconds by named phase: where a conversion's time goes (the converter's job log and summary.json).

    ``with clock("name"):`` times a block; ``mark()`` then ``lap("name")`` calls time consecutive steps, each
    lap the time since the previous mark or lap. With a CUDA ``device`` every boundary synchronizes the
    device, so kernels count in the phase that queued them (a few synchronizations per linear group, nothing
    next to its Viterbi work). Phases are meant to be disjoint: a nested one also counts in the one around it.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def _now(self) -> float:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def mark(self) -> None:
        self._last = self._now()

    def lap(self, name: str) -> None:
        now = self._now()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.mark()
        try:
            yield
        finally:
            self.lap(name)

    def since(self, earlier: dict[str, float]) -> dict[str, float]:
        """Seconds per phase spent after ``earlier`` (a copy of :attr:`seconds`), rounded to milliseconds."""
        return {k: round(v - earlier.get(k, 0.0), 3) for k, v in self.seconds.items() if v > earlier.get(k, 0.0)}


def _had_rows(x: torch.Tensor) -> torch.Tensor:
    """Had @ x: the block Hadamard along dim 0."""
    return hadamard_128(x.t().contiguous()).t().contiguous()


def _random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1


SLAB_ELEMENTS = 1 << 25  # columns are transformed and measured in slabs of about this many weights (128 MiB fp32)


def _column_slabs(k: int, n: int) -> list[slice]:
    """Column ranges (multiples of 128 wide) that split a [k, n] matrix into slabs of ~SLAB_ELEMENTS.

    Every column-wise step (output Hadamard, H products, LDLQ) is independent per 128 columns, so a
    large head is processed slab by slab instead of through whole-matrix temporaries."""
    width = max(PAD, SLAB_ELEMENTS // max(k, 1) // PAD * PAD)
    return [slice(c, min(c + width, n)) for c in range(0, n, width)]


def hessian_form(x: torch.Tensor, h: torch.Tensor) -> float:
    """tr(x^T h x) for x [k, n], h [k, k], without the n x n product: sum of x * (h @ x), slab by slab."""
    total = 0.0
    for cols in _column_slabs(*x.shape):
        xs = x[:, cols]
        total += (xs * (h @ xs)).sum(dtype=torch.float64).item()
    return total


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
    # L @ blockdiag(D_i^-1), one batched product per block column: a broadcast matmul here expanded inv to
    # [k, nb, 16, 16], 16x the Hessian (13 GB for a 14336-wide down_proj: most of an 8B conversion's GPU peak)
    u = torch.bmm(chol.view(k, nb, block).transpose(0, 1), inv).transpose(0, 1).reshape(k, k)
    u.view(nb, block, nb, block).diagonal(dim1=0, dim2=2).zero_()
    return u


def _sample_tiles(w_reg: torch.Tensor, generator: torch.Generator, max_tiles: int) -> torch.Tensor:
    """[m, 256] tiles (trellis order) of w_reg for the scale search: the lowest- and highest-RMS tiles
    plus a random sample, gathered by index (the whole matrix is never re-laid out as tiles)."""
    k, n = w_reg.shape
    tk, tn = k // 16, n // 16
    total = tk * tn
    if total <= max_tiles:
        picks = torch.arange(total)
    else:
        tile_ms = torch.empty(tk, tn, device=w_reg.device)
        rows_per = max(1, SLAB_ELEMENTS // (16 * n))
        for r in range(0, tk, rows_per):
            blk = w_reg[16 * r : 16 * min(r + rows_per, tk)].view(-1, 16, tn, 16)
            tile_ms[r : r + blk.shape[0]] = blk.pow(2).mean((1, 3))
        order = torch.argsort(tile_ms.flatten()).cpu()
        extremes = torch.cat([order[: max_tiles // 8], order[-(max_tiles // 8) :]])
        rand = torch.randperm(total, generator=generator)[: max_tiles - extremes.numel()]
        picks = torch.cat([extremes, rand]).unique()
    picks = picks.to(w_reg.device)
    tiles = w_reg.view(tk, 16, tn, 16)[picks // tn, :, picks % tn, :]  # [m, 16, 16] row-major
    return tiles.reshape(-1, 256)[:, TILE_PERM.to(w_reg.device)]


def _search_scale(w_reg: torch.Tensor, K: int, codebook: str, generator: torch.Generator, max_tiles: int | None = None,
                  drift: float = 1.0) -> float:
    """Global scale g minimising the tile quantization MSE of a tile sample (coarse grid, fine grid, parabola).

    ``drift``: the sample is scaled up by it first (:data:`LDLQ_DRIFT`), so g fits the inflated strips LDLQ
    will encode rather than the weight itself. The search costs ~7 encodes of the sample: 48 tiles on a CPU
    (~15 ms per tile there), 1024 on a GPU, where a larger sample makes g less noisy for next to nothing."""
    if max_tiles is None:
        max_tiles = 1024 if w_reg.device.type == "cuda" else 48
    n_tiles = (w_reg.shape[0] // 16) * (w_reg.shape[1] // 16)
    max_tiles = max(8, min(max_tiles, n_tiles // 8))
    tiles = _sample_tiles(w_reg, generator, max_tiles) * drift

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


def _to_original(e_reg: torch.Tensor, su: torch.Tensor, sv: torch.Tensor) -> torch.Tensor:
    """diag(su) Had e_reg Had diag(sv), slab by slab, into a new [k, n] tensor."""
    out = torch.empty_like(e_reg)
    for cols in _column_slabs(*e_reg.shape):
        out[:, cols] = hadamard_128(_had_rows(e_reg[:, cols]) * su[:, None]) * sv[None, cols]
    return out


def refit_scales(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor, members: list[slice], rounds: int = 2
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Input-row and output-column factors (r [k], c [n]) that minimise tr(E^T H E), E = W - diag(r) Q diag(c).

    The trellis stays fixed; the factors fold into the stored fp16 ``suh`` / ``svh`` (one suh per member
    of a group, so each member's column range gets its own r). Alternates the closed-form column fit
    c_j = q_j^T H w_j / q_j^T H q_j with the row fit ((Q Q^T) o H) r = rowsum(Q o H W), ``rounds`` times.
    ``q`` is scaled in place. A factor that comes out non-finite or non-positive stays 1.
    """
    k, n = q.shape
    r_all = torch.ones(len(members), k, device=q.device)
    c = torch.ones(n, device=q.device)
    for _ in range(rounds):
        for m, cols in enumerate(members):
            gram = torch.zeros(k, k, device=q.device)
            rhs = torch.zeros(k, device=q.device)
            for sub in _column_slabs(k, cols.stop - cols.start):
                sl = slice(cols.start + sub.start, cols.start + sub.stop)
                qs, hw = q[:, sl], h @ w[:, sl]
                num, den = (qs * hw).sum(0), (qs * (h @ qs)).sum(0)
                fit = torch.where(den > 0, num / den.clamp_min(1e-30), torch.ones_like(num))
                fit = torch.where(torch.isfinite(fit) & (fit > 0), fit, torch.ones_like(fit))
                qs.mul_(fit)
                c[sl] *= fit
                gram.addmm_(qs, qs.t())
                rhs += (qs * hw).sum(1)
            a = gram * h
            a.diagonal().add_(1e-6 * a.diagonal().mean().clamp_min(1e-30))
            r = torch.linalg.solve(a, rhs)
            r = torch.where(torch.isfinite(r) & (r > 0), r, torch.ones_like(r))
            q[:, cols].mul_(r[:, None])
            r_all[m] *= r
    return r_all, c


def compensated_weights(weights: list[torch.Tensor], hessian: torch.Tensor, cross: torch.Tensor, strength: float = 1.0
                        ) -> list[torch.Tensor]:
    """The weights (HF [out, in]) that best map the quantized model's inputs x to the dense model's outputs.

    A linear of the quantized model sees x, not the dense model's x_ref: quantizing W itself reproduces
    W x, carrying the error of every layer before. The least-squares weight for W x_ref from x is
    W* = W C^T H^-1 = W + W (C - H)^T H^-1 with H = E[x x^T] and C = E[x x_ref^T]; LDLQ towards W* in
    the metric H then minimises E|W x_ref - Q x|^2 (the error-compensating target of asymmetric
    calibration, as in GPTAQ). H is damped as in LDLQ in the correction term only, so W* = W exactly
    when the inputs agree (C = H). ``strength`` in [0, 1] moves the target from W (0) to W* (1).
    """
    h = hessian.to(dtype=torch.float32, copy=True)
    h.diagonal().add_(DAMPING * h.diagonal().mean().clamp_min(1e-20))
    chol, info = torch.linalg.cholesky_ex(h)
    del h
    if int(info) != 0:  # not positive definite even damped: keep the dense weights as targets
        return [w.float() for w in weights]
    delta = cross.to(device=chol.device, dtype=torch.float32) - hessian.to(device=chol.device, dtype=torch.float32)
    out = []
    for w in weights:
        w32 = w.to(device=chol.device, dtype=torch.float32)
        correction = torch.cholesky_solve(delta @ w32.t(), chol).t()  # (H^-1 (C - H) W^T)^T
        out.append(w32.add(correction, alpha=strength).to(w.device))
    return out


def out_scale_loss_ratio(col_rms: torch.Tensor, sensitivity: torch.Tensor) -> float | None:
    """Predicted output loss of a linear quantized with output-channel scales, over the loss without them.

    After the Hadamards the tile error is spread evenly over the columns it is quantized in. With the scales
    each column's error is proportional to the column's energy e_j = rms_j^2; without them it is the same for
    every column. Weighting column j's error by its sensitivity s_j (loss per unit of error), the two losses
    compare as E[s e] / (E[s] E[e]): above 1 when the sensitive columns are the heavy ones. None when the
    sensitivity says nothing (no positive finite mean). Both are over the member's live (nonzero) columns.
    """
    e = col_rms.double().square()
    s = sensitivity.to(e.device).double()
    live = e > 0
    e, s = e[live], s[live]
    if not bool(torch.isfinite(s).all()) or e.numel() == 0:
        return None
    den = s.mean() * e.mean()
    if not den.item() > 0:
        return None
    return ((s * e).mean() / den).item()


def column_scale_shape(col_rms: torch.Tensor, sensitivity: torch.Tensor | None, mode: str) -> tuple[torch.Tensor, str]:
    """The output-channel scales of one linear, up to a constant, and the choice made ("always", "never", "fit").

    ``mode`` (:data:`OUT_SCALE_MODES`): "always" is the column RMS, "never" ones; without a sensitivity
    "auto" and "fit" are "always". "auto": "never" when :func:`out_scale_loss_ratio` exceeds
    :data:`OUT_SCALES_MAX_RATIO`. "fit": the scales t that minimise the predicted loss
    (sum_j s_j t_j^2) (sum_j rms_j^2 / t_j^2), t_j = (rms_j^2 / s_j)^(1/4), with s normalized to mean 1 and
    floored (:data:`SENSITIVITY_FLOOR`); t = rms is that optimum for s ~ 1 / rms^2.
    """
    if mode not in OUT_SCALE_MODES:
        raise ValueError(f"out_scales must be one of {', '.join(OUT_SCALE_MODES)}, got {mode!r}")
    ones = torch.ones_like(col_rms)
    if mode == "never":
        return ones, "never"
    ratio = None if mode == "always" or sensitivity is None else out_scale_loss_ratio(col_rms, sensitivity)
    if ratio is None:
        return col_rms.clone(), "always"
    if mode == "auto":
        return (col_rms.clone(), "always") if ratio <= OUT_SCALES_MAX_RATIO else (ones, "never")
    s = sensitivity.to(device=col_rms.device, dtype=torch.float32)
    live = col_rms > 0
    s = s.clamp_min(0) / s[live].clamp_min(0).mean() + SENSITIVITY_FLOOR
    return torch.where(live, (col_rms.square() / s).pow(0.25), ones), "fit"


def quantize_group(
    weights: list[torch.Tensor],
    hessian: torch.Tensor | None,
    bits: int,
    codebook: str = "mul1",
    seed: int = 0,
    biases: list[torch.Tensor | None] | None = None,
    out_scales: str = "always",
    scale_search: bool = True,
    device: torch.device | str | None = None,
    refit: bool = True,
    sensitivities: list[torch.Tensor | None] | None = None,
    drift: bool = False,
    clock: PhaseClock | None = None,
) -> tuple[list[QuantizedTensors], QuantStats]:
    """Quantize linears that share one input (HF weights [out_i, in]) to EXL3 at ``bits`` per weight.

    ``hessian`` is E[x x^T] [in, in] of the shared input (None: no calibration, plain tile rounding).
    ``out_scales`` (:data:`OUT_SCALE_MODES`) with ``sensitivities`` (per member, [out_i] or None): how each
    member's output columns are scaled before quantization (:func:`column_scale_shape`); the scales are
    folded into ``svh``, so the file format does not change. ``drift``: the scale search allows for LDLQ's
    feedback (:data:`LDLQ_DRIFT`).
    ``refit``: after the trellis is chosen, refit each member's suh and svh in the Hessian metric
    (:func:`refit_scales`). Memory: the padded float32 weight, about three slab-sized temporaries and
    [in, in] matrices; the weight is overwritten with the LDLQ error as the strips are done.
    ``clock``: the steps' times go to its phases regularize, scale_search, ldl, viterbi (LDLQ's strip loop:
    the tile encodes and their feedback products) and refit (back to the original basis, refit, proxy error).
    """
    t0 = time.perf_counter()
    clock = clock if clock is not None else PhaseClock()
    clock.mark()
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
    members = []
    col = 0
    for width in widths:
        members.append(slice(col, col + width))
        col += width

    def original_weight() -> torch.Tensor:
        """W [k, n]: the weights transposed to (in, out), zero-padded, side by side, float32."""
        full = torch.zeros(k, n, device=device)
        for wi, cols in zip(weights, members):
            full[:in_features, cols.start : cols.start + wi.shape[0]] = wi.t().to(device=device, dtype=torch.float32)
        return full

    w = original_weight()
    h = torch.zeros(k, k, device=device)
    calibrated = hessian is not None and bool(torch.isfinite(hessian).all()) and hessian.diagonal().mean() > 1e-20
    if calibrated:
        h[:in_features, :in_features] = hessian.to(device=device, dtype=torch.float32)
    else:
        h.diagonal().fill_(1.0)
    undamped = h.clone() if refit or calibrated else h
    h.diagonal().add_(DAMPING * h.diagonal().mean())
    slabs = _column_slabs(k, n)

    # Output side: random signs times each member's column scales (column_scale_shape), normalized so that
    # the scaled columns of every member have the mean square of the group's mean column RMS.
    col_rms = torch.cat([w[:, cols].pow(2).mean(0) for cols in slabs]).sqrt()
    zero_cols = col_rms == 0
    mean_rms = col_rms[~zero_cols].mean() if (~zero_cols).any() else torch.tensor(1.0, device=device)
    scales = torch.ones(n, device=device)
    choices = []
    for m, (cols, out) in enumerate(zip(members, outs)):
        sens = sensitivities[m] if sensitivities is not None else None
        if sens is not None and sens.numel() != out:
            raise ValueError(f"member {m}: sensitivity has {sens.numel()} entries for {out} output channels")
        rms = col_rms[cols.start : cols.start + out]
        shape, choice = column_scale_shape(rms, sens, out_scales)
        live = rms > 0
        if live.any():
            spread = (rms[live] / shape[live]).pow(2).mean().sqrt()
            scales[cols.start : cols.start + out] = torch.where(live, shape * spread / mean_rms, 1.0)
        choices.append(choice)
    sv = _random_signs(n, gen).to(device) * scales
    row_ss = torch.zeros(k, device=device)
    for cols in slabs:
        w[:, cols] = hadamard_128(w[:, cols] / sv[cols])
        row_ss += w[:, cols].pow(2).sum(1)
    # Input side: random signs times the row RMS, normalized to the codebook RMS.
    row_rms = (row_ss / n).sqrt()
    row_rms = torch.where(row_rms == 0, torch.full_like(row_rms, 0.1), row_rms)
    su = _random_signs(k, gen).to(device) * row_rms / CODEBOOK_SCALE
    for cols in slabs:
        w[:, cols] = _had_rows(w[:, cols] / su[:, None])

    clock.lap("regularize")
    g = _search_scale(w, bits, codebook, gen, drift=LDLQ_DRIFT.get(bits, 1.0) if drift else 1.0) if scale_search else 1.0
    clock.lap("scale_search")
    w.mul_(g)
    su = su / g

    h_reg = _had_rows(hadamard_128(h * su[:, None] * su[None, :]))
    h_reg = 0.5 * (h_reg + h_reg.t())
    u = block_ldl(h_reg) if calibrated else None
    clock.lap("ldl")

    # LDLQ, strips from last to first. w[rows] becomes the strip's error E = W_reg - Q once it is
    # quantized, so the feedback of a strip reads the later strips' errors straight from w.
    trellis = torch.empty(k // 16, n // 16, 16 * bits, dtype=torch.int16, device=device)
    weight_ss = torch.zeros((), dtype=torch.float64, device=device)
    target_ss = torch.zeros((), dtype=torch.float64, device=device)
    for strip in range(k // 16 - 1, -1, -1):
        rows = slice(16 * strip, 16 * strip + 16)
        after = 16 * strip + 16
        target = w[rows]
        weight_ss += target.pow(2).sum(dtype=torch.float64)
        if u is not None and after < k:
            target = target + u[after:, rows].t() @ w[after:]
        target_ss += target.pow(2).sum(dtype=torch.float64)
        states, vals = encode_tiles(matrix_to_tiles(target).reshape(-1, 256), bits, codebook)
        trellis[strip] = pack_trellis(states.view(n // 16, 256), bits)
        w[rows] -= tiles_to_matrix(vals.view(1, n // 16, 256))
    clock.lap("viterbi")

    # The stored fp16 scales; Q (original basis) = W - E_orig, with the fp16 rounding of su / sv.
    suh = su.half()
    svh = torch.where(zero_cols, torch.zeros_like(sv), sv).half()
    e_orig = _to_original(w, su, sv)
    del w
    q = original_weight()
    q.sub_(e_orig)
    del e_orig
    q.mul_((suh.float() / su)[:, None])
    q.mul_((svh.float() / sv)[None, :])
    w = original_weight()
    suhs = [suh] * len(weights)
    if refit:
        r, c = refit_scales(w, q, h, members)
        svh = (svh.float() * c).half()
        suhs = [(suh.float() * r[m]).half() for m in range(len(weights))]
    q.sub_(w)  # the error of what is stored
    proxy = hessian_form(q, undamped) / max(hessian_form(w, undamped), 1e-30)

    results = []
    for m, (out, cols, b) in enumerate(zip(outs, members, biases)):
        bias = None
        if b is not None:
            bias = torch.zeros(cols.stop - cols.start, dtype=torch.float16, device=device)
            bias[:out] = b.to(device=device, dtype=torch.float16)
        results.append(
            QuantizedTensors(
                trellis=trellis[:, cols.start // 16 : cols.stop // 16].contiguous(),
                suh=suhs[m].clone(),
                svh=svh[cols].contiguous(),
                codebook=codebook,
                bias=bias,
            )
        )
    numel = in_features * sum(outs)
    ldlq_drift = (target_ss / weight_ss.clamp_min(1e-30)).sqrt().item()
    extra = {"out_scales": choices, "ldlq_drift": round(ldlq_drift, 5)}
    clock.lap("refit")
    return results, QuantStats(bits, numel, proxy, g, time.perf_counter() - t0, extra)


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
