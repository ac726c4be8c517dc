"""What a plugin registers: specs that turn an HF config into a model."""
from __future__ import annotations

from typing import Any, Callable

import attrs


@attrs.frozen
class ArchitectureSpec:
    """One model family.

    ``architectures``: the HF ``config.json`` ``architectures[0]`` names served.
    ``read_config``: raw HF config dict -> typed config (raise ``ConfigError`` for unsupported values).
    ``build``: typed config -> an unloaded :class:`trellm.modules.CausalLM`.
    """

    name: str
    architectures: tuple[str, ...]
    read_config: Callable[[dict[str, Any]], Any]
    build: Callable[[Any], Any]
    description: str = ""


@attrs.frozen
class VisionTowerSpec:
    """One vision encoder family (image preprocessing + tower), combined with a language family.

    ``model_types``: the ``vision_config.model_type`` values served. ``build(vision_config, key)``:
    the raw vision config dict and the tower's tensor prefix -> an unloaded tower Module.
    ``processor(preprocessor_config, vision_config)``: a callable turning a PIL image into pixels
    (None: the architecture brings its own).
    """

    name: str
    model_types: tuple[str, ...]
    build: Callable[..., Any]
    description: str = ""
    processor: Callable[..., Any] | None = None
