"""Tile encoding for the quantizer: batches of 16x16 tiles -> trellis states and decoded values.

CUDA tensors go through the ``trellis_viterbi`` op (the CUDA kernel when registered, else the
torch reference). CPU tensors use a small C encoder (``viterbi_cpu.c``, compiled once with the
system C compiler and cached), because the torch reference costs tens of ms per tile on a CPU;
without a compiler the torch reference is used. Batches are sized so the back-pointer buffers
stay within ``memory_budget`` bytes.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from ...ops.exl3 import codebook_lut, exl3_codebook_decode, trellis_viterbi

_SOURCE = Path(__file__).with_name("viterbi_cpu.c")
_cpu_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable


def _cache_dir() -> Path:
    base = os.environ.get("TRELLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "trellm")
    return Path(base)


def _load_cpu_encoder() -> ctypes.CDLL | None:
    """Compile (once per source hash and machine) and load the C tile encoder; None when impossible."""
    global _cpu_lib
    if _cpu_lib is not None:
        return _cpu_lib or None
    if os.environ.get("TRELLM_VITERBI", "") == "torch":
        _cpu_lib = False
        return None
    src = _SOURCE.read_bytes()
    tag = hashlib.sha256(src + platform.machine().encode() + sys.platform.encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"viterbi_cpu_{tag}.so"
    try:
        if not lib_path.is_file():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            cc = os.environ.get("CC", "cc")
            with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
                out = Path(tmp) / lib_path.name
                cmd = [cc, "-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", str(_SOURCE), "-o", str(out)]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:  # retry without OpenMP (e.g. clang without libomp)
                    cmd.remove("-fopenmp")
                    res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    raise RuntimeError(res.stderr.strip()[-500:])
                os.replace(out, lib_path)
        lib = ctypes.CDLL(str(lib_path))
        lib.trellm_viterbi_tiles.restype = ctypes.c_int
        lib.trellm_viterbi_tiles.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        _cpu_lib = lib
        return lib
    except Exception as e:  # no compiler, read-only cache, ...
        warnings.warn(f"trellm: C Viterbi encoder unavailable, using the (slow) torch reference on CPU ({e})")
        _cpu_lib = False
        return None


def _viterbi_cpu(lib: ctypes.CDLL, targets: torch.Tensor, K: int, codebook: str) -> torch.Tensor:
    targets = targets.float().contiguous()
    lut = codebook_lut(codebook, "cpu", torch.float32).contiguous()
    states = torch.empty(targets.shape, dtype=torch.int32)
    rc = lib.trellm_viterbi_tiles(lut.data_ptr(), targets.data_ptr(), states.data_ptr(), targets.shape[0], K)
    if rc != 0:
        raise MemoryError(f"C Viterbi encoder failed (code {rc}) on {targets.shape[0]} tiles at K={K}")
    return states


def tile_batch_size(K: int, device: torch.device, memory_budget: int | None = None) -> int:
    """Tiles per Viterbi call so that candidates and back-pointers stay within ``memory_budget`` bytes."""
    if memory_budget is None:
        memory_budget = 2 << 30 if device.type == "cuda" else 256 << 20
    if device.type == "cuda" and "cuda" in trellis_viterbi.impls:
        # the CUDA kernel's back-pointer scratch is per block (bounded by the SM count), not per tile:
        # batching would only add launches and partly idle waves
        per_tile = 256 * 4 * 3  # targets, states, decoded values
    else:
        per_tile = 65536 * (4 + 8) + 256 * (1 << (16 - K))  # candidates + argmin + uint8 back-pointers
    return max(1, memory_budget // per_tile)


def encode_tiles(
    targets: torch.Tensor, K: int, codebook: str, memory_budget: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize tiles [N, 256] (position order) -> (int32 states [N, 256], float32 decoded values [N, 256])."""
    if targets.dim() != 2 or targets.shape[1] != 256:
        raise ValueError(f"tile targets must be [N, 256], got {list(targets.shape)}")
    if targets.device.type == "cpu" and (lib := _load_cpu_encoder()) is not None:
        states = _viterbi_cpu(lib, targets, K, codebook)
    else:
        batch = tile_batch_size(K, targets.device, memory_budget)
        parts = [trellis_viterbi(targets[i : i + batch].float(), K, codebook) for i in range(0, targets.shape[0], batch)]
        states = torch.cat(parts) if parts else torch.empty(0, 256, dtype=torch.int32, device=targets.device)
    return states, exl3_codebook_decode(states, codebook).float()
