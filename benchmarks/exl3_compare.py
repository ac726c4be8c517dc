"""trellm's EXL3 converter against ExLlamaV3's, side by side, in one run on the GPU machine.

    python benchmarks/exl3_compare.py --model smollm2-640=PIECE0.gguf,PIECE1.gguf --model gemma3-270m=G.gguf \
        --bits 2,3,4,5 --out $OUT [--exl3-cal-rows 100] [--deadline-s 540]

Each ``--model NAME=GGUF[,GGUF...]`` is imported from its GGUF (GGUF pieces are merged first, see
``exl3_quality.merge_ggufs``; byte pieces such as the Gemma-3-270M chunk packages' ``.partNN`` files are
joined in the order given); a name starting with ``smollm2-640`` is zero-padded from hidden 576
to 640 (:func:`pad_smollm2`: the same function, every width a multiple of 128, which ExLlamaV3 needs).
Then, per model and bitrate, both converters run on the dense model (head 6 bits, codebook mul1), and trellm once more per
``--trellm-variant NAME=FLAGS`` (extra ``trellm convert`` flags, reported as converter ``trellm-NAME``);
every output is scored on the built-in held-out text (``trellm.evaluate.eval_text``; ``--eval-text FILE``) against the
dense model's fp32 logits, by trellm and, when ``exllamav3`` imports, by ExLlamaV3: KL(dense || quant)
per token, top-1 agreement and perplexity. Conversion wall time: the 4 bpw (or first) conversions of
both converters run alone, one after the other; the others run ``--parallel`` at a time, and their
times say "shared"; a trellm conversion timed alone also prints its seconds by phase (the converter's
``summary.json``: dense_pass, hessian_passes, target, viterbi, ...). Writes ``exl3_compare.json``,
``exl3_compare.png`` and prints the table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pad_smollm2(src: Path, dst: Path, hidden: int = 640) -> Path:
    """SmolLM2-135M (hidden 576, 9 query / 3 KV heads of 64) zero-padded to ``hidden`` with the same function.

    KV heads grow to the fewest whose width is a multiple of 128 (3 -> 4) and query heads keep the group
    size (9 -> 12; the added heads are all zero and attend to zero values), every input width gets zero columns, o_proj/down_proj/embedding outputs
    zero rows or columns; RMSNorm weights are scaled by sqrt(576/hidden) on the real channels (zero on
    the padding, kept in float32) and eps by 576/hidden, so each norm returns what it did.
    """
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    old, hd = config["hidden_size"], config["head_dim"] if "head_dim" in config else config["hidden_size"] // config["num_attention_heads"]
    group = config["num_attention_heads"] // config["num_key_value_heads"]
    kv = config["num_key_value_heads"]
    while (kv * hd) % 128:  # the fewest KV heads (same group size) whose q/k/v widths are multiples of 128
        kv += 1
    heads = kv * group
    norm_scale = math.sqrt(old / hidden)
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        t = t.float()
        if name.endswith("norm.weight"):
            p = torch.zeros(hidden)
            p[:old] = t * norm_scale
        elif name.endswith(("q_proj.weight",)):
            p = torch.zeros(heads * hd, hidden)
            p[: t.shape[0], :old] = t
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            p = torch.zeros(kv * hd, hidden)
            p[: t.shape[0], :old] = t
        elif name.endswith("o_proj.weight"):
            p = torch.zeros(hidden, heads * hd)
            p[:old, : t.shape[1]] = t
        elif name.endswith(("gate_proj.weight", "up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
            p = torch.zeros(t.shape[0], hidden)
            p[:, :old] = t
        elif name.endswith("down_proj.weight"):
            p = torch.zeros(hidden, t.shape[1])
            p[:old] = t
        else:
            raise ValueError(f"pad_smollm2: unexpected tensor {name!r}")
        # bf16 values padded with zeros stay exact in bf16; scaled norm weights would not (fp32)
        out[name] = (p if name.endswith("norm.weight") else p.to(torch.bfloat16)).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    config.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                  rms_norm_eps=config.get("rms_norm_eps", 1e-5) * old / hidden)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def prepare(name: str, ggufs: list[str], work: Path) -> Path:
    from exl3_quality import merge_ggufs

    from trellm.gguf import import_gguf

    dense = work / name / "dense"
    if dense.exists():
        return dense
    if len(ggufs) == 1:
        gguf = Path(ggufs[0])
    elif all(open(g, "rb").read(4) == b"GGUF" for g in ggufs):
        gguf = merge_ggufs(ggufs, work / f"{name}.gguf")
    else:  # byte pieces of one file (the PyPI chunk packages' .partNN files), in the order given
        gguf = work / f"{name}.gguf"
        gguf.parent.mkdir(parents=True, exist_ok=True)
        with open(gguf, "wb") as f:
            for g in ggufs:
                f.write(Path(g).read_bytes())
    if name.startswith("smollm2-640"):
        raw = import_gguf(gguf, work / name / "raw", dtype="bfloat16", show_progress=False)
        pad_smollm2(raw, dense)
    else:
        import_gguf(gguf, dense, dtype="bfloat16", show_progress=False)
    return dense


def convert_cmd(converter: str, dense: Path, out: Path, bits: str, args) -> list[str]:
    if converter.startswith("trellm"):
        extra = shlex.split(args.trellm_variants.get(converter, ""))
        return [sys.executable, "-m", "trellm.cli", "convert", "-i", str(dense), "-o", str(out), "-w", str(out) + ".work",
                "-b", bits, "-hb", "6", "-d", "cuda", "-q", *extra]
    cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(dense), "-o", str(out),
           "-w", str(out) + ".work", "-b", bits, "-hb", "6"]
    return cmd + (["-cr", str(args.exl3_cal_rows)] if args.exl3_cal_rows else [])


def exllamav3_available() -> bool:
    try:
        import exllamav3  # noqa: F401

        return True
    except Exception:
        return False


def reference_logprobs(dense: Path, windows: list[list[int]]):
    import torch

    import trellm

    lm = trellm.load(dense, device="cuda", dtype=torch.float32, tokenizer=False)
    out = [lm.logits(torch.tensor([w]))[0, :-1].float().log_softmax(-1) for w in windows]
    del lm
    torch.cuda.empty_cache()
    return out


def metrics(ref: list, logits: list, windows: list[list[int]]) -> dict:
    import torch

    kl = nll = agree = tokens = 0.0
    for lr, lq, w in zip(ref, logits, windows):
        lq = lq[: lr.shape[0], : lr.shape[1]].float().log_softmax(-1).to(lr.device)
        target = torch.tensor(w[1:], device=lr.device)
        kl += (lr.exp() * (lr - lq)).sum().item()
        nll += -lq.gather(1, target[:, None]).sum().item()
        agree += (lr.argmax(-1) == lq.argmax(-1)).sum().item()
        tokens += target.numel()
    return {"kl": kl / tokens, "top1": agree / tokens, "ppl": math.exp(nll / tokens), "tokens": int(tokens)}


def trellm_logits(model_dir: Path, windows):
    import torch

    import trellm

    lm = trellm.load(model_dir, device="cuda", dtype=torch.float16, tokenizer=False)
    out = [lm.logits(torch.tensor([w]))[0, :-1].float() for w in windows]
    del lm
    torch.cuda.empty_cache()
    return out


def exllamav3_logits(model_dir: Path, windows):
    import torch
    from exllamav3 import Config, Model

    model = Model.from_config(Config.from_directory(str(model_dir)))
    model.load(device="cuda:0")
    try:
        out = [model.forward(torch.tensor([w], dtype=torch.long), {"attn_mode": "flash_attn_nc"})[0, :-1].float().cuda()
               for w in windows]
    finally:
        model.unload()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True, help="NAME=GGUF[,GGUF...] (repeat)")
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--out", default="exl3_compare_out")
    ap.add_argument("--work", default="/tmp/exl3_compare")
    ap.add_argument("--exl3-cal-rows", type=int, default=0, help="ExLlamaV3 calibration rows (0: its default, 250)")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--eval-text", default=None,
                    help="UTF-8 text to score on, cut into --windows windows of --seq-len tokens (default: the "
                         "built-in held-out text, trellm.evaluate.eval_text, about 700 SmolLM2 tokens of prose)")
    ap.add_argument("--deadline-s", type=float, default=540)
    ap.add_argument("--trellm-variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="also convert with trellm convert FLAGS, reported as converter trellm-NAME (e.g. "
                         "plain='--no-sequential --error-target 0': what the newer quantizer steps buy)")
    args = ap.parse_args()
    args.trellm_variants = {}
    for spec in args.trellm_variant:
        name, _, flags = spec.partition("=")
        args.trellm_variants[f"trellm-{name}"] = flags
    start = time.perf_counter()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    have_exl3 = exllamav3_available()
    converters = ["trellm", *args.trellm_variants] + (["exllamav3"] if have_exl3 else [])
    print(f"ExLlamaV3 {'importable' if have_exl3 else 'NOT importable: trellm only'}", flush=True)

    from trellm.evaluate import eval_text, token_windows
    from trellm.tokenizer import Tokenizer

    models = {}
    for spec in args.model:
        name, _, files = spec.partition("=")
        dense = prepare(name, files.split(","), work)
        text = Path(args.eval_text).read_text(encoding="utf-8") if args.eval_text else eval_text()
        windows = token_windows(Tokenizer.from_dir(dense), text, args.seq_len, args.windows)
        models[name] = (dense, windows)
        print(f"{name}: dense model ready, {sum(len(w) for w in windows)} held-out tokens "
              f"({time.perf_counter() - start:.0f}s)", flush=True)

    bits = [b.strip() for b in args.bits.split(",") if b.strip()]
    solo_bits = "4" if "4" in bits else bits[0]
    jobs = [(m, c, b) for m in models for b in bits for c in converters]
    solo = [j for j in jobs if j[2] == solo_bits]
    shared = [j for j in jobs if j[2] != solo_bits]
    results: dict[tuple, dict] = {}
    logs = out / "logs"
    logs.mkdir(exist_ok=True)

    def launch(job):
        m, c, b = job
        target = work / m / f"{c}_{b}"
        log = open(logs / f"{m}_{c}_{b}.txt", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return subprocess.Popen(convert_cmd(c, models[m][0], target, b, args), stdout=log, stderr=subprocess.STDOUT, env=env), time.perf_counter()

    def phases(job) -> dict:
        """A trellm conversion's seconds by phase (its work dir's summary.json), largest first."""
        m, c, b = job
        summary = work / m / f"{c}_{b}.work" / "summary.json"
        if not c.startswith("trellm") or not summary.is_file():
            return {}
        found = json.loads(summary.read_text()).get("phases", {})
        return dict(sorted(found.items(), key=lambda kv: -kv[1]))

    for job in solo:  # timed alone
        proc, t0 = launch(job)
        rc = proc.wait(timeout=max(1, args.deadline_s - (time.perf_counter() - start)))
        results[job] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "timing": "alone", "phases": phases(job)}
        print(f"  {job}: exit {rc}, {results[job]['seconds']}s (alone)", flush=True)
        if results[job]["phases"]:
            print("    by phase: " + ", ".join(f"{k} {v:.1f}s" for k, v in results[job]["phases"].items()), flush=True)
    pending, running = list(shared), {}
    while pending or running:
        while pending and len(running) < args.parallel:
            job = pending.pop(0)
            running[job] = launch(job)
        for job, (proc, t0) in list(running.items()):
            if proc.poll() is not None:
                results[job] = {"rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 1), "timing": "shared"}
                print(f"  {job}: exit {proc.returncode}, {results[job]['seconds']}s (shared)", flush=True)
                del running[job]
        if time.perf_counter() - start > args.deadline_s:
            for job, (proc, _) in running.items():
                proc.kill()
                print(f"  {job}: deadline, stopped", flush=True)
            break
        time.sleep(0.5)

    rows = []
    for m, (dense, windows) in models.items():
        ref = reference_logprobs(dense, windows)
        for (mm, c, b), res in sorted(results.items()):
            if mm != m or res["rc"] != 0:
                continue
            qdir = work / m / f"{c}_{b}"
            cfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
            row = dict(model=m, converter=c, target=float(b), bits=cfg["bits"], seconds=res["seconds"], timing=res["timing"],
                       phases=res.get("phases", {}))
            for engine, fn in (("trellm", trellm_logits), ("exllamav3", exllamav3_logits)):
                if engine == "exllamav3" and not have_exl3:
                    continue
                try:
                    row[engine] = metrics(ref, fn(qdir, windows), windows)
                except Exception as e:  # report and go on: one engine failing on one file must not lose the table
                    row[engine] = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    report(rows, out)
    print(f"total {time.perf_counter() - start:.0f}s", flush=True)
    return 0 if rows else 1


def report(rows: list[dict], out: Path) -> None:
    (out / "exl3_compare.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{'model':14s} {'bpw':>4s} {'converter':10s} {'time s':>12s} | {'KL (trellm)':>11s} {'top1':>6s} {'ppl':>8s} | "
          f"{'KL (exl3)':>10s} {'top1':>6s} {'ppl':>8s}")
    for r in sorted(rows, key=lambda r: (r["model"], r["target"], r["converter"])):
        cells = []
        for engine in ("trellm", "exllamav3"):
            m = r.get(engine, {})
            cells.append(f"{m['kl']:11.5f} {m['top1']:6.3f} {m['ppl']:8.3f}" if "kl" in m else f"{'-':>11s} {'':6s} {'':8s}")
        print(f"{r['model']:14s} {r['target']:4.0f} {r['converter']:10s} {r['seconds']:6.1f} {r['timing']:>5s} | "
              f"{cells[0]} | {cells[1]}")
    by_pair = {}
    for r in rows:
        m = r.get("trellm", {})
        if "kl" in m:
            by_pair.setdefault((r["model"], r["target"]), {})[r["converter"]] = m["kl"]
    for (model, b), kls in sorted(by_pair.items()):
        for conv in sorted(c for c in kls if c.startswith("trellm")):
            if "exllamav3" in kls:
                print(f"{model} {b:.0f} bpw: KL {conv} / ExLlamaV3 = {kls[conv] / kls['exllamav3']:.3f} (scored by trellm)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in sorted({r["model"] for r in rows}):
        for conv in sorted({r["converter"] for r in rows}):
            style = "s--" if conv == "exllamav3" else "o-" if conv == "trellm" else "^:"
            pts = sorted((r["bits"], r["trellm"]["kl"]) for r in rows
                         if r["model"] == model and r["converter"] == conv and "kl" in r.get("trellm", {}))
            if pts:
                ax.plot(*zip(*pts), style, label=f"{model}, {conv} converter")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (decoder linears)")
    ax.set_ylabel("KL(dense || quantized) per token")
    ax.set_title("EXL3: trellm vs ExLlamaV3 converter (scored by trellm)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "exl3_compare.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
