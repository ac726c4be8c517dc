"""EXL3 quality sweep: convert SmolLM2-135M at several bitrates, measure KL / perplexity / time.

    python benchmarks/exl3_quality.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out results/ [--bits 2,3,4,5,6,8]

The dense reference is the GGUF imported to an HF directory (``trellm.gguf.import_gguf``). Each
bitrate is converted in its own process (in parallel: one GPU has room for all of them) and then
evaluated against the dense model on the built-in held-out text. Prints a table and writes
``exl3_quality.json`` and ``exl3_quality.png`` (when matplotlib is installed). ``--deadline-s``
stops waiting for conversions that run too long and reports what finished.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _write_gguf(out: Path, meta, tensors: list) -> Path:
    """A GGUF at ``out`` with every metadata field of the reader ``meta`` and ``tensors``
    (``(reader, tensor)`` pairs, written in order)."""
    import gguf

    arch = meta.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch=arch, endianess=meta.endianess)
    for field in meta.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for _, t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for r, t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=r.endianess)
    writer.close()
    return out


def merge_ggufs(paths: list[str], out: Path) -> Path:
    """One GGUF from several: metadata of the last file, each tensor from the first file that has it.

    Lets a model travel in pieces smaller than a transfer limit (e.g. layers 0-11 with the
    embedding, then the remaining layers with the full metadata).
    """
    import gguf

    readers = [gguf.GGUFReader(p) for p in paths]
    tensors: dict = {}
    for r in readers:
        for t in r.tensors:
            tensors.setdefault(t.name, (r, t))
    return _write_gguf(out, readers[-1], list(tensors.values()))


def split_gguf(path: str, out_dir: Path, pieces: int = 2) -> list[Path]:
    """The inverse of merge_ggufs: ``pieces`` GGUFs of about equal size, each with the full metadata."""
    import gguf

    reader = gguf.GGUFReader(path)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    groups: list[list] = [[]]
    size = 0
    for t in reader.tensors:
        if size >= total * len(groups) / pieces and len(groups) < pieces:
            groups.append([])
        groups[-1].append(t)
        size += int(t.n_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_write_gguf(out_dir / f"piece{i}.gguf", reader, [(reader, t) for t in group]) for i, group in enumerate(groups)]


def one(args) -> int:
    """Child: convert at one bitrate and evaluate against the dense model; writes a JSON line."""
    import torch

    from trellm.convert import convert
    from trellm.evaluate import evaluate

    work = Path(args.work)
    out = work / f"q{args.one}"
    t0 = time.perf_counter()
    summary = convert(args.dense, out, work / f"w{args.one}", float(args.one), head_bits=args.head_bits,
                      device=args.device, progress=False, cal_rows=args.cal_rows, cal_cols=args.cal_cols)
    seconds = time.perf_counter() - t0
    if args.device and args.device.startswith("cuda"):
        torch.cuda.synchronize()
    ev = evaluate(out, args.dense, device=args.device, seq_len=512, max_windows=8)
    row = dict(bits=summary["bits"], target=float(args.one), head_bits=args.head_bits, seconds=round(seconds, 1),
               weights=summary["weights_quantized"], weights_per_s=round(summary["weights_quantized"] / summary["quant_seconds"]),
               output_mb=round(summary["output_bytes"] / 2**20, 1), **ev)
    (work / f"result_{args.one}.json").write_text(json.dumps(row))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", nargs="+", help="SmolLM2 GGUF file (or GGUF pieces to merge, see merge_ggufs)")
    ap.add_argument("--dense", help="an existing dense HF dir (instead of --gguf)")
    ap.add_argument("--out", default="exl3_quality_out")
    ap.add_argument("--work", default="/tmp/exl3_quality")
    ap.add_argument("--bits", default="2,3,4,5,6,8")
    ap.add_argument("--head-bits", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cal-rows", type=int, default=32)
    ap.add_argument("--cal-cols", type=int, default=512)
    ap.add_argument("--parallel", type=int, default=6)
    ap.add_argument("--deadline-s", type=float, default=1e9)
    ap.add_argument("--smoke", action="store_true", help="only: Viterbi throughput and one layer quantized on the device")
    ap.add_argument("--split", type=int, metavar="N", help="only: split --gguf into N pieces under --out")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.split:
        for piece in split_gguf(args.gguf[0], Path(args.out), args.split):
            print(f"{piece} {piece.stat().st_size / 2**20:.1f} MiB")
        return 0
    if args.one:
        return one(args)
    if args.smoke:
        return smoke(args.device)

    start = time.perf_counter()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if args.dense is None:
        gguf = Path(args.gguf[0])
        if len(args.gguf) > 1:
            gguf = merge_ggufs(args.gguf, work / "model.gguf")
        from trellm.gguf import import_gguf

        args.dense = str(work / "dense")
        if not Path(args.dense).exists():
            import_gguf(gguf, args.dense, dtype="bfloat16", show_progress=False)
    print(f"dense model ready ({time.perf_counter() - start:.1f}s)", flush=True)
    _viterbi_throughput(args.device)

    bits = [b.strip() for b in args.bits.split(",") if b.strip()]
    pending = list(bits)
    running: dict[str, subprocess.Popen] = {}
    logs = {}
    while pending or running:
        while pending and len(running) < args.parallel:
            b = pending.pop(0)
            cmd = [sys.executable, __file__, "--one", b, "--dense", args.dense, "--work", str(work), "--device", args.device,
                   "--head-bits", str(args.head_bits), "--cal-rows", str(args.cal_rows), "--cal-cols", str(args.cal_cols)]
            logs[b] = open(out / f"log_{b}.txt", "w")
            running[b] = subprocess.Popen(cmd, stdout=logs[b], stderr=subprocess.STDOUT)
        for b, p in list(running.items()):
            if p.poll() is not None:
                print(f"  {b} bpw finished (exit {p.returncode}) at {time.perf_counter() - start:.0f}s", flush=True)
                del running[b]
        if time.perf_counter() - start > args.deadline_s:
            for b, p in running.items():
                print(f"  {b} bpw: deadline reached, stopping it", flush=True)
                p.kill()
            break
        time.sleep(1)

    rows = []
    for b in bits:
        f = work / f"result_{b}.json"
        if f.is_file():
            rows.append(json.loads(f.read_text()))
    report(rows, out)
    return 0 if rows else 1


def smoke(device: str) -> int:
    """Kernels build, Viterbi speed, and one 1536x576 layer through quantize -> EXL3Linear on ``device``."""
    import torch

    from trellm.quant.exl3 import EXL3Linear, quantize_group
    from trellm.quant.exl3.quantize import relative_mse

    _viterbi_throughput(device)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(576, 1536, generator=gen)
    x = torch.randn(4096, 1536, generator=gen) @ (torch.eye(1536) + 0.05 * torch.randn(1536, 1536, generator=gen))
    h = x.t() @ x / x.shape[0]
    for K in (2, 4):
        t0 = time.perf_counter()
        (qt,), st = quantize_group([w], h, K, "mul1", device=device)
        dt = time.perf_counter() - t0
        lin = EXL3Linear.from_quantized(qt, 1536, 576)
        xd = x[:256].to(device)
        y = lin.forward(xd).float().cpu()
        ref = x[:256] @ w.t()
        print(f"layer 1536x576 K={K}: {dt:.2f}s ({w.numel() / dt / 1e6:.2f} M weights/s), proxy {st.proxy_error:.5f}, "
              f"output rel MSE {relative_mse(ref, y):.5f}, scale {st.scale:.3f}", flush=True)
    return 0


def _viterbi_throughput(device: str) -> None:
    import torch

    from trellm.quant.exl3.viterbi import encode_tiles

    if not device.startswith("cuda"):
        return
    x = torch.randn(4096, 256, device=device) * 1.2
    encode_tiles(x[:8], 4, "mul1")  # builds / loads the kernels
    for K in (2, 4, 6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        encode_tiles(x, K, "mul1")
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"Viterbi K={K}: {x.numel() / dt / 1e6:.2f} M weights/s", flush=True)


def report(rows: list[dict], out: Path) -> None:
    (out / "exl3_quality.json").write_text(json.dumps(rows, indent=2))
    if not rows:
        print("no bitrate finished")
        return
    print(f"\ndense perplexity {rows[0].get('ref_ppl', float('nan')):.3f} ({rows[0]['tokens']} tokens)")
    print(f"{'bpw':>5} {'KL':>9} {'ppl':>8} {'top1':>6} {'time s':>7} {'Mw/s':>6} {'MB':>6}")
    for r in rows:
        print(f"{r['bits']:5.2f} {r['kl']:9.5f} {r['ppl']:8.3f} {r['top1_agreement']:6.3f} {r['seconds']:7.1f} "
              f"{r['weights_per_s'] / 1e6:6.2f} {r['output_mb']:6.1f}")
    from trellm.evaluate import plot_sweep

    if plot_sweep(rows, out / "exl3_quality.png", "EXL3 (trellm) on SmolLM2-135M"):
        print(f"plot: {out / 'exl3_quality.png'}")


if __name__ == "__main__":
    sys.exit(main())
