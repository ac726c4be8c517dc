"""Quantizer changes measured end to end on a CPU: SmolLM2-135M cut to its first few layers.

    python benchmarks/exl3_cpu_proxy.py --layers 2 --bits 2,4 --variant base=sequential:0,error_target:0 \
        --variant seq=error_target:0 --variant all= --work /tmp/exl3_proxy

The real SmolLM2-135M weights (the default model, imported from its GGUF) keep their first ``--layers``
decoder layers, the final norm and the tied head; that model is converted by ``trellm.convert`` with each
``--variant``'s keyword arguments (``name=key:value,...``; sequential and scale_search take 0 or 1) at
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


def truncated_smollm2(layers: int, out: Path) -> Path:
    """The default model's first ``layers`` decoder layers (plus embedding, norm, tied head) as an HF dir."""
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
            if int(name.split(".")[2]) >= layers:
                continue
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
        kwargs[key] = bool(int(value)) if key == "sequential" or key == "scale_search" else float(value)
    return name, kwargs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
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
    dense = truncated_smollm2(args.layers, work / f"dense{args.layers}")
    results_path = work / "exl3_cpu_proxy.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else []
    for variant in args.variant or ["default="]:
        name, kwargs = parse_variant(variant)
        for bits in (float(b) for b in args.bits.split(",")):
            tag = f"{name}_L{args.layers}_b{bits:g}_h{args.head_bits}"
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
            row = dict(variant=name, kwargs=kwargs, layers=args.layers, bits=bits, head_bits=args.head_bits,
                       seconds=round(seconds, 1), kl=ev["kl"], top1=ev["top1_agreement"], ppl=ev["ppl"],
                       ref_ppl=ev["ref_ppl"], proxy_errors=proxies)
            print(f"{name:>12} L{args.layers} {bits:g} bpw: KL {ev['kl']:.5f} top1 {ev['top1_agreement']:.4f} "
                  f"ppl {ev['ppl']:.3f} (dense {ev['ref_ppl']:.3f}) {seconds:.0f}s proxy {proxies}", flush=True)
            results.append(row)
            results_path.write_text(json.dumps(results, indent=2))
            shutil.rmtree(w, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
