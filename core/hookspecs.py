"""The plugin hooks. Each takes a ``register`` callback, like simonw/llm's hooks.

A plugin module (or object) implements any of these with ``@trellm.hookimpl``. Registered things
are attributed to the plugin that registered them (see ``trellm plugins``).
"""
from pluggy import HookimplMarker, HookspecMarker

hookspec = HookspecMarker("trellm")
hookimpl = HookimplMarker("trellm")


@hookspec
def trellm_register_architectures(register):
    """Register model families: ``register(spec)`` with a :class:`trellm.spec.ArchitectureSpec`."""


@hookspec
def trellm_register_vision_towers(register):
    """Register vision encoders: ``register(tower)`` with a :class:`trellm.spec.VisionTowerSpec`."""


@hookspec
def trellm_register_quant_formats(register):
    """Register weight formats: ``register(fmt)`` with a :class:`trellm.quant.QuantFormat`."""


@hookspec
def trellm_register_samplers(register):
    """Register sampler steps: ``register(name, factory)``; ``factory(**settings)`` returns a step."""
