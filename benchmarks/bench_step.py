"""Time one decode step of bench_decode's model (PDL on unless TRELLM_PDL=0), the graph captured first in
a fresh process: the A/B unit for knobs read at launch (env) or baked into a build (TRELLM_NVCC_FLAGS).

    python benchmarks/bench_step.py BITS [LABEL [BATCH]]
    python benchmarks/bench_step.py --sweep BITS [--batches 1 2 4 ...] [--label L] [--csv F] [--plot P]
    python benchmarks/bench_step.py --replot CSV_OR_LOG... --plot P [--title T]

Knobs compared this way (NOTES): TRELLM_GEMV_EARLY_STAGES, TRELLM_PDL, TRELLM_EXL3_MID (batched steps).
Run variants interleaved (A B A B), each in its own process: one process's clocks and allocator drift.
``--sweep`` runs one fresh process per batch size and draws tokens/s vs batch; ``--replot`` draws the same
from saved CSVs or from logs of single runs (their printed lines), on any machine.
"""
from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# One printed result: "LABEL step K=4 batch 32: 5.939 ms = 5388 tokens/s".
LINE = re.compile(r"^(?P<label>.*?)\s*step K=(?P<K>\d+) batch (?P<batch>\d+): (?P<ms>[\d.]+) ms = (?P<tps>\d+) tokens/s")


def time_step(bits: int, label: str, batch: int) -> str:
    """Capture and time one step of the 8B-shaped model; the printed line."""
    import torch
    from bench_decode import Model
    from common import time_graph

    from trellm.kernels_cuda import ops as _cuda_ops  # noqa: F401  (registers the CUDA implementations)

    model = Model(32, bits, 6, 513)
    # A batched step: `batch` sequences of 512 cached tokens each, reading the same KV pages (random data, so
    # the attention reads are real; their KV writes land on one slot, which does not change the timing).
    model.block_table = model.block_table.expand(batch, -1).contiguous()
    tok = torch.full((batch,), 123, device="cuda")
    pos = torch.full((batch,), 512, device="cuda")
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    ctx = torch.full((batch,), 513, device="cuda", dtype=torch.int32)
    t = time_graph(lambda: model.forward(tok, pos, cu, ctx, all_logits=batch > 1), reps=20)
    return f"{label} step K={bits} batch {batch}: {t * 1e3:.3f} ms = {batch / t:.0f} tokens/s"


def parse_lines(text: str) -> list[dict]:
    """The results printed in ``text`` (a log of single runs or of a sweep) as rows: label, K, batch, ms, tokens_s."""
    rows = []
    for line in text.splitlines():
        m = LINE.match(line.strip())
        if m:
            rows.append(dict(label=m["label"] or f"K={m['K']}", K=int(m["K"]), batch=int(m["batch"]),
                             ms=float(m["ms"]), tokens_s=int(m["tps"])))
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["label", "K", "batch", "ms", "tokens_s"])
        w.writeheader()
        w.writerows(rows)


def read_rows(path: Path) -> list[dict]:
    """Rows from a --csv file, or from a log of printed lines (any other text file)."""
    text = path.read_text()
    if not text.startswith("label,"):
        return parse_lines(text)
    return [dict(label=r["label"], K=int(r["K"]), batch=int(r["batch"]), ms=float(r["ms"]),
                 tokens_s=int(r["tokens_s"])) for r in csv.DictReader(text.splitlines())]


def plot_batches(rows: list[dict], path: Path, title: str = "") -> bool:
    """Tokens/s and step time vs batch size, a line per label (several runs of one point: their mean).
    Returns False (and says so) without matplotlib."""
    from common import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return False
    fig, (ax_tps, ax_ms) = plt.subplots(1, 2, figsize=(9, 3.8))
    for label in dict.fromkeys(r["label"] for r in rows):
        points: dict[int, list[dict]] = {}
        for r in rows:
            if r["label"] == label:
                points.setdefault(r["batch"], []).append(r)
        batches = sorted(points)
        tps = [sum(r["tokens_s"] for r in points[b]) / len(points[b]) for b in batches]
        ms = [sum(r["ms"] for r in points[b]) / len(points[b]) for b in batches]
        ax_tps.plot(batches, tps, marker="o", label=label)
        ax_ms.plot(batches, ms, marker="o", label=label)
    for ax, name in ((ax_tps, "tokens/s"), (ax_ms, "ms per step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences in the step (batch)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    ax_tps.legend(fontsize=8)
    return save_figure(plt, fig, path, title)


def sweep(bits: int, batches: list[int], label: str) -> list[dict]:
    """One fresh process per batch size (as the A/B runs): the rows, each printed as it comes."""
    rows = []
    for batch in batches:
        out = subprocess.run([sys.executable, __file__, str(bits), label, str(batch)], capture_output=True, text=True)
        found = parse_lines(out.stdout)
        if out.returncode != 0 or not found:
            raise SystemExit(f"batch {batch}: the step run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        print(out.stdout.strip().splitlines()[-1], flush=True)
        rows += found
    return rows


def main(argv: list[str]) -> None:
    if argv and not argv[0].startswith("-"):  # the single run: BITS [LABEL [BATCH]]
        bits, label = int(argv[0]), argv[1] if len(argv) > 1 else ""
        print(time_step(bits, label, int(argv[2]) if len(argv) > 2 else 1), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", type=int, metavar="BITS", help="time BITS per weight at each of --batches")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--label", default="", help="the sweep's label (default: K=BITS)")
    ap.add_argument("--replot", type=Path, nargs="+", metavar="FILE", help="saved --csv files or logs of printed lines")
    ap.add_argument("--csv", type=Path)
    ap.add_argument("--plot", type=Path, help="tokens/s and ms vs batch, saved here (needs matplotlib)")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    if args.sweep is None and not args.replot:
        ap.error("give BITS [LABEL [BATCH]], --sweep BITS or --replot FILE...")
    rows = [r for f in args.replot for r in read_rows(f)] if args.replot else sweep(
        args.sweep, args.batches, args.label or f"K={args.sweep}")
    if not rows:
        raise SystemExit("no step results found")
    if args.csv:
        write_rows(args.csv, rows)
    if args.plot:
        plot_batches(rows, args.plot, args.title)


if __name__ == "__main__":
    main(sys.argv[1:])
