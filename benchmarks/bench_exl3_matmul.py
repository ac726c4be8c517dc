"""EXL3 matmul at Llama-3.1-8B shapes against the memory-bandwidth limit and against bf16 F.linear.

For each (k -> n, K, M): the whole op (input Hadamard*suh, matmul, output Hadamard*svh) timed by CUDA
graph replay over enough weight copies to miss the L2; effective GB/s = weight bytes / time; the
limit is weight bytes / the copy bandwidth measured in the same run; bf16 is torch F.linear on
weights of the same shape (also rotated past the L2). ``path``: "fused" is the one-launch small-batch
kernel (M <= 16), "mid" decodes the trellis in registers against tensor-core fragments of x (17..64),
"cublas" decodes W_hat to fp16 and multiplies with cuBLAS. ``--routes`` also times every route that can
take each M (gemv_us, mid_us, cublas_us): the A/B of the three in one process. With the MUL1 codebook (the
default: what both converters write) it also times the GEMV's split-halves MUL1 route (gemv_split_us,
TRELLM_MUL1_GEMV=split) beside MUL1 as the environment routes it (gemv_us: the fp16-fma route unless
TRELLM_MUL1_GEMV is set), and the same trellis bits read as MCG
(gemv_mcg_us), the speed the split route is meant to reach; up to 8 rows the mid-size route's split decode too
(mid_split_us).

    python benchmarks/bench_exl3_matmul.py [--quick] [--csv out.csv] [--plot out.png]

``--plot`` (needs matplotlib) draws, per shape, the speed-up over bf16 and the % of copy bandwidth
against the number of rows, one line per K.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copies_for, copy_bandwidth, l2_bytes, pyplot, save_figure, time_graph  # noqa: E402

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)]
KS = [2, 3, 4, 5, 6, 8]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def parse_shape(text: str) -> tuple[int, int]:
    """"4096x14336" -> (4096, 14336): k (in features) by n (out features), both multiples of 128."""
    try:
        k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected KxN, e.g. 4096x14336") from None
    if k <= 0 or n <= 0 or k % 128 or n % 128:
        raise argparse.ArgumentTypeError(f"shape {text!r}: k and n must be positive multiples of 128")
    return k, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="K=4 and 2 only, M in 1,4,8,16,32,256")
    ap.add_argument("--codebook", default="mul1", choices=["3inst", "mcg", "mul1"])
    ap.add_argument("--ks", type=int, nargs="*")
    ap.add_argument("--ms", type=int, nargs="*")
    ap.add_argument("--shapes", nargs="*", metavar="KxN", type=parse_shape,
                    help="only these shapes, e.g. 4096x14336 (default: the five Llama-3.1-8B shapes)")
    ap.add_argument("--routes", action="store_true", help="also time each route (GEMV, mid, decode + cuBLAS) that can take M")
    ap.add_argument("--csv", type=Path)
    ap.add_argument("--plot", type=Path, help="save speed-up and %% of copy bandwidth vs rows here (needs matplotlib); "
                    "with --routes, each route's time vs rows")
    ap.add_argument("--replot", type=Path, metavar="CSV", help="draw --plot from a saved --csv (no GPU needed)")
    ap.add_argument("--title", default=None, help="the plot's title (default: the GPU, or the CSV's name)")
    args = ap.parse_args()
    if args.replot:
        rows = read_rows(args.replot)
        drawn = (plot_routes if "cublas_us" in rows[0] else plot_rows)(rows, args.plot, args.title or args.replot.name)
        return 0 if drawn else 1

    from trellm.kernels_cuda import ops as cuda_ops

    ks = args.ks or ([4, 2] if args.quick else KS)
    ms = args.ms or ([1, 4, 8, 16, 32, 256] if args.quick else MS)
    l2 = l2_bytes()
    bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"# {dev}: measured copy bandwidth {bw / 1e9:.0f} GB/s (read+write), L2 {l2 >> 20} MiB, codebook {args.codebook}")
    header = ["k", "n", "K", "M", "exl3_us", "path", "GB/s", "%copy", "limit_us", "bf16_us", "bf16_GB/s", "speedup"]
    print(" ".join(f"{h:>9}" for h in header), flush=True)
    rows = []
    bf16_cache: dict[tuple[int, int, int], float] = {}
    for k, n in args.shapes or SHAPES:
        wb_bf16 = k * n * 2
        nb = copies_for(wb_bf16, l2)
        w_bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(nb)]
        for K in ks:
            tbytes = k * n * K // 8 + 2 * (k + n)
            nc = copies_for(tbytes, l2)
            layers = [
                (
                    torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), device="cuda", dtype=torch.int16),
                    (torch.randn(k, device="cuda") * 0.05).half(),
                    torch.randn(n, device="cuda").half(),
                )
                for _ in range(nc)
            ]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)

                def run_exl3():
                    for t, suh, svh in layers:
                        cuda_ops.exl3_matmul(x, t, suh, svh, args.codebook)

                t_exl3 = time_graph(run_exl3) / nc
                path = ("fused" if m < cuda_ops.EXL3_MID_MIN_ROWS else "mid" if m <= cuda_ops.EXL3_MID_MAX_ROWS
                        else "cublas")
                routes = time_routes(x, layers, args.codebook) if args.routes else {}
                key = (k, n, m)
                if key not in bf16_cache:
                    xb = x.to(torch.bfloat16)

                    def run_bf16():
                        for w in w_bf16:
                            F.linear(xb, w)

                    bf16_cache[key] = time_graph(run_bf16) / nb
                t_bf16 = bf16_cache[key]
                row = dict(
                    k=k, n=n, K=K, M=m,
                    exl3_us=t_exl3 * 1e6, path=path,
                    gbps=tbytes / t_exl3 / 1e9, pct=100 * tbytes / t_exl3 / bw,
                    limit_us=tbytes / bw * 1e6, bf16_us=t_bf16 * 1e6,
                    bf16_gbps=wb_bf16 / t_bf16 / 1e9, speedup=t_bf16 / t_exl3,
                    **{f"{r}_us": t * 1e6 for r, t in routes.items()},
                )
                rows.append(row)
                print(
                    f"{k:>9} {n:>9} {K:>9} {m:>9} {row['exl3_us']:>9.1f} {path:>9} {row['gbps']:>9.0f} "
                    f"{row['pct']:>8.0f}% {row['limit_us']:>9.1f} {row['bf16_us']:>9.1f} {row['bf16_gbps']:>9.0f} "
                    f"{row['speedup']:>8.2f}x" + "".join(f"  {r} {t * 1e6:.1f} us" for r, t in routes.items()),
                    flush=True,
                )
            del layers
        del w_bf16
        torch.cuda.empty_cache()
    if args.csv:
        write_rows(args.csv, rows)
    if args.plot:
        (plot_routes if args.routes else plot_rows)(rows, args.plot, args.title or f"{dev}, codebook {args.codebook}")
    return 0


def write_rows(path: Path, rows: list[dict]) -> None:
    """The rows as CSV, one column per key any row has (the route columns vary with M; read_rows reads it)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        w.writeheader()
        w.writerows(rows)


def read_rows(path: Path) -> list[dict]:
    """The rows of a saved --csv, numbers as numbers (empty cells, a route that cannot take M, dropped)."""
    def value(v: str):
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v
    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def time_routes(x: torch.Tensor, layers: list, codebook: str) -> dict[str, float]:
    """Seconds per matmul of each route that can take x's rows: the GEMV (<= 16), mid (<= 64), decode + cuBLAS."""
    from trellm.kernels_cuda import binding
    from trellm.kernels_cuda import ops as cuda_ops

    m = x.shape[0]
    routes = {}
    if m <= binding.EXL3_SMALL_MAX_ROWS:
        routes["gemv"] = lambda t, suh, svh: binding.exl3_matmul_small(x, t, suh, svh, codebook)
        if codebook == "mul1":  # the GEMV's other MUL1 route, and MCG on the same bits
            for name, cb in (("gemv_split", "mul1_split"), ("gemv_mcg", "mcg")):
                routes[name] = lambda t, suh, svh, cb=cb: binding.exl3_matmul_small(x, t, suh, svh, cb)
    if m <= binding.EXL3_MID_MAX_ROWS:
        routes["mid"] = lambda t, suh, svh: binding.exl3_matmul_mid(x, t, suh, svh, codebook)
        if codebook == "mul1" and m <= 8:  # one row group: the mid route's split decode too
            routes["mid_split"] = lambda t, suh, svh: binding.exl3_matmul_mid(x, t, suh, svh, "mul1_split")
    routes["cublas"] = lambda t, suh, svh: cuda_ops.exl3_matmul_decoded(x, t, suh, svh, codebook)
    return {name: time_graph(lambda f=f: [f(*layer) for layer in layers]) / len(layers) for name, f in routes.items()}


ROUTE_STYLES = {"gemv_us": ("GEMV (<= 16 rows)", "o-"), "gemv_split_us": ("GEMV, MUL1 split route", "o:"),
                "gemv_mcg_us": ("GEMV, same bits as MCG", "o--"), "mid_us": ("mid (<= 64 rows)", "s-"),
                "mid_split_us": ("mid, MUL1 split route", "s:"),
                "cublas_us": ("decode + cuBLAS", "^-"), "bf16_us": ("bf16 F.linear", "k--")}


def plot_routes(rows: list[dict], path: Path, title: str = "", bits: int = 4) -> bool:
    """Microseconds vs rows M for each route of a --routes run (one panel per shape, at ``bits`` per weight),
    bf16 F.linear dashed. Returns False (and says so) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in rows if r["K"] == bits]
    shapes = list(dict.fromkeys((r["k"], r["n"]) for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.6 * len(shapes), 3.6), squeeze=False)
    for col, (k, n) in enumerate(shapes):
        ax = axes[0][col]
        pts = sorted((r for r in rows if (r["k"], r["n"]) == (k, n)), key=lambda r: r["M"])
        for key, (label, style) in ROUTE_STYLES.items():
            xy = [(r["M"], r[key]) for r in pts if key in r]
            if xy:
                ax.plot([p[0] for p in xy], [p[1] for p in xy], style, ms=3, label=label)
        ax.set_title(f"{k} -> {n}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows M")
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel(f"us per matmul, {bits} bpw")
    axes[0][-1].legend(fontsize="small")
    return save_figure(plt, fig, path, title)


def plot_rows(rows: list[dict], path: Path, title: str = "") -> bool:
    """Speed-up over bf16 (top) and % of copy bandwidth (bottom) vs rows M, one column of panels per
    shape, one line per K. Returns False (and says so) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    shapes = list(dict.fromkeys((r["k"], r["n"]) for r in rows))
    bits = sorted({r["K"] for r in rows})
    fig, axes = plt.subplots(2, len(shapes), figsize=(3.6 * len(shapes), 6), sharex=True, squeeze=False)
    for col, (k, n) in enumerate(shapes):
        for K in bits:
            pts = sorted((r["M"], r["speedup"], r["pct"]) for r in rows if (r["k"], r["n"], r["K"]) == (k, n, K))
            if not pts:
                continue
            ms = [p[0] for p in pts]
            axes[0][col].plot(ms, [p[1] for p in pts], "o-", ms=3, label=f"{K} bpw")
            axes[1][col].plot(ms, [p[2] for p in pts], "o-", ms=3, label=f"{K} bpw")
        axes[0][col].axhline(1.0, color="gray", lw=0.8, ls="--")
        axes[0][col].set_title(f"{k} -> {n}")
        axes[1][col].set_xscale("log", base=2)
        axes[1][col].set_xlabel("rows M")
    axes[0][0].set_ylabel("speed-up over bf16 F.linear")
    axes[1][0].set_ylabel("% of copy bandwidth")
    axes[0][-1].legend(fontsize="small")
    return save_figure(plt, fig, path, title)


if __name__ == "__main__":
    raise SystemExit(main())
