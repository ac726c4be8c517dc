"""Time one decode step of bench_decode's model (EXL3 codebook mcg unless --codebook), the graph captured first in
a fresh process: the A/B unit for knobs read at launch (env) or baked into a build (TRELLM_NVCC_FLAGS).

    python benchmarks/bench_step.py BITS [LABEL [BATCH]] [--codebook mcg|mul1|3inst] [--tree DIR]
    python benchmarks/bench_step.py --sweep BITS [--batches 1 2 4 ...] [--label L] [--csv F] [--plot P] [--codebook C]
                                    [--tree DIR]
    python benchmarks/bench_step.py --replot CSV_OR_LOG... --plot P [--title T]

Settings compared this way (NOTES): the GEMV's early ring columns, PDL, the mid-size route (batched steps).
Run variants interleaved (A B A B), each in its own process: one process's clocks and allocator drift.
``--tree DIR`` imports trellm from another checkout (same layout), e.g. the code before a change, so that
one script times both in one session.
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


TREE_PACKAGES = {"trellm": "core", "trellm.kernels_cuda": "kernels_cuda", "trellm.plugins": "plugins",
                 "trellm.sdk": "sdk", "trellm.server": "server"}


def use_tree(root: Path) -> None:
    """Import trellm from another checkout (its folders mapped as setup.py maps them): the same script then
    times that tree's ops and kernels, e.g. the code before a change, in the same session."""
    import importlib.util

    class TreeFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            folder = TREE_PACKAGES.get(name)
            if folder is None:
                return None
            d = root / folder
            return importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])

    if not (root / "core" / "__init__.py").exists():
        raise SystemExit(f"--tree {root}: not a trellm checkout (no core/__init__.py)")
    sys.meta_path.insert(0, TreeFinder)


def time_step(bits: int, label: str, batch: int, codebook: str = "mcg") -> str:
    """Capture and time one step of the 8B-shaped model; the printed line."""
    import torch
    from bench_decode import Model
    from common import time_graph

    from trellm.kernels_cuda import ops as _cuda_ops  # noqa: F401  (registers the CUDA implementations)

    model = Model(32, bits, 6, 513, codebook)
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


def sweep(bits: int, batches: list[int], label: str, codebook: str = "mcg", tree: Path | None = None) -> list[dict]:
    """One fresh process per batch size (as the A/B runs): the rows, each printed as it comes."""
    rows = []
    for batch in batches:
        tree_args = ["--tree", str(tree)] if tree is not None else []
        out = subprocess.run([sys.executable, __file__, str(bits), label, str(batch), "--codebook", codebook, *tree_args],
                             capture_output=True, text=True)
        found = parse_lines(out.stdout)
        if out.returncode != 0 or not found:
            raise SystemExit(f"batch {batch}: the step run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        print(out.stdout.strip().splitlines()[-1], flush=True)
        rows += found
    return rows


def _take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of ``name VALUE`` in argv (options both forms take) and argv without them."""
    if name not in argv:
        return None, argv
    i = argv.index(name)
    if i + 1 >= len(argv):
        raise SystemExit(f"{name} needs a value")
    return argv[i + 1], argv[:i] + argv[i + 2:]


def main(argv: list[str]) -> None:
    codebook, argv = _take_option(argv, "--codebook")  # the trellis codebook of every layer
    codebook = codebook or "mcg"
    if codebook not in ("mcg", "mul1", "3inst"):
        raise SystemExit(f"--codebook {codebook!r}: mcg, mul1 or 3inst")
    tree, argv = _take_option(argv, "--tree")  # another checkout's trellm (the code before a change)
    tree = Path(tree).resolve() if tree else None
    if tree is not None:
        use_tree(tree)
    if argv and not argv[0].startswith("-"):  # the single run: BITS [LABEL [BATCH]]
        bits, label = int(argv[0]), argv[1] if len(argv) > 1 else ""
        print(time_step(bits, label, int(argv[2]) if len(argv) > 2 else 1, codebook), flush=True)
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
        args.sweep, args.batches, args.label or f"K={args.sweep}", codebook, tree)
    if not rows:
        raise SystemExit("no step results found")
    if args.csv:
        write_rows(args.csv, rows)
    if args.plot:
        plot_batches(rows, args.plot, args.title)


if __name__ == "__main__":
    main(sys.argv[1:])
