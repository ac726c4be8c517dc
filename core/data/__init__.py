"""Built-in calibration mix for EXL3 conversion: prose (stories, news, letters, recipes, instructions),
encyclopedic articles, code in many languages, Python, text in 34 languages and a dozen scripts, technical
and legal text with LaTeX math, numbers, chat.

The files here are written for trellm (no downloaded corpus); ``eval.txt`` is the held-out evaluation text
and no part of the mix. Two sources come from the running Python instead of files, for volume: the source
code of a fixed list of standard-library modules and the language reference topics of ``pydoc_data``
(technical English). The numeric section is generated deterministically. Chat dialogues are rendered with
the model's own chat template by the converter, so its special tokens and turn markers are calibrated too.
"""
from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_HERE = Path(__file__).parent
# Standard-library modules read as code (pure Python in every CPython 3.9+).
STDLIB_CODE_MODULES = (
    "argparse", "bisect", "calendar", "configparser", "csv", "dataclasses", "difflib", "fractions", "functools",
    "heapq", "json.decoder", "json.encoder", "pathlib", "shlex", "statistics", "string", "textwrap", "tokenize",
    "uuid", "zipfile",
)


@dataclass(frozen=True)
class CalibrationSource:
    """One part of the mix: its text and its share of the calibration rows."""

    name: str
    text: str
    share: float
    chat: bool = False  # dialogues ("user: ..." / "assistant: ..." lines, blank line between dialogues)


def _numbers(lines: int = 400, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    months = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"]
    for i in range(lines):
        a, b = rng.randint(0, 9999), rng.randint(1, 999)
        kind = i % 6
        if kind == 0:
            out.append(f"{a} + {b} = {a + b}; {a} - {b} = {a - b}; {a} * {b} = {a * b}")
        elif kind == 1:
            out.append(f"{a} / {b} = {a / b:.4f}, remainder {a % b}")
        elif kind == 2:
            out.append(f"{rng.randint(1, 28)} {months[rng.randrange(12)]} {rng.randint(1900, 2030)}, {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}")
        elif kind == 3:
            row = [f"{rng.uniform(-100, 100):.2f}" for _ in range(6)]
            out.append("| " + " | ".join(row) + " |")
        elif kind == 4:
            out.append(f"0x{rng.getrandbits(32):08x} {rng.getrandbits(16):016b} {rng.random():.6e}")
        else:
            out.append(f"item {i}: quantity {b}, unit price ${rng.uniform(0.5, 500):.2f}, total ${b * rng.uniform(0.5, 500):,.2f}")
    return "\n".join(out)


def _read(name: str) -> str:
    return (_HERE / name).read_text(encoding="utf-8")


def stdlib_code() -> str:
    """Source of STDLIB_CODE_MODULES (those this Python has as .py files), concatenated."""
    parts = []
    for module in STDLIB_CODE_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            parts.append(Path(spec.origin).read_text(encoding="utf-8"))
    return "\n\n".join(parts)


def reference_topics() -> str:
    """The Python language reference topics shipped with pydoc (technical English), in key order, each
    paragraph once (several topics quote the same sections)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return ""
    paragraphs = (p for k in sorted(topics) for p in topics[k].split("\n\n"))
    return "\n\n".join(dict.fromkeys(p for p in paragraphs if p.strip()))


@lru_cache(maxsize=1)
def calibration_sources() -> tuple[CalibrationSource, ...]:
    """The built-in mix. Shares sum to 0.9: the converter fills the rest with uniform random tokens.

    Each file source holds enough text for its share of the default 64 rows of 512 SmolLM2 tokens without a
    repeat (``tests/test_calibration.py``); the large generated ones (Python's own code and reference) are
    separate sources, so that the written files are not diluted by them."""
    return (
        CalibrationSource("prose", "\n\n".join(_read(f) for f in ("prose.txt", "fiction.txt", "everyday.txt")), 0.20),
        CalibrationSource("encyclopedic", _read("encyclopedic.txt"), 0.16),
        CalibrationSource("code", _read("code.txt"), 0.10),
        CalibrationSource("python", stdlib_code(), 0.07),
        CalibrationSource("multilingual", _read("multilingual.txt"), 0.12),
        CalibrationSource("technical", _read("technical.txt"), 0.05),
        CalibrationSource("reference", reference_topics(), 0.04),
        CalibrationSource("numbers", _numbers(), 0.03),
        CalibrationSource("chat", _read("chat.txt"), 0.13, chat=True),
    )


def chat_dialogues(text: str) -> list[list[dict]]:
    """Dialogues of a chat source as message lists (role from each line's "user:" / "assistant:" prefix;
    other lines continue the previous message)."""
    dialogues = []
    for block in ("\n" + text.strip()).split("\n\nuser: "):
        block = "user: " + block.lstrip("\n").removeprefix("user: ")
        messages: list[dict] = []
        for line in block.split("\n"):
            role, sep, content = line.partition(": ")
            if sep and role in ("user", "assistant"):
                messages.append({"role": role, "content": content})
            elif messages:
                messages[-1]["content"] += "\n" + line
        if messages:
            dialogues.append(messages)
    return dialogues
