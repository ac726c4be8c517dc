"""Hooks that core itself implements (registered before any entry-point plugin)."""
from __future__ import annotations

from .hookspecs import hookimpl


@hookimpl
def trellm_register_quant_formats(register):
    try:
        from .quant.exl3 import EXL3Format
    except ImportError:  # the format module is optional while it is being built
        return
    register(EXL3Format())


@hookimpl
def trellm_register_samplers(register):
    from .samplers import BUILTIN_STEPS

    for name, factory in BUILTIN_STEPS.items():
        register(name, factory)
