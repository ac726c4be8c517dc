"""Generator throughput: tokens/s vs number of concurrent jobs, and speculative decoding speed-up.

    python benchmarks/bench_generator.py                       # SmolLM2 (the default model), CPU or GPU
    python benchmarks/bench_generator.py --device cuda --random-exl3 /tmp/r8b --batch-sizes 1,8,32,64 \
        --prompt-tokens 512 --new-tokens 256                    # Llama-3.1-8B shape, random EXL3 4 bpw, mul1
    python benchmarks/bench_generator.py --batch-sizes 1,4,16 --new-tokens 64 --plot gen.png
    python benchmarks/bench_generator.py --speculative ngram   # n-gram lookup on a repetitive task
    python benchmarks/bench_generator.py --device cuda --speculative ngram --cuda-graphs both   # verification captured vs eager
    python benchmarks/bench_generator.py --speculative draft --draft-model /path/to/small-or-quantized

Prints one row per batch size: wall time, generated tokens/s over the whole run (prefill included), then the
decode figures over the steps where every job decodes (the prefills are staggered, so at the end jobs finish one
per step and the batch shrinks; those steps are left out): decode tokens/s and ms per step, on CUDA the captured
step alone (the replay of the generator's own decode graph for that batch, on the inputs of one of those steps,
timed in the same process right after the run) and how much longer the generator's step took ("over %", the
target is under 5), the host's own ms per step (CUDA: the step's wall time less the time iterate() waited for the
device's tokens; CPU: this thread's CPU time less the forward's and the token choice's, what a GPU would run), the share of steps queued
ahead of the previous one's read-back, and mean time to first token. Each batch size runs with the generator's
async scheduling off and then on (``--async-scheduling both``, the default; rows marked "async"): with it the
host's work overlaps the next step on the device. Every decode graph size is captured before the timing
(``Generator.capture_graphs``); ``--capture lazy`` captures each when a step first needs it, inside the timing, as
this benchmark did before (tens of ms per size, which showed as per-step host work). Every row names the weights'
codebook. With matplotlib installed, ``--plot`` saves tokens/s vs batch size.

``--random-exl3 DIR`` writes (once; reused while its settings match) a Llama-3.1-8B-shaped model with
random EXL3 weights (``--bits``, head 6 bits, ``--codebook`` mul1 by default, what both converters write)
and benchmarks it; no tokenizer, prompts are token ids. ``--sample`` gives every job the "default" sampler
preset (temperature 0.8, top-k 50, top-p 0.95) with a seed, instead of greedy decoding. ``--mul1-gemv fma split``
runs every batch size on each MUL1 decode route of the CUDA matmuls (``TRELLM_MUL1_GEMV``) in this process.

Fixed per-step overhead (host work around the forward) shows best with a model whose forward is
cheap: on a GPU the SmolLM2 shape at batch 1; on CPU ``--random-like-smollm2 DIR --tiny`` (2 layers,
hidden 64, SmolLM2's vocabulary). ``--profile`` prints where the decode steps' host time goes.

    python benchmarks/bench_generator.py --device cuda --dtype bfloat16 --batch-sizes 1,8,32 --new-tokens 256
    python benchmarks/bench_generator.py --random-like-smollm2 /tmp/rsmol --tiny --threads 1 --profile
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import json
import os
from pathlib import Path

import torch

import trellm
from trellm.generator import (DraftModelProposer, Generator, Job, JobFinished, JobStarted, NgramProposer,
                              PrefillProgress, SamplerSettings, TokenChunk)
from trellm.ops.exl3 import MUL1_GEMV_ENV, MUL1_GEMV_ROUTES, mul1_gemv_route

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     tie_word_embeddings=True, initializer_range=0.02)

LLAMA_8B_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)

TOPICS = ["the sea", "a mountain village", "an old clock", "the first snow", "a city at night", "a lost key",
          "the library", "a long train ride", "a garden in spring", "the lighthouse", "a chess game", "the desert"]


def prompts(lm, n: int, prompt_tokens: int) -> list[list[int]]:
    """``n`` distinct prompts of exactly ``prompt_tokens`` tokens each (a sentence repeated as often as needed:
    a fixed number of repeats ran out near 700 tokens and silently benchmarked shorter prompts)."""
    out = []
    for i in range(n):
        if lm.tokenizer is None:
            out.append([(7 * i + j) % 200 + 1 for j in range(prompt_tokens)])
            continue
        sentence = lm.tokenizer.encode(f"Story {i}: write a short story about {TOPICS[i % len(TOPICS)]}. ")
        ids = sentence * -(-prompt_tokens // len(sentence))
        out.append(ids[:prompt_tokens])
    return out


def write_random_exl3(path: Path, bits: int, codebook: str, head_bits: int = 6) -> Path:
    """A Llama-3.1-8B-shaped model directory whose projections and LM head are random EXL3 tensors (the given
    codebook's marker on each), random norms and embeddings: for speed only, its output is noise. Written once;
    a directory written with other settings is rewritten."""
    from safetensors.torch import save_file

    from trellm.quant.exl3.format import MARKER_VALUES

    quant = {"quant_method": "exl3", "bits": bits, "head_bits": head_bits, "codebook": codebook, "random_weights": True}
    config = dict(LLAMA_8B_SHAPE, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float16",
                  quantization_config=quant)
    if (path / "config.json").is_file() and json.loads((path / "config.json").read_text()) == config:
        return path
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    h, inter, heads, kv = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"))
    head_dim = h // heads

    def exl3(key: str, k: int, n: int, K: int) -> dict[str, torch.Tensor]:
        return {f"{key}.trellis": torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), generator=g, dtype=torch.int16),
                f"{key}.suh": torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0).half(),
                f"{key}.svh": ((torch.rand(n, generator=g) + 0.5) / k**0.5).half(),
                f"{key}.{codebook}": torch.tensor(MARKER_VALUES[codebook], dtype=torch.int32)}

    files = {}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t = {f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.float16),
             f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.float16)}
        for name, k, n in (("self_attn.q_proj", h, heads * head_dim), ("self_attn.k_proj", h, kv * head_dim),
                           ("self_attn.v_proj", h, kv * head_dim), ("self_attn.o_proj", heads * head_dim, h),
                           ("mlp.gate_proj", h, inter), ("mlp.up_proj", h, inter), ("mlp.down_proj", inter, h)):
            t.update(exl3(f"{p}.{name}", k, n, bits))
        files[f"model-layer{i:02d}.safetensors"] = t
    files["model-rest.safetensors"] = {
        "model.embed_tokens.weight": (torch.randn(config["vocab_size"], h, generator=g) * 0.02).half(),
        "model.norm.weight": torch.ones(h, dtype=torch.float16), **exl3("lm_head", h, config["vocab_size"], head_bits)}
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, str(path / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path


def codebook_of(model_dir: Path) -> str:
    """The EXL3 codebook the model's config names ("dense" for unquantized weights)."""
    quant = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
    if quant.get("quant_method") != "exl3":
        return "dense"
    return quant.get("codebook", "3inst")


def captured_step_ms(gen: Generator, n: int, reps: int = 50, width: int = 1, staged: torch.Tensor | None = None
                     ) -> float | None:
    """Median ms of one replay of the generator's own captured graph for ``n`` sequences of ``width`` tokens (1: the
    decode step, k + 1: the verification of k drafts): the step's GPU work alone, on the inputs its last step
    staged, or on ``staged`` (a copy of :func:`staged_inputs`: a step of the run with every row real, whose
    attention reads every job's context; the jobs' pages are free by now, the replay only rewrites them); None
    when no graph ran that size."""
    runner = gen.graph_runner
    size = None if runner is None else next((b for b in runner.batch_sizes if b >= n), None)
    if size is None or (size, width) not in runner.graphs:
        return None
    from common import replay_seconds  # benchmarks/common.py, next to this script

    if staged is not None:
        with torch.inference_mode():  # the runner's buffers are inference tensors
            runner.buffers[size, width].dev.copy_(staged)
    graph = runner.graphs[size, width][0]
    for _ in range(3):
        graph.replay()
    return 1e3 * replay_seconds(graph, reps)


def staged_inputs(gen: Generator, n: int) -> torch.Tensor | None:
    """A copy of what the generator last staged for the decode graph of ``n`` sequences (device order: taken after
    the step's own upload and fed ids), for :func:`captured_step_ms`."""
    runner = gen.graph_runner
    size = None if runner is None else next((b for b in runner.batch_sizes if b >= n), None)
    buffers = None if size is None else runner.buffers.get((size, 1))
    return None if buffers is None else buffers.dev.clone()


class _DeviceWork:
    """CPU runs: this thread's CPU seconds in the model's forward and the token choice, the work a GPU would do
    while the host goes on; the step's CPU seconds less these are the host's own work (CPU seconds, not wall: other
    processes on the machine do not count). Wraps the generator's instance attributes; not used on CUDA (there the
    host's time is the wall time less the read-back wait)."""

    def __init__(self, gen: Generator):
        self.seconds = 0.0
        self.wrapped = [(gen.model, "forward"), (gen, "_choose")]
        for owner, name in self.wrapped:
            setattr(owner, name, self._timed(getattr(owner, name)))

    def restore(self) -> None:
        for owner, name in self.wrapped:
            delattr(owner, name)  # the class's method again (the model is shared by the runs)

    def _timed(self, fn):
        def run(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - t
        return run


class _DeviceTrace:
    """torch.profiler over ``steps`` consecutive decode steps (CUDA kernels, graph replays included): whether the
    gap between the generator's step and its captured graph is extra device work or the device waiting."""

    def __init__(self, steps: int, jobs: int):
        self.steps, self.jobs, self.seen, self.prof, self.t0, self.wall = steps, jobs, 0, None, 0.0, 0.0

    def start(self) -> None:
        if self.prof is None and self.seen == 0:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def step(self) -> None:
        if self.prof is None or self.wall:
            return
        self.seen += 1
        if self.seen == self.steps:
            torch.cuda.synchronize()
            self.wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)

    def report(self, captured_ms: float | None) -> None:
        if not self.wall:
            print(f"-- trace: fewer than {self.steps} decode steps ran")
            return
        kernels = [e for e in self.prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e3  # us -> ms
        per_step = self.wall * 1e3 / self.steps
        print(f"-- trace of {self.steps} decode steps, {self.jobs} jobs: {per_step:.3f} ms/step wall, device busy "
              f"{busy / self.steps:.3f} ms/step ({len(kernels) / self.steps:.0f} kernels and copies per step), "
              f"captured graph alone {captured_ms or float('nan'):.3f} ms")
        totals: dict[str, list[float]] = {}
        for e in kernels:
            t = totals.setdefault(e.name[:90], [0.0, 0])
            t[0] += e.device_time / 1e3
            t[1] += 1
        for name, (ms, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:15]:
            print(f"   {ms / self.steps:8.4f} ms/step  {count / self.steps:6.1f}x  {name}")


def run_batch(lm, n: int, args, proposer=None, task_prompts=None, async_scheduling: bool | None = None,
              cuda_graphs: bool = True, capture_first: bool = True) -> dict:
    """One run of ``n`` jobs. Decode figures come from the steps where all ``n`` jobs decode (the jobs' prefills
    are staggered, so at the end they finish one per step and the batch shrinks): ms per step, the host's own
    time per step (CUDA: the step's wall time less the time spent waiting for its tokens; CPU: less the forward
    and the token choice) and the captured graph replayed on such a step's inputs. ``capture_first``: every
    decode graph size is captured before the timing (``Generator.capture_graphs``); else sizes met first while
    the batch shrinks are captured inside timed steps."""
    sampler = SamplerSettings.preset("default") if args.sample else None
    jobs = [Job(p, args.new_tokens, stop_token_ids=[], sampler=sampler, seed=i)
            for i, p in enumerate(task_prompts or prompts(lm, n, args.prompt_tokens))]
    short = [len(j.prompt_ids) for j in jobs if task_prompts is None and len(j.prompt_ids) != args.prompt_tokens]
    if short:
        raise SystemExit(f"prompts of {short[0]} tokens instead of --prompt-tokens {args.prompt_tokens}")
    # whole pages for every job at once (else fewer than n run together), plus the CUDA graphs' scratch page
    pages = sum(-(-(len(j.prompt_ids) + args.new_tokens + args.draft_tokens) // args.page_size) for j in jobs) + 1
    gen = Generator(lm, cache_tokens=pages * args.page_size, page_size=args.page_size,
                    max_batch_size=max(n, 1), max_chunk_tokens=args.chunk_tokens, proposer=proposer,
                    num_draft_tokens=args.draft_tokens, prefix_caching=False, async_scheduling=async_scheduling,
                    cuda_graphs=cuda_graphs)
    # first-call overheads (and, on CUDA, the capture of this batch size's decode graph) out of the timing
    gen.generate([j.prompt_ids[:8] for j in jobs], 2, stop_token_ids=[], sampler=sampler)
    if capture_first:
        gen.capture_graphs()
    cuda = lm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    device_work = None if cuda else _DeviceWork(gen)
    profiler = cProfile.Profile() if args.profile else None
    tracer = _DeviceTrace(args.trace_steps, n) if args.trace_steps and cuda else None
    steps0, ahead0 = gen.stats["steps"], gen.stats["steps_ahead"]
    staged = None
    t0 = time.perf_counter()
    gen.enqueue(jobs)
    finished = []
    full_time, full_host, full_steps = 0.0, 0.0, 0  # steps where all n jobs decode
    while gen.has_work():
        t_step, cpu_step = time.perf_counter(), time.thread_time()
        device_s = device_work.seconds if device_work else gen.stats["readback_wait_s"]
        prefilling = any(r.prefilling for r in gen.active) or gen.num_pending
        if profiler is not None and not prefilling:
            profiler.enable()
        if tracer is not None and not prefilling:
            tracer.start()
        results = gen.iterate()  # returns once its step is read back (async: with the next one queued behind)
        if profiler is not None:
            profiler.disable()
        if tracer is not None:
            tracer.step()
        took = time.perf_counter() - t_step
        if (not any(isinstance(r, (PrefillProgress, JobStarted)) for r in results)
                and sum(len(r.token_ids) for r in results if isinstance(r, TokenChunk)) == n):
            full_time += took
            if device_work is not None:
                full_host += time.thread_time() - cpu_step - (device_work.seconds - device_s)
            else:
                full_host += took - (gen.stats["readback_wait_s"] - device_s)
            full_steps += 1
            if full_steps == 3 and cuda:  # steady state: what is staged now (this step's or the next's) is full too
                staged = staged_inputs(gen, n)
        finished += [r for r in results if isinstance(r, JobFinished)]
    wall = time.perf_counter() - t0
    if device_work is not None:
        device_work.restore()
    if tracer is not None:
        tracer.report(captured_step_ms(gen, n))
    if profiler is not None:
        print(f"-- {n} jobs: decode steps, by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile_rows)
    tokens = sum(r.generated_tokens for r in finished)
    runner = gen.graph_runner
    if runner is None:
        decode_path = "eager"
    else:  # name the sizes, so an eager run cannot pass for a graph run
        decode_path = (f"graphs {sorted(runner.graphs)}" if runner.graphs else "eager") + (
            f", capture failed for {sorted(runner._failed)}" if runner._failed else "")
    steps = gen.stats["steps"] - steps0
    return {
        "decode_path": decode_path + (", async" if gen.async_scheduling else ""),
        "steps_ahead": gen.stats["steps_ahead"],
        "ahead": (gen.stats["steps_ahead"] - ahead0) / steps if steps else 0.0,
        "captured_ms": captured_step_ms(gen, n, staged=staged) if cuda else None,
        "jobs": n, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
        "decode_tok_s": n * full_steps / full_time if full_time else 0.0,
        "step_ms": 1e3 * full_time / full_steps if full_steps else 0.0,
        "host_ms": 1e3 * full_host / full_steps if full_steps else 0.0,
        "full_steps": full_steps,
        "ttft_s": statistics.mean(r.time_to_first_token for r in finished),
        "proposed": sum(r.draft_proposed for r in finished), "accepted": sum(r.draft_accepted for r in finished),
    }


def repetitive_prompts(lm, n: int) -> list[list[int]]:
    """A task where the answer repeats the prompt (n-gram lookup's home ground)."""
    base = ("Copy the following list exactly, one item per line:\n" +
            "".join(f"- item {k}: apples, pears, plums and cherries\n" for k in range(12)) + "Copy:\n")
    ids = lm.tokenizer.encode(base) if lm.tokenizer else [1 + (j % 23) for j in range(256)]
    return [ids for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--random-like-smollm2", metavar="DIR", default=None,
                    help="build a random-weight Llama of SmolLM2-135M's shape in DIR and use it (no weights needed)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--random-exl3", metavar="DIR", default=None,
                    help="write (once) a Llama-3.1-8B-shaped model with random EXL3 weights in DIR and use it")
    ap.add_argument("--bits", type=int, default=4, help="with --random-exl3: bits per weight (head: 6)")
    ap.add_argument("--codebook", default="mul1", choices=["mul1", "mcg", "3inst"],
                    help="with --random-exl3: the trellis codebook (default mul1, the converters' default)")
    ap.add_argument("--mul1-gemv", nargs="+", choices=MUL1_GEMV_ROUTES, default=None,
                    help="with a mul1 model: run every batch size on each of these MUL1 decode routes (TRELLM_MUL1_GEMV), "
                         "in this process (default: the route the environment picks)")
    ap.add_argument("--sample", action="store_true", help="jobs sample (preset 'default', seeded) instead of greedy")
    ap.add_argument("--tiny", action="store_true",
                    help="with --random-like-smollm2: 2 layers, hidden 64 (SmolLM2's vocabulary): the step is mostly host overhead")
    ap.add_argument("--profile", action="store_true", help="cProfile the decode steps; print the top functions per batch size")
    ap.add_argument("--profile-rows", type=int, default=20)
    ap.add_argument("--trace-steps", type=int, default=0,
                    help="CUDA: torch.profiler over this many decode steps per run; prints device busy time per step "
                         "beside the wall step and the captured graph, and the top kernels")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--speculative", choices=["none", "ngram", "draft"], default="none")
    ap.add_argument("--draft-model", default=None, help="draft model dir for --speculative draft (default: the model itself)")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--async-scheduling", choices=["both", "on", "off"], default="both",
                    help="run each batch size with the generator's async scheduling off and on (both: one row each)")
    ap.add_argument("--capture", choices=["first", "lazy", "both"], default="first",
                    help="capture every decode graph size before the timing (first), or when a step first needs it "
                         "(lazy: what the figures included before; both: one row each)")
    ap.add_argument("--cuda-graphs", choices=["on", "off", "both"], default="on",
                    help="with --speculative: the generator's CUDA graphs (decode and draft verification steps) on, "
                         "off, or one row each")
    ap.add_argument("--plot", default=None, help="save tokens/s vs batch size here (needs matplotlib)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random_like_smollm2:
        from trellm.sdk.testing import make_tiny_hf_model

        shape = dict(SMOLLM2_SHAPE)
        if args.tiny:
            shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        args.model = make_tiny_hf_model("LlamaForCausalLM", args.random_like_smollm2, **shape)
    if args.random_exl3:
        args.model = write_random_exl3(Path(args.random_exl3), args.bits, args.codebook)
    if args.model is None:
        from trellm.default_model import default_model_dir

        args.model = default_model_dir()
    lm = trellm.load(args.model, device=args.device, dtype=args.dtype)
    codebook = codebook_of(lm.model_dir)
    print(f"model {lm!r}, codebook {codebook}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens per job, "
          f"{'sampled (preset default)' if args.sample else 'greedy'}, torch {torch.__version__}")

    if args.speculative != "none":
        n = int(args.batch_sizes.split(",")[0])
        task = repetitive_prompts(lm, n)
        print(f"{'mode':>12} {'graphs':<7} {'tok/s':>8} {'wall s':>8} {'ms/step':>8}  codebook  decode path")
        for graphs in {"on": (True,), "off": (False,), "both": (True, False)}[args.cuda_graphs]:
            base = run_batch(lm, n, args, task_prompts=task, cuda_graphs=graphs)
            if args.speculative == "ngram":
                proposer = NgramProposer(num_tokens=args.draft_tokens)
            else:
                draft = trellm.load(args.draft_model, device=args.device, dtype=args.dtype) if args.draft_model else lm
                proposer = DraftModelProposer(draft, num_tokens=args.draft_tokens, cache_tokens=n * 2048, page_size=args.page_size)
            spec = run_batch(lm, n, args, proposer=proposer, task_prompts=task, cuda_graphs=graphs)
            rate = spec["accepted"] / max(spec["proposed"], 1)
            on = "on" if graphs else "off"
            print(f"{'plain':>12} {on:<7} {base['tok_s']:8.2f} {base['wall_s']:8.2f} {base['step_ms']:8.3f}  {codebook:<8}  "
                  f"{base['decode_path']}")
            print(f"{args.speculative:>12} {on:<7} {spec['tok_s']:8.2f} {spec['wall_s']:8.2f} {spec['step_ms']:8.3f}  {codebook:<8}  "
                  f"{spec['decode_path']}; speed-up x{spec['tok_s'] / base['tok_s']:.2f}, acceptance "
                  f"{spec['accepted']}/{spec['proposed']} = {rate:.0%}", flush=True)
        return

    rows = []
    header = (f"{'jobs':>5} {'wall s':>8} {'tok/s':>8} {'decode tok/s':>13} {'ms/step':>8} {'captured ms':>11} "
              f"{'over %':>7} {'host ms':>8} {'ahead':>6} {'ttft s':>8}  codebook  decode path")
    if not args.profile:
        print(header)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.async_scheduling]
    captures = {"first": (True,), "lazy": (False,), "both": (False, True)}[args.capture]
    routes = (args.mul1_gemv or [mul1_gemv_route()]) if codebook == "mul1" else [None]
    for route, n, mode, first in ((r, int(x), m, c) for r in routes for x in args.batch_sizes.split(",")
                                  for c in captures for m in modes):
        if route is not None:  # read when each run's graphs are captured: a fresh Generator per run
            os.environ[MUL1_GEMV_ENV] = route
        row = run_batch(lm, n, args, async_scheduling=mode, capture_first=first)
        row["codebook"] = codebook if route is None else f"{codebook}/{route}"
        rows.append(row)
        if args.profile:
            print(header)
        captured = row["captured_ms"]  # the step's GPU work alone, on a step's inputs with all n jobs decoding
        cap, over = (f"{captured:11.3f}", f"{100 * (row['step_ms'] / captured - 1):7.1f}") if captured else (f"{'-':>11}", f"{'-':>7}")
        path = row["decode_path"] + ("" if first or row["decode_path"].startswith("eager") else ", graphs captured when first met")
        print(f"{n:5d} {row['wall_s']:8.2f} {row['tok_s']:8.2f} {row['decode_tok_s']:13.2f} {row['step_ms']:8.3f} {cap} {over} "
              f"{row['host_ms']:8.3f} {row['ahead']:6.0%} {row['ttft_s']:8.2f}  {row['codebook']:<8}  {path}", flush=True)
    if args.plot:
        from common import pyplot, save_figure  # benchmarks/common.py, next to this script

        plt = pyplot()
        if plt is None:
            return
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for (mode, book) in ((m, b) for b in dict.fromkeys(r["codebook"] for r in rows) for m in modes):
            mine = [r for r in rows if ("async" in r["decode_path"]) == mode and r["codebook"] == book]
            tag = ("async" if mode else "sync") + (f", {book}" if len(routes) > 1 else "")
            ax.plot([r["jobs"] for r in mine], [r["tok_s"] for r in mine], "o-", label=f"overall, {tag}")
            ax.plot([r["jobs"] for r in mine], [r["decode_tok_s"] for r in mine], "s--", label=f"decode, {tag}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent jobs")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{lm.model_dir.name} ({codebook}) on {lm.device}")
        ax.legend()
        save_figure(plt, fig, args.plot)


if __name__ == "__main__":
    main()
