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
