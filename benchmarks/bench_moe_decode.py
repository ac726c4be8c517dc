"""Decode speed of a Qwen3.5-MoE-shaped (or Qwen3-MoE-shaped) model with random weights, next to the bandwidth ideal.

    python benchmarks/bench_moe_decode.py --device cuda                  # Qwen3.5-35B-A3B shape, bf16 weights
    python benchmarks/bench_moe_decode.py --device cuda --weights exl3   # random EXL3 (4-bit) weights
    python benchmarks/bench_moe_decode.py --device cuda --layers 8       # fewer layers (faster to set up)
    python benchmarks/bench_moe_decode.py --device cuda --weights exl3 --generator  # + through the Generator
    python benchmarks/bench_moe_decode.py --tiny                         # CPU smoke run, tiny dims
    python benchmarks/bench_moe_decode.py --device cuda --weights exl3 --shape qwen3-30b-a3b --batch 1 8  # 48 layers, 128 experts
    python benchmarks/bench_moe_decode.py --device cuda --weights exl3 --moe-decode pairs fused one_launch \
        --deltanet-decode unfused fused                                  # the decode routes side by side
    python benchmarks/bench_moe_decode.py --device cuda --weights exl3 --mul1-gemv fma split  # MUL1's two decode routes

The model is built from trellm's modules (the qwen3_5_moe plugin) and filled with random tensors
straight on the device, no checkpoint written. Each batch row is one sequence with its own paged
KV pages and recurrent-state slot; after a short prefill, ``--steps`` decode steps are timed twice:
eagerly (one host round trip per step, as the generator runs today) and, on CUDA, as replays of the
step captured in a CUDA graph (the step feeds its argmax back and advances positions on the device;
``--no-graph`` skips it). A capture that fails names the line with the host sync.
The ideal is the bytes one decode step must read (weights of the layers' non-expert parts, the
experts the batch routes to, the LM head) divided by the measured copy bandwidth (CUDA) or a
nominal one; at batch > 1 the expected number of distinct experts per layer under uniform
routing, E * (1 - (1 - k/E)^B), is used. ``--moe-decode`` and ``--deltanet-decode`` time each listed
decode route on the same model, one row per pair (``TRELLM_MOE_DECODE``: "pairs" runs the shared
expert as its own MLP, "fused" inside the routed pair launches, "one_launch" also finishes each pair
matmul in its own launch; ``TRELLM_DELTANET_DECODE``: "unfused" or "fused" gated-delta-net glue).
"""
from __future__ import annotations

import argparse
import math
import os
import time
import traceback
from types import SimpleNamespace

import torch
from trellm.batch import ForwardBatch
from trellm.cache import KVCache, SequenceState
from trellm.cache.recurrent import alloc_state_slot
from trellm.config import DecoderConfig
from trellm.modules.base import LoadContext
from trellm.modules.moe import MOE_DECODE_ENV, MOE_DECODE_MODES, moe_decode_mode
from trellm.modules.recurrent import DELTANET_DECODE_ENV, DELTANET_DECODE_MODES, deltanet_decode_mode
from trellm.ops.exl3 import MUL1_GEMV_ENV, MUL1_GEMV_ROUTES, mul1_gemv_route
from trellm.sdk import build_qwen3_5_moe

# Qwen3.5-35B-A3B text config (hidden 2048, 40 layers, 3 linear : 1 full attention, 256 experts, top 8).
FULL = {
    "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "intermediate_size": 512, "vocab_size": 248320, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}
TINY = dict(
    FULL, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=32, vocab_size=1024,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
)
# Qwen3-30B-A3B config (hidden 2048, 48 attention layers, 128 experts, top 8, no shared expert).
FULL_QWEN3 = {
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "rope_theta": 1000000.0,
}
TINY_QWEN3 = dict(FULL_QWEN3, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, vocab_size=1024, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128)
SHAPES = {  # name: (full config, tiny config, architecture, norm weights stored as w - 1)
    "qwen3.5-35b-a3b": (FULL, TINY, "Qwen3_5MoeForCausalLM", True),
    "qwen3-30b-a3b": (FULL_QWEN3, TINY_QWEN3, "Qwen3MoeForCausalLM", False),
}


def build_model(architecture: str, cfg: DecoderConfig):
    """The model as trellm's plugin for ``architecture`` builds it."""
    if architecture == "Qwen3MoeForCausalLM":
        from trellm.sdk import DecoderOptions, build_decoder, use_qwen3_moe_layers

        model = build_decoder(cfg, DecoderOptions(qk_norm=True))
        use_qwen3_moe_layers(model, cfg)
        return model
    return build_qwen3_5_moe(cfg)


def make_cache(model, max_tokens: int, page: int, slots: int):
    """The model's paged cache (with ``slots`` recurrent-state slots for a hybrid model)."""
    if hasattr(model, "make_cache"):
        return model.make_cache(max_tokens=max_tokens, page_size=page, max_slots=slots)
    return KVCache.for_model(model, max_tokens=max_tokens, page_size=page)


class RandomWeights:
    """A stand-in WeightStore that makes every requested tensor up (normal(0, std); sensible norms and decays)."""

    model_dir = "<random weights>"

    def __init__(self, seed: int = 0, std: float = 0.02, stacked_experts: bool = True, norm_offset: bool = True):
        self.std, self.stacked_experts, self.norm_offset = std, stacked_experts, norm_offset
        torch.manual_seed(seed)

    def __iter__(self):
        return iter(())  # no listing: optional tensors (MTP heads) count as absent

    def __contains__(self, name: str) -> bool:
        if name.endswith("experts.gate_up_proj"):
            return self.stacked_experts  # [E, 2I, H] tensors rather than one Linear per expert
        if name.endswith(("experts.gate_proj.weight", "experts.up_proj.weight", "experts.down_proj.weight")):
            return False  # not gate and up stacked apart (Step 3.5's layout): that would read dense experts
        return name.endswith((".weight", "A_log", "dt_bias"))  # no biases

    def info(self, name: str) -> SimpleNamespace:
        """No stored layout: every tensor is made in the shape it is asked for (never read as transposed)."""
        return SimpleNamespace(shape=())

    def get(self, name: str, shape=None, dtype=None, device=None) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32 if dtype is None else dtype, device=device)
        if name.endswith("linear_attn.norm.weight"):
            return t.fill_(1.0)
        if name.endswith(("norm.weight", "layernorm.weight")):
            return t.zero_() if self.norm_offset else t.fill_(1.0)  # stored as w - 1 (Qwen3.5) or w
        if name.endswith("A_log"):
            return t.uniform_(0.0, math.log(16.0))
        if name.endswith("dt_bias"):
            return t.fill_(1.0)
        return t.normal_(0.0, self.std)


class RandomEXL3:
    """A QuantFormat that gives every big Linear random EXL3 tensors (``bits`` per weight) instead of reading them."""

    name = "exl3-random"

    def __init__(self, bits: int = 4, codebook: str = "mul1"):
        self.bits, self.codebook = bits, codebook

    def detect(self, store, key: str) -> bool:
        return not key.endswith(("in_proj_b", "in_proj_a", "shared_expert_gate", "mlp.gate", "lm_head"))

    def load_linear(self, store, key, in_features, out_features, bias, device, dtype):
        from trellm.quant.exl3.format import EXL3Linear

        pad = lambda n: -(-n // 128) * 128
        k, n = pad(in_features), pad(out_features)
        trellis = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * self.bits), dtype=torch.int16, device=device)
        suh = (torch.randint(0, 2, (k,), device=device) * 2 - 1).half()
        svh = torch.full((n,), 0.02 / math.sqrt(k), dtype=torch.float16, device=device)
        return EXL3Linear(trellis, suh, svh, self.codebook, in_features, out_features, None, key)


def linear_bytes(model) -> tuple[int, int, int]:
    """(bytes outside the routed experts, bytes of one routed expert, number of MoE layers)."""
    routed = [layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts")]
    routed_bytes = sum(e.nbytes() for e in routed)
    expert_bytes = routed[0].nbytes() // routed[0].num_experts if routed else 0
    embed = model.embed.nbytes()  # one row per token is read, not the table
    return model.nbytes() - routed_bytes - embed, expert_bytes, len(routed)


def _decode_graph(model, cache, seqs, slot_t, first_ids: list[int], page: int):
    """A self-advancing decode step captured in a CUDA graph: each replay runs the model on the static
    batch, writes the argmax tokens back as the next inputs and advances positions, context lengths and
    cache slots on the device, so replays need no host work. Returns (graph, step) or raises when the
    step is not capturable (a host sync on the path)."""
    device = cache.device
    width = max(len(s.pages) for s in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        table[i, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
    table = table.to(device)
    lengths = torch.tensor([s.length for s in seqs], dtype=torch.long, device=device)
    n = len(seqs)
    batch = ForwardBatch(
        input_ids=torch.tensor(first_ids, dtype=torch.long, device=device),
        positions=lengths.clone(),
        cu_seqlens=torch.arange(n + 1, dtype=torch.int32, device=device),
        logits_indices=torch.arange(n, dtype=torch.long, device=device),
        cache=cache,
        block_table=table,
        context_lens=(lengths + 1).to(torch.int32),
        slots=torch.zeros(n, dtype=torch.long, device=device),
        max_seq_len=width * page,
        state_slots=slot_t,
        cached_lens=None,  # decode rows are never fresh: no zero-state test (a host sync) in the recurrent layers
    )

    def set_slots() -> None:
        pos = batch.positions
        batch.slots.copy_(table.gather(1, (pos // page)[:, None])[:, 0].long() * page + pos % page)

    def step() -> None:
        logits = model.forward(batch)
        batch.input_ids.copy_(logits.argmax(-1))
        batch.positions.add_(1)
        batch.context_lens.add_(1)
        set_slots()

    set_slots()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: lazy tables, kernel library, RoPE tables
            step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph


def run(model, cfg, batch_size: int, prompt_len: int, steps: int, device, use_graph: bool,
        use_generator: bool = False) -> dict[str, float | str]:
    """Decode tokens/s of ``batch_size`` sequences decoding together: eagerly (one host round trip per
    step), when ``use_graph`` and the step is capturable as CUDA-graph replays, and with ``use_generator``
    through the Generator (async scheduling off and on)."""
    page = 64
    total = prompt_len + 2 * (steps + 4) + 8
    cache = make_cache(model, batch_size * (-(-total // page) + 1) * page, page, batch_size)
    seqs, slots = [], []
    for _ in range(batch_size):
        s = SequenceState(cache)
        s.reserve(total)
        seqs.append(s)
        slots.append(alloc_state_slot(cache))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch_size)]
    slot_t = None if None in slots else torch.tensor(slots, dtype=torch.long, device=device)  # None: no recurrent layers
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def forward(tokens: list[list[int]]) -> torch.Tensor:
        batch = ForwardBatch.with_cache(tokens, [s.length for s in seqs], [s.pages for s in seqs], cache)
        batch.state_slots = slot_t
        out = model.forward(batch)
        for s, t in zip(seqs, tokens):
            s.length += len(t)
        return out

    result: dict[str, float | str] = {}
    with torch.inference_mode():
        nxt = forward(prompts).argmax(-1).tolist()
        for _ in range(2):  # warm-up steps
            nxt = forward([[t] for t in nxt]).argmax(-1).tolist()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = forward([[t] for t in nxt]).argmax(-1).tolist()
        sync()
        result["eager"] = batch_size * steps / (time.perf_counter() - t0)
        if use_graph and device.type == "cuda":
            try:
                graph = _decode_graph(model, cache, seqs, slot_t, nxt, page)
            except Exception as e:  # a host sync on the path: report eager only, naming the innermost trellm line
                frames = [f for f in traceback.extract_tb(e.__traceback__) if "/trellm/" in f.filename or "/core/" in f.filename]
                where = f" at {frames[-1].filename.split('/')[-1]}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
                result["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}{where}"
                torch.cuda.synchronize()
            else:
                graph.replay()
                sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    graph.replay()
                sync()
                result["graph"] = batch_size * steps / (time.perf_counter() - t0)
                del graph
    for s in seqs:
        s.release()
    if use_generator:
        for overlap in (False, True):
            result["gen-async" if overlap else "gen"] = generator_rate(model, prompts, steps, page, overlap)
    return result


def generator_rate(model, prompts: list[list[int]], steps: int, page: int, async_scheduling: bool) -> float:
    """Decode tokens/s of the same jobs through trellm's Generator (its paged cache, CUDA graphs, device
    sampling and host bookkeeping), over the steps that do no prefill work."""
    from trellm.generator import Generator, Job, JobStarted, PrefillProgress

    total = len(prompts[0]) + steps + 4
    gen = Generator(model, max_batch_size=len(prompts), cache_tokens=len(prompts) * (-(-total // page) + 2) * page,
                    page_size=page, max_chunk_tokens=max(512, len(prompts) * len(prompts[0])), prefix_caching=False,
                    async_scheduling=async_scheduling)
    gen.generate([p[:8] for p in prompts], 3, stop_token_ids=[])  # warm-up: captures this batch size's graph
    gen.enqueue([Job(p, steps + 4, stop_token_ids=[]) for p in prompts])
    decode_time, decode_tokens = 0.0, 0
    while gen.has_work():
        t0 = time.perf_counter()
        results = gen.iterate()
        if not any(isinstance(r, (JobStarted, PrefillProgress)) for r in results):
            decode_time += time.perf_counter() - t0
            decode_tokens += sum(len(getattr(r, "token_ids", ())) for r in results if type(r).__name__ == "TokenChunk")
    return decode_tokens / decode_time if decode_time else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-35b-a3b", help="the model shape (default Qwen3.5-35B-A3B)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (CPU smoke run)")
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers (keep a multiple of 4)")
    ap.add_argument("--weights", choices=("bf16", "exl3"), default="bf16")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--codebook", choices=("mul1", "mcg", "3inst"), default="mul1",
                    help="the random EXL3 weights' codebook (default mul1: what both converters write)")
    ap.add_argument("--mul1-gemv", nargs="+", choices=MUL1_GEMV_ROUTES, default=None,
                    help="with --weights exl3 --codebook mul1: time each of these MUL1 decode routes (TRELLM_MUL1_GEMV) in turn")
    ap.add_argument("--experts", choices=("stacked", "per_expert"), default=None,
                    help="expert layout (default: stacked for bf16, per_expert for exl3, whose experts are Linears)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--no-graph", action="store_true", help="time eager decode only (no CUDA-graph capture)")
    ap.add_argument("--generator", action="store_true",
                    help="also decode the same jobs through the Generator (rows gen, gen-async), beside the captured step")
    ap.add_argument("--moe-decode", nargs="+", choices=MOE_DECODE_MODES, default=None,
                    help=f"MoE decode routes to time, one row each (default: ${MOE_DECODE_ENV} or fused)")
    ap.add_argument("--deltanet-decode", nargs="+", choices=DELTANET_DECODE_MODES, default=None,
                    help=f"gated delta net decode routes to time, one row each (default: ${DELTANET_DECODE_ENV} or fused)")
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s for the ideal (default: measured on CUDA, 50e9 on CPU)")
    args = ap.parse_args()
    device = torch.device(args.device)
    full, tiny, architecture, norm_offset = SHAPES[args.shape]
    raw = dict(tiny if args.tiny else full)
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    raw["architectures"] = [architecture]
    cfg = DecoderConfig.from_hf(raw)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(architecture, cfg)
    formats = [RandomEXL3(args.bits, args.codebook)] if args.weights == "exl3" else []
    t0 = time.perf_counter()
    layout = args.experts or ("per_expert" if args.weights == "exl3" else "stacked")
    if layout == "stacked" and args.weights == "exl3":
        raise SystemExit("EXL3 experts are per-expert Linears; use --experts per_expert")
    store = RandomWeights(stacked_experts=layout == "stacked", norm_offset=norm_offset)
    model.load(LoadContext(store=store, device=device, dtype=dtype, quant_formats=formats))
    loaded = {layer.mlp.experts.layout for layer in model.layers if hasattr(layer.mlp, "experts")}
    if loaded != {layout}:
        raise SystemExit(f"asked for {layout} experts, the model loaded {sorted(loaded)}")
    weights = f"exl3 {args.bits} bpw {args.codebook}" if args.weights == "exl3" else args.weights
    print(f"built {cfg.num_hidden_layers}-layer {args.shape}-shaped model ({weights}, {layout} experts, {dtype}) on {device} "
          f"in {time.perf_counter() - t0:.1f}s: {model.nbytes() / 1e9:.2f} GB")
    if args.bandwidth:
        bandwidth = args.bandwidth
    elif device.type == "cuda":
        from common import copy_bandwidth  # benchmarks/common.py

        bandwidth = copy_bandwidth()
    else:
        bandwidth = 50e9
    dense_bytes, expert_bytes, moe_layers_count = linear_bytes(model)
    experts, top_k = cfg.extra["num_experts"], cfg.extra["num_experts_per_tok"]
    steps = args.steps or (4 if args.tiny else 16)
    print(f"bandwidth for the ideal: {bandwidth / 1e9:.0f} GB/s; non-expert weights {dense_bytes / 1e9:.3f} GB, "
          f"one expert {expert_bytes / 1e6:.2f} MB x {experts} x {moe_layers_count} layers")
    moe_layers = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts")]
    experts0 = moe_layers[0].experts if moe_layers else None
    sync_free = experts0 is not None and (experts0.layout == "stacked" or getattr(experts0.active, "pair_set", None) is not None)
    state_bytes = sum(l.nbytes() for l in make_cache(model, 64, 64, 1).state_layers())
    folded = sum(m.shared_fold is not None for m in moe_layers)
    print(f"MoE dispatch at decode: {'sync-free pair kernels (graph-capturable)' if sync_free else 'grouped by expert (host sync per layer)'}; "
          f"shared expert foldable into the pair launches in {folded} of {len(moe_layers)} MoE layers; "
          f"recurrent state per sequence {state_bytes / 1e6:.1f} MB (read + written each step, not in the ideal)")
    print(f"{'batch':>5} {'moe/deltanet/mul1 route':>25} {'mode':>9} {'tokens/s':>10} {'ms/step':>9} {'ideal tok/s':>12} "
          f"{'of ideal':>9} {'GB read/step':>13}")
    routes = [(m, d, g) for m in args.moe_decode or [moe_decode_mode()] for d in args.deltanet_decode or [deltanet_decode_mode()]
              for g in args.mul1_gemv or [mul1_gemv_route()]]
    for b in args.batch:
        touched = experts * (1 - (1 - top_k / experts) ** b)
        step_bytes = dense_bytes + touched * expert_bytes * moe_layers_count
        ideal = b * bandwidth / step_bytes
        for moe_route, deltanet_route, mul1_route in routes:
            os.environ[MOE_DECODE_ENV], os.environ[DELTANET_DECODE_ENV] = moe_route, deltanet_route
            os.environ[MUL1_GEMV_ENV] = mul1_route
            route = f"{moe_route}/{deltanet_route}/{mul1_route}"
            res = run(model, cfg, b, args.prompt, steps, device, not args.no_graph, args.generator)
            for mode in ("eager", "graph", "gen", "gen-async"):
                if mode in res:
                    tps = res[mode]
                    print(f"{b:>5} {route:>25} {mode:>9} {tps:>10.1f} {1e3 * b / tps:>9.2f} {ideal:>12.0f} {tps / ideal:>8.1%} "
                          f"{step_bytes / 1e9:>13.3f}")
            if "graph" in res and "eager" in res:
                print(f"{'':>31} graph / eager: {res['graph'] / res['eager']:.2f}x")
            for mode in ("gen", "gen-async"):
                if res.get(mode) and "graph" in res:
                    print(f"{'':>31} {mode} / graph: {res[mode] / res['graph']:.2f}x (target: >= 0.90)")
            if "graph_error" in res:
                print(f"{'':>31} graph capture failed, eager only: {res['graph_error']}")


if __name__ == "__main__":
    main()
