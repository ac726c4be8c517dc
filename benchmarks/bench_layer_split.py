"""Layer split speed: the same model on one GPU and with its layers split over several, and what crossing costs.

The random Llama-shaped EXL3 model of ``bench_tensor_parallel.py`` (``--shape 8b|70b``) is loaded on one device
(``--baseline``) and with ``gpu_split`` (default: its layers evenly over ``--gpus N`` devices). Each prints decode
ms/step at batch 1 and 8 (512 cached tokens), a 2048-token prefill, next to the weight-read limit (one device's
copy bandwidth: the stages run one after another, so a split reads the same bytes at the same speed). Both run
eagerly (a split has no CUDA graphs; the baseline is timed the same way, through ``model.forward``).

Then the crossings: how many hidden-state moves and batch copies one step makes (counted by the split), and the
median time of moving a [rows, hidden] hidden state (x and its pending residual) from the first device to the
second, at 1, 8 and 2048 rows, with the peer-to-peer bandwidth it reaches.

    python benchmarks/bench_layer_split.py --shape 8b --gpus 2 --baseline --dir /tmp/ls8b
    python benchmarks/bench_layer_split.py --shape tiny --device cpu --gpus 2 --baseline --dir /tmp/lstiny  # smoke run
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tensor_parallel import SHAPES, measure, median_seconds, write_model  # noqa: E402


def even_split(path: Path, device: torch.device, gpus: int, context: int) -> list[float]:
    """GiB per device that spread the layers (with ``context`` cache tokens) evenly, the head's room on the last."""
    from trellm.distributed.plan import GiB, layer_costs

    c = layer_costs(path, device)
    layers = sum(c.layer(i, context, 0) for i in range(len(c.layer_weights)))
    share = layers / gpus * 1.02 + c.activations
    return [(share + (c.embed if d == 0 else 0) + (c.tail if d == gpus - 1 else 0)) / GiB for d in range(gpus)]


def time_crossings(lm, hidden: int, reps: int) -> None:
    """What one step crosses, and the time of one hidden-state move from the first stage to the second."""
    from trellm.batch import ForwardBatch

    split = lm.model.layer_split
    cache = lm.new_cache(max_tokens=8 * 3 * 256, page_size=256)
    pages = cache.allocator.alloc(8 * 3)
    step = ForwardBatch.with_cache([[123]] * 8, [512] * 8, [pages[i * 3:(i + 1) * 3] for i in range(8)], cache)
    before = (split.counts.hidden_moves, split.counts.batch_copies, split.counts.batch_bytes)
    lm.model.forward(step)
    moves, copies, batch_bytes = (now - was for now, was in zip(
        (split.counts.hidden_moves, split.counts.batch_copies, split.counts.batch_bytes), before))
    print(f"per step over {len(split.stages)} stages: {moves} hidden-state moves, {copies} batch copies "
          f"({batch_bytes} bytes at batch 8), whatever the layer count", flush=True)
    src, dst = split.stages[0].device, split.stages[1].device
    for rows in (1, 8, 2048):
        x = torch.randn(rows, hidden, dtype=lm.dtype, device=src)
        residual = torch.randn_like(x)
        t = median_seconds(lambda: (x.to(dst), residual.to(dst)), dst, reps)
        size = 2 * x.numel() * x.element_size()
        print(f"hidden move {rows}x{hidden} {src} -> {dst}: {t * 1e6:.1f} us ({size / t / 1e9:.2f} GB/s); "
              f"{moves} per step: {moves * t * 1e6:.1f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (quicker to write)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=2, help="devices the even split spreads the layers over")
    ap.add_argument("--gpu-split", default=None, help="'auto' or GiB per device instead of the even split")
    ap.add_argument("--context", type=int, default=8192, help="cache tokens the split plans room for")
    ap.add_argument("--baseline", action="store_true", help="also time the whole model on the first device")
    ap.add_argument("--dir", type=Path, required=True, help="where the random model is written (reused when it matches)")
    ap.add_argument("--device", default=None, help="the first device (cpu: every stage on the CPU, a smoke run)")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()

    import trellm
    from trellm.distributed.layer_split import parse_gpu_split

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = write_model(args.dir, args.shape, args.layers, args.bits)
    hidden, *_, n_layers = SHAPES[args.shape]
    bandwidth = None
    if device.type == "cuda":
        from common import copy_bandwidth

        bandwidth = copy_bandwidth()
    weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    read = weight_bytes - SHAPES[args.shape][5] * hidden * 2  # the embedding is read a row per token, not whole
    layers = args.layers or n_layers
    print(f"model: {args.shape} ({layers} layers, {args.bits} bpw EXL3, {weight_bytes / 1e9:.2f} GB) from {device}", flush=True)
    if args.baseline:
        lm = trellm.load(path, device=device, tokenizer=False)
        measure(lm, "one device", args.reps, bandwidth, read, hidden, layers)
        del lm
    split = parse_gpu_split(args.gpu_split) if args.gpu_split else even_split(path, device, args.gpus, args.context)
    t0 = time.perf_counter()
    lm = trellm.load(path, device=device, tokenizer=False, gpu_split=split, context=args.context)
    stages = lm.model.layer_split.stages
    print(f"split: loaded in {time.perf_counter() - t0:.1f} s; "
          + ", ".join(f"{s.device} layers {s.first}-{s.last - 1}" for s in stages), flush=True)
    for s in stages:
        if s.device.type == "cuda":
            print(f"  {s.device}: {torch.cuda.memory_allocated(s.device) / 2**30:.2f} GiB allocated", flush=True)
    measure(lm, f"split {len(stages)}", args.reps, bandwidth, read, hidden, layers)
    if len(stages) > 1:
        time_crossings(lm, hidden, args.reps)


if __name__ == "__main__":
    main()
