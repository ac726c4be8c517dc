"""Decode speed with LoRA adapters: tokens/s with 0, 1, 2 and 4 rank-R adapters at batch 1 and 8.

    python benchmarks/bench_lora.py --out /tmp/bench_lora            # GPU: a random Llama-8B-shaped dense model
    python benchmarks/bench_lora.py --layers 4 --rank 16 --batches 1,8 --new-tokens 128

A random Llama of the 8B shape (``--layers`` of its layers; EXL3 at ``--exl3`` bits, or dense bf16 with
``--exl3 0``) and rank-R adapters in PEFT's format on every projection q/k/v/o/gate/up/down are written
straight to safetensors (random codes and factors: the speed is real, the text is not). Each row runs the Generator (CUDA graphs on) with B jobs decoding together:

* ``0 adapters``: the base model, no adapter loaded (the baseline, same process);
* ``N adapters``: N adapters loaded, the B rows spread over them round-robin (1: every row on one adapter).

Printed per row: decode tokens/s over the steps after every prefill, ms per step, the cost against the
baseline, the cost per update call (4 per layer: q/k/v, o, gate/up, down; each one launch on the fused
route, two on the split route) and the weight-read floor of a step (base weights + the adapters the batch
uses, over HBM bandwidth ``--hbm-tb-s``). Issue 25's bar: rank-16 adapters cost at most 10% at batch 1 and
15% at batch 8 with two adapters in the batch. Each adapter row runs once per kernel route (``--routes``,
``TRELLM_LORA_KERNEL``), against one baseline.

Before the model, ``--op-calls`` > 0 times the update op alone on each projection group of the shape (a CUDA
graph of that many calls in a row, rows on two adapters): microseconds per call per route, beside what its
bytes need (the factors of the slots used plus x and y, over ``--hbm-tb-s``; repeated calls find the factors
in L2, so this is the launch and latency cost the step pays).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
UPDATES_PER_LAYER = 4  # update calls per layer with TARGETS: q/k/v and gate/up as one group each, o, down


def _projections(layers: int) -> dict[str, tuple[int, int]]:
    """Every projection of the Llama shape: tensor prefix -> (in, out)."""
    h, i = LLAMA_8B["hidden_size"], LLAMA_8B["intermediate_size"]
    d = h // LLAMA_8B["num_attention_heads"]
    kv = LLAMA_8B["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv), "self_attn.o_proj": (h, h),
              "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}
    return {f"model.layers.{l}.{name}": io for l in range(layers) for name, io in shapes.items()}


def make_model(out: Path, layers: int, adapters: int, rank: int, bits: int) -> tuple[Path, list[Path]]:
    """A random Llama (dense bf16, or EXL3 with ``bits`` per weight and a 6-bit head) and ``adapters`` PEFT-format
    adapters of ``rank`` on every projection, written straight to safetensors (made once, reused from ``out``).
    Random trellis codes decode to meaningless weights: the speed is real, the text is not."""
    from safetensors.torch import save_file

    shape = f"{layers}l_h{LLAMA_8B['hidden_size']}"
    base = out / (f"base_{shape}" + (f"_exl3_{bits}" if bits else ""))
    paths = [out / f"adapter_{shape}_r{rank}_{i}" for i in range(adapters)]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    h, vocab = LLAMA_8B["hidden_size"], LLAMA_8B["vocab_size"]
    if not (base / "config.json").is_file():
        base.mkdir(parents=True, exist_ok=True)
        config = dict(LLAMA_8B, num_hidden_layers=layers, architectures=["LlamaForCausalLM"], model_type="llama",
                      torch_dtype="bfloat16", hidden_act="silu")
        (base / "config.json").write_text(json.dumps(config))
        tensors = {"model.embed_tokens.weight": torch.randn(vocab, h, device=dev, generator=g).bfloat16() * 0.02,
                   "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
        for l in range(layers):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"model.layers.{l}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for key, (k, n) in {**_projections(layers), "lm_head": (h, vocab)}.items():
            if bits:
                kb = 6 if key == "lm_head" else bits
                tensors[f"{key}.trellis"] = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * kb), device=dev,
                                                          dtype=torch.int16, generator=g)
                tensors[f"{key}.suh"] = (torch.randn(k, device=dev, generator=g) * 0.02).half()
                tensors[f"{key}.svh"] = (torch.randn(n, device=dev, generator=g) * 0.02).half()
            else:
                tensors[f"{key}.weight"] = (torch.randn(n, k, device=dev, generator=g) * 0.02).bfloat16()
        save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(base / "model.safetensors"))
    for i, path in enumerate(paths):
        if (path / "adapter_config.json").is_file():
            continue
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none"}))
        factors = {}
        for key, (k, n) in _projections(layers).items():
            factors[f"base_model.model.{key}.lora_A.weight"] = (torch.randn(rank, k, device=dev, generator=g) * 0.01).bfloat16()
            factors[f"base_model.model.{key}.lora_B.weight"] = (torch.randn(n, rank, device=dev, generator=g) * 0.01).bfloat16()
        save_file({k: v.cpu() for k, v in factors.items()}, str(path / "adapter_model.safetensors"))
    return base, paths


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_rate(lm, batch: int, names: list[str | None], new_tokens: int, prompt_len: int) -> tuple[float, float]:
    """(decode tokens/s, ms per step) of ``batch`` jobs decoding together, rows on ``names`` round-robin."""
    from trellm.generator import Generator, Job

    gen = Generator(lm, max_batch_size=batch, cache_tokens=batch * (prompt_len + new_tokens) + 1024, page_size=256,
                    max_chunk_tokens=max(512, batch * prompt_len))
    prompts = [[(7 * i + 13 * j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    for warm in (True, False):
        n = 8 if warm else new_tokens
        jobs = [Job(p, n, lora=names[i % len(names)], stop_token_ids=[]) for i, p in enumerate(prompts)]
        gen.enqueue(jobs)
        while any(r.prefilling for r in gen.active) or gen.pending:  # prefill every job first
            gen.iterate()
        _sync()
        t0, steps, tokens = time.perf_counter(), 0, 0
        while gen.has_work():
            tokens += sum(len(getattr(r, "token_ids", ())) for r in gen.iterate() if type(r).__name__ == "TokenChunk")
            steps += 1
        _sync()
        dt = time.perf_counter() - t0
    return tokens / dt, 1e3 * dt / steps


def _op_groups() -> dict[str, tuple[int, list[int], bool]]:
    """The update calls of one layer of the shape: name -> (k, output widths, in place)."""
    h, i = LLAMA_8B["hidden_size"], LLAMA_8B["intermediate_size"]
    kv = LLAMA_8B["num_key_value_heads"] * (h // LLAMA_8B["num_attention_heads"])
    return {"q/k/v": (h, [h, kv, kv], True), "o": (h, [h], False), "gate/up": (h, [i, i], True), "down": (i, [h], False)}


def op_rates(routes: list[str], batches: list[int], rank: int, calls: int, hbm_tb_s: float) -> list[dict]:
    """Microseconds per update call of each projection group, route and batch (two adapter slots, rows
    alternating between them), from a CUDA graph of ``calls`` calls replayed; printed beside the bytes floor."""
    from trellm import ops
    from trellm.ops.lora import LORA_KERNEL_ENV

    rows_out, slots_n, dtype, dev = [], 2, torch.float16, "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    for name, (k, ns, in_place) in _op_groups().items():
        a = [(torch.randn(slots_n * rank, k, device=dev, generator=g) * k ** -0.5).to(dtype) for _ in ns]
        b = [(torch.randn(n, slots_n * rank, device=dev, generator=g) * 0.01).to(dtype) for n in ns]
        for batch in batches:
            x = torch.randn(batch, k, device=dev, generator=g).to(dtype)
            ys = [torch.randn(batch, n, device=dev, generator=g).to(dtype) for n in ns]
            slots = torch.arange(batch, device=dev) % slots_n
            used = min(batch, slots_n)
            nbytes = 2 * (used * rank * (len(ns) * k + sum(ns)) + batch * (k + 2 * sum(ns)))
            line = f"  {name:8s} batch {batch:2d}:"
            for route in routes:
                os.environ[LORA_KERNEL_ENV] = route

                def call():
                    if in_place:
                        ops.lora_add_parts(ys, x, a, b, slots, rank)
                    else:
                        ops.lora_add(ys[0], x, a[0], b[0], slots, rank, out=torch.empty_like(ys[0]))

                call()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(calls):
                        call()
                graph.replay()
                _sync()
                reps = 20
                t0 = time.perf_counter()
                for _ in range(reps):
                    graph.replay()
                _sync()
                us = 1e6 * (time.perf_counter() - t0) / (reps * calls)
                line += f"  {route} {us:6.2f} us/call"
                rows_out.append(dict(group=name, batch=batch, route=route, us_call=us, floor_us=1e6 * nbytes / (hbm_tb_s * 1e12)))
            print(f"{line}   (bytes floor {1e6 * nbytes / (hbm_tb_s * 1e12):.2f} us)", flush=True)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/bench_lora", help="where the random model and adapters are written")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the 8B shape (32 = the whole 8B)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--exl3", type=int, default=4, metavar="BITS", help="EXL3 base with BITS per weight (0: dense bf16)")
    ap.add_argument("--adapters", default="0,1,2,4", help="adapter counts to compare")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--hbm-tb-s", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8 TB/s)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--device", default="cuda", help="cuda (the figures that count); cpu only checks the script runs")
    ap.add_argument("--shape", default=None, help="JSON of LlamaConfig values replacing the 8B shape's (smoke runs)")
    ap.add_argument("--routes", default="fused,split", help="TRELLM_LORA_KERNEL routes to compare (CUDA)")
    ap.add_argument("--op-calls", type=int, default=50, help="update calls per graph when timing the op alone (0: skip)")
    args = ap.parse_args()
    if args.shape:
        LLAMA_8B.update(json.loads(args.shape))
    import trellm

    from trellm.ops.lora import LORA_KERNEL_ENV

    counts = [int(c) for c in args.adapters.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    routes = args.routes.split(",") if args.device == "cuda" else ["reference"]
    if args.device == "cuda" and args.op_calls > 0:
        print(f"the update op alone, rank {args.rank}, rows on two adapters ({args.op_calls} calls per CUDA graph):")
        op_rows = op_rates(routes, batches, args.rank, args.op_calls, args.hbm_tb_s)
    else:
        op_rows = []
    base, paths = make_model(Path(args.out), args.layers, max(counts), args.rank, args.exl3)
    lm = trellm.load(base, device=args.device, dtype=torch.float16 if args.exl3 else torch.bfloat16, tokenizer=False)
    weight_bytes = lm.model.nbytes() - lm.model.embed.weight.numel() * 2  # the embedding is gathered, not read whole
    per_adapter = sum(p.stat().st_size for p in paths[0].glob("*.safetensors")) if paths else 0  # stored 16-bit
    kind = f"EXL3 {args.exl3} bpw (head 6)" if args.exl3 else "dense bf16"
    print(f"model: Llama-8B shape, {args.layers} layers, {kind}, {weight_bytes / 1e9:.2f} GB read per step; "
          f"rank-{args.rank} adapters on q/k/v/o/gate/up/down, {per_adapter / 1e6:.1f} MB each (bf16)")
    updates = UPDATES_PER_LAYER * args.layers
    rows, baseline = [], {}
    for count in counts:
        for name in list(lm.loras):
            lm.unload_lora(name)
        names: list[str | None] = [lm.load_lora(p, name=f"a{i}") for i, p in enumerate(paths[:count])] or [None]
        for route in routes[:1] if count == 0 else routes:
            os.environ[LORA_KERNEL_ENV] = route if route != "reference" else "fused"
            for batch in batches:
                tps, ms = decode_rate(lm, batch, names, args.new_tokens, args.prompt_len)
                used = min(count, batch)
                floor_ms = 1e3 * (weight_bytes + used * per_adapter) / (args.hbm_tb_s * 1e12)
                if count == 0:
                    baseline[batch] = ms
                cost = f"{100 * (ms / baseline[batch] - 1):+.1f}% vs base" if batch in baseline else ""
                per_call = (f"{1e3 * (ms - baseline[batch]) / updates:6.2f} us per update call ({route})"
                            if count and batch in baseline else "")
                print(f"batch {batch:2d}, {count} adapter(s): {tps:8.1f} tokens/s, {ms:.3f} ms/step {cost:>16} "
                      f"{per_call:>36}   (weight-read floor {floor_ms:.3f} ms/step)", flush=True)
                rows.append(dict(batch=batch, adapters=count, route=None if count == 0 else route, tokens_s=tps,
                                 ms_step=ms, floor_ms=floor_ms,
                                 cost_pct=None if count == 0 else 100 * (ms / baseline[batch] - 1),
                                 us_per_update=None if count == 0 else 1e3 * (ms - baseline[batch]) / updates))
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": rows, "op": op_rows}, indent=1))


if __name__ == "__main__":
    main()
