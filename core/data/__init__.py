"""Built-in calibration text for EXL3 conversion: prose, dialogue, code, numbers and several languages.

Written for trellm (no downloaded corpus). The numeric section is generated deterministically,
so arithmetic, dates, tables and digits are covered without storing a large file.
"""
from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

_FILES = ("prose.txt", "code.txt", "multilingual.txt")


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


@lru_cache(maxsize=1)
def calibration_text() -> str:
    """The built-in calibration mix as one string."""
    here = Path(__file__).parent
    parts = [(here / name).read_text(encoding="utf-8") for name in _FILES]
    parts.append(_numbers())
    return "\n\n".join(parts)
