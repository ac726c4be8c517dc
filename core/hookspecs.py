"""The plugin hooks. The ``trellm_register_*`` hooks take a ``register`` callback, like simonw/llm's
hooks; ``trellm_resolve_architecture`` answers "who serves X" when plugins disagree (pytest's
``firstresult`` style).

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


@hookspec
def trellm_register_commands(subparsers):
    """Add ``trellm`` subcommands: ``p = subparsers.add_parser(name, help=...)`` (an argparse
    sub-parser action), its arguments, then ``p.set_defaults(func=handler)`` with ``handler(args) -> int``."""


@hookspec(firstresult=True)
def trellm_resolve_architecture(architecture, claims):
    """Choose which plugin serves ``architecture`` when several register it.

    ``claims`` lists :class:`trellm.registry.ArchitectureClaim` (``plugin``, ``spec``) in load order.
    Return the claim to use, or None to leave the choice to another plugin; the first answer wins.
    With no answer, loading that architecture fails with an error naming every claiming plugin.
    """
