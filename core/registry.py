"""The plugin registry: one pluggy PluginManager, loaded lazily and once.

Plugins are found through the ``trellm`` entry-point group (built-in families use the same path as
pip-installed ones). ``TRELLM_PLUGINS=a,b`` loads only the named entry points (empty string: none);
``TRELLM_TRACE_PLUGINS=1`` prints every hook call. When several plugins register one architecture,
a ``trellm_resolve_architecture`` hook chooses; without one, using that architecture is an error
naming the plugins (load order never decides silently).
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata
from typing import Any, Callable

import attrs
import pluggy

from . import hookspecs
from .errors import ArchitectureConflictError, UnknownArchitectureError

ENTRY_POINT_GROUP = "trellm"
REGISTER_HOOKS = (
    "trellm_register_architectures",
    "trellm_register_vision_towers",
    "trellm_register_quant_formats",
    "trellm_register_samplers",
)

pm = pluggy.PluginManager("trellm")
pm.add_hookspecs(hookspecs)
_loaded = False


@attrs.define
class PluginInfo:
    name: str
    version: str | None = None
    registers: dict[str, list[str]] = attrs.field(factory=dict)


_versions: dict[str, str | None] = {}


def load_plugins() -> pluggy.PluginManager:
    """Load core defaults and entry-point plugins exactly once; return the plugin manager."""
    global _loaded
    if _loaded:
        return pm
    _loaded = True
    from . import default_plugins

    if not pm.is_registered(default_plugins):
        pm.register(default_plugins, name="trellm.core")
    allow = os.environ.get("TRELLM_PLUGINS")
    allowed = None if allow is None else {p.strip() for p in allow.split(",") if p.strip()}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        if pm.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
        except Exception as e:  # a broken third-party plugin must not take trellm down
            print(f"trellm: plugin {ep.name!r} failed to load: {e!r}", file=sys.stderr)
            continue
        pm.register(plugin, name=ep.name)
        _versions[ep.name] = ep.dist.version if ep.dist else None
    if os.environ.get("TRELLM_TRACE_PLUGINS"):
        pm.trace.root.setwriter(lambda msg: print(msg, end="", file=sys.stderr))
        pm.enable_tracing()
    return pm


def _callers(hook: str) -> list[tuple[str, Callable[..., Any]]]:
    """(plugin name, a caller of ``hook`` reaching only that plugin) for each plugin implementing it, in load order."""
    load_plugins()
    implementers = {impl.plugin_name for impl in getattr(pm.hook, hook).get_hookimpls()}
    plugins = [(n, p) for n, p in pm.list_name_plugin() if p is not None]
    return [(name, pm.subset_hook_caller(hook, remove_plugins=[p for n, p in plugins if n != name]))
            for name, _ in plugins if name in implementers]


def _collect(hook: str) -> list[tuple[str, Any]]:
    """Call ``hook`` plugin by plugin, returning (plugin_name, registered item) pairs."""
    out: list[tuple[str, Any]] = []
    for name, caller in _callers(hook):

        def register(*item: Any, _name: str = name) -> None:
            out.append((_name, item[0] if len(item) == 1 else item))

        caller(register=register)
    return out


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Let each plugin add its ``trellm`` subcommands; one that fails (a name already taken, an error)
    is reported on stderr and skipped, as a plugin that fails to load is."""
    for name, caller in _callers("trellm_register_commands"):
        try:
            caller(subparsers=subparsers)
        except Exception as e:  # a broken third-party plugin must not take the CLI down
            print(f"trellm: plugin {name!r} could not add its commands: {e}", file=sys.stderr)


@attrs.frozen
class ArchitectureClaim:
    """One plugin's registration of an ArchitectureSpec for one HF architecture name."""

    plugin: str
    spec: Any


def architecture_claims() -> dict[str, list[ArchitectureClaim]]:
    """HF architecture name -> every plugin's claim on it, in load order."""
    table: dict[str, list[ArchitectureClaim]] = {}
    for plugin, spec in _collect("trellm_register_architectures"):
        for arch in spec.architectures:
            table.setdefault(arch, []).append(ArchitectureClaim(plugin, spec))
    return table


def _resolve(arch: str, claims: list[ArchitectureClaim], source: str) -> ArchitectureClaim:
    """The one claim that serves ``arch``: the only one, or the one a resolver hook picks."""
    if len(claims) == 1:
        return claims[0]
    chosen = pm.hook.trellm_resolve_architecture(architecture=arch, claims=list(claims))
    if chosen in claims:
        return chosen
    named = ", ".join(f"{c.plugin!r} (spec {c.spec.name!r})" for c in claims)
    if chosen is not None:
        raise ArchitectureConflictError(
            f"{source}: a trellm_resolve_architecture hook answered {chosen!r} for {arch!r}, which is none of its claims: {named}"
        )
    raise ArchitectureConflictError(
        f"{source}: architecture {arch!r} is served by {len(claims)} plugins: {named}. Keep one (pip uninstall the "
        f"other, or list the plugins to load in TRELLM_PLUGINS), or add a plugin whose trellm_resolve_architecture "
        f"hook chooses."
    )


def architectures() -> dict[str, tuple[str, Any]]:
    """HF architecture name -> (plugin name, ArchitectureSpec) of the plugin serving it.

    Architectures whose claims conflict without a resolution are left out (:func:`find_architecture`
    names the plugins)."""
    table: dict[str, tuple[str, Any]] = {}
    for arch, claims in architecture_claims().items():
        try:
            claim = _resolve(arch, claims, "registry")
        except ArchitectureConflictError:
            continue
        table[arch] = (claim.plugin, claim.spec)
    return table


def resolve_architecture(arch: str, source: str = "config.json") -> ArchitectureClaim:
    """The plugin and spec serving ``arch``; a clear error when none does or several do unresolved."""
    table = architecture_claims()
    if arch in table:
        return _resolve(arch, table[arch], source)
    installed = ", ".join(sorted(table)) or "(none)"
    raise UnknownArchitectureError(
        f"{source}: no installed plugin serves architecture {arch!r}. Installed architectures: {installed}. "
        f"Install a plugin that provides it (pip install <plugin>), or write one: see CONTRIBUTING.md."
    )


def find_architecture(arch: str, source: str = "config.json") -> Any:
    """The ArchitectureSpec serving ``arch`` (see :func:`resolve_architecture`)."""
    return resolve_architecture(arch, source).spec


def quant_formats() -> list[Any]:
    return [fmt for _, fmt in _collect("trellm_register_quant_formats")]


def vision_towers() -> dict[str, Any]:
    table: dict[str, Any] = {}
    for _, spec in _collect("trellm_register_vision_towers"):
        for mt in spec.model_types:
            table[mt] = spec
    return table


def samplers() -> dict[str, Callable[..., Any]]:
    table: dict[str, Callable[..., Any]] = {}
    for _, item in _collect("trellm_register_samplers"):
        name, factory = item
        table[name] = factory
    return table


def plugin_infos() -> list[PluginInfo]:
    """What each loaded plugin is and registers, for ``trellm plugins``."""
    load_plugins()
    infos = {name: PluginInfo(name, _versions.get(name)) for name, p in pm.list_name_plugin() if p is not None}
    labels = {
        "trellm_register_architectures": ("architectures", lambda s: list(s.architectures)),
        "trellm_register_vision_towers": ("vision_towers", lambda s: list(s.model_types)),
        "trellm_register_quant_formats": ("quant_formats", lambda f: [f.name]),
        "trellm_register_samplers": ("samplers", lambda item: [item[0]]),
    }
    for hook, (label, names) in labels.items():
        for plugin, item in _collect(hook):
            infos[plugin].registers.setdefault(label, []).extend(names(item))
    return list(infos.values())
