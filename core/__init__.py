"""trellm: fast local LLM inference with EXL3 trellis quantization and pluggable model families."""
from __future__ import annotations

from .hookspecs import hookimpl
from .spec import ArchitectureSpec, VisionTowerSpec

__version__ = "0.1.0"

__all__ = ["load", "hookimpl", "ArchitectureSpec", "VisionTowerSpec", "__version__"]


def load(path, device=None, dtype=None, **kwargs):
    """Load an HF model directory (dense or EXL3). See :func:`trellm.model.load`."""
    from .model import load as _load

    return _load(path, device=device, dtype=dtype, **kwargs)
