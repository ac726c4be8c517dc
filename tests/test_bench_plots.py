"""The benchmark plots draw from their rows on any machine (the GPU only produces the numbers)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_exl3_routes_plot_redraws_from_a_saved_csv(tmp_path):
    # --routes --csv writes one row per (shape, K, M) with a column per route that can take M; --replot draws
    # the time of each route vs rows from that file alone.
    pytest.importorskip("matplotlib")
    bench = _load("bench_exl3_matmul")
    rows = []
    for k, n in ((4096, 4096), (4096, 14336)):
        for K in (2, 4):
            for m in (1, 16, 32, 64):
                row = dict(k=k, n=n, K=K, M=m, bf16_us=14.0, cublas_us=30.0 + m / 8)
                if m <= 16:
                    row["gemv_us"] = 10.0 + m
                row["mid_us"] = 13.0 + m / 4
                rows.append(row)
    saved = tmp_path / "routes.csv"
    bench.write_rows(saved, rows)
    back = bench.read_rows(saved)
    assert back[0]["M"] == 1 and back[0]["gemv_us"] == 11.0 and "gemv_us" not in back[2]  # numbers, gaps dropped
    out = tmp_path / "routes.png"
    assert bench.plot_routes(back, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exl3_matmul_plot_has_a_panel_per_shape_and_a_line_per_bitrate(tmp_path):
    pytest.importorskip("matplotlib")
    bench = _load("bench_exl3_matmul")
    rows = [
        dict(k=k, n=n, K=K, M=m, speedup=1.5 / m ** 0.3 * K / 4, pct=40.0 / m ** 0.2)
        for k, n in ((4096, 4096), (4096, 14336)) for K in (2, 4) for m in (1, 4, 16, 64)
    ]
    out = tmp_path / "mm.png"
    assert bench.plot_rows(rows, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w = matplotlib.image.imread(out).shape[:2]
    assert w > h  # two shapes side by side, two rows of panels


def test_step_sweep_plot_from_printed_lines_and_csv(tmp_path):
    # bench_step.py prints one line per run; --replot turns logs of such lines (or a saved --csv) into tokens/s
    # vs batch, a line per label; lines that are not results are skipped.
    pytest.importorskip("matplotlib")
    bench = _load("bench_step")
    log = tmp_path / "steps.log"
    log.write_text(
        "/root/.cache/trellm/kernels/libtrellm_kernels-sm_90.so\n"
        "stream step K=4 batch 16: 4.843 ms = 3304 tokens/s\n"
        "nostream step K=4 batch 16: 4.994 ms = 3204 tokens/s\n"
        "stream step K=4 batch 32: 5.939 ms = 5388 tokens/s\n"
        "stream step K=4 batch 32: 5.941 ms = 5386 tokens/s\n"
        " step K=2 batch 1: 3.050 ms = 328 tokens/s\n"
    )
    rows = bench.read_rows(log)
    assert [(r["label"], r["batch"]) for r in rows] == [
        ("stream", 16), ("nostream", 16), ("stream", 32), ("stream", 32), ("K=2", 1)]
    assert rows[0]["ms"] == 4.843 and rows[0]["tokens_s"] == 3304 and rows[0]["K"] == 4
    saved = tmp_path / "steps.csv"
    bench.write_rows(saved, rows)
    assert bench.read_rows(saved) == rows
    out = tmp_path / "steps.png"
    assert bench.plot_batches(rows, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
