"""Peak host and GPU memory of ``trellm convert`` per model size (random Llama-shaped checkpoints).

    python benchmarks/convert_memory.py --sizes toy-49k --device cpu
    python benchmarks/convert_memory.py --sizes toy-49k,llama-8b-2l,llama-70b-1l --device cuda --out $OUT

Each size is converted in its own process (so peaks do not mix), with a small calibration set
(``--cal-rows`` x ``--cal-cols``; the activations scale with it, the weights do not). The table
prints, beside each peak, the bf16 size of the whole checkpoint and of its largest layer: a
layer-by-layer converter's host peak should not grow with the checkpoint, and its GPU peak should
stay near a few copies of the largest single matrix (the head, for large vocabularies). Sizes
named ``*-2l`` / ``*-1l`` keep the real widths and vocabulary of the model with only 2 or 1
decoder layers: every per-layer and head peak of the full model is there, without its disk size.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name: (layers, hidden, intermediate, heads, kv heads, vocab)
SIZES = {
    "toy-49k": (2, 576, 1536, 9, 3, 49152),  # the toy: SmolLM2 widths, 2 layers
    "smollm2-135m": (30, 576, 1536, 9, 3, 49152),
    "llama-1b-2l": (2, 2048, 8192, 32, 8, 128256),
    "llama-8b-2l": (2, 4096, 14336, 32, 8, 128256),
    "llama-70b-1l": (1, 8192, 28672, 64, 8, 128256),
}


def _fp8_block(w, block: int = 128):
    """(e4m3 values, float32 scale per block x block tile) of w, as DeepSeek-style FP8 checkpoints store it."""
    import torch

    out, inp = w.shape
    tiles = torch.nn.functional.pad(w.float(), (0, -inp % block, 0, -out % block))
    tiles = tiles.view(tiles.shape[0] // block, block, tiles.shape[1] // block, block)
    scale = tiles.abs().amax((1, 3)).clamp_min(1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).view(tiles.shape[0] * block, -1)[:out, :inp].to(torch.float8_e4m3fn)
    return q, scale


def make_random_llama(path: Path, layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int,
                      fp8: bool = False, head_dim: int | None = None) -> Path:
    """A LlamaForCausalLM directory with random weights, written tensor by tensor (no transformers):
    bf16, or with ``fp8`` the decoder linears as FP8 with 128x128 block scales (``quant_method: fp8``).
    ``head_dim``: when the heads are not hidden / heads wide (padded SmolLM2: 12 heads of 64 at hidden 640)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    hd = head_dim or hidden // heads
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    shards = [{"model.embed_tokens.weight": rnd(vocab, hidden, std=1.0), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               "lm_head.weight": rnd(vocab, hidden)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append({
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rnd(heads * hd, hidden), p + "self_attn.k_proj.weight": rnd(kv * hd, hidden),
            p + "self_attn.v_proj.weight": rnd(kv * hd, hidden), p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
            p + "mlp.gate_proj.weight": rnd(inter, hidden), p + "mlp.up_proj.weight": rnd(inter, hidden),
            p + "mlp.down_proj.weight": rnd(hidden, inter),
        })
        if fp8:
            for name in [n for n in shards[-1] if n.endswith("proj.weight")]:
                shards[-1][name], shards[-1][name + "_scale_inv"] = _fp8_block(shards[-1][name])
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(path / name))
        weight_map.update({k: name for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "head_dim": hd,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        **({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}} if fp8 else {}),
    }))
    return path


def _stub_tile_encoder() -> None:
    """Runs on a slow CPU: every tile is encoded as a random trellis path (a valid one: each state is the last
    16 bits of its K-bit symbols, wrapping around the tile), with the same tensor shapes and dtypes as the
    Viterbi encoder's output and none of its ~10 ms per tile. The quantized weights are random, not close to
    the model's; but they are finite and of the codebook's scale, so every later step (Hessians of the
    quantized layers' outputs, scale refit, forwards) does its full work. Memory peaks and phase times stand;
    the model's quality does not."""
    import torch

    from trellm.ops.exl3 import exl3_codebook_decode
    from trellm.quant.exl3 import quantize

    def encode(targets, K, codebook, memory_budget=None):
        gen = torch.Generator().manual_seed(targets.shape[0] * 16 + K)
        symbols = torch.randint(0, 1 << K, targets.shape, generator=gen)
        states = torch.zeros_like(symbols)
        for back in range(-(-16 // K)):  # the symbols a state holds: this one and the ones before it
            states |= torch.roll(symbols, back, dims=1) << (K * back)
        states = (states & 0xFFFF).int().to(targets.device)
        return states, exl3_codebook_decode(states, codebook).float()

    quantize.encode_tiles = encode


def one(args) -> int:
    """Child: convert one checkpoint, print a JSON line with the peaks."""
    import torch

    from trellm.convert import convert

    cuda = args.device.startswith("cuda")
    if args.stub_encoder:
        _stub_tile_encoder()
    t0 = time.perf_counter()
    summary = convert(args.one, Path(args.work) / "out", Path(args.work) / "work", args.bits, head_bits=args.head_bits,
                      device=args.device, progress=False, cal_rows=args.cal_rows, cal_cols=args.cal_cols)
    row = dict(seconds=round(time.perf_counter() - t0, 1), host_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               gpu_peak=torch.cuda.max_memory_allocated() if cuda else 0, bits=summary["bits"])
    print("RESULT " + json.dumps(row), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="toy-49k", help=f"comma list of {', '.join(SIZES)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--head-bits", type=int, default=6)
    ap.add_argument("--cal-rows", type=int, default=8)
    ap.add_argument("--cal-cols", type=int, default=256)
    ap.add_argument("--work", default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--fp8", action="store_true", help="write the decoder linears as FP8 with block scales (an FP8 source)")
    ap.add_argument("--stub-encoder", action="store_true",
                    help="memory only: random trellis paths instead of the Viterbi encoder (CPU runs; output is garbage)")
    ap.add_argument("--out", default=None, help="write convert_memory.json here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for name in [s.strip() for s in args.sizes.split(",") if s.strip()]:
            layers, hidden, inter, heads, kv, vocab = SIZES[name]
            src = make_random_llama(Path(tmp) / name / "src", *SIZES[name], fp8=args.fp8)
            layer_params = 2 * hidden * hidden + 2 * hidden * (hidden // heads * kv) + 3 * hidden * inter
            ckpt_bytes = 2 * (2 * vocab * hidden + layers * layer_params)
            cmd = [sys.executable, __file__, "--one", str(src), "--work", str(Path(tmp) / name), "--device", args.device,
                   "--bits", str(args.bits), "--head-bits", str(args.head_bits), "--cal-rows", str(args.cal_rows),
                   "--cal-cols", str(args.cal_cols)] + (["--stub-encoder"] if args.stub_encoder else [])
            res = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"{name}: failed (exit {res.returncode})\n{res.stderr[-2000:]}", flush=True)
                continue
            row = dict(size=name + (" fp8" if args.fp8 else ""), layers=layers, hidden=hidden, vocab=vocab, checkpoint_bytes=ckpt_bytes,
                       layer_bytes=2 * layer_params, head_bytes=2 * vocab * hidden, **json.loads(line[7:]))
            rows.append(row)
            gib = 2**30
            print(f"{name:14s} checkpoint {ckpt_bytes / gib:6.2f} GiB (largest layer {2 * layer_params / gib:5.2f}, head "
                  f"{2 * vocab * hidden / gib:5.2f} GiB bf16): host peak {row['host_peak'] / gib:6.2f} GiB, "
                  f"GPU peak {row['gpu_peak'] / gib:6.2f} GiB, {row['seconds']:.0f}s", flush=True)
            import shutil

            shutil.rmtree(Path(tmp) / name, ignore_errors=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "convert_memory.json").write_text(json.dumps(rows, indent=2))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
