"""Load test of ``trellm serve``: N concurrent streaming clients on loopback, official openai client.

    python benchmarks/bench_server_load.py [--clients 1,16,64] [--requests 3] [--max-tokens 32] [--model DIR]
    python benchmarks/bench_server_load.py --url http://127.0.0.1:5000 --api-key KEY   # a server already running

Without --url the server runs in this process (uvicorn in a thread on a free 127.0.0.1 port). For each
client count, each client sends ``--requests`` streaming chat completions one after another
(``ignore_eos`` so every request makes ``--max-tokens`` tokens). Prints requests/s, generated tokens/s,
p50/p95/p99 time to first token and failed requests per client count; the first count (1 client by
default) is the baseline the others are compared with; exits 1 when any request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import openai

PROMPTS = [
    "Write a haiku about the sea.", "What is the capital of Italy?", "Explain photosynthesis briefly.",
    "List three prime numbers.", "Describe a cat in one sentence.", "Why is the sky blue?",
    "Give me a tip for learning Python.", "What does a compiler do?",
]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def run_load(base_url: str, api_key: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    ttfts: list[float] = []
    tokens = 0
    failures: list[str] = []

    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=600) as client:
        async def one_client(c: int) -> None:
            nonlocal tokens
            for r in range(requests):
                prompt = PROMPTS[(c + r) % len(PROMPTS)]
                t0 = time.perf_counter()
                first = None
                try:
                    stream = await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                        temperature=0.7, seed=c * 1000 + r, stream=True, stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True})
                    usage = None
                    async for chunk in stream:
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = time.perf_counter() - t0
                        if chunk.usage is not None:
                            usage = chunk.usage
                    if usage is None:
                        raise RuntimeError("no usage chunk")
                    tokens += usage.completion_tokens
                    if first is not None:
                        ttfts.append(first)
                except Exception as exc:
                    failures.append(f"client {c} request {r}: {type(exc).__name__}: {exc}")

        t_start = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in range(clients)))
        wall = time.perf_counter() - t_start
    done = clients * requests - len(failures)
    return {"requests": done, "failures": failures, "wall_s": wall, "requests_per_s": done / wall,
            "tokens_per_s": tokens / wall, "tokens": tokens, "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p95_s": percentile(ttfts, 95), "ttft_p99_s": percentile(ttfts, 99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,16,64", help="concurrent clients; a comma list runs each in turn")
    ap.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--cache-size", type=int, default=8192)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    ap.add_argument("--api-key", default="bench-key-0123456789")
    ap.add_argument("--model-name", default=None, help="model id to request (with --url; default: the first in /v1/models)")
    args = ap.parse_args()

    counts = [int(c) for c in str(args.clients).split(",")]
    if args.url:
        model = args.model_name or openai.OpenAI(base_url=args.url + "/v1", api_key=args.api_key).models.list().data[0].id
        results = [asyncio.run(run_load(args.url, args.api_key, model, n, args.requests, args.max_tokens)) for n in counts]
        device = "remote"
    else:
        from trellm.server.app import resolve_model_dir
        from trellm.server.config import ServerConfig
        from trellm.server.testing import ServerThread

        config = ServerConfig(model=args.model, api_key=args.api_key, admin_key=args.api_key + "-admin", device=args.device,
                              cache_size=args.cache_size, max_batch_size=args.max_batch_size, page_size=64,
                              max_queue=max(64, max(counts)))
        config = config.updated({"model": str(resolve_model_dir(config))}, "bench")
        with ServerThread(config) as server:
            device = str(server.host.lm.device)
            model = server.host.model_name
            results = []
            for n in counts:
                results.append(asyncio.run(run_load(server.url, args.api_key, model, n, args.requests, args.max_tokens)))
                server.host.generator.verify_pages()
            preempted = server.host.generator.stats["preempted"]

    print(f"model {model} on {device}: streaming clients x {args.requests} requests each, {args.max_tokens} tokens per "
          f"request, batch {args.max_batch_size}, cache {args.cache_size} tokens")
    print(f"{'clients':>8} {'requests':>9} {'wall s':>7} {'req/s':>6} {'tok/s':>8} {'x base':>7} "
          f"{'TTFT p50':>9} {'p95':>7} {'p99':>7} {'failed':>6}")
    base = results[0]["tokens_per_s"] or float("nan")
    for n, r in zip(counts, results):
        print(f"{n:>8} {r['requests']:>9} {r['wall_s']:>7.1f} {r['requests_per_s']:>6.2f} {r['tokens_per_s']:>8.1f} "
              f"{r['tokens_per_s'] / base:>7.2f} {r['ttft_p50_s'] * 1000:>7.0f}ms {r['ttft_p95_s'] * 1000:>5.0f}ms "
              f"{r['ttft_p99_s'] * 1000:>5.0f}ms {len(r['failures']):>6}")
    if not args.url:
        print(f"  preemptions: {preempted} (jobs recomputed when the cache ran out of pages)")
    failures = [f for r in results for f in r["failures"]]
    for line in failures[:10]:
        print("   ", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
