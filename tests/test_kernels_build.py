"""CPU-side checks of the kernel build and binding: the header parses, the nvcc command lines are right,
the cache key moves with what it should. An nvcc compile for one arch is marked slow."""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from trellm.kernels_cuda import build


def test_header_abi_parses_with_cffi():
    cffi = pytest.importorskip("cffi")
    from trellm.kernels_cuda import binding

    ffi = cffi.FFI()
    ffi.cdef(binding.abi_declarations())
    # every C entry point the binding calls is declared
    text = binding.abi_declarations()
    for name in (
        "trellm_error_string", "trellm_fill_f32", "trellm_hadamard_128", "trellm_exl3_matmul_small", "trellm_exl3_matmul_small_workspace",
        "trellm_exl3_decode_tiles", "trellm_exl3_codebook_decode", "trellm_rms_norm", "trellm_rotary_embedding",
        "trellm_gated_activation", "trellm_write_kv_pages", "trellm_paged_attention",
    ):
        assert f"{name}(" in text, name
    assert ffi.sizeof("cudaStream_t") == ffi.sizeof("void *")
    assert ffi.typeof("int (*)(float *, int64_t, float, cudaStream_t)") is not None


def test_every_declared_function_is_defined_in_a_source():
    from trellm.kernels_cuda import binding

    import re

    declared = set(re.findall(r"\b(trellm_\w+)\s*\(", binding.abi_declarations()))
    sources = "".join(p.read_text() for p in build.SOURCE_DIR.glob("*.cu"))
    defined = set(re.findall(r'extern "C"[^(]*?\b(trellm_\w+)\s*\(', sources))
    assert declared == defined, (declared - defined, defined - declared)


def test_compile_and_link_commands():
    src = build.SOURCE_DIR / "exl3.cu"
    cmd = build.compile_command("/opt/nvcc", src, Path("/tmp/x.o"), ["sm_80", "sm_90"])
    assert cmd[0] == "/opt/nvcc"
    assert "-gencode=arch=compute_80,code=sm_80" in cmd and "-gencode=arch=compute_90,code=sm_90" in cmd
    assert cmd[-4:] == ["-c", str(src), "-o", "/tmp/x.o"]
    assert "-Xcompiler" in cmd and "-fPIC" in cmd and "-O3" in cmd
    link = build.link_command("/opt/nvcc", [Path("/tmp/a.o"), Path("/tmp/b.o")], Path("/tmp/lib.so"), ["sm_90"])
    assert link[:2] == ["/opt/nvcc", "-shared"] and link[-2:] == ["-o", "/tmp/lib.so"]


def test_normalize_arch():
    assert build.normalize_arch("sm_90") == "sm_90"
    assert build.normalize_arch("9.0") == "sm_90"
    assert build.normalize_arch("86") == "sm_86"
    with pytest.raises(ValueError, match="bad CUDA arch"):
        build.normalize_arch("hopper")


def test_cache_key_depends_on_arch_and_toolkit(monkeypatch, tmp_path):
    monkeypatch.setenv("TRELLM_CACHE", str(tmp_path))
    assert build.cache_dir() == tmp_path / "kernels"
    a = build.build_key(["sm_80"], "cuda 13.0")
    assert a == build.build_key(["sm_80"], "cuda 13.0")
    assert a != build.build_key(["sm_90"], "cuda 13.0")
    assert a != build.build_key(["sm_80"], "cuda 12.4")


def test_nvcc_flags_knob_reaches_the_command_and_the_cache_key(monkeypatch, tmp_path):
    # TRELLM_NVCC_FLAGS builds (and caches apart) a library with other compile-time settings
    monkeypatch.delenv("TRELLM_NVCC_FLAGS", raising=False)
    plain = build.build_key(["sm_90"], "cuda 13.0")
    monkeypatch.setenv("TRELLM_NVCC_FLAGS", "-DTRELLM_MID_CHUNK_TILES=16 -DTRELLM_GEMV_RING_KB=4")
    assert build.extra_flags() == ["-DTRELLM_MID_CHUNK_TILES=16", "-DTRELLM_GEMV_RING_KB=4"]
    cmd = build.compile_command("nvcc", tmp_path / "a.cu", tmp_path / "a.o", ["sm_90"])
    assert "-DTRELLM_MID_CHUNK_TILES=16" in cmd and "-DTRELLM_GEMV_RING_KB=4" in cmd
    assert build.build_key(["sm_90"], "cuda 13.0") != plain


def test_ops_reference_knob_forces_the_references(monkeypatch):
    # TRELLM_OPS=reference: every op answers with its torch reference, whatever a backend registered
    from trellm.ops import Op

    fake = Op("knob_probe", lambda x: "reference")
    fake.register("cuda")(lambda x: "cuda")
    monkeypatch.delenv("TRELLM_OPS", raising=False)
    monkeypatch.setattr("trellm.ops._backends_loaded", True)
    assert fake.implementation("cuda")(0) == "cuda"
    monkeypatch.setenv("TRELLM_OPS", "reference")
    assert fake.implementation("cuda")(0) == "reference"


def test_cli_parses_archs():
    from trellm.kernels_cuda import cli

    parser = argparse.ArgumentParser()
    cli.add_cli(parser.add_subparsers())
    args = parser.parse_args(["build-kernels", "--arch", "sm_80", "--arch", "sm_90"])
    assert args.archs == ["sm_80", "sm_90"] and args.func is cli.run


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_build_sm90(monkeypatch, tmp_path):
    monkeypatch.setenv("TRELLM_CACHE", str(tmp_path))
    lib = build.build(archs=["sm_90"])
    assert lib.exists() and lib.stat().st_size > 0
    assert build.build(archs=["sm_90"]) == lib  # cached
    cffi = pytest.importorskip("cffi")
    from trellm.kernels_cuda import binding

    ffi = cffi.FFI()
    ffi.cdef(binding.abi_declarations())
    handle = ffi.dlopen(str(lib))  # loads without a GPU: only libcudart's static copy is linked
    assert handle.trellm_abi_version() == 1
    assert ffi.string(handle.trellm_error_string(-2)) == b"unsupported or inconsistent shape"


def test_sass_and_ptx_compatibility():
    assert build.runs_on("sm_86", ["sm_80"], None) and build.runs_on("sm_89", ["sm_80", "sm_90"], None)
    assert not build.runs_on("sm_80", ["sm_86"], None)  # SASS never runs on an older minor
    assert not build.runs_on("sm_100", ["sm_80", "sm_90"], None)  # nor on another major
    assert build.runs_on("sm_120", ["sm_80", "sm_90"], "sm_90")  # PTX: the driver compiles it for newer GPUs
    assert not build.runs_on("sm_75", ["sm_80"], "sm_80")
    assert build.gencode_flags(["sm_80", "sm_90"], ptx="sm_90")[-1] == "-gencode=arch=compute_90,code=compute_90"
    link = build.link_command("/opt/nvcc", [Path("/tmp/a.o")], Path("/tmp/lib.so"), ["sm_90"])
    assert link[link.index("-cudart") + 1] == "static"  # needs only the driver, no CUDA runtime library


def _manifest(folder: Path, **fields) -> None:
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / build.PREBUILT_LIBRARY).write_bytes(b"\x7fELF")
    entry = {"library": build.PREBUILT_LIBRARY, "archs": ["sm_80", "sm_90"], "ptx": "sm_90", "sources": build.source_key()}
    (folder / build.MANIFEST).write_text(json.dumps({**entry, **fields}))


def test_prebuilt_library_is_used_only_when_it_fits(tmp_path, monkeypatch):
    monkeypatch.delenv("TRELLM_NVCC_FLAGS", raising=False)
    fits = tmp_path / "fits"
    _manifest(fits)
    assert build.prebuilt_library("sm_89", fits) == fits / build.PREBUILT_LIBRARY
    assert build.prebuilt_library("sm_120", fits) == fits / build.PREBUILT_LIBRARY  # through the PTX
    assert build.prebuilt_library("sm_75", fits) is None
    stale = tmp_path / "stale"
    _manifest(stale, sources="0" * 16)  # built from other sources: a developer edited a .cu since
    assert build.prebuilt_library("sm_90", stale) is None
    assert build.prebuilt_library("sm_90", tmp_path / "none") is None
    monkeypatch.setenv("TRELLM_NVCC_FLAGS", "-DTRELLM_GEMV_RING_KB=12")  # a tuning experiment builds its own
    assert build.prebuilt_library("sm_90", fits) is None


def test_old_gpu_is_refused_before_building(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Tesla T4")
    with pytest.raises(build.KernelBuildError, match=r"need compute capability 8.0 or newer .*Tesla T4 is 7.5"):
        build.library()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_failed_build_is_one_line_with_the_log_in_a_file(tmp_path):
    broken = tmp_path / "broken.cu"
    broken.write_text("__global__ void k() { this is not C++; }\n")
    cmd = build.compile_command(build.find_nvcc(), broken, tmp_path / "broken.o", ["sm_80"])
    log = tmp_path / "build.log"
    with pytest.raises(build.KernelBuildError) as e:
        build._run(cmd, log)
    message = str(e.value)
    assert "\n" not in message and message.startswith("nvcc failed on broken.cu") and str(log) in message
    assert "broken.cu" in log.read_text() and "error" in log.read_text()
