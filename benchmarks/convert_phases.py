"""Where ``trellm convert``'s time goes, by phase, for quantizer variants of one random Llama-shaped model.

    python benchmarks/convert_phases.py --shape smollm2-640 --layers 2 --cal-rows 16 --device cpu --stub-encoder \
        --variant default= --variant plain=sequential:0,error_target:0

The model has the real widths of ``--shape`` (smollm2-640: SmolLM2-135M zero-padded to hidden 640, 12 query and
4 KV heads of 64, as ``exl3_compare.py`` converts it; tiny: a test-sized Llama) and ``--layers`` decoder layers,
random bf16 weights (``convert_memory.make_random_llama``); ``--shape smollm2-real`` is the real SmolLM2-135M's
first ``--layers`` layers instead (``exl3_cpu_proxy.truncated_smollm2``, calibrated on its tokenizer's text). Each ``--variant name=key:value,...`` (convert keyword
arguments, as ``exl3_cpu_proxy.py`` takes them) converts it once, and the table shows the wall time of each phase
of the converter's clock (``summary.json``'s ``phases``: dense_pass, hessian_passes, target, quantize_group's
regularize / scale_search / ldl / viterbi / refit, advance, io, setup, compile), with the sha256 of the written
model: two code versions that print the same hash wrote the same bytes. ``--stub-encoder`` replaces the Viterbi
tile encoder by random trellis paths (``convert_memory._stub_tile_encoder``): on a CPU the encoder costs ~10 ms
per 256-weight tile and would hide everything else; the other phases do the same work either way (their values,
not their sizes, change). Writes ``convert_phases.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# name: (hidden, intermediate, heads, kv heads, head_dim, vocab)
SHAPES = {
    "smollm2-640": (640, 1536, 12, 4, 64, 49152),
    "tiny": (128, 384, 4, 2, 32, 512),
}


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def main() -> int:
    from convert_memory import _stub_tile_encoder, make_random_llama
    from exl3_cpu_proxy import parse_variant, truncated_smollm2

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES) + ["smollm2-real"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--head-bits", type=int, default=16)
    ap.add_argument("--cal-rows", type=int, default=64)
    ap.add_argument("--cal-cols", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variant", action="append", default=[], help="name=key:value,... (convert keyword arguments)")
    ap.add_argument("--stub-encoder", action="store_true", help="random trellis paths instead of the Viterbi encoder")
    ap.add_argument("--work", default="/tmp/convert_phases")
    ap.add_argument("--out", default=None, help="write convert_phases.json here (default: --work)")
    args = ap.parse_args()

    from trellm.convert import convert

    if args.stub_encoder:
        _stub_tile_encoder()
    work = Path(args.work)
    src = work / f"src_{args.shape}_{args.layers}"
    if args.shape == "smollm2-real":
        truncated_smollm2(args.layers, src)
    elif not (src / "config.json").is_file():
        hidden, inter, heads, kv, head_dim, vocab = SHAPES[args.shape]
        make_random_llama(src, args.layers, hidden, inter, heads, kv, vocab, head_dim=head_dim)
    rows = []
    for spec in args.variant or ["default="]:
        name, kwargs = parse_variant(spec)
        out, w = work / f"q_{name}", work / f"w_{name}"
        for d in (out, w):
            shutil.rmtree(d, ignore_errors=True)
        t0 = time.perf_counter()
        summary = convert(src, out, w, args.bits, head_bits=args.head_bits, device=args.device, progress=False,
                          cal_rows=args.cal_rows, cal_cols=args.cal_cols, **kwargs)
        seconds = time.perf_counter() - t0
        rows.append(dict(variant=name, kwargs=kwargs, seconds=round(seconds, 2), phases=summary["phases"],
                         model_sha256=file_hash(out / "model.safetensors")))
        print(f"{name}: {seconds:.1f}s, model.safetensors sha256 {rows[-1]['model_sha256']}", flush=True)
    phases = sorted({p for r in rows for p in r["phases"]}, key=lambda p: -max(r["phases"].get(p, 0) for r in rows))
    print(f"\n{args.shape}, {args.layers} layers, {args.cal_rows}x{args.cal_cols} calibration tokens, {args.bits:g} bpw, "
          f"device {args.device}{', stub encoder' if args.stub_encoder else ''}")
    print(f"{'phase (s)':16s}" + "".join(f"{r['variant']:>12s}" for r in rows))
    for p in phases:
        print(f"{p:16s}" + "".join(f"{r['phases'].get(p, 0):12.2f}" for r in rows))
    print(f"{'total':16s}" + "".join(f"{r['seconds']:12.2f}" for r in rows))
    dest = Path(args.out) if args.out else work
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "convert_phases.json").write_text(json.dumps(dict(vars(args), rows=rows), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
