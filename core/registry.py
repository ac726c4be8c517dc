"""The plugin registry: one pluggy PluginManager, loaded lazily and once.

Plugins are found through the ``trellm`` entry-point group (built-in families use the same path as
pip-installed ones). ``TRELLM_PLUGINS=a,b`` loads only the named entry points (empty string: none);
``TRELLM_TRACE_PLUGINS=1`` prints every hook call.
"""
from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import Any, Callable

import attrs
import pluggy

from . import hookspecs
from .errors import UnknownArchitectureError

ENTRY_POINT_GROUP = "trellm"
HOOKS = (
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


def _collect(hook: str) -> list[tuple[str, Any]]:
    """Call ``hook`` plugin by plugin, returning (plugin_name, registered item) pairs."""
    load_plugins()
    out: list[tuple[str, Any]] = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None or not hasattr(plugin, hook):
            continue
        others = [p for n, p in pm.list_name_plugin() if n != name and p is not None]
        caller = pm.subset_hook_caller(hook, remove_plugins=others)

        def register(*item: Any, _name: str = name) -> None:
            out.append((_name, item[0] if len(item) == 1 else item))

        caller(register=register)
    return out


def architectures() -> dict[str, tuple[str, Any]]:
    """HF architecture name -> (plugin name, ArchitectureSpec). Later plugins override earlier ones."""
    table: dict[str, tuple[str, Any]] = {}
    for plugin, spec in _collect("trellm_register_architectures"):
        for arch in spec.architectures:
            table[arch] = (plugin, spec)
    return table


def find_architecture(arch: str, source: str = "config.json") -> Any:
    table = architectures()
    if arch in table:
        return table[arch][1]
    installed = ", ".join(sorted(table)) or "(none)"
    raise UnknownArchitectureError(
        f"{source}: no installed plugin serves architecture {arch!r}. Installed architectures: {installed}. "
        f"Install a plugin that provides it (pip install <plugin>), or write one: see CONTRIBUTING.md."
    )


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
