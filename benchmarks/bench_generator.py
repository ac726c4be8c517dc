"""Generator throughput: tokens/s vs number of concurrent jobs, and speculative decoding speed-up.

    python benchmarks/bench_generator.py                       # SmolLM2 (the default model), CPU or GPU
    python benchmarks/bench_generator.py --batch-sizes 1,4,16 --new-tokens 64 --plot gen.png
    python benchmarks/bench_generator.py --speculative ngram   # n-gram lookup on a repetitive task
    python benchmarks/bench_generator.py --speculative draft --draft-model /path/to/small-or-quantized

Prints one row per batch size: wall time, generated tokens/s over the whole run (prefill included),
decode tokens/s (over the steps that did no prefill work) and mean time to first token. With matplotlib installed,
``--plot`` saves tokens/s vs batch size.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import trellm
from trellm.generator import (DraftModelProposer, Generator, Job, JobFinished, JobStarted, NgramProposer,
                              PrefillProgress, TokenChunk)

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     tie_word_embeddings=True, initializer_range=0.02)

TOPICS = ["the sea", "a mountain village", "an old clock", "the first snow", "a city at night", "a lost key",
          "the library", "a long train ride", "a garden in spring", "the lighthouse", "a chess game", "the desert"]


def prompts(lm, n: int, prompt_tokens: int) -> list[list[int]]:
    """``n`` distinct prompts of about ``prompt_tokens`` tokens each."""
    out = []
    for i in range(n):
        text = f"Story {i}: write a short story about {TOPICS[i % len(TOPICS)]}. " * 64
        ids = lm.tokenizer.encode(text) if lm.tokenizer else [(7 * i + j) % 200 + 1 for j in range(prompt_tokens)]
        out.append(ids[:prompt_tokens])
    return out


def run_batch(lm, n: int, args, proposer=None, task_prompts=None) -> dict:
    gen = Generator(lm, cache_tokens=n * (args.prompt_tokens + args.new_tokens) + 512, page_size=args.page_size,
                    max_batch_size=max(n, 1), max_chunk_tokens=args.chunk_tokens, proposer=proposer,
                    num_draft_tokens=args.draft_tokens, prefix_caching=False)
    jobs = [Job(p, args.new_tokens, stop_token_ids=[]) for p in (task_prompts or prompts(lm, n, args.prompt_tokens))]
    warm = Job(jobs[0].prompt_ids[:8], 2, stop_token_ids=[])
    gen.generate(warm.prompt_ids, 2, stop_token_ids=[])  # first-call overheads out of the timing
    if lm.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    gen.enqueue(jobs)
    finished = []
    decode_time, decode_tokens = 0.0, 0  # steps without any prefill work: the pure decode rate
    while gen.has_work():
        t_step = time.perf_counter()
        results = gen.iterate()
        if lm.device.type == "cuda":
            torch.cuda.synchronize()
        if not any(isinstance(r, (PrefillProgress, JobStarted)) for r in results):
            decode_time += time.perf_counter() - t_step
            decode_tokens += sum(len(r.token_ids) for r in results if isinstance(r, TokenChunk))
        finished += [r for r in results if isinstance(r, JobFinished)]
    wall = time.perf_counter() - t0
    tokens = sum(r.generated_tokens for r in finished)
    return {
        "jobs": n, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
        "decode_tok_s": decode_tokens / decode_time if decode_time else 0.0,
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
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--speculative", choices=["none", "ngram", "draft"], default="none")
    ap.add_argument("--draft-model", default=None, help="draft model dir for --speculative draft (default: the model itself)")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--plot", default=None, help="save tokens/s vs batch size here (needs matplotlib)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random_like_smollm2:
        from trellm.sdk.testing import make_tiny_hf_model

        args.model = make_tiny_hf_model("LlamaForCausalLM", args.random_like_smollm2, **SMOLLM2_SHAPE)
    if args.model is None:
        from trellm.default_model import default_model_dir

        args.model = default_model_dir()
    lm = trellm.load(args.model, device=args.device, dtype=args.dtype)
    print(f"model {lm!r}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens per job, torch {torch.__version__}")

    if args.speculative != "none":
        n = int(args.batch_sizes.split(",")[0])
        task = repetitive_prompts(lm, n)
        base = run_batch(lm, n, args, task_prompts=task)
        if args.speculative == "ngram":
            proposer = NgramProposer(num_tokens=args.draft_tokens)
        else:
            draft = trellm.load(args.draft_model, device=args.device, dtype=args.dtype) if args.draft_model else lm
            proposer = DraftModelProposer(draft, num_tokens=args.draft_tokens, cache_tokens=n * 2048, page_size=args.page_size)
        spec = run_batch(lm, n, args, proposer=proposer, task_prompts=task)
        rate = spec["accepted"] / max(spec["proposed"], 1)
        print(f"{'mode':>12} {'tok/s':>8} {'wall s':>8}")
        print(f"{'plain':>12} {base['tok_s']:8.2f} {base['wall_s']:8.2f}")
        print(f"{args.speculative:>12} {spec['tok_s']:8.2f} {spec['wall_s']:8.2f}   speed-up x{spec['tok_s'] / base['tok_s']:.2f}, "
              f"acceptance {spec['accepted']}/{spec['proposed']} = {rate:.0%}")
        return

    rows = []
    print(f"{'jobs':>5} {'wall s':>8} {'tok/s':>8} {'decode tok/s':>13} {'ttft s':>8}")
    for n in (int(x) for x in args.batch_sizes.split(",")):
        row = run_batch(lm, n, args)
        rows.append(row)
        print(f"{n:5d} {row['wall_s']:8.2f} {row['tok_s']:8.2f} {row['decode_tok_s']:13.2f} {row['ttft_s']:8.2f}", flush=True)
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot")
            return
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["jobs"] for r in rows], [r["tok_s"] for r in rows], "o-", label="overall")
        ax.plot([r["jobs"] for r in rows], [r["decode_tok_s"] for r in rows], "s--", label="decode")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent jobs")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{lm.model_dir.name} on {lm.device}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot saved to {args.plot}")


if __name__ == "__main__":
    main()
