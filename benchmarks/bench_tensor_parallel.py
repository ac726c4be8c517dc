"""Tensor-parallel speed: decode steps at batch 1 and 8, a 2048-token prefill, and the all-reduce per layer.

A random EXL3 model (Llama-shaped; 8B: hidden 4096, 32/8 heads, MLP 14336, vocab 128256; 70B: hidden
8192, 64/8 heads, MLP 28672, 80 layers) is written once to ``--dir`` and loaded with
``trellm.load(tensor_parallel=N)`` for each N of ``--tp``. ``--tp 1`` still takes the distributed path
(one rank, its own NCCL group): beside it, ``--baseline`` times the plain one-device load, so on one GPU
the cost of the tensor-parallel machinery (step messages, collectives, no CUDA graph) shows.

Each figure is printed next to its limit: the weight bytes one rank reads per step over the copy
bandwidth measured in the same process (decode is bandwidth-bound), and, for the all-reduce, the bytes
of one layer's two all-reduces. Random weights: the speed is what is measured, not the output.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python benchmarks/bench_tensor_parallel.py --shape 8b --tp 1 2 4 --baseline --dir /tmp/tp8b
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # hidden, heads, kv heads, head dim, intermediate, vocab, layers
    "8b": (4096, 32, 8, 128, 14336, 128256, 32),
    "70b": (8192, 64, 8, 128, 28672, 128256, 80),
    "tiny": (512, 8, 4, 128, 1024, 4096, 4),  # CPU smoke run of this script
}


def write_model(path: Path, shape: str, layers: int | None, bits: int) -> Path:
    """A Llama config and random EXL3 tensors (one safetensors file per layer), unless already there."""
    from safetensors.torch import save_file

    hidden, heads, kv, hd, inter, vocab, n_layers = SHAPES[shape]
    n_layers = layers or n_layers
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, vocab_size=vocab,
                  num_hidden_layers=n_layers, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                  tie_word_embeddings=False, torch_dtype="bfloat16")
    marker = path / "config.json"
    if marker.is_file() and json.loads(marker.read_text()) == config:
        return path
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)

    def exl3(key: str, k: int, n: int, k_bits: int) -> dict:
        return {f"{key}.trellis": torch.randint(-32768, 32768, (k // 16, n // 16, 16 * k_bits), generator=g, dtype=torch.int16),
                f"{key}.suh": (torch.randn(k, generator=g) * 0.02).half(), f"{key}.svh": (torch.randn(n, generator=g) * 0.02).half()}

    index = {}
    for i in range(n_layers):
        p = f"model.layers.{i}"
        t = {**exl3(f"{p}.self_attn.q_proj", hidden, heads * hd, bits), **exl3(f"{p}.self_attn.k_proj", hidden, kv * hd, bits),
             **exl3(f"{p}.self_attn.v_proj", hidden, kv * hd, bits), **exl3(f"{p}.self_attn.o_proj", heads * hd, hidden, bits),
             **exl3(f"{p}.mlp.gate_proj", hidden, inter, bits), **exl3(f"{p}.mlp.up_proj", hidden, inter, bits),
             **exl3(f"{p}.mlp.down_proj", inter, hidden, bits),
             f"{p}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             f"{p}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
        name = f"layer-{i:03d}.safetensors"
        save_file(t, path / name)
        index.update({k: name for k in t})
    t = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16(),
         "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16), **exl3("lm_head", hidden, vocab, 6)}
    save_file(t, path / "embed-head.safetensors")
    index.update({k: "embed-head.safetensors" for k in t})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    marker.write_text(json.dumps(config))
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, reps: int) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(lm, label: str, reps: int, bandwidth: float | None, rank_bytes: int, hidden: int, layers: int) -> None:
    """Decode at batch 1 and 8 (512 cached tokens each), a 2048-token prefill, and (tensor parallel) the all-reduce."""
    from trellm.batch import ForwardBatch

    device = lm.device
    per_seq = 3  # pages of one sequence: 512 cached tokens + the new one
    cache = lm.new_cache(max_tokens=(8 * per_seq + 8) * 256, page_size=256)  # 8 decode sequences, one 2048-token prompt
    pages = cache.allocator.alloc(8 * per_seq + 8)
    ideal = f" (limit {bandwidth / rank_bytes:.0f} steps/s: {rank_bytes / 1e9:.2f} GB per rank at {bandwidth / 1e9:.0f} GB/s)" if bandwidth else ""
    for batch in (1, 8):
        rows = [pages[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
        step = ForwardBatch.with_cache([[123]] * batch, [512] * batch, rows, cache)
        t = median_seconds(lambda: lm.model.forward(step), device, reps)
        print(f"{label} decode batch {batch}: {t * 1e3:.3f} ms/step = {batch / t:.0f} tokens/s{ideal}", flush=True)
    prompt = ForwardBatch.with_cache([[7] * 2048], [0], [pages[8 * per_seq:]], cache)
    t = median_seconds(lambda: lm.model.forward(prompt), device, max(2, reps // 10))
    print(f"{label} prefill 2048: {t * 1e3:.1f} ms = {2048 / t:.0f} tokens/s", flush=True)
    if hasattr(lm.model, "time_all_reduce"):  # a tensor-parallel model: every rank takes part
        for batch in (1, 8, 2048):
            t = lm.model.time_all_reduce(batch, reps)
            size = batch * hidden * lm.dtype.itemsize
            print(f"{label} all-reduce {batch}x{hidden}: {t * 1e6:.1f} us each, {2 * t * 1e6:.1f} us per layer "
                  f"({2 * layers * t * 1e3:.2f} ms per step of {layers} layers; {size / t / 1e9:.2f} GB/s of payload)",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (quicker to write)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--baseline", action="store_true", help="also time the plain one-device load (no distributed path)")
    ap.add_argument("--dir", type=Path, required=True, help="where the random model is written (reused when it matches)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()

    import trellm
    from trellm.distributed import load_tensor_parallel

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = write_model(args.dir, args.shape, args.layers, args.bits)
    hidden, *_ , n_layers = SHAPES[args.shape]
    layers = args.layers or n_layers
    bandwidth = None
    if device.type == "cuda":
        from common import copy_bandwidth

        bandwidth = copy_bandwidth()
    weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    embed = SHAPES[args.shape][5] * hidden * 2  # the embedding table is read a row per token, not whole
    print(f"model: {args.shape} ({layers} layers, {args.bits} bpw EXL3, {weight_bytes / 1e9:.2f} GB) on {device}", flush=True)
    if args.baseline:
        lm = trellm.load(path, device=device, tokenizer=False)
        measure(lm, "one device", args.reps, bandwidth, weight_bytes - embed, hidden, layers)
        del lm
    for world in args.tp:
        t0 = time.perf_counter()
        lm = load_tensor_parallel(path, world, device, None, progress=False, tokenizer=False)
        print(f"TP {world}: loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        measure(lm, f"TP {world}", args.reps, bandwidth, (weight_bytes - embed) // world, hidden, layers)
        lm.close()
        del lm


if __name__ == "__main__":
    main()
