"""Layering rules of the projection seam, checked on the source text: model modules state the math and never
name a quantization format (the format's Weights and trellm.ops.project decide how a projection runs), and no
kernel file reaches up into the model modules."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUANT_FORMATS = re.compile(r"exl3|gguf|fp8|mxfp4|awq|gptq", re.IGNORECASE)
MODULES_IMPORT = re.compile(r"^\s*(from|import)\s+(trellm\.modules\b|\.\.+core\.modules\b)", re.MULTILINE)


def _python_files(folder: str) -> list[Path]:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}"
    return files


def test_model_modules_name_no_quant_format():
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in _python_files("core/modules")
            for n, line in enumerate(path.read_text().splitlines(), 1) if QUANT_FORMATS.search(line)]
    assert not hits, "core/modules names a quantization format:\n" + "\n".join(hits)


def test_kernels_do_not_import_model_modules():
    hits = [str(path.relative_to(ROOT)) for path in _python_files("kernels_cuda") if MODULES_IMPORT.search(path.read_text())]
    assert not hits, "kernels_cuda imports trellm.modules: " + ", ".join(hits)
