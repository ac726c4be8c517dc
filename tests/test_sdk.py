"""trellm.sdk is the whole plugin surface: plugins, the template and the example import nothing else."""
from __future__ import annotations

import ast
from pathlib import Path

import trellm.sdk

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SOURCES = (ROOT / "plugins", ROOT / "sdk" / "template", ROOT / "examples" / "trellm-example-plugin")
ALLOWED = ("trellm", "trellm.sdk")


def _trellm_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a trellm module in ``path``; ``from trellm import x`` counts as trellm.x."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, "." * node.level + (node.module or "")))
            elif node.module == "trellm":
                found += [(node.lineno, f"trellm.{a.name}") for a in node.names if not hasattr(trellm, a.name)]
            elif node.module and node.module.split(".")[0] == "trellm":
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "trellm"]
    return found


def _allowed(module: str) -> bool:
    return module in ALLOWED or module.startswith("trellm.sdk.")


def test_plugins_import_only_the_sdk():
    files = [f for src in PLUGIN_SOURCES for f in sorted(src.rglob("*.py"))]
    assert len(files) > 50
    bad = [f"{f.relative_to(ROOT)}:{line}: {mod}" for f in files for line, mod in _trellm_imports(f) if not _allowed(mod)]
    assert not bad, "plugins must import from trellm.sdk (or trellm) only:\n" + "\n".join(bad)


def test_every_sdk_name_resolves():
    missing = [name for name in trellm.sdk.__all__ if not hasattr(trellm.sdk, name)]
    assert not missing and len(set(trellm.sdk.__all__)) == len(trellm.sdk.__all__)


def test_every_plugin_folder_has_an_entry_point():
    """A built-in plugin is found only through [project.entry-points.trellm], like a pip-installed one."""
    import tomllib

    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["trellm"]
    folders = {f"trellm.plugins.{kind}.{d.name}" for kind in ("architectures", "vision")
               for d in (ROOT / "plugins" / kind).iterdir() if (d / "__init__.py").is_file()}
    assert len(folders) > 40
    assert folders - set(entry_points.values()) == set()
    assert set(entry_points.values()) - folders == set()
