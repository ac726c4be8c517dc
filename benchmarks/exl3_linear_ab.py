"""Same-input A/B of trellm's EXL3 quantizer against ExLlamaV3's procedure, one linear group at a time, on a CPU.

    OMP_NUM_THREADS=1 python benchmarks/exl3_linear_ab.py --layer 3 --groups qkv,down --bits 4 \
        --variants trellm,exl3,exl3:scaled --out /tmp/ab.json
    OMP_NUM_THREADS=2 python benchmarks/exl3_linear_ab.py --layer 3,12,25 --groups qkv,down --bits 4,2 \
        --variants trellm --cal-source trellm,rows:OLD.json,file:SELF.txt,exl3:DIR --heldout eval,exl3:DIR

The real SmolLM2-135M (the default model) runs dense in float32 on each calibration set (``--cal-source``:
trellm's built-in mix, a ``--calibration`` text file, saved rows, ExLlamaV3's mix) up to the decoder layers
``--layer``; each chosen group (``qkv`` = q/k/v on their shared input, ``o``, ``gu`` = gate/up, ``down``)
gets its input Hessian H = E[x x^T] from those rows, and per held-out part (``--heldout``: trellm's
evaluation text; with ``exl3:DIR`` the last 10% of ExLlamaV3's wiki, code, multilingual and tiny-stories
files, which no calibration set here contains) the E[x x^T] of its windows. Every variant quantizes the same
weights with the same H and the same tile encoder
(:func:`trellm.quant.exl3.viterbi.encode_tiles`), so only the procedure around the trellis search differs:

- ``trellm``: :func:`trellm.quant.exl3.quantize.quantize_group` as ``trellm convert`` calls it.
- ``exl3``: ExLlamaV3 1.6.5's default procedure re-expressed here from its source (as facts): damping
  0.025 * mean diag; the LDL factor of the Hessian rotated with the input *signs only*, shared by the group;
  per tensor its own output scales (column RMS over the mean), input scales (row RMS after the output
  Hadamard) and global scale (diagonal + extreme-tile sample, coarse grid 0.1..1.9 on a third of it, fine
  grid +-2 x 0.075, parabola); LDLQ over 128-row spans with the group concatenated along n; the post-LDLQ
  refit of the fp16 scales in the damped Hessian (two rounds), per tensor.
- ``exl3:<switch>+<switch>``: ``exl3`` with single steps swapped for trellm's, to bisect:
  ``scaled`` (LDL of the Hessian with the full input scales, as trellm), ``groupsu`` (one input scale vector
  for the whole group, from the concatenated weight, and one global scale, as trellm), ``norefit``.

Printed per group, calibration set and variant: the proxy loss tr(E^T H E) / tr(W^T H W) on the calibration
Hessian and the relative output error |X E|^2 / |X W|^2 per held-out part and their mean ("heldout"), in
the original basis for the fp16 scales as stored. Nothing here imports ExLlamaV3.

Measured on SmolLM2-135M, 4 bpw mul1 (held-out error on eval.txt alone; December 2026): on the same inputs
the two procedures agree within 5%, trellm mostly ahead (layer 3 q/k/v 0.000779 trellm, 0.000792 ExLlamaV3's;
o 0.001903, 0.002001; gate/up 0.002625, 0.002633; down 0.004143, 0.004070; layer 2 down 0.000376, 0.000372),
while the calibration text moves the same quantizer more: layer 3 down 0.004143 on trellm's 64 x 512 rows of
its first mix (25 KB), 0.003939 on ExLlamaV3's mix at 64 x 512, 0.003790 at 64 x 2048; and 2048-token rows
raise layer 2 down's error by half at equal tokens (0.000376 -> 0.000574; first-token activations carry a
quarter of that Hessian at 512-token rows).

The calibration mix (trellm variant, 64 x 512 rows, seed 0; held-out error as the mean over five parts: eval.txt
and the held-out tails of ExLlamaV3's wiki, code, multilingual and tiny files), the first mix (25 KB, its prose,
multilingual and chat rows repeating the same text) against the written 116 KB mix that replaced it, with
ExLlamaV3's mix for reference:

    bpw tensor     first mix  116 KB mix  ExLlamaV3's   (new/first)
    4   L3 q/k/v   0.000887   0.000874    0.000945      0.985
    4   L3 gate/up 0.002782   0.002696    0.002750      0.969
    4   L3 down    0.004397   0.004104    0.004170      0.933
    4   L12 q/k/v  0.000565   0.000553    0.000570      0.980
    4   L12 g/u    0.002051   0.001977    0.002001      0.964
    4   L12 down   0.003689   0.003440    0.003455      0.932
    4   L25 q/k/v  0.001024   0.000996    0.001057      0.973
    4   L25 g/u    0.002493   0.002383    0.002504      0.956
    4   L25 down   0.003617   0.003318    0.003496      0.917
    2   L3 q/k/v   0.013734   0.013651    0.014667      0.994
    2   L3 down    0.065330   0.060965    0.062074      0.933
    2   L12 q/k/v  0.008427   0.008270    0.008536      0.981
    2   L12 down   0.055215   0.051707    0.051754      0.936
    2   L25 q/k/v  0.015352   0.014738    0.015319      0.960
    2   L25 down   0.054695   0.050304    0.053224      0.920

The proxy-to-held-out gap (held-out / proxy - 1) halved: down 47-51% on the first mix, 17-27% on the new one
(ExLlamaV3's 28-31%); ExLlamaV3's mix wins only on the wiki part (its own source). Text sampled from the model
itself (``self_calibration.py``, 56 rows of 512 tokens as a ``--calibration`` file, the rest random rows) did
worse than either mix: L3 q/k/v 0.000960, L3 down 0.004546 at 4 bpw (proxy gaps 52% and 73%: SmolLM2-135M's
samples loop on a phrase). Without the random-token rows (the new mix's shares scaled to fill 63 rows) the
error moved within -0.7%..+1.1% of the new mix's at 4 bpw on the six q/k/v and down tensors: they stay.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

GROUPS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gu": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
SIGMA_REG = 0.025
CODEBOOK_SCALE = 1.24371088
LDLQ_DRIFT = {1: 1.08, 2: 1.018, 3: 1.004}


# ---------------------------------------------------------------------------------------------------------
# Inputs: real weights, Hessians and held-out activations


EXL3_FILES = ("c4.utf8", "code.utf8", "multilingual.utf8", "technical.utf8", "wiki.utf8", "tiny.utf8")
HELDOUT_FRACTION = 0.1  # the tail of each ExLlamaV3 file that its reference calibration never reads


def exl3_text(data_dir: Path, name: str, part: str) -> str:
    """The head (first 90%, what the ``exl3:`` calibration reads) or the tail (last 10%, held out) of one file
    of ExLlamaV3's ``standard_cal_data``, cut at a line break."""
    text = (data_dir / name).read_text(encoding="utf-8")
    cut = text.find("\n", int(len(text) * (1 - HELDOUT_FRACTION)))
    cut = len(text) if cut < 0 else cut + 1
    return text[:cut] if part == "head" else text[cut:]


def exl3_style_rows(tokenizer, vocab_size: int, rows: int, cols: int, data_dir: Path) -> list[list[int]]:
    """Calibration rows made the way ExLlamaV3 1.6.5 makes its default ones (its calibration_data.py, read as
    facts), from the heads (:func:`exl3_text`) of the text files of a directory laid out like its
    ``standard_cal_data``: weights 20/20/10/10/50/5 over c4 (shuffled lines), code (raw slices), multilingual
    (shuffled lines), technical (raw slices), wiki (articles), tiny (stories), the remainder random tokens;
    articles are packed into rows, with BOS/EOS around each article on even rows."""
    import random

    bos = tokenizer.bos_token_id
    eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None

    def pack(articles: list[str], n: int) -> list[list[int]]:
        out, row, i = [], [], 0
        while len(out) < n and i < len(articles):
            ids = tokenizer.encode(articles[i], add_special_tokens=False)
            if len(out) % 2 == 0:
                ids = ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
            row = (row + ids)[:cols]
            if len(row) == cols:
                out.append(row)
                row = []
            i += 1
        return out

    def lines(text: str, n: int) -> list[list[int]]:
        arts = [a for a in text.split("\n") if a and not a.isspace()]
        random.seed(0)
        random.shuffle(arts)
        return pack(arts, n)

    def raw(text: str, n: int) -> list[list[int]]:
        ids = tokenizer.encode(text[: n * cols * 8], add_special_tokens=False)
        return [ids[i * cols : (i + 1) * cols] for i in range(n) if len(ids) >= (i + 1) * cols]

    def wiki(text: str, n: int) -> list[list[int]]:
        arts = [a[a.find("\n") + 1 :] for a in text.split("</doc>\n")]
        return pack([a for a in arts if len(a) > 50], n)

    def tiny(text: str, n: int) -> list[list[int]]:
        return pack([a.strip() for a in text.split("<|endoftext|>")], n)

    mix = [(EXL3_FILES[0], 20, lines), (EXL3_FILES[1], 20, raw), (EXL3_FILES[2], 10, lines),
           (EXL3_FILES[3], 10, raw), (EXL3_FILES[4], 50, wiki), (EXL3_FILES[5], 5, tiny)]
    total = sum(w for _, w, _ in mix) + 20
    out: list[list[int]] = []
    for name, weight, make in mix:
        out += make(exl3_text(data_dir, name, "head"), max(1, int(weight / total * rows)))
    gen = torch.Generator().manual_seed(0)
    while len(out) < rows:
        out.append(torch.randint(0, vocab_size, (cols,), generator=gen).tolist())
    return out


def calibration_sets(specs: list[str], tokenizer, vocab_size: int, rows: int, cols: int) -> dict[str, list[list[int]]]:
    """Calibration token rows by spec: ``trellm`` (``trellm.convert.calibration_rows``, the built-in mix),
    ``file:PATH`` (the same on a text file, as ``trellm convert --calibration``), ``rows:PATH`` (rows saved by
    ``--dump-rows``, e.g. an earlier commit's mix), ``exl3:DIR`` (:func:`exl3_style_rows`)."""
    from trellm.convert import calibration_rows

    out = {}
    for spec in specs:
        kind, _, arg = spec.partition(":")
        if spec == "trellm":
            out[spec] = calibration_rows(tokenizer, vocab_size, rows, cols)
        elif kind == "file":
            out[spec] = calibration_rows(tokenizer, vocab_size, rows, cols, arg)
        elif kind == "rows":
            out[spec] = json.loads(Path(arg).read_text())
        elif kind == "exl3":
            out[spec] = exl3_style_rows(tokenizer, vocab_size, rows, cols, Path(arg))
        else:
            raise SystemExit(f"unknown calibration source {spec!r} (trellm, file:PATH, rows:PATH or exl3:DIR)")
    return out


def heldout_sets(specs: list[str], tokenizer, cols: int, windows: int) -> dict[str, list[list[int]]]:
    """Held-out token windows by part: ``eval`` (trellm's built-in evaluation text), ``file:PATH``, and for
    ``exl3:DIR`` the tails of ExLlamaV3's wiki, code, multilingual and tiny files (parts ``wiki`` ...), which
    neither trellm's mix nor the ``exl3:`` calibration contains; ``windows`` windows of ``cols`` tokens each."""
    from trellm.evaluate import eval_text, token_windows

    texts = {}
    for spec in specs:
        kind, _, arg = spec.partition(":")
        if spec == "eval":
            texts["eval"] = eval_text()
        elif kind == "file":
            texts[Path(arg).stem] = Path(arg).read_text(encoding="utf-8")
        elif kind == "exl3":
            for name in ("wiki.utf8", "code.utf8", "multilingual.utf8", "tiny.utf8"):
                texts[name.split(".")[0]] = exl3_text(Path(arg), name, "tail")
        else:
            raise SystemExit(f"unknown held-out part {spec!r} (eval, file:PATH or exl3:DIR)")
    return {name: token_windows(tokenizer, text, cols, windows) for name, text in texts.items()}


def capture(layers: list[int], groups: list[str], cal: dict[str, list[list[int]]],
            heldout: dict[str, list[list[int]]], lm, cache: Path | None = None) -> dict:
    """By (layer, group): HF weights [out, in], by calibration set its Hessian E[x x^T] [in, in] and by
    held-out part its E[x x^T] (what the held-out error needs: |X E|^2 = tr(E^T X^T X E)). One dense float32
    forward per token set, up to the last layer. ``cache``: a file of earlier captures, keyed by the token
    rows' hash, layer and group; sets found there for every layer and group are not run again."""
    import hashlib

    from trellm.batch import ForwardBatch
    from trellm.convert import _record, layer_linears

    model = lm.model
    out = {}
    for li in layers:
        layer = model.layers[li]
        prefix = layer.key + "."
        linears = {lin.key[len(prefix):]: lin for lin in layer_linears(layer)}
        for g in groups:
            out[li, g] = dict(weights=[linears[r].impl.dense_weight().float().clone() for r in GROUPS[g]],
                              hessians={}, heldout={})
    stored = torch.load(cache) if cache is not None and cache.is_file() else {}
    sets = [("hessians", name, seqs) for name, seqs in cal.items()]
    sets += [("heldout", name, seqs) for name, seqs in heldout.items()]
    with torch.inference_mode():
        for kind, name, seqs in sets:
            digest = hashlib.sha1(json.dumps(seqs).encode()).hexdigest()[:16]
            keys = {(li, g): f"{digest}|{li}|{g}" for li in layers for g in groups}
            if all(k in stored for k in keys.values()):
                for (li, g), k in keys.items():
                    out[li, g][kind][name] = stored[k]
                continue
            batch = ForwardBatch.no_cache(seqs, "cpu")
            state = model.embed_tokens(batch).float()
            for i in range(max(layers) + 1):
                layer = model.layers[i]
                if i not in layers:
                    state = layer.forward(state, batch).float()
                    continue
                prefix = layer.key + "."
                linears = {lin.key[len(prefix):]: lin for lin in layer_linears(layer)}
                state, recorders = _record(layer, list(linears.values()), state, batch, keep_inputs=True)
                state = state.float()
                for g in groups:
                    x = recorders[linears[GROUPS[g][0]].key].group_inputs().double()
                    out[i, g][kind][name] = stored[keys[i, g]] = (x.t() @ x / x.shape[0]).float()
            if cache is not None:
                torch.save(stored, cache)
    return out


# ---------------------------------------------------------------------------------------------------------
# ExLlamaV3's procedure (from its source, as facts), with trellm's tile encoder


def _had():
    from trellm.ops.exl3 import hadamard_matrix

    return hadamard_matrix("cpu").float()


def had_left(x: torch.Tensor) -> torch.Tensor:
    k, n = x.shape
    return (_had() @ x.reshape(k // 128, 128, n)).reshape(k, n)


def had_right(x: torch.Tensor) -> torch.Tensor:
    k, n = x.shape
    return (x.reshape(k, n // 128, 128) @ _had()).reshape(k, n)


def exl3_block_ldl(h: torch.Tensor) -> torch.Tensor:
    """L with H = L D L^T, unit block-lower with 16x16 blocks, scalar diagonal zeroed (as ldlq expects)."""
    n = h.shape[0]
    m = n // 16
    chol = torch.linalg.cholesky(h)
    dl = torch.linalg.inv(torch.diagonal(chol.reshape(m, 16, m, 16), dim1=0, dim2=2).permute(2, 0, 1))
    L = chol.view(n, m, 16).clone()
    for i in range(m):
        L[:, i, :] = L[:, i, :] @ dl[i]
    L = L.reshape(n, n)
    blocks = L.view(m, 16, m, 16).permute(0, 2, 1, 3)
    r = torch.arange(m)
    blocks[r, r] = torch.eye(16)
    L.diagonal().zero_()
    return L


def encode(tiles: torch.Tensor, K: int, codebook: str) -> tuple[torch.Tensor, torch.Tensor]:
    from trellm.quant.exl3.viterbi import encode_tiles

    states, vals = encode_tiles(tiles.contiguous(), K, codebook)
    return vals, states


def exl3_sample_tiles(w: torch.Tensor, width: int = 3) -> torch.Tensor:
    from trellm.ops.exl3 import TILE_PERM

    tk, tn = w.shape[0] // 16, w.shape[1] // 16
    w4 = w.view(tk, 16, tn, 16)
    diag = max(tk, tn)
    ii = torch.arange(diag).repeat_interleave(width)
    ww = torch.arange(width).repeat(diag)
    kk, nn = ii % tk, (ii + ww) % tn
    num_x = min(max(8, diag * width // 16), (tk * tn + 1) // 2)
    ms = w4.square().mean(dim=(1, 3)).flatten()
    ext = torch.cat((torch.topk(ms, num_x).indices, torch.topk(ms, num_x, largest=False).indices))
    tiles = w4[torch.cat((kk, ext // tn)), :, torch.cat((nn, ext % tn)), :].reshape(-1, 256)
    return tiles[:, TILE_PERM]


def exl3_scale_search(samples: torch.Tensor, K: int, codebook: str) -> float:
    def mse(t: torch.Tensor, s: float) -> float:
        return (encode(t * s, K, codebook)[0] / s - t).square().mean().item()

    coarse = [0.1 + 0.2 * i for i in range(10)]
    sub = samples[::3]
    c = coarse[min(range(10), key=lambda i: mse(sub, coarse[i]))]
    step = 0.075
    fine = [c + step * (i - 2) for i in range(5)]
    e = [mse(samples, s) for s in fine]
    best = min(range(5), key=e.__getitem__)
    offset = 0.0
    if 0 < best < 4:
        denom = e[best - 1] - 2 * e[best] + e[best + 1]
        offset = max(-0.5, min(0.5, 0.5 * (e[best - 1] - e[best + 1]) / denom)) if denom > 0 else 0.0
    return max(fine[best] + offset * step, 0.01)


def exl3_ldlq(w: torch.Tensor, L: torch.Tensor, K: int, codebook: str, span: int = 128) -> torch.Tensor:
    from trellm.ops.exl3 import TILE_PERM, TILE_PERM_INV

    k, n = w.shape
    tn = n // 16
    prod = torch.zeros(k, n)
    q = torch.zeros(k, n)
    for j in range(k, 0, -span):
        i = j - span
        for bj in range(span, 0, -16):
            bi = bj - 16
            err = w[i + bj : j] - q[i + bj : j]
            comp = prod[i + bi : i + bj] + L[i + bj : j, i + bi : i + bj].t() @ err
            rows = w[i + bi : i + bj] + comp
            tiles = rows.reshape(16, tn, 16).permute(1, 0, 2).reshape(tn, 256)[:, TILE_PERM]
            vals, _ = encode(tiles, K, codebook)
            q[i + bi : i + bj] = vals[:, TILE_PERM_INV].reshape(tn, 16, 16).permute(1, 0, 2).reshape(16, n)
        prod += L[i:j].t() @ (w[i:j] - q[i:j])
    return q


def exl3_refit(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor, rounds: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """ExLlamaV3's refit_scales: column fit then row solve in the (damped) H, ``rounds`` times; returns the
    row and column factors (r [k], c [n]) that multiply su and sv."""
    k, n = q.shape
    hw = h @ w
    r_all, c_all = torch.ones(k), torch.ones(n)
    for _ in range(rounds):
        num = (q * hw).sum(0)
        dn = (q * (h @ q)).sum(0)
        c = torch.where(dn > 1e-30, num / dn.clamp(min=1e-30), torch.ones_like(num))
        q = q * c
        c_all *= c
        a = (q @ q.t()) * h
        b = (q * hw).sum(1)
        a.diagonal().add_(1e-6 * a.diagonal().mean())
        r = torch.linalg.solve(a, b)
        r = torch.where(torch.isfinite(r) & (r > 0), r, torch.ones_like(r))
        q = q * r[:, None]
        r_all *= r
    return r_all, c_all


def exl3_quantize_group(weights: list[torch.Tensor], hessian: torch.Tensor, K: int, codebook: str, seed: int,
                        switches: set[str]) -> list[torch.Tensor]:
    """Dequantized weights [k, n_t] (in, out; padded; fp16 scales) of ExLlamaV3's procedure for one group."""
    from trellm.quant.exl3.quantize import padded

    k_in = weights[0].shape[1]
    k = padded(k_in)
    h = torch.zeros(k, k)
    h[:k_in, :k_in] = hessian
    h.diagonal().add_(SIGMA_REG * h.diagonal().mean())  # damped, original basis
    torch.manual_seed(seed)
    su_sign = (torch.randn(k).sign() + 1e-5).sign()
    h_rot = had_left(had_right(h * su_sign[None, :] * su_sign[:, None]))
    L_signs = exl3_block_ldl(h_rot) if "scaled" not in switches else None

    originals, regs, sus, svs = [], [], [], []
    for w_hf in weights:
        n_out = w_hf.shape[0]
        n = padded(n_out)
        w = torch.zeros(k, n)
        w[:k_in, :n_out] = w_hf.t()
        originals.append(w.clone())
        sv = (torch.randn(n).sign() + 1e-5).sign()
        scales = w.square().mean(0).sqrt()
        scales = scales / scales.mean()
        zero = scales.abs() < 1e-30
        scales[zero] = 0.1
        sv = sv * scales + 1e-10
        w = w / sv
        sv[zero] = 0.0
        w = had_right(w)
        svs.append(sv)
        regs.append(w)
    if "groupsu" in switches:
        cat = torch.cat(regs, 1)
        in_scales = [cat.square().mean(1).sqrt()] * len(regs)
    else:
        in_scales = [w.square().mean(1).sqrt() for w in regs]
    for t, w in enumerate(regs):
        s = in_scales[t].clone()
        s[s.abs() < 1e-30] = 0.1
        su = su_sign * s / (-CODEBOOK_SCALE) + 1e-10
        regs[t] = had_left(w / su[:, None])
        sus.append(su)
    drift = LDLQ_DRIFT.get(K, 1.0)
    if "groupsu" in switches:
        g = exl3_scale_search(exl3_sample_tiles(torch.cat(regs, 1)) * drift, K, codebook)
        gs = [g] * len(regs)
    else:
        gs = [exl3_scale_search(exl3_sample_tiles(w) * drift, K, codebook) for w in regs]
    for t in range(len(regs)):
        regs[t] = regs[t] * gs[t]
        sus[t] = sus[t] / gs[t]

    widths = [w.shape[1] for w in regs]
    if L_signs is not None:
        q_all = exl3_ldlq(torch.cat(regs, 1), L_signs, K, codebook)
        qs = list(torch.split(q_all, widths, 1))
    else:  # the Hessian in the domain LDLQ quantizes in: full su per tensor (or the group's one)
        qs = []
        for t, w in enumerate(regs):
            hs = had_left(had_right(h * sus[t][None, :] * sus[t][:, None]))
            qs.append(exl3_ldlq(w, exl3_block_ldl(0.5 * (hs + hs.t())), K, codebook))

    out = []
    for t, q in enumerate(qs):
        su, sv = sus[t], svs[t]
        if "norefit" not in switches:
            r, c = exl3_refit(originals[t], had_right(had_left(q) * su[:, None]) * sv[None, :], h)
            su, sv = su * r, sv * c
        out.append(had_right(had_left(q) * su.half().float()[:, None]) * sv.half().float()[None, :])
    return out


# ---------------------------------------------------------------------------------------------------------
# Scoring


def score(weights: list[torch.Tensor], deq: list[torch.Tensor], hessian: torch.Tensor,
          heldout: dict[str, torch.Tensor]) -> dict:
    """Proxy loss tr(E^T H E) / tr(W^T H W) on the calibration Hessian; per held-out part the relative output
    error |X E|^2 / |X W|^2 (the same ratio on that part's E[x x^T]) and ``heldout``, their mean over parts."""
    k_in = weights[0].shape[1]
    w = torch.cat([wt.t() for wt in weights], 1).double()
    q = torch.cat([d[:k_in, : wt.shape[0]] for d, wt in zip(deq, weights)], 1).double()
    e = q - w

    def ratio(h: torch.Tensor) -> float:
        h = h.double()
        return ((e * (h @ e)).sum() / (w * (h @ w)).sum()).item()

    parts = {name: ratio(h) for name, h in heldout.items()}
    return dict(proxy=ratio(hessian), heldout=sum(parts.values()) / len(parts), parts=parts)


def run_variant(name: str, weights: list[torch.Tensor], hessian: torch.Tensor, K: int, codebook: str, seed: int,
                device: str = "cpu") -> list[torch.Tensor]:
    if name == "trellm" or name.startswith("trellm:"):
        from trellm.quant.exl3.quantize import dequantize, quantize_group

        opts = dict(kv.split("=") for kv in name.split(":")[1].split("+")) if ":" in name else {}
        kwargs = {key: (value if key == "out_scales" else bool(int(value))) for key, value in opts.items()}
        qts, _ = quantize_group(weights, hessian, K, codebook, seed=seed, device=device, **kwargs)
        return [dequantize(qt).cpu() for qt in qts]
    if name == "exl3" or name.startswith("exl3:"):
        switches = set(name.split(":")[1].split("+")) if ":" in name else set()
        return exl3_quantize_group(weights, hessian, K, codebook, seed, switches)
    raise SystemExit(f"unknown variant {name!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None, help="Llama-family HF dir (default: the default model)")
    ap.add_argument("--layer", default="3", help="decoder layers, comma-separated")
    ap.add_argument("--groups", default="qkv,down")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--variants", default="trellm,exl3")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--cal-rows", type=int, default=64)
    ap.add_argument("--cal-cols", type=int, default=512)
    ap.add_argument("--cal-source", default="trellm",
                    help="calibration sets, comma-separated: trellm (the built-in mix), file:PATH (a --calibration "
                         "text file), rows:PATH (rows saved by --dump-rows), exl3:DIR (ExLlamaV3's mix from its "
                         "standard_cal_data DIR, the first 90%% of each file)")
    ap.add_argument("--heldout", default="eval",
                    help="held-out parts, comma-separated: eval (trellm's eval.txt), file:PATH, exl3:DIR (the last "
                         "10%% of ExLlamaV3's wiki, code, multilingual and tiny files)")
    ap.add_argument("--heldout-windows", type=int, default=8, help="windows per held-out part (default 8)")
    ap.add_argument("--heldout-cols", type=int, default=512, help="tokens per held-out window (default 512)")
    ap.add_argument("--write-heldout", default=None,
                    help="write the --heldout parts' windows as one UTF-8 text (each part decoded, blank line "
                         "between) and stop: an --eval-text for exl3_compare.py that scores on the same text")
    ap.add_argument("--dump-rows", default=None, help="write the first --cal-source's token rows to this JSON file "
                                                      "and stop (for rows:PATH later, e.g. after the mix changed)")
    ap.add_argument("--device", default="cpu",
                    help="where the trellm variants quantize (cuda: its CUDA tile encoder and GPU scale sample); "
                         "the exl3 variants stay on the CPU encoder")
    ap.add_argument("--out", default=None, help="JSON file the rows are appended to")
    ap.add_argument("--capture-cache", type=Path, default=None,
                    help="file keeping the captured matrices of each token set, layer and group: a later run "
                         "with another --cal-source forwards only the sets it has not seen")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    import trellm
    from trellm.default_model import default_model_dir

    groups = args.groups.split(",")
    layers = [int(x) for x in args.layer.split(",")]
    t0 = time.perf_counter()
    model_dir = args.model_dir or default_model_dir(show_progress=False)
    if args.write_heldout:
        from trellm.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(model_dir)
        parts = heldout_sets(args.heldout.split(","), tokenizer, args.heldout_cols, args.heldout_windows)
        Path(args.write_heldout).write_text(
            "\n\n".join(tokenizer.decode([t for w in windows for t in w]) for windows in parts.values()),
            encoding="utf-8")
        print(f"wrote {args.write_heldout}: parts {list(parts)}")
        return 0
    lm = trellm.load(model_dir, device="cpu", dtype=torch.float32,
                     tokenizer=True)
    vocab = lm.model.embed.vocab_size
    cal = calibration_sets(args.cal_source.split(","), lm.tokenizer, vocab, args.cal_rows, args.cal_cols)
    if args.dump_rows:
        Path(args.dump_rows).write_text(json.dumps(next(iter(cal.values()))))
        print(f"wrote {args.dump_rows}")
        return 0
    heldout = heldout_sets(args.heldout.split(","), lm.tokenizer, args.heldout_cols, args.heldout_windows)
    data = capture(layers, groups, cal, heldout, lm, args.capture_cache)
    print(f"captured layers {layers}: {len(cal)} calibration sets, held-out parts "
          f"{ {k: sum(map(len, v)) for k, v in heldout.items()} } tokens ({time.perf_counter() - t0:.0f}s)", flush=True)
    rows = []
    for bits in (int(b) for b in args.bits.split(",")):  # every tensor at the first bitrate first
        for li in layers:
            for g in groups:
                d = data[li, g]
                for seed in (int(s) for s in args.seeds.split(",")):
                    for cal_name, hessian in d["hessians"].items():
                        for variant in args.variants.split(","):
                            t0 = time.perf_counter()
                            deq = run_variant(variant, d["weights"], hessian, bits, args.codebook, seed, args.device)
                            s = score(d["weights"], deq, hessian, d["heldout"])
                            row = dict(layer=li, group=g, bits=bits, seed=seed, variant=variant, device=args.device,
                                       cal=f"{cal_name} {args.cal_rows}x{args.cal_cols}", **s,
                                       seconds=round(time.perf_counter() - t0, 1))
                            rows.append(row)
                            parts = " ".join(f"{k} {v:.6f}" for k, v in s["parts"].items())
                            print(f"L{li} {g:>5} {bits} bpw seed {seed} {variant:>8} cal {row['cal']}: proxy "
                                  f"{s['proxy']:.6f} heldout {s['heldout']:.6f} ({parts}) ({row['seconds']}s)",
                                  flush=True)
                            if args.out:  # appended as it goes: a long run killed early keeps its rows
                                path = Path(args.out)
                                old = json.loads(path.read_text()) if path.is_file() else []
                                path.write_text(json.dumps(old + [row], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
