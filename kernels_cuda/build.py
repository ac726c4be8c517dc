"""Find or build the CUDA kernel library: one shared library, prebuilt in the package or built with nvcc.

:func:`library` picks, for the visible GPU: a library shipped in ``prebuilt/`` (made by
``trellm build-kernels --into``, packed into the wheel) when it was built from these very sources for a
compatible arch, else a JIT build with nvcc, cached by content. The cache key hashes the sources and
the header, the target archs, the nvcc version and the flags, so a changed source, GPU or toolkit gives
a new library and an unchanged one is never rebuilt. Sources compile in parallel (one nvcc per ``.cu``)
and link with ``nvcc -shared`` (the CUDA runtime linked statically: the library needs only the driver,
not torch's CUDA libraries); the finished library is renamed into place, so concurrent builders never
see a half-written file.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
HEADER = SOURCE_DIR / "trellm_kernels.h"
PREBUILT_DIR = SOURCE_DIR / "prebuilt"
PREBUILT_LIBRARY = "libtrellm_kernels.so"
MANIFEST = "manifest.json"
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr"]
MIN_CAPABILITY = (8, 0)  # the kernels use sm_80 instructions (cp.async, bf16 mma)


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
    """The arch of every visible GPU (needs torch with CUDA); KernelBuildError for one older than sm_80."""
    import torch

    if not torch.cuda.is_available():
        raise KernelBuildError("no CUDA device visible: name the target, e.g. `trellm build-kernels --arch sm_90` "
                               "(in Python: build(archs=['sm_90']))")
    caps = {}
    for i in range(torch.cuda.device_count()):
        caps.setdefault(torch.cuda.get_device_capability(i), torch.cuda.get_device_name(i))
    old = {cap: name for cap, name in caps.items() if cap < MIN_CAPABILITY}
    if old:
        (major, minor), name = next(iter(old.items()))
        raise KernelBuildError(f"the CUDA kernels need compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
                               f"newer (Ampere and later); {name} is {major}.{minor}, so trellm runs the torch ops")
    return [f"sm_{major}{minor}" for major, minor in sorted(caps)]


def _arch_number(arch: str) -> tuple[int, int]:
    digits = "".join(c for c in arch[3:] if c.isdigit())
    return int(digits[:-1]), int(digits[-1])


def runs_on(device_arch: str, built_archs: list[str], ptx: str | None) -> bool:
    """Whether a library with SASS for ``built_archs`` (and PTX for ``ptx``) runs on ``device_arch``:
    SASS runs on its own major version at the same or a higher minor; PTX is compiled by the driver for
    any newer GPU."""
    major, minor = _arch_number(device_arch)
    if any(_arch_number(a)[0] == major and _arch_number(a)[1] <= minor for a in built_archs):
        return True
    return ptx is not None and _arch_number(ptx) <= (major, minor)


def source_key() -> str:
    """The hash of what the library is built from (sources, header, flags), without the archs or toolkit:
    a prebuilt library is only used by the sources it was built from."""
    h = _hash_sources()
    h.update(" ".join(NVCC_FLAGS).encode())
    return h.hexdigest()[:16]


def _hash_sources():
    h = hashlib.sha256()
    for f in sources():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h


def prebuilt_library(device_arch: str, folder: Path = PREBUILT_DIR) -> Path | None:
    """The library in ``folder`` (see :func:`install_prebuilt`) if it was built from these sources and runs on
    ``device_arch``; None otherwise (no prebuilt library, sources edited since, ``TRELLM_NVCC_FLAGS`` set)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    lib = folder / manifest.get("library", PREBUILT_LIBRARY)
    if extra_flags() or manifest.get("sources") != source_key() or not lib.is_file():
        return None
    return lib if runs_on(device_arch, manifest.get("archs", []), manifest.get("ptx")) else None


def library(progress: bool = True) -> Path:
    """The kernel library for the visible GPUs: the prebuilt one when it fits, else built with nvcc (cached)."""
    archs = device_archs()
    found = [prebuilt_library(a) for a in archs]
    if all(found):
        return found[0]
    return build(archs, progress=progress)


def install_prebuilt(archs: list[str], into: Path, progress: bool = True, force: bool = False, verbose: bool = False) -> Path:
    """Build for ``archs`` (plus PTX for the newest, so later GPUs run it too) and place the library and its
    manifest in ``into``, e.g. ``kernels_cuda/prebuilt`` before building a wheel."""
    archs = [normalize_arch(a) for a in archs]
    nvcc = find_nvcc()
    ptx = max(archs, key=_arch_number)
    built = build(archs, force=force, verbose=verbose, progress=progress, ptx=ptx)
    into.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(built, into / (PREBUILT_LIBRARY + ".tmp"))
    os.replace(into / (PREBUILT_LIBRARY + ".tmp"), into / PREBUILT_LIBRARY)
    manifest = {"library": PREBUILT_LIBRARY, "archs": archs, "ptx": ptx, "sources": source_key(),
                "nvcc": nvcc_version(nvcc)}
    (into / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return into / PREBUILT_LIBRARY


def gencode_flags(archs: list[str], ptx: str | None = None) -> list[str]:
    """SASS for each arch, plus PTX for ``ptx`` (the driver compiles it for GPUs newer than every arch)."""
    flags = [f"-gencode=arch=compute_{arch[3:]},code=sm_{arch[3:]}" for arch in archs]
    if ptx is not None:
        flags.append(f"-gencode=arch=compute_{ptx[3:]},code=compute_{ptx[3:]}")
    return flags


def compile_command(nvcc: str, source: Path, obj: Path, archs: list[str], ptx: str | None = None) -> list[str]:
    return [nvcc, *NVCC_FLAGS, *extra_flags(), *gencode_flags(archs, ptx), "-I", str(SOURCE_DIR), "-c", str(source),
            "-o", str(obj)]


def link_command(nvcc: str, objects: list[Path], lib: Path, archs: list[str], ptx: str | None = None) -> list[str]:
    return [nvcc, "-shared", "-cudart", "static", *gencode_flags(archs, ptx), *map(str, objects), "-o", str(lib)]


def build_key(archs: list[str], nvcc_ver: str, ptx: str | None = None) -> str:
    h = _hash_sources()
    h.update(",".join(archs).encode())
    h.update(f"ptx {ptx}".encode() if ptx else b"")
    h.update(nvcc_ver.encode())
    h.update(" ".join(NVCC_FLAGS + extra_flags()).encode())
    return h.hexdigest()[:16]


def library_path(archs: list[str], nvcc: str | None = None, ptx: str | None = None) -> Path:
    nvcc = nvcc or find_nvcc()
    archs = [normalize_arch(a) for a in archs]
    tag = "-".join(archs) + (f"-ptx{ptx[3:]}" if ptx else "")
    return cache_dir() / f"libtrellm_kernels-{tag}-{build_key(archs, nvcc_version(nvcc), ptx)}.so"


def _run(cmd: list[str], log: Path) -> None:
    """Run one nvcc command; on failure its whole output goes to ``log`` and the error names the first error line."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        output = f"{proc.stdout}{proc.stderr}"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{output}\n")
        first = next((line for line in output.splitlines() if "error" in line.lower()), output.strip()[:200])
        target = Path(cmd[-3]).name if "-c" in cmd else "the link"
        raise KernelBuildError(f"nvcc failed on {target} (exit {proc.returncode}): {first.strip()}; full log: {log}")


def build(archs: list[str] | None = None, force: bool = False, verbose: bool = False, progress: bool = False,
          ptx: str | None = None) -> Path:
    """Compile (or find in the cache) the kernel library for ``archs`` (default: the visible GPUs).

    ``progress`` reports each finished source on stderr (a build takes minutes per arch); ``ptx`` adds PTX
    for that arch (see :func:`gencode_flags`)."""
    archs = [normalize_arch(a) for a in (archs or device_archs())]
    ptx = normalize_arch(ptx) if ptx else None
    nvcc = find_nvcc()
    lib = library_path(archs, nvcc, ptx)
    if lib.exists() and not force:
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    log = lib.with_suffix(".log")
    log.unlink(missing_ok=True)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if progress else (lambda text: None)
    with tempfile.TemporaryDirectory(prefix="trellm-build-", dir=lib.parent) as tmp:
        tmpdir = Path(tmp)
        cu_files = sorted(SOURCE_DIR.glob("*.cu"))
        objects = [tmpdir / (f.stem + ".o") for f in cu_files]
        cmds = [compile_command(nvcc, f, o, archs, ptx) for f, o in zip(cu_files, objects)]
        if verbose:
            for c in cmds:
                print(" ".join(c), file=sys.stderr)
        workers = max(1, min(len(cmds), os.cpu_count() or 1))
        say(f"trellm: compiling the CUDA kernels for {', '.join(archs)} with nvcc ({len(cmds)} sources, {workers} at "
            f"a time; several minutes per arch, once: cached in {lib.parent})")
        t0 = time.time()
        with ThreadPoolExecutor(workers) as pool:
            running = {pool.submit(_run, c, log): f for c, f in zip(cmds, cu_files)}
            for done, future in enumerate(as_completed(running), 1):
                if future.exception() is not None:
                    pool.shutdown(cancel_futures=True)  # the first failure ends the build
                    raise future.exception()
                say(f"trellm: [{done}/{len(cmds)}] {running[future].name} ({time.time() - t0:.0f} s)")
        staged = tmpdir / lib.name
        _run(link_command(nvcc, objects, staged, archs, ptx), log)
        os.replace(staged, lib)
    say(f"trellm: kernels built in {time.time() - t0:.0f} s: {lib}")
    return lib
