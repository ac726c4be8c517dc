"""The docs stay true: the supported-models table matches the registry, and relative links lead to files."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_models_table_matches_the_registry():
    spec = importlib.util.spec_from_file_location("docs_models", ROOT / "docs" / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "models.md").read_text() == module.render(), (
        "docs/models.md is out of date with the plugin registry: run `python docs/models.py` and commit it")


def test_relative_links_lead_to_files():
    broken = []
    for doc in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", doc.read_text()):
            if not re.match(r"[a-z]+://|mailto:", target) and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken
