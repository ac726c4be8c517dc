"""Quantizer changes measured end to end on a CPU: SmolLM2-135M cut to its first few layers.

    python benchmarks/exl3_cpu_proxy.py --layers 2 --bits 2,4 --variant base=sequential:0,error_target:0 \
        --variant seq=error_target:0 --variant all= --work /tmp/exl3_proxy

The real SmolLM2-135M weights (the default model, imported from its GGUF) keep their first ``--layers``
decoder layers, the final norm and the tied head; that model is converted by ``trellm.convert`` with each
``--variant``'s keyword arguments (``name=key:value,...``; sequential, scale_search and scale_drift take 0 or
1, out_scales a mode name: ``auto=out_scales:auto``) at
each bitrate, the head left unquantized (``--head-bits 16``) unless asked, and scored against its own dense fp32 logits on
the built-in held-out text: KL(dense || quant) per token, top-1 agreement. A full model costs hours of CPU
Viterbi (about 10 ms per 256-weight tile per core); a two-layer cut shows what a change buys in minutes.
Prints one line per run and writes ``exl3_cpu_proxy.json`` under ``--work``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path


def truncated_smollm2(layers: int, out: Path, first: int = 0) -> Path:
    """The default model's decoder layers ``first`` .. ``first + layers - 1`` (renumbered from 0, plus the
    embedding, final norm and tied head) as an HF dir."""
    from safetensors.torch import load_file, save_file

    from trellm.default_model import default_model_dir

    if (out / "model.safetensors").is_file():
        return out
    src = default_model_dir(show_progress=False)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    keep = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if not first <= index < first + layers:
                continue
            name = name.replace(f"model.layers.{index}.", f"model.layers.{index - first}.", 1)
        keep[name] = t.float().contiguous()
    save_file(keep, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition("=")
    kwargs: dict = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition(":")
        if key in ("sequential", "scale_search", "scale_drift"):
            kwargs[key] = bool(int(value))
        else:
            kwargs[key] = value if key == "out_scales" else float(value)
    return name, kwargs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--first-layer", type=int, default=0,
                    help="keep the layers from this one on (e.g. one where out_scales auto drops scales)")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--head-bits", type=int, default=16)
    ap.add_argument("--variant", action="append", default=[], help="name=key:value,... (convert keyword arguments)")
    ap.add_argument("--cal-rows", type=int, default=64)
    ap.add_argument("--cal-cols", type=int, default=512)
    ap.add_argument("--work", default="/tmp/exl3_cpu_proxy")
    args = ap.parse_args()

    from trellm.convert import convert
    from trellm.evaluate import evaluate

    work = Path(args.work)
    cut = f"{args.first_layer}-{args.first_layer + args.layers - 1}" if args.first_layer else str(args.layers)
    dense = truncated_smollm2(args.layers, work / f"dense{cut}", args.first_layer)
    results_path = work / "exl3_cpu_proxy.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else []
    for variant in args.variant or ["default="]:
        name, kwargs = parse_variant(variant)
        for bits in (float(b) for b in args.bits.split(",")):
            tag = f"{name}_L{cut}_b{bits:g}_h{args.head_bits}"
            out, w = work / f"q_{tag}", work / f"w_{tag}"
            for d in (out, w):
                if d.exists():
                    shutil.rmtree(d)
            t0 = time.perf_counter()
            summary = convert(dense, out, w, bits, head_bits=args.head_bits, device="cpu", progress=False,
                              cal_rows=args.cal_rows, cal_cols=args.cal_cols, **kwargs)
            seconds = time.perf_counter() - t0
            ev = evaluate(out, dense, device="cpu", seq_len=512, max_windows=8)
            proxies = [p for layer in summary["layers"] for p in layer.get("proxy_errors", [])]
            drifts = [d for layer in summary["layers"] for d in layer.get("ldlq_drift", [])]
            choices = {k: c for layer in summary["layers"] for k, c in layer.get("out_scales", {}).items()}
            row = dict(variant=name, kwargs=kwargs, layers=args.layers, first_layer=args.first_layer, bits=bits,
                       head_bits=args.head_bits,
                       seconds=round(seconds, 1), kl=ev["kl"], top1=ev["top1_agreement"], ppl=ev["ppl"],
                       ref_ppl=ev["ref_ppl"], proxy_errors=proxies, ldlq_drift=drifts, out_scales=choices)
            print(f"{name:>12} L{cut} {bits:g} bpw: KL {ev['kl']:.5f} top1 {ev['top1_agreement']:.4f} "
                  f"ppl {ev['ppl']:.3f} (dense {ev['ref_ppl']:.3f}) {seconds:.0f}s proxy {proxies} "
                  f"LDLQ drift {drifts} out scales not 'always': {choices or 'none'}", flush=True)
            results.append(row)
            results_path.write_text(json.dumps(results, indent=2))
            shutil.rmtree(w, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
