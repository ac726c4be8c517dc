"""Build the CUDA kernels with nvcc into one shared library, cached by content.

The cache key hashes the sources and the header, the target archs, the nvcc version and the flags,
so a changed source, GPU or toolkit gives a new library and an unchanged one is never rebuilt.
Sources compile in parallel (one nvcc per ``.cu``) and link with ``nvcc -shared``; the finished
library is renamed into place, so concurrent builders never see a half-written file.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
HEADER = SOURCE_DIR / "trellm_kernels.h"
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr"]


def extra_flags() -> list[str]:
    """``TRELLM_NVCC_FLAGS``: extra nvcc flags for tuning experiments (e.g. ``-DTRELLM_GEMV_RING_KB=12``);
    part of the cache key, so each setting gets its own cached library."""
    return os.environ.get("TRELLM_NVCC_FLAGS", "").split()


class KernelBuildError(RuntimeError):
    """nvcc is missing or failed; the message carries the command and its output."""


def sources() -> list[Path]:
    """Every file that goes into the library (``.cu``, ``.cuh``, the header)."""
    files = sorted(SOURCE_DIR.glob("*.cu")) + sorted(SOURCE_DIR.glob("*.cuh")) + [HEADER]
    return files


def cache_dir() -> Path:
    root = os.environ.get("TRELLM_CACHE")
    base = Path(root) / "kernels" if root else Path.home() / ".cache" / "trellm" / "kernels"
    return base


def find_nvcc() -> str:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc")):
        if cand and Path(cand).exists():
            return cand
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    raise KernelBuildError("nvcc not found: put it on PATH or set NVCC / CUDA_HOME")


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def normalize_arch(arch: str) -> str:
    """'sm_90', '90', '9.0', 'sm_90a' -> 'sm_90' / 'sm_90a'."""
    a = arch.strip().lower().replace("sm_", "").replace("compute_", "").replace(".", "")
    if not a or not a[:2].isdigit():
        raise ValueError(f"bad CUDA arch {arch!r}; expected e.g. --arch sm_80 or --arch sm_90 (in Python: archs=['sm_90'])")
    return f"sm_{a}"


def device_archs() -> list[str]:
    """The arch of every visible GPU (needs torch with CUDA)."""
    import torch

    if not torch.cuda.is_available():
        raise KernelBuildError("no CUDA device visible: name the target, e.g. `trellm build-kernels --arch sm_90` "
                               "(in Python: build(archs=['sm_90']))")
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return [f"sm_{major}{minor}" for major, minor in sorted(caps)]


def gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for arch in archs:
        num = arch[3:]
        flags += [f"-gencode=arch=compute_{num},code=sm_{num}"]
    return flags


def compile_command(nvcc: str, source: Path, obj: Path, archs: list[str]) -> list[str]:
    return [nvcc, *NVCC_FLAGS, *extra_flags(), *gencode_flags(archs), "-I", str(SOURCE_DIR), "-c", str(source), "-o", str(obj)]


def link_command(nvcc: str, objects: list[Path], lib: Path, archs: list[str]) -> list[str]:
    return [nvcc, "-shared", *gencode_flags(archs), *map(str, objects), "-o", str(lib)]


def build_key(archs: list[str], nvcc_ver: str) -> str:
    h = hashlib.sha256()
    for f in sources():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(",".join(archs).encode())
    h.update(nvcc_ver.encode())
    h.update(" ".join(NVCC_FLAGS + extra_flags()).encode())
    return h.hexdigest()[:16]


def library_path(archs: list[str], nvcc: str | None = None) -> Path:
    nvcc = nvcc or find_nvcc()
    archs = [normalize_arch(a) for a in archs]
    return cache_dir() / f"libtrellm_kernels-{'-'.join(archs)}-{build_key(archs, nvcc_version(nvcc))}.so"


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelBuildError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")


def build(archs: list[str] | None = None, force: bool = False, verbose: bool = False) -> Path:
    """Compile (or find in the cache) the kernel library for ``archs`` (default: the visible GPUs)."""
    archs = [normalize_arch(a) for a in (archs or device_archs())]
    nvcc = find_nvcc()
    lib = library_path(archs, nvcc)
    if lib.exists() and not force:
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trellm-build-", dir=lib.parent) as tmp:
        tmpdir = Path(tmp)
        cu_files = sorted(SOURCE_DIR.glob("*.cu"))
        objects = [tmpdir / (f.stem + ".o") for f in cu_files]
        cmds = [compile_command(nvcc, f, o, archs) for f, o in zip(cu_files, objects)]
        if verbose:
            for c in cmds:
                print(" ".join(c))
        workers = max(1, min(len(cmds), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(_run, cmds))
        staged = tmpdir / lib.name
        _run(link_command(nvcc, objects, staged, archs))
        os.replace(staged, lib)
    return lib
