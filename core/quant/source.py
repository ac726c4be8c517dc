"""Quantized *source* checkpoints, dequantized when their tensors are read.

Users download FP8 and MXFP4 checkpoints as often as bf16 ones. trellm runs them (and converts them
to EXL3) by presenting their weights to the model as the dense tensors they encode: the store gets
one virtual tensor per quantized weight, whose read decodes the stored values with their scales to
float32 (then the model dtype). Nothing runs in FP8 or FP4 directly; memory and speed are those of
the dense model.

- ``quant_method: fp8`` (DeepSeek V3, Qwen3-FP8, MiniMax-M2): ``{key}.weight`` in float8 e4m3 with
  ``{key}.weight_scale_inv`` per ``weight_block_size`` block (default 128x128); dense = fp8 * scale.
- ``quant_method: compressed-tensors`` with float (fp8) weights: ``{key}.weight`` in float8 with
  ``{key}.weight_scale`` per tensor, per output channel or per block; ``input_scale`` is dropped.
- ``quant_method: mxfp4`` (gpt-oss): ``{experts}.gate_up_proj_blocks`` / ``_scales`` (and ``down_proj``),
  E2M1 values two per byte (low nibble first) in blocks of 32 with one E8M0 exponent (bias 127). They
  are presented per expert, ``{experts}.{e}.gate_proj.weight`` (the even rows of gate_up),
  ``.up_proj.weight`` (odd rows) and ``.down_proj.weight`` (+ biases split the same way), which is the
  layout EXL3 quantizes expert by expert.

Any other ``quant_method`` is refused by name.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import WeightError

SUPPORTED = ("fp8", "compressed-tensors", "mxfp4", "exl3")
# E2M1 code -> value; codes 8..15 are the negatives of 0..7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32


@dataclass
class VirtualTensor:
    """A tensor the store does not hold as such: ``read()`` builds it (dequantized, float32)."""

    name: str
    dtype: torch.dtype  # what the model sees (the checkpoint's dense dtype)
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def quantization_config(model_dir: Path) -> dict | None:
    """The ``quantization_config`` of ``model_dir/config.json`` (None when absent or not a dict)."""
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    try:
        qc = json.loads(path.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None  # config problems are reported by the config reader, with the file named
    return qc if isinstance(qc, dict) else None


def source_views(model_dir: Path, index: dict, reader: Callable[[str, slice | None], torch.Tensor]
                 ) -> tuple[dict[str, VirtualTensor], set[str]]:
    """The virtual tensors a quantized source presents and the stored names they replace.

    ``index`` maps stored names to their infos (dtype, shape); ``reader(name, rows)`` reads a stored
    tensor, or only the ``rows`` slice of its first dimension. Raises WeightError for an unsupported
    or malformed ``quantization_config``.
    """
    qc = quantization_config(model_dir)
    if qc is None:
        return {}, set()
    method = qc.get("quant_method")
    where = f"{model_dir / 'config.json'}: quantization_config"
    if method not in SUPPORTED:
        raise WeightError(
            f"{where}.quant_method {method!r} is not supported: trellm reads unquantized (bf16/fp16/fp32), "
            f"FP8 (fp8, compressed-tensors), MXFP4 and EXL3 checkpoints. Use the model's unquantized weights "
            f"(and `trellm convert` them to EXL3)"
        )
    if method == "exl3":
        return {}, set()
    if method == "mxfp4":
        return _mxfp4_views(index, reader, where)
    return _fp8_views(index, reader, qc, method, where)


# ---------------------------------------------------------------------------------------------
# FP8


def _fp8_views(index: dict, reader, qc: dict, method: str, where: str) -> tuple[dict, set]:
    scale_suffix = "weight_scale_inv" if method == "fp8" else "weight_scale"
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt not in ("float-quantized", "naive-quantized", None):
            raise WeightError(f"{where}.format {fmt!r} is not supported (only float-quantized FP8 weights are)")
    block = qc.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise WeightError(f"{where}.weight_block_size must be two positive integers, got {block!r}")
    views, hidden = {}, set()
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    for name, info in index.items():
        if not name.endswith(".weight") or info.dtype not in fp8:
            continue
        key = name[: -len(".weight")]
        scale_name = f"{key}.{scale_suffix}"
        if scale_name not in index:
            raise WeightError(f"tensor {name!r} is FP8 but {scale_name!r} (its scales) is missing")
        scale_info = index[scale_name]
        _check_scale_shape(name, info.shape, scale_name, scale_info.shape, block)
        views[name] = VirtualTensor(name, torch.bfloat16, tuple(info.shape),
                                    lambda name=name, scale_name=scale_name: dequantize_fp8(reader(name, None), reader(scale_name, None), block))
        hidden |= {scale_name, f"{key}.input_scale", f"{key}.weight_zero_point"}
    return views, hidden & set(index)


def _check_scale_shape(name: str, shape: tuple, scale_name: str, scale_shape: tuple, block: list | None) -> None:
    if len(shape) != 2:
        raise WeightError(f"FP8 tensor {name!r} has shape {list(shape)}; only 2-D weights are supported")
    out, inp = shape
    numel = math.prod(scale_shape)
    if numel == 1 or tuple(scale_shape) in ((out,), (out, 1)):
        return
    if len(scale_shape) == 2:
        bo, bi = block if block is not None else (-(-out // scale_shape[0]), -(-inp // scale_shape[1]))
        if tuple(scale_shape) == (-(-out // bo), -(-inp // bi)):
            return
    raise WeightError(
        f"{scale_name!r} has shape {list(scale_shape)}, which fits neither one scale, one per output channel "
        f"nor one per {block or 'block'} block of {name!r} {list(shape)}"
    )


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: list[int] | None = None) -> torch.Tensor:
    """float32 [out, in] from FP8 values and their scale: one, one per output row, or one per block."""
    w = weight.float()
    s = scale.float()
    out, inp = w.shape
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == out and (s.dim() == 1 or s.shape[1] == 1):
        return w * s.reshape(out, 1)
    bo, bi = block if block is not None else (-(-out // s.shape[0]), -(-inp // s.shape[1]))
    full = s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return w * full


# ---------------------------------------------------------------------------------------------
# MXFP4


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., G * 32] from E2M1 pairs [..., G, 16] (low nibble first) and E8M0 exponents [..., G]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise WeightError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
                          f"([..., G, {MXFP4_BLOCK // 2}] and [..., G])")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1))
    return values.reshape(*blocks.shape[:-2], -1)


def _mxfp4_views(index: dict, reader, where: str) -> tuple[dict, set]:
    views, hidden = {}, set()
    for name, info in index.items():
        if not name.endswith("_blocks"):
            continue
        base = name[: -len("_blocks")]  # e.g. model.layers.0.mlp.experts.gate_up_proj
        scales = f"{base}_scales"
        if scales not in index:
            raise WeightError(f"tensor {name!r} is MXFP4 but {scales!r} (its exponents) is missing")
        if len(info.shape) != 4 or tuple(index[scales].shape) != tuple(info.shape[:3]):
            raise WeightError(f"MXFP4 tensors {name!r} {list(info.shape)} and {scales!r} {list(index[scales].shape)} "
                              f"must be [experts, out, in/32, 16] and [experts, out, in/32]")
        experts_key, proj = base.rsplit(".", 1)
        num_experts, out, groups, _ = info.shape
        inp = groups * MXFP4_BLOCK
        hidden |= {name, scales}

        def expert(e: int, rows: slice, name=name, scales=scales) -> torch.Tensor:
            one = slice(e, e + 1)
            return dequantize_mxfp4(reader(name, one)[0, rows], reader(scales, one)[0, rows])

        bias = f"{base}_bias"
        if proj == "gate_up_proj":
            parts = (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2)))
            out //= 2
        elif proj == "down_proj":
            parts = (("down_proj", slice(None)),)
        else:
            raise WeightError(f"MXFP4 tensor {name!r}: expected gate_up_proj or down_proj blocks (experts)")
        for e in range(num_experts):
            for part, rows in parts:
                key = f"{experts_key}.{e}.{part}"
                views[f"{key}.weight"] = VirtualTensor(f"{key}.weight", torch.bfloat16, (out, inp),
                                                       lambda e=e, rows=rows, expert=expert: expert(e, rows))
                if bias in index:
                    views[f"{key}.bias"] = VirtualTensor(f"{key}.bias", torch.bfloat16, (out,),
                                                         lambda e=e, rows=rows, bias=bias: reader(bias, slice(e, e + 1))[0, rows].float())
        if bias in index:
            hidden.add(bias)
    return views, hidden
