"""The built wheel, installed into a fresh virtualenv with no nvcc reachable, finds its prebuilt kernels.

Runs when ``TRELLM_WHEEL`` names a wheel made after ``trellm build-kernels --arch ... --into
kernels_cuda/prebuilt`` (``.ci/run`` does this where nvcc exists); skipped otherwise. The venv sees the
system site-packages (torch, cffi) but imports trellm from the wheel. On a GPU machine it also runs a
kernel from the packaged library and checks that nothing was compiled.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WHEEL = os.environ.get("TRELLM_WHEEL")
pytestmark = pytest.mark.skipif(not WHEEL, reason="set TRELLM_WHEEL to a wheel with prebuilt kernels")

CHECK = r"""
import json, os, sys
from pathlib import Path
import trellm
from trellm.kernels_cuda import build

venv = Path(sys.prefix)
assert venv in Path(trellm.__file__).parents, f"trellm came from {trellm.__file__}, not the wheel in {venv}"
manifest = json.loads((build.PREBUILT_DIR / build.MANIFEST).read_text())
assert manifest["sources"] == build.source_key(), "the wheel's library was built from other sources"
for arch in manifest["archs"]:
    assert build.prebuilt_library(arch) == build.PREBUILT_DIR / build.PREBUILT_LIBRARY, arch
from trellm.kernels_cuda import binding
handle = binding.ffi().dlopen(str(build.PREBUILT_DIR / build.PREBUILT_LIBRARY))
assert handle.trellm_abi_version() == 1
import torch
if torch.cuda.is_available():
    binding.lib()
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, device="cuda", dtype=torch.float16)
    from trellm import ops
    ops.load_backends()
    got = ops.rms_norm(x, w, 1e-6)
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).half()
    assert torch.allclose(got.float(), want.float(), atol=1e-2), (got - want).abs().max()
    assert not any(Path(os.environ["TRELLM_CACHE"]).rglob("*.so")), "a kernel library was compiled"
    print("kernels ran on", torch.cuda.get_device_name())
print("ok", manifest["archs"], "ptx", manifest["ptx"])
"""


def test_wheel_in_a_fresh_venv_without_nvcc(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", WHEEL],
                   check=True)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not (Path(d) / "nvcc").exists())
    env = {k: v for k, v in os.environ.items() if k not in ("NVCC", "CUDA_HOME", "CUDA_PATH", "PYTHONPATH")}
    env.update(PATH=path, TRELLM_CACHE=str(tmp_path / "cache"))
    got = subprocess.run([str(py), "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.strip().splitlines()[-1].startswith("ok")
    print(got.stdout)
