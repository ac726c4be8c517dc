"""``trellm convert``: quantize an HF model directory to EXL3, layer by layer, with resume.

Pipeline (shared/exl3_format.md section 5): calibration tokens -> embedding -> for each decoder
layer: capture the Hessian of every linear's input, quantize the linears (linears sharing an input
as one group), swap them for EXL3 and advance the hidden states through the *quantized* layer, so
later Hessians see the error of earlier layers -> final norm -> head. Two steps beyond ExLlamaV3's
pipeline: within a layer each group's Hessian is captured after the groups the layer calls before it
are quantized (``sequential``), and the dense model's hidden states are carried along so that each
linear is quantized towards the weight that maps its quantized-model input to its dense-model output
(``error_target``, :func:`trellm.quant.exl3.quantize.compensated_weights`). Every finished layer's tensors
are saved into the work dir, and about every minute (``CHECKPOINT_SECONDS``) a checkpoint (hidden states +
next layer, swapped in atomically), so ``resume=True`` continues from the last checkpoint and produces
identical output.
Finally the output directory is compiled: sharded safetensors, config.json with
``quantization_config``, quantization_config.json and the non-weight files of the source.
"""
from __future__ import annotations

import argparse
import errno
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from .errors import ConfigError, TrellmError
from .modules.linear import Linear
from .quant.exl3.format import MARKER_VALUES, EXL3Linear
from .quant.exl3.quantize import OUT_SCALE_MODES, PhaseClock, quantize_group

CODEBOOK = "mul1"
ERROR_TARGET = 1.0  # convert's default strength of the error-compensating target (compensated_weights)
# Defaults of the output-channel scale choice (quantize.OUT_SCALE_MODES) and of the scale search's LDLQ drift
# allowance (quantize.LDLQ_DRIFT): on a CPU proxy (SmolLM2-135M layer 11 alone, 2 bpw) auto, fit and drift
# each moved KL by under 2%, inside what any change of the trellis moves it; the GPU side-by-side decides.
OUT_SCALES = "always"
SCALE_DRIFT = False
NOT_COPIED = {".safetensors", ".bin", ".ckpt", ".pth", ".pt"}
NOT_COPIED_NAMES = {"config.json", "model.safetensors.index.json"}
# The hidden states are checkpointed after the first layer that ends this long after the last checkpoint (and
# after the head, and when a job is stopped): a crash redoes at most about this much work, and a small model does
# not write its states (two per layer with the error target, 168 MB for SmolLM2-640) after every layer.
CHECKPOINT_SECONDS = 60.0
# Arguments that must match when a job is resumed.
FIXED_ARGS = ("bits", "head_bits", "cal_rows", "cal_cols", "codebook", "scale_search", "sequential", "error_target",
              "out_scales", "scale_drift")


class ConversionError(TrellmError):
    """The conversion cannot start or continue (bad arguments, output dir, disk space, ...)."""


class ConversionInterrupted(ConversionError):
    """Raised by ``stop_after_layer`` (tests): the job stopped cleanly after a checkpoint."""


# ---------------------------------------------------------------------------------------------
# Progress


class Progress:
    """A one-line progress bar with ETA on stderr (silent when disabled)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.done, self.start = 0, time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        self.done = done
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        frac = done / self.total
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        eta_s = f"{eta:6.0f}s" if math.isfinite(eta) else "     ?"
        print(f"\r{self.label} [{bar}] {done}/{self.total} elapsed {elapsed:5.0f}s eta {eta_s} {note:<40}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def log(msg: str, enabled: bool = True) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Calibration


CHARS_PER_ROW = 8  # characters of text cut per calibration token wanted (tokens average 3-5 characters)


def calibration_rows(tokenizer, vocab_size: int, rows: int, cols: int, text_file: str | Path | None = None) -> list[list[int]]:
    """``rows`` token rows of ``cols`` tokens from the built-in mix (or a user text file), then random tokens.

    Each source of the mix (``trellm.data.calibration_sources``) gets its share of the rows, cut as
    windows spread evenly over its token stream; chat dialogues are rendered with the tokenizer's chat
    template. At the default 64 x 512 no window overlaps another. A source shorter than one row (at
    8,192-token rows, the mix's technical text of about 3,300 SmolLM2 tokens) gives rows holding it once,
    shorter rows: wrapped round into itself inside a row, it would put the model in copy mode, whose
    activations no real input has. The remaining rows (about 1/10; 1/8 with a user
    file) are uniform random tokens, so every embedding row and rare token direction contributes a
    little to the Hessians. Deterministic.
    """
    from .data import CalibrationSource, calibration_sources

    if text_file is not None:
        path = Path(text_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConversionError(f"calibration file {path}: cannot read as UTF-8 text ({e})") from None
        sources: tuple[CalibrationSource, ...] = (CalibrationSource(path.name, text, 0.875),)
    else:
        sources = calibration_sources()
    out: list[list[int]] = []
    if tokenizer is not None:
        for source in sources:
            n = max(1, round(source.share * rows))
            if len(out) + n >= rows:
                n = rows - len(out) - 1
            if n <= 0:
                break
            span = CHARS_PER_ROW * cols
            if not source.chat and len(source.text) > n * span:  # a long source: tokenize only n spread-out pieces
                starts = torch.linspace(0, len(source.text) - span, steps=n).long().tolist()
                pieces = [tokenizer.encode(source.text[s : s + span]) for s in starts]
                if all(len(p) >= cols for p in pieces):
                    out += [p[:cols] for p in pieces]
                    continue
            ids = _source_tokens(tokenizer, source)
            if len(ids) < cols and text_file is not None:
                raise ConversionError(f"calibration text has {len(ids)} tokens, fewer than one row of {cols}")
            if len(ids) <= cols:  # shorter than a row: rows of the text once (repeated in one row, it puts the
                out += [ids] * n  # model in copy mode, with activations unlike any real input's)
                continue
            if len(ids) < n * cols:  # a short source repeats (windows then start at different offsets)
                ids = ids * -(-n * cols // max(len(ids), 1))
            starts = torch.linspace(0, len(ids) - cols, steps=n).long().tolist()
            out += [ids[s : s + cols] for s in starts]
    gen = torch.Generator().manual_seed(0)
    for _ in range(rows - len(out)):
        out.append(torch.randint(0, vocab_size, (cols,), generator=gen).tolist())
    return out


def _source_tokens(tokenizer, source) -> list[int]:
    """Token ids of one calibration source; chat dialogues rendered by the model's chat template when it has one."""
    if not source.chat:
        return tokenizer.encode(source.text)
    from .data import chat_dialogues

    ids: list[int] = []
    for messages in chat_dialogues(source.text):
        if tokenizer.chat_templates:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        else:
            text = "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages) + "\n\n"
        ids += tokenizer.encode(text)
    return ids


# ---------------------------------------------------------------------------------------------
# Hessian capture


class _InputTracker:
    """Assigns linears called with the very same input tensor to one group (q/k/v, gate/up), numbered in call
    order. ``accumulated``: only the first this many groups accumulate their matrices, the others count their
    rows (None: every group)."""

    def __init__(self, accumulated: int | None = None):
        self.last_input: torch.Tensor | None = None
        self.last_group = -1
        self.groups = 0
        self.accumulated = accumulated

    def accumulates(self, group: int) -> bool:
        return self.accumulated is None or group < self.accumulated


def _compact_rows(rows: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """A copy of float32 rows on ``device``, in float16 when every finite value fits (half the memory of the
    dense model's inputs that the error target keeps for a layer: 1.75 GB instead of 3.5 GB for an 8B model at
    the default calibration); float16's 11-bit mantissa leaves the cross term's error far below the
    quantization error it measures. The rounding is IEEE round-to-nearest-even on any device."""
    magnitude = rows.abs().nan_to_num_(0.0, posinf=0.0)  # non-finite values are skipped later: they do not count
    small = magnitude.numel() == 0 or magnitude.max().item() < torch.finfo(torch.float16).max
    return rows.to(device, dtype=torch.float16 if small else torch.float32, copy=True)


class HessianRecorder:
    """Wraps a Linear's weights: forwards unchanged, accumulating H = sum x x^T of its input (float32).

    ``keep_rows``: in the dense model's pass, keep the input rows (on ``keep_device``, the host by default)
    when the linear is called once with exactly that many rows, one per calibration token
    (:func:`compensated_weights` needs rows that pair token by token; a routed expert's do not).
    ``reference``: those dense-model rows; the recorder then also accumulates the cross term sum x x_ref^T,
    unless its own rows do not pair with them. Rows with a non-finite value on either side are skipped.
    """

    CHUNK_ROWS = 8192  # reference rows converted to float32 and multiplied at a time

    def __init__(self, inner, tracker: _InputTracker, shared: dict[int, "HessianRecorder"],
                 reference: torch.Tensor | None = None, keep_rows: int | None = None,
                 observer: "GatedSensitivity | None" = None, keep_device: torch.device | str = "cpu"):
        self.inner, self.tracker, self.shared = inner, tracker, shared
        self.observer = observer  # also sees the group's input rows (the owner's)
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.group: int | None = None
        self.hessian: torch.Tensor | None = None
        self.cross: torch.Tensor | None = None
        self.reference, self.keep_rows, self.keep_device = reference, keep_rows, keep_device
        self.inputs: torch.Tensor | None = None
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tracker
        if self.group is None:
            if x is t.last_input:
                self.group = t.last_group
            else:
                self.group = t.groups
                t.groups += 1
                t.last_input, t.last_group = x, self.group
        owner = self.shared.setdefault(self.group, self)
        if owner is self:
            rows = x.reshape(-1, x.shape[-1]).float()
            if self.keep_rows is not None:
                first = self.inputs is None and self.count == 0 and rows.shape[0] == self.keep_rows
                self.inputs = _compact_rows(rows, self.keep_device) if first else None
            finite = torch.isfinite(rows).all(dim=1)
            ref = self.reference
            if ref is not None and (self.count or ref.shape != rows.shape):
                ref = self.reference = self.cross = None  # called again, or rows that do not pair
            if ref is not None:
                finite &= torch.isfinite(ref).all(dim=1).to(finite.device)
            if bool(finite.all()):  # copies only where a row is dropped
                rows = rows.contiguous()  # the layout (and so the sums) of the copy it would be
            else:
                rows = rows[finite]
                ref = ref[finite.to(ref.device)] if ref is not None else None
            if t.accumulates(self.group):
                self._accumulate(rows, ref)
            self.count += rows.shape[0]
        return self.inner.forward(x)

    __call__ = forward

    def _accumulate(self, rows: torch.Tensor, ref: torch.Tensor | None) -> None:
        width = rows.shape[-1]
        if self.hessian is None:
            self.hessian = torch.zeros(width, width, device=rows.device)
        self.hessian.addmm_(rows.t(), rows)
        if self.observer is not None:
            self.observer.add(rows)
        if ref is not None:
            self.cross = torch.zeros(width, width, device=rows.device)
            for r in range(0, rows.shape[0], self.CHUNK_ROWS):
                part = ref[r : r + self.CHUNK_ROWS].to(device=rows.device, dtype=torch.float32)
                self.cross.addmm_(rows[r : r + self.CHUNK_ROWS].t(), part)

    def release(self) -> None:
        """Drop the accumulated matrices and rows now: recorders of one pass reference each other (``shared``),
        so without this their [in, in] tensors would wait for the garbage collector."""
        self.hessian = self.cross = self.inputs = self.reference = self.observer = None

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def dense_weight(self) -> torch.Tensor:
        return self.inner.dense_weight()

    def _owner(self) -> "HessianRecorder":
        return self.shared.get(self.group, self)

    def finished_hessian(self) -> torch.Tensor | None:
        owner = self._owner()
        if owner.hessian is None or owner.count == 0:
            return None
        return owner.hessian / owner.count

    def finished_cross(self) -> torch.Tensor | None:
        """E[x x_ref^T] (quantized-model inputs x, dense-model inputs x_ref), or None without a reference."""
        owner = self._owner()
        if owner.cross is None or owner.count == 0:
            return None
        return owner.cross / owner.count

    def group_inputs(self) -> torch.Tensor | None:
        return self._owner().inputs


class GatedSensitivity:
    """How much a gated MLP's output moves per unit of error in each output channel of its gate and up
    projections, from the calibration rows x of their input: for down(act(g) * u), channel j of up matters as
    E[act(g_j)^2] |down[:, j]|^2 and channel j of gate as E[(act'(g_j) u_j)^2] |down[:, j]|^2 (the slopes of
    the gated product, times what the down projection makes of it). What the ``out_scales`` choice of the two
    projections weighs their columns by (:func:`trellm.quant.exl3.quantize.column_scale_shape`); it covers
    the MLP itself, not the layers after it. The projections are recomputed from the rows with the dense
    weights (the group is still unquantized while its Hessian is captured).
    """

    CHUNK_ROWS = 2048  # rows per step: g, u, act and its slope are [rows, intermediate] each

    def __init__(self, mlp):
        from .ops.dense import activation_fn

        self.gate_key, self.up_key = mlp.gate_proj.key, mlp.up_proj.key
        self.act = activation_fn(mlp.activation)
        self.gate, self.gate_bias = _dense_parts(mlp.gate_proj)
        self.up, self.up_bias = _dense_parts(mlp.up_proj)
        self.down_energy = _dense_parts(mlp.down_proj)[0].pow(2).sum(0)  # |down[:, j]|^2, [intermediate]
        self.sums = torch.zeros(2, self.gate.shape[0], dtype=torch.float64, device=self.gate.device)
        self.count = 0

    def add(self, rows: torch.Tensor) -> None:
        for r in range(0, rows.shape[0], self.CHUNK_ROWS):
            x = rows[r : r + self.CHUNK_ROWS].to(self.gate.device)
            g = torch.nn.functional.linear(x, self.gate, self.gate_bias)
            u = torch.nn.functional.linear(x, self.up, self.up_bias)
            with torch.inference_mode(False), torch.enable_grad():
                g = g.clone().requires_grad_(True)
                a = self.act(g)
                (slope,) = torch.autograd.grad(a, g, torch.ones_like(a))
            self.sums[0] += (slope * u).pow(2).sum(0, dtype=torch.float64)
            self.sums[1] += a.detach().pow(2).sum(0, dtype=torch.float64)
            self.count += x.shape[0]

    def result(self) -> dict[str, torch.Tensor]:
        """Sensitivity per output channel ([intermediate], float32) by linear key; empty without rows."""
        if self.count == 0:
            return {}
        s = (self.sums / self.count).float() * self.down_energy
        return {self.gate_key: s[0].cpu(), self.up_key: s[1].cpu()}


def layer_linears(module) -> list[Linear]:
    return [m for m in module.modules() if isinstance(m, Linear)]


def _priority(layer, linear: Linear) -> int:
    """Attention linears first (2), then the rest (1), as upstream's allocation does."""
    from .modules.layers import Attention

    for child in layer.modules():
        if isinstance(child, Attention) and any(m is linear for m in child.modules()):
            return 2
    return 1


# ---------------------------------------------------------------------------------------------
# Bit allocation


@dataclass
class PlanGroup:
    layer: int
    keys: list[str]
    numel: int
    priority: int
    bits: int


def allocate_bits(groups: list[PlanGroup], bits: float, num_layers: int) -> float:
    """Give every group floor(bits), then +1 round-robin by priority until the budget int(bits*numel) is spent.

    Returns the exact average bits per weight.
    """
    base = int(math.floor(bits))
    total = sum(g.numel for g in groups)
    budget = int(bits * total)
    for g in groups:
        g.bits = base
    used = base * total
    order = sorted(
        range(len(groups)),
        key=lambda i: (-groups[i].priority, min(groups[i].layer, num_layers - 1 - groups[i].layer), groups[i].layer, i),
    )
    changed = True
    while changed:
        changed = False
        for i in order:
            g = groups[i]
            if g.bits < 8 and used + g.numel <= budget:
                g.bits += 1
                used += g.numel
                changed = True
    return used / max(total, 1)


# ---------------------------------------------------------------------------------------------
# Work dir


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        _raise_disk(e, path)


def _raise_disk(e: OSError, path: Path):
    if e.errno == errno.ENOSPC:
        raise ConversionError(f"disk full while writing {path}: free some space and rerun with resume") from None
    raise ConversionError(f"cannot write {path}: {e.strerror or e}") from None


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2))
        os.replace(tmp, path)
    except OSError as e:
        _raise_disk(e, path)


def _save_checkpoint(work: Path, state: torch.Tensor, job: dict, state_fp: torch.Tensor | None = None) -> None:
    """Write ckpt_new/, then swap: ckpt -> ckpt_old, ckpt_new -> ckpt, drop ckpt_old."""
    new, cur, old = work / "ckpt_new", work / "ckpt", work / "ckpt_old"
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    _atomic_save({"state": state} if state_fp is None else {"state": state, "state_fp": state_fp}, new / "state.safetensors")
    _write_json(new / "job.json", job)
    shutil.rmtree(old, ignore_errors=True)
    if cur.exists():
        os.replace(cur, old)
    os.replace(new, cur)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(work: Path) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """The quantized model's hidden states, the dense model's (None when not tracked) and the job state."""
    cur = work / "ckpt"
    if not cur.is_dir() and (work / "ckpt_old").is_dir():  # crashed between the two renames
        os.replace(work / "ckpt_old", cur)
    try:
        job = json.loads((cur / "job.json").read_text())
        saved = load_file(str(cur / "state.safetensors"))
        state = saved["state"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise ConversionError(f"{work}: no usable checkpoint to resume from ({e})") from None
    return state, saved.get("state_fp"), job


# ---------------------------------------------------------------------------------------------
# Validation


def _check_work_dir(work_dir: Path, output_dir: Path, input_dir: Path, resume: bool) -> None:
    """The work folder must be its own folder, and a fresh start must not wipe a job that has quantized layers."""
    for other, flag in ((output_dir, "-o/--output"), (input_dir, "-i/--input")):
        if work_dir.resolve() == other.resolve():
            raise ConversionError(f"the work directory {work_dir} is also the {flag} directory; "
                                  "give -w/--work-dir a folder of its own (it holds checkpoints)")
    done = [work_dir / "ckpt", work_dir / "ckpt_old"]
    if not resume and any(p.is_dir() for p in done):
        raise ConversionError(f"work directory {work_dir} holds a started conversion job; resume it with -r/--resume "
                              "(resume=True), or delete the folder (or pick another) to start over")


def _check_args(input_dir: Path, output_dir: Path, bits: float, head_bits: int) -> dict:
    if not isinstance(bits, (int, float)) or not 1 <= bits <= 8:
        raise ConversionError(f"bits must be between 1 and 8, got {bits!r}")
    if head_bits not in (*range(1, 9), 16):
        raise ConversionError(f"head_bits must be 1..8 or 16, got {head_bits!r}")
    cfg_path = input_dir / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{input_dir}: not a model directory (config.json is missing)")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_path}: invalid JSON ({e})") from None
    archs = raw.get("architectures") or []
    if not archs:
        raise ConfigError(f"{cfg_path}: no 'architectures' entry")
    from . import registry

    registry.find_architecture(archs[0], source=str(cfg_path))  # raises UnknownArchitectureError
    qc = raw.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "exl3":
        raise ConversionError(f"{cfg_path}: the model is already EXL3-quantized; convert the unquantized model")
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise ConversionError(f"output directory {output_dir} exists and is not empty; choose a new or empty directory")
    return raw


def _estimate_output_bytes(store, linear_numel: int, head_numel: int, bits: float, head_bits: int) -> int:
    total = sum(store.info(n).nbytes for n in store)
    dense_linear = 2 * (linear_numel + head_numel)  # roughly what quantization replaces (as fp16)
    other = max(total - dense_linear, 0)
    return int(other + linear_numel * bits / 8 + head_numel * head_bits / 8) + (1 << 20)


def _check_free_space(path: Path, needed: int, what: str) -> None:
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise ConversionError(
            f"not enough disk space for the {what} at {path}: need about {needed / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free"
        )


# ---------------------------------------------------------------------------------------------
# The job


def convert(
    input_dir: str | Path,
    output_dir: str | Path,
    work_dir: str | Path,
    bits: float,
    head_bits: int = 6,
    resume: bool = False,
    calibration: str | Path | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    cal_rows: int = 64,
    cal_cols: int = 512,
    codebook: str = CODEBOOK,
    scale_search: bool = True,
    shard_size_mb: int = 8192,
    stop_after_layer: int | None = None,
    sequential: bool = True,
    error_target: float = ERROR_TARGET,
    out_scales: str = OUT_SCALES,
    scale_drift: bool = SCALE_DRIFT,
) -> dict:
    """Quantize ``input_dir`` (HF safetensors) to EXL3 in ``output_dir``; returns a summary dict.

    ``bits`` is the target average over the decoder linears (mixed integer K per linear group);
    the head gets ``head_bits`` (16: kept unquantized). ``work_dir`` holds checkpoints;
    ``resume=True`` continues a stopped job with the same arguments. ``sequential`` and
    ``error_target``: see :func:`_quantize_layer` (``error_target`` > 0 also carries the dense
    model's hidden states along, one more state tensor and one more layer forward per layer).
    ``out_scales`` (always, never, auto, fit) and ``scale_drift``: see :func:`_quantize_layer`.
    """
    import trellm

    input_dir, output_dir, work_dir = Path(input_dir), Path(output_dir), Path(work_dir)
    raw_config = _check_args(input_dir, output_dir, bits, head_bits)
    _check_work_dir(work_dir, output_dir, input_dir, resume)
    if codebook not in ("3inst", "mcg", "mul1"):
        raise ConversionError(f"codebook must be 3inst, mcg or mul1, got {codebook!r}")
    if not isinstance(error_target, (int, float)) or not 0.0 <= error_target <= 1.0:
        raise ConversionError(f"error_target must be a number between 0 and 1, got {error_target!r}")
    error_target = float(error_target)
    if out_scales not in OUT_SCALE_MODES:
        raise ConversionError(f"out_scales must be one of {', '.join(OUT_SCALE_MODES)}, got {out_scales!r}")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = dict(
        input_dir=str(input_dir), bits=float(bits), head_bits=int(head_bits), cal_rows=cal_rows, cal_cols=cal_cols,
        codebook=codebook, scale_search=scale_search, calibration=str(calibration) if calibration else None,
        sequential=bool(sequential), error_target=float(error_target), out_scales=out_scales,
        scale_drift=bool(scale_drift),
    )
    if resume:
        try:
            old = json.loads((work_dir / "args.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConversionError(f"{work_dir}: cannot resume, args.json is missing or unreadable ({e})") from None
        changed = [k for k in FIXED_ARGS if old.get(k) != args[k]]
        if changed:
            raise ConversionError(f"{work_dir}: cannot resume with different {', '.join(changed)} (was {[old.get(k) for k in changed]})")
    else:
        if work_dir.exists() and any(work_dir.iterdir()):
            shutil.rmtree(work_dir / "ckpt", ignore_errors=True)
            shutil.rmtree(work_dir / "qtensors", ignore_errors=True)
        (work_dir / "qtensors").mkdir(parents=True, exist_ok=True)
        _write_json(work_dir / "args.json", args)

    t_start = time.perf_counter()
    clock = PhaseClock(dev)
    # Modules are built here but load their weights one at a time (ModelStream): host and device
    # memory hold one decoder layer, the embedding and the head, never the whole model.
    lm = trellm.load(input_dir, device=dev, dtype=torch.float32, tokenizer=True, weights=False)
    model, store = lm.model, lm.store
    stream = ModelStream(lm)
    layers = list(model.layers)
    num_layers = len(layers)

    # Plan: group linears by shared input with a tiny dry run, then allocate bits.
    groups = _plan_groups(model, stream)
    linear_numel = sum(g.numel for g in groups)
    head = model.lm_head
    head_numel = head.in_features * head.out_features
    avg_bits = allocate_bits(groups, bits, num_layers)
    _check_free_space(output_dir, _estimate_output_bytes(store, linear_numel, head_numel, bits, head_bits), "output")
    log(f"convert {input_dir.name}: {num_layers} layers, {linear_numel / 1e6:.1f}M linear weights at {avg_bits:.3f} bpw "
        f"(target {bits}), head {head_numel / 1e6:.1f}M at {head_bits} bits, device {dev}", progress)

    rows = calibration_rows(lm.tokenizer, model.embed.vocab_size, cal_rows, cal_cols, calibration)
    from .batch import ForwardBatch

    batch = ForwardBatch.no_cache(rows, dev)
    state_fp = None
    if resume:
        state, state_fp, job = _load_checkpoint(work_dir)
        state = state.to(dev)
        if error_target > 0:
            if state_fp is None:
                raise ConversionError(f"{work_dir}: the checkpoint has no dense-model states to resume error_target with")
            state_fp = state_fp.to(dev)
        start = int(job["next_layer"])
    else:
        with torch.inference_mode():
            state = model.embed_tokens(batch).float()
        state_fp = state.clone() if error_target > 0 else None
        start = 0

    clock.lap("setup")

    stats_log: list[dict] = []
    weights_done = 0
    bar = Progress(num_layers + 1, "quantizing", progress)
    bar.update(start)
    last_checkpoint = -math.inf  # the first layer done is always checkpointed
    for index in range(start, num_layers + 1):
        t0 = time.perf_counter()
        before = dict(clock.seconds)
        if index < num_layers:
            layer = layers[index]
            layer_groups = [g for g in groups if g.layer == index]
            with clock("io"):
                stream.load(layer)
            state, state_fp, layer_stats = _quantize_layer(layer, index, layer_groups, state, batch, codebook,
                                                           scale_search, dev, sequential, state_fp, error_target,
                                                           out_scales, scale_drift, clock)
            clock.mark()
            stream.release()
            tensors = layer_stats.pop("tensors")
            _atomic_save(tensors, work_dir / "qtensors" / f"{layer.key}.safetensors")
        else:
            with clock("io"):
                stream.load(model.lm_head)
            layer_stats, tensors = _quantize_head(model, state, head_bits, codebook, scale_search, dev, num_layers,
                                                  state_fp, error_target, out_scales, scale_drift, clock)
            clock.mark()
            model.lm_head.unload()
            stream.release()
            _atomic_save(tensors, work_dir / "qtensors" / "lm_head.safetensors")
        del tensors
        stopping = stop_after_layer is not None and stop_after_layer <= index < num_layers
        if stopping or index == num_layers or time.perf_counter() - last_checkpoint >= CHECKPOINT_SECONDS:
            _save_checkpoint(work_dir, state, {"next_layer": index + 1}, state_fp)
            last_checkpoint = time.perf_counter()
        clock.lap("io")
        n = layer_stats.get("numel", 0)
        weights_done += n
        dt = time.perf_counter() - t0
        layer_stats.update(index=index, seconds=round(dt, 3), weights_per_s=round(n / dt) if dt > 0 else 0,
                           phases=clock.since(before))
        stats_log.append(layer_stats)
        bar.update(index + 1, f"layer {index}: rfn {layer_stats.get('rfn', 0):.4f}")
        if stopping:
            bar.close()
            raise ConversionInterrupted(f"stopped after layer {index} (resume with resume=True)")
    bar.close()
    quant_seconds = time.perf_counter() - t_start

    with clock("compile"):
        summary = compile_output(input_dir, output_dir, work_dir, raw_config, store, model, groups, avg_bits,
                                 head_bits, codebook, cal_rows, cal_cols, shard_size_mb, progress, out_scales)
    summary.update(
        bits=avg_bits, head_bits=head_bits, seconds=round(time.perf_counter() - t_start, 2),
        quant_seconds=round(quant_seconds, 2), weights_quantized=weights_done, layers=stats_log,
        phases=clock.since({}),
    )
    with open(work_dir / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    log(f"done: {output_dir} ({summary['seconds']:.1f}s, {avg_bits:.3f} bpw average)", progress)
    log("time by phase: " + ", ".join(f"{k} {v:.1f}s" for k, v in sorted(summary["phases"].items(), key=lambda kv: -kv[1])),
        progress)
    lm.store.close()
    return summary


class ModelStream:
    """Loads a built model's modules one at a time for the converter.

    The embedding, final norm and any other top-level module stay loaded; decoder layers and the head
    are loaded when their turn comes and unloaded after. Each load gets a fresh LoadContext (its tensor
    cache would otherwise keep every layer alive), and ``release`` closes the memory maps, so pages
    read for a finished layer stop counting against the process.
    """

    def __init__(self, lm):
        from . import registry
        from .modules.base import LoadContext

        self.lm = lm
        self._context = lambda: LoadContext(store=lm.store, device=lm.device, dtype=lm.dtype,
                                            quant_formats=registry.quant_formats())
        model = lm.model
        streamed = {id(m) for m in model.layers} | {id(model.lm_head)}
        ctx = self._context()
        for child in model.children():
            if id(child) not in streamed:
                child.load(ctx)
        self.release()

    def load(self, module) -> None:
        module.load(self._context())

    def release(self) -> None:
        self.lm.store.close()  # maps reopen lazily on the next read


def _layer_signature(layer) -> tuple:
    """What decides a layer's grouping: its type and its linears (key relative to the layer, shape)."""
    return (type(layer).__name__,) + tuple(
        (lin.key[len(layer.key):], lin.in_features, lin.out_features) for lin in layer_linears(layer)
    )


def _plan_groups(model, stream: ModelStream) -> list[PlanGroup]:
    """Linears of each layer grouped by shared input, found with a four-token dry run of one layer per
    signature (layers of the same type and shapes group alike), so planning loads only a few layers."""
    from .batch import ForwardBatch

    device = model.embed.weight.device
    batch = ForwardBatch.no_cache([[0, 1, 2, 3]], device)
    plan: list[PlanGroup] = []
    groupings: dict[tuple, list[list[str]]] = {}  # signature -> groups of relative keys
    with torch.inference_mode():
        x = model.embed_tokens(batch)
        for index, layer in enumerate(model.layers):
            signature = _layer_signature(layer)
            if signature not in groupings:
                groupings[signature] = _dry_run_groups(layer, x, batch, stream)
            by_key = {lin.key[len(layer.key):]: lin for lin in layer_linears(layer)}
            for rel_keys in groupings[signature]:
                members = [by_key[r] for r in rel_keys]
                plan.append(PlanGroup(
                    layer=index, keys=[m.key for m in members],
                    numel=sum(m.in_features * m.out_features for m in members),
                    priority=_priority(layer, members[0]), bits=0,
                ))
    return plan


def _dry_run_groups(layer, x: torch.Tensor, batch, stream: ModelStream) -> list[list[str]]:
    """Relative keys of the layer's linears, grouped by which ones are called with the same input tensor."""
    stream.load(layer)
    linears = layer_linears(layer)
    tracker, shared = _InputTracker(), {}
    recorders = []
    for lin in linears:
        rec = HessianRecorder(lin.impl, tracker, shared)
        recorders.append(rec)
        lin.impl = rec
    try:
        layer.forward(x, batch)
    finally:
        for lin, rec in zip(linears, recorders):
            lin.impl = rec.inner
        layer.unload()
        stream.release()
    by_group: dict[int, list[str]] = {}
    for lin, rec in zip(linears, recorders):
        gid = rec.group if rec.group is not None else 10_000 + len(by_group)  # never called: alone
        by_group.setdefault(gid, []).append(lin.key[len(layer.key):])
    return list(by_group.values())


def _dense_parts(lin: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    impl = lin.impl
    weight = impl.dense_weight().float()
    bias = getattr(impl, "bias", None)
    return weight, bias


class _PassDone(Exception):
    """Raised by a :class:`_PassEnd`: the capture pass has recorded what it runs for."""


class _PassEnd:
    """Stands in for a linear that the layer calls after every linear a capture pass records, and that the pass
    does not need: its call ends the pass (the rest of the layer's forward would change no recorded input)."""

    def __init__(self, inner):
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise _PassDone

    __call__ = forward

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def dense_weight(self) -> torch.Tensor:
        return self.inner.dense_weight()


def _record(layer, linears: list[Linear], state: torch.Tensor, batch, references: dict[str, torch.Tensor] | None = None,
            keep_inputs: bool = False, sensitivity: dict[str, torch.Tensor] | None = None,
            accumulated_groups: int | None = None, keep_device: torch.device | str = "cpu",
            stop_at: list[Linear] | None = None) -> tuple[torch.Tensor | None, dict[str, HessianRecorder]]:
    """One forward of ``layer`` with ``linears`` wrapped in recorders; the output and the recorders by key.
    ``keep_inputs``: the recorders keep the input rows of linears that see every token once (on
    ``keep_device``). ``accumulated_groups``: only the first this many groups called accumulate Hessians
    (:class:`_InputTracker`). ``sensitivity``: filled with the :class:`GatedSensitivity` of every gated MLP
    whose gate and up are both recorded, by linear key.
    ``stop_at``: linears the layer calls after all of ``linears``; the pass ends at the first of their calls
    (a partial forward) and returns no output."""
    from .modules.layers import GatedMLP

    tracker, shared = _InputTracker(accumulated_groups), {}
    recorders = {}
    tokens = state.reshape(-1, state.shape[-1]).shape[0] if keep_inputs else None
    keys = {lin.key for lin in linears}
    observers: dict[str, GatedSensitivity] = {}
    if sensitivity is not None:
        for mlp in layer.modules():
            if isinstance(mlp, GatedMLP) and {mlp.gate_proj.key, mlp.up_proj.key} <= keys:
                observers[mlp.gate_proj.key] = observers[mlp.up_proj.key] = GatedSensitivity(mlp)
    for lin in linears:
        ref = references.get(lin.key) if references else None
        recorders[lin.key] = HessianRecorder(lin.impl, tracker, shared, reference=ref, keep_rows=tokens,
                                             observer=observers.get(lin.key), keep_device=keep_device)
        lin.impl = recorders[lin.key]
    ends = {lin.key: _PassEnd(lin.impl) for lin in stop_at or []}
    for lin in stop_at or []:
        lin.impl = ends[lin.key]
    out = None
    try:
        out = layer.forward(state, batch)
    except _PassDone:
        pass
    finally:
        for lin in linears:
            lin.impl = recorders[lin.key].inner
        for lin in stop_at or []:
            lin.impl = ends[lin.key].inner
    if sensitivity is not None:
        for obs in set(observers.values()):
            sensitivity.update(obs.result())
    return out, recorders


def _dense_rows_device(dev: torch.device, tokens: int, widths: list[int]) -> torch.device:
    """Where a layer's kept dense-model inputs go: the device when even in float32 they would take at most a
    quarter of its free memory, else the host. On the device, each capture pass reads them where it multiplies
    them; from the host they crossed PCIe once per pass that records their group (1.3 GB per SmolLM2-640 layer
    at the default calibration, converted to float32 on the CPU first)."""
    if dev.type != "cuda":
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(dev)
    return dev if 4 * tokens * sum(widths) <= free // 4 else torch.device("cpu")


@torch.inference_mode()
def _quantize_layer(layer, index: int, plan: list[PlanGroup], state: torch.Tensor, batch, codebook: str,
                    scale_search: bool, dev: torch.device, sequential: bool = True,
                    state_fp: torch.Tensor | None = None, error_target: float = 0.0,
                    out_scales: str = "always", scale_drift: bool = False, clock: PhaseClock | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Quantize one decoder layer's linear groups; returns the hidden states advanced through the quantized
    layer, the dense model's states advanced through the dense layer (``state_fp``, when given) and stats.

    ``sequential``: the groups are quantized in the order the layer calls them, and each group's Hessian is
    captured after the groups before it are quantized (the o_proj sees the quantized q/k/v's error, the MLP
    the quantized attention's), instead of all from one pass with the dense layer.
    ``state_fp`` with ``error_target`` > 0: each linear is quantized towards the weight that best maps its
    input in the quantized model to its output in the dense model (:func:`compensated_weights`).
    ``out_scales`` "auto" / "fit": gated MLPs' gate and up projections choose their output-channel scales
    from the :class:`GatedSensitivity` captured with their Hessian. ``scale_drift``: see :func:`quantize_group`.
    ``clock``: the steps' times go to its phases dense_pass, hessian_passes, target, advance and quantize_group's.
    """
    from .quant.exl3.quantize import compensated_weights

    clock = clock if clock is not None else PhaseClock()
    clock.mark()
    linears = {lin.key: lin for lin in layer_linears(layer)}
    dense_inputs: dict[str, torch.Tensor] = {}
    new_state_fp = None
    tokens = state.reshape(-1, state.shape[-1]).shape[0]
    if state_fp is not None:
        widths = [linears[g.keys[0]].in_features for g in plan]
        new_state_fp, recorders = _record(layer, list(linears.values()), state_fp, batch, keep_inputs=True,
                                          accumulated_groups=0, keep_device=_dense_rows_device(dev, tokens, widths))
        new_state_fp = new_state_fp.float()
        for group in plan:
            inputs = recorders[group.keys[0]].group_inputs()
            if inputs is not None:
                dense_inputs.update({k: inputs for k in group.keys})
        for rec in recorders.values():
            rec.release()
        del recorders
        clock.lap("dense_pass")
    use_targets = error_target > 0 and bool(dense_inputs)
    refs = dense_inputs if use_targets else None
    sensitivity: dict[str, torch.Tensor] | None = {} if out_scales in ("auto", "fit") else None
    # The first pass gives the dense layer's output on the quantized model's states (the rfn reference), the
    # order the layer calls its groups in (a group's inputs depend only on the groups called before it) and
    # which groups see every token; with ``sequential`` it accumulates the first group's matrices only.
    reference, recorders = _record(layer, list(linears.values()), state, batch, refs, sensitivity=sensitivity,
                                   accumulated_groups=1 if sequential else None)
    order = sorted(plan, key=lambda g: (recorders[g.keys[0]].group is None, recorders[g.keys[0]].group or 0))
    sees_all = {id(g): recorders[g.keys[0]]._owner().count == tokens for g in plan}

    def capture(position: int) -> None:
        """A capture pass for order[position] and the groups after it up to the next that sees every token
        (routed experts keep the latest pass's Hessians: a pass per expert would cost a layer forward each,
        and quantizing one expert does not change another's inputs). It ends where the layer calls that next
        group: the rest of the forward changes no input the pass records."""
        upto = next((j for j in range(position + 1, len(order)) if sees_all[id(order[j])]), len(order))
        for g in order[position:]:  # superseded: free their matrices before the new pass allocates its own
            for k in g.keys:
                recorders[k].release()
        served = [linears[k] for g in order[position:upto] for k in g.keys]
        ends = [linears[k] for k in order[upto].keys] if upto < len(order) else []
        recorders.update(_record(layer, served, state, batch, refs, sensitivity=sensitivity, stop_at=ends)[1])

    if sequential and len(order) > 1 and not sees_all[id(order[1])]:
        capture(1)  # routed groups right after the first share its pass: record them before it is quantized
    clock.lap("hessian_passes")

    tensors: dict[str, torch.Tensor] = {}
    numel, proxies, drifts, choices = 0, {}, {}, {}
    for position, group in enumerate(order):
        members = [linears[k] for k in group.keys]
        if sequential and position > 0 and sees_all[id(group)]:
            capture(position)  # after the groups before it are quantized
            clock.lap("hessian_passes")
        rec = recorders[group.keys[0]]
        hessian = rec.finished_hessian()
        parts = [_dense_parts(m) for m in members]
        weights = [w for w, _ in parts]
        cross = rec.finished_cross() if use_targets else None
        if cross is not None and hessian is not None:
            weights = compensated_weights(weights, hessian, cross, error_target)
            clock.lap("target")
        gi = plan.index(group)
        sens = [sensitivity.get(k) for k in group.keys] if sensitivity else None
        qts, st = quantize_group(weights, hessian, group.bits, codebook, seed=index * 1000 + gi,
                                 biases=[b for _, b in parts], scale_search=scale_search, device=dev,
                                 out_scales=out_scales, sensitivities=sens, drift=scale_drift, clock=clock)
        for m, qt in zip(members, qts):
            tensors.update(qt.state_dict(m.key))
            m.impl = EXL3Linear.from_quantized(qt, m.in_features, m.out_features, dev, m.key)
        clock.mark()
        numel += st.numel
        proxies[gi] = round(st.proxy_error, 6)
        choices.update(zip(group.keys, st.extra["out_scales"]))
        drifts[gi] = st.extra["ldlq_drift"]
    for rec in recorders.values():
        rec.release()
    del recorders, dense_inputs
    # Advance the hidden states through the quantized layer: later layers see this layer's error.
    new_state = layer.forward(state, batch).float()
    rfn = ((new_state - reference).norm() / reference.norm().clamp_min(1e-30)).item()
    clock.lap("advance")
    layer.unload()  # the layer is finished: free its weights
    stats = {"key": layer.key, "numel": numel, "rfn": rfn, "proxy_errors": [proxies[i] for i in sorted(proxies)],
             "ldlq_drift": [drifts[i] for i in sorted(drifts)], "bits": [g.bits for g in plan], "tensors": tensors,
             "out_scales": {k: c for k, c in choices.items() if c != "always"}}
    if new_state_fp is not None:  # the error of the quantized model so far, against the dense model's states
        stats["rfn_dense"] = ((new_state - new_state_fp).norm() / new_state_fp.norm().clamp_min(1e-30)).item()
    return new_state, new_state_fp, stats


@torch.inference_mode()
def _quantize_head(model, state: torch.Tensor, head_bits: int, codebook: str, scale_search: bool,
                   dev: torch.device, num_layers: int, state_fp: torch.Tensor | None = None,
                   error_target: float = 0.0, out_scales: str = "always", scale_drift: bool = False,
                   clock: PhaseClock | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    from .quant.exl3.quantize import compensated_weights

    clock = clock if clock is not None else PhaseClock()

    head = model.lm_head
    weight, bias = _dense_parts(head)
    if head_bits == 16:
        tensors = {"lm_head.weight": weight.half()}
        if bias is not None:
            tensors["lm_head.bias"] = bias.half()
        return {"key": "lm_head", "numel": 0, "bits": 16}, tensors
    clock.mark()
    x = model.norm.forward(state)
    rows = x.reshape(-1, x.shape[-1]).float()
    hessian = rows.t() @ rows / rows.shape[0]
    target = weight
    if state_fp is not None and error_target > 0:
        ref = model.norm.forward(state_fp).reshape(-1, x.shape[-1]).float()
        cross = rows.t() @ ref / rows.shape[0]
        clock.lap("hessian_passes")
        (target,) = compensated_weights([weight], hessian, cross, error_target)
        clock.lap("target")
    else:
        clock.lap("hessian_passes")
    (qt,), st = quantize_group([target], hessian, head_bits, codebook, seed=num_layers * 1000 + 999,
                               biases=[bias], scale_search=scale_search, device=dev, out_scales=out_scales,
                               drift=scale_drift, clock=clock)
    return ({"key": "lm_head", "numel": st.numel, "bits": head_bits, "proxy_errors": [round(st.proxy_error, 6)]},
            qt.state_dict("lm_head"))


# ---------------------------------------------------------------------------------------------
# Output


def _storage_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.half() if t.dtype in (torch.float32, torch.float64) else t


def compile_output(input_dir: Path, output_dir: Path, work_dir: Path, raw_config: dict, store, model, groups,
                   avg_bits: float, head_bits: int, codebook: str, cal_rows: int, cal_cols: int,
                   shard_size_mb: int, progress: bool, out_scales: str = "always") -> dict:
    """Assemble the output dir from the source (unquantized tensors) and the work dir (quantized ones).
    ``out_scales`` is recorded in ``quantization_config`` (metadata: the scales are in each ``svh``)."""
    from .weights import SafetensorsFile

    quantized_keys = {k for g in groups for k in g.keys}
    head_key = model.lm_head.key
    # Modules in model order as lists of (name, bytes, reader); a module is never split across shards.
    # Tensors are read when their shard is written, so host memory holds one shard at a time.
    Entry = tuple[str, int, Callable[[], torch.Tensor]]
    modules: list[list[Entry]] = []

    def source_entry(name: str) -> Entry:
        info = store.info(name)
        item = 2 if info.dtype in (torch.float32, torch.float64) else info.dtype.itemsize
        return name, info.numel * item, lambda: _storage_dtype(store.get(name))

    def source_tensors(prefix: str) -> list[Entry]:
        out = []
        for name in store.keys():
            if not (name == prefix or name.startswith(prefix + ".")):
                continue
            owner = name.rsplit(".", 1)[0]
            if owner in quantized_keys or owner == head_key:
                continue
            out.append(source_entry(name))
        return out

    def quantized_tensors(path: Path) -> list[Entry]:
        f = SafetensorsFile(path)
        return [(name, info.nbytes, lambda f=f, name=name: f.read(name)) for name, info in f.tensors.items()]

    modules.append(source_tensors(model.embed.key))
    for layer in model.layers:
        modules.append(source_tensors(layer.key) + quantized_tensors(work_dir / "qtensors" / f"{layer.key}.safetensors"))
    modules.append(source_tensors(model.norm.key) if getattr(model.norm, "key", "") else [])
    modules.append(quantized_tensors(work_dir / "qtensors" / "lm_head.safetensors"))
    claimed = {name for m in modules for name, _, _ in m}
    # Anything else of the source that no module claimed (extra tensors), unquantized.
    rest = []
    for name in store.keys():
        owner = name.rsplit(".", 1)[0]
        if name in claimed or owner in quantized_keys or owner == head_key or name.startswith(head_key + "."):
            continue
        rest.append(source_entry(name))
    modules.append(rest)
    modules = [m for m in modules if m]

    # Shards: start a new file when the next module would exceed the limit.
    limit = shard_size_mb * 2**20
    shards: list[list[Entry]] = [[]]
    size = 0
    for m in modules:
        m_size = sum(nbytes for _, nbytes, _ in m)
        if shards[-1] and size + m_size > limit:
            shards.append([])
            size = 0
        shards[-1].extend(m)
        size += m_size
    needed = sum(nbytes for shard in shards for _, nbytes, _ in shard)
    _check_free_space(output_dir, needed + (1 << 20), "output")
    output_dir.mkdir(parents=True, exist_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    weight_map, storage = {}, {}
    for name, shard in zip(names, shards):
        path = output_dir / name
        tensors = {key: read().contiguous() for key, _, read in shard}
        try:
            save_file(tensors, str(path))
        except OSError as e:
            _raise_disk(e, path)
        weight_map.update({k: name for k in tensors})
        storage.update(_tensor_storage(tensors))
        del tensors
        store.close()
    if len(shards) > 1:
        _write_json(output_dir / "model.safetensors.index.json", {"metadata": {"total_size": needed}, "weight_map": weight_map})

    from . import __version__

    qconfig = {
        "quant_method": "exl3",
        "version": __version__,
        "bits": round(avg_bits, 2),
        "head_bits": head_bits,
        "calibration": {"rows": cal_rows, "cols": cal_cols},
        "out_scales": out_scales,
        "codebook": codebook,
    }
    config = dict(raw_config)
    if "tied_word_embeddings" in config:  # upstream's update_config quirk (not HF's tie_word_embeddings)
        config["tied_word_embeddings"] = True
    old_q = config.get("quantization_config")
    if old_q is not None:
        qconfig["original_quantization_config"] = old_q
    config["quantization_config"] = qconfig
    _write_json(output_dir / "config.json", config)
    _write_json(output_dir / "quantization_config.json", dict(qconfig, tensor_storage=storage))

    for src in sorted(input_dir.iterdir()):
        if src.is_file() and src.suffix not in NOT_COPIED and src.name not in NOT_COPIED_NAMES:
            try:
                shutil.copy2(src, output_dir / src.name)
            except OSError as e:
                _raise_disk(e, output_dir / src.name)
    return {"output_dir": str(output_dir), "shards": names, "output_bytes": needed}


def _tensor_storage(tensors: dict[str, torch.Tensor]) -> dict:
    """quantization_config.json's tensor_storage entries of one shard's tensors, by leaf module."""
    leaves: dict[str, dict] = {}
    for name, t in tensors.items():
        leaf, tensor_name = name.rsplit(".", 1)
        entry = leaves.setdefault(leaf, {"stored_tensors": {}})
        entry["stored_tensors"][name] = {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
        if tensor_name == "trellis":
            entry["quant_format"] = "exl3"
            entry["bits_per_weight"] = t.shape[-1] // 16
        if tensor_name in MARKER_VALUES:
            entry[f"{tensor_name}_multiplier"] = int(t.item()) & 0xFFFFFFFF
    return leaves


# ---------------------------------------------------------------------------------------------
# CLI


def add_cli(subparsers) -> None:
    from .cli import device_name, positive_int

    p = subparsers.add_parser("convert", help="quantize an HF model directory to EXL3")
    p.add_argument("-i", "--input", required=True, help="source HF model directory (safetensors)")
    p.add_argument("-o", "--output", required=True, help="output directory (new or empty)")
    p.add_argument("-w", "--work-dir", required=True, help="work directory for checkpoints (resume with -r)")
    p.add_argument("-b", "--bits", type=float, required=True, help="target average bits per weight, 1..8 (fractional mixes K)")
    p.add_argument("-hb", "--head-bits", type=int, default=6, help="head bits: 1..8, or 16 for unquantized (default 6)")
    p.add_argument("-r", "--resume", action="store_true", help="resume the job in --work-dir")
    p.add_argument("-c", "--calibration", default=None, help="UTF-8 text file to calibrate on (default: built-in mix)")
    p.add_argument("-d", "--device", type=device_name, default=None, help="device for quantization (default: cuda if available)")
    p.add_argument("--cal-rows", type=positive_int, default=64, help="calibration rows (default 64)")
    p.add_argument("--cal-cols", type=positive_int, default=512, help="tokens per calibration row (default 512)")
    p.add_argument("--codebook", default=CODEBOOK, choices=("mul1", "mcg", "3inst"))
    p.add_argument("--shard-size", type=positive_int, default=8192, help="shard size in MB (default 8192)")
    p.add_argument("--no-scale-search", action="store_true", help="skip the global scale search (faster, slightly worse)")
    p.add_argument("--no-sequential", action="store_true",
                   help="capture every linear group's Hessian in one pass of the dense layer (instead of after the "
                        "groups before it are quantized)")
    p.add_argument("--error-target", type=float, default=ERROR_TARGET, metavar="S",
                   help="0..1: how far each linear's target moves from its dense weight towards the weight that "
                        "undoes the earlier layers' error (default %(default)s; 0 turns it off)")
    p.add_argument("--out-scales", default=OUT_SCALES, choices=OUT_SCALE_MODES,
                   help="output-channel scales: always, never, auto (gated MLPs' gate and up drop them where their "
                        "channel sensitivity predicts a loss), fit (gate and up scaled by that sensitivity) "
                        "(default %(default)s)")
    p.add_argument("--scale-drift", action=argparse.BooleanOptionalAction, default=SCALE_DRIFT,
                   help="fit the global scale to the strips LDLQ's feedback inflates (default %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        convert(args.input, args.output, args.work_dir, args.bits, head_bits=args.head_bits, resume=args.resume,
                calibration=args.calibration, device=args.device, progress=not args.quiet, cal_rows=args.cal_rows,
                cal_cols=args.cal_cols, codebook=args.codebook, scale_search=not args.no_scale_search,
                sequential=not args.no_sequential,
                error_target=args.error_target, out_scales=args.out_scales, scale_drift=args.scale_drift,
                shard_size_mb=args.shard_size)
    except TrellmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
