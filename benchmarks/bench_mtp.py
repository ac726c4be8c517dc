"""MTP drafting on a random-weight Qwen3.5 shape: what the draft costs and what full acceptance would give.

    python benchmarks/bench_mtp.py                          # cuda, bfloat16, batch sizes 1 and 8
    python benchmarks/bench_mtp.py --shape mimo             # MiMo: a dense Qwen2 shape with an MTP layer
    python benchmarks/bench_mtp.py --device cpu --dtype float32 --small --batch-sizes 1 --new-tokens 16

Random weights make the MTP's own drafts almost never accepted, so per batch size and draft length
three runs are timed with the same prompts (prefill excluded: decode steps only):

- plain: no draft;
- mtp:   the MTP drafts (acceptance ~0: the figure is the draft's cost);
- ceiling: the MTP still runs every step, but its drafts are swapped for the true greedy continuation
  (all accepted): the most an MTP draft of that length can give on this shape.

Printed: decode tokens/s, ratio to plain (with the same graph setting), acceptance, decode steps, ms per
decode step, and the share of decode time spent inside the MTP proposer. Output equality with the plain
run is checked (greedy). On CUDA each run goes with CUDA graphs on and off (``--cuda-graphs both``, the
default): with them the target's verification step is a captured graph (rows of k + 1 tokens) and so is each
MTP proposal (absorb + k - 1 chained head steps, ``trellm.generator.mtp.ProposalGraphs``); "captured ms" is
the replay of the target's graph plus that of the proposal graph, timed in the same process after the run
(the step's GPU work without host work: the figure the generator's ms/step is held to), and "MTP graphs"
how many proposals replayed one per decode step.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import trellm
from trellm.generator import Generator, Job, JobFinished, PrefillProgress
from trellm.generator.mtp import MTPProposer
from trellm.sdk.testing import make_tiny_hf_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_mtp import add_mtp_tensors

from bench_generator import captured_step_ms  # benchmarks/, next to this script

SHAPE = dict(  # a small Qwen3.5: 3 gated-delta-net layers per full-attention layer
    vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, max_position_embeddings=4096,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3,
)
MIMO = dict(  # a small MiMo (Qwen2 + MTP layer): every layer full attention
    vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=4096,
)
MIMO_SMALL = dict(MIMO, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1)
SMALL = dict(SHAPE, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])


class TimedMTP:
    """The MTP proposer with its time measured; ``ceiling`` swaps its drafts for the known continuation."""

    wants_hidden_states = True

    def __init__(self, mtp: MTPProposer, sync, continuations: list[list[int]] | None = None):
        self.mtp, self.sync, self.continuations, self.seconds = mtp, sync, continuations, 0.0

    def _timed(self, fn, *args):
        self.sync()
        t = time.perf_counter()
        out = fn(*args)
        self.sync()
        self.seconds += time.perf_counter() - t
        return out

    def observe_hidden(self, *args) -> None:
        self._timed(self.mtp.observe_hidden, *args)

    def propose(self, requests):
        drafts = self._timed(self.mtp.propose, requests)
        if self.continuations is None:
            return drafts
        out = []
        for r, d in zip(requests, drafts):
            seq = next(s for s in self.continuations if s[: len(r.tokens)] == list(r.tokens))
            out.append(seq[len(r.tokens): len(r.tokens) + len(d)])
        return out

    def release(self, key) -> None:
        self.mtp.release(key)


def decode_run(lm, prompts, new_tokens, proposer, k, sync, cache_tokens, graphs: bool = True):
    """Greedy run; returns (results, decode seconds, decode steps, seconds of those inside the proposer, captured
    ms of the step's graphs or None), steps that prefilled left out."""
    gen = Generator(lm, max_batch_size=len(prompts), max_chunk_tokens=4096, cache_tokens=cache_tokens, page_size=64,
                    proposer=proposer, num_draft_tokens=k, cuda_graphs=graphs)
    gen.enqueue([Job(list(p), new_tokens, stop_token_ids=[], identifier=i) for i, p in enumerate(prompts)])
    done, seconds, steps, in_proposer = [], 0.0, 0, 0.0
    with torch.inference_mode():
        while gen.has_work():
            sync()
            t, before = time.perf_counter(), getattr(proposer, "seconds", 0.0)
            results = gen.iterate()
            sync()
            if not any(isinstance(r, PrefillProgress) for r in results):  # decode-only step
                seconds += time.perf_counter() - t
                in_proposer += getattr(proposer, "seconds", 0.0) - before
                steps += 1
            done += [r for r in results if isinstance(r, JobFinished)]
    captured = captured_step_ms(gen, len(prompts), width=k + 1 if proposer is not None else 1) if graphs else None
    drafts = getattr(getattr(proposer, "mtp", None), "graphs", None)  # the MTP proposal graph of this batch and k
    key = None if drafts is None else next(((b, k + 1) for b in drafts.batch_sizes if b >= len(prompts)), None)
    if captured is not None and key in getattr(drafts, "graphs", {}):
        from common import replay_seconds

        captured += 1e3 * replay_seconds(drafts.graphs[key][0])
    return sorted(done, key=lambda r: r.identifier), seconds, steps, in_proposer, captured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--draft-tokens", default="1,3")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--small", action="store_true", help="a tiny shape (CPU smoke run)")
    ap.add_argument("--shape", choices=["qwen3_5", "mimo"], default="qwen3_5",
                    help="qwen3_5: hybrid (gated delta net + attention); mimo: dense Qwen2 with an MTP layer")
    ap.add_argument("--cuda-graphs", choices=["both", "on", "off"], default="both",
                    help="run everything with the generator's CUDA graphs on and off (both: one row each)")
    args = ap.parse_args()
    shape = {("qwen3_5", False): SHAPE, ("qwen3_5", True): SMALL, ("mimo", False): MIMO, ("mimo", True): MIMO_SMALL}[
        args.shape, args.small]
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape == "mimo":
            from test_new_families import _mimo_checkpoint

            _, model_dir, _ = _mimo_checkpoint(Path(tmp), **shape)
        else:
            model_dir = make_tiny_hf_model("Qwen3_5ForCausalLM", Path(tmp) / "qwen3_5_mtp", **shape)
            add_mtp_tensors(model_dir)
        lm = trellm.load(model_dir, device=args.device, dtype=args.dtype, tokenizer=False)
    g = torch.Generator().manual_seed(0)
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.cuda_graphs] if cuda else (False,)
    print(f"random {lm.spec.name} shape: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, vocab "
          f"{shape['vocab_size']}; {args.device} {args.dtype}; prompt {args.prompt_tokens}, {args.new_tokens} new tokens")
    print(f"{'batch':>5} {'k':>2} {'run':<8} {'graphs':<6} {'tok/s':>9} {'x plain':>8} {'accepted':>9} {'steps':>6} "
          f"{'ms/step':>8} {'captured ms':>11} {'in MTP':>7} {'MTP graphs':>10}  same")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [torch.randint(0, shape["vocab_size"], (args.prompt_tokens,), generator=g).tolist() for _ in range(batch)]
        cache_tokens = batch * (args.prompt_tokens + args.new_tokens + 64) + 256
        for graphs in modes:
            on = "on" if graphs else "off"
            decode_run(lm, prompts, 8, None, 1, sync, cache_tokens, graphs)  # warm-up
            plain, plain_s, plain_steps, _, cap = decode_run(lm, prompts, args.new_tokens, None, 1, sync, cache_tokens, graphs)
            tokens = sum(len(r.token_ids) for r in plain) - batch  # the first token of each job comes from prefill
            plain_tps = tokens / plain_s
            cap = f"{cap:11.3f}" if cap is not None else f"{'-':>11}"
            print(f"{batch:>5} {'-':>2} {'plain':<8} {on:<6} {plain_tps:>9.1f} {1.0:>8.2f} {'-':>9} {plain_steps:>6} "
                  f"{1e3 * plain_s / plain_steps:>8.3f} {cap} {'-':>7} {'-':>10}")
            continuations = [p + r.token_ids for p, r in zip(prompts, plain)]
            for k in [int(x) for x in args.draft_tokens.split(",")]:
                for name, cont in (("mtp", None), ("ceiling", continuations)):
                    mtp = MTPProposer(lm, num_tokens=k, cache_tokens=cache_tokens, page_size=64, cuda_graphs=graphs)
                    timed = TimedMTP(mtp, sync, cont)
                    done, seconds, steps, in_mtp, cap = decode_run(lm, prompts, args.new_tokens, timed, k, sync, cache_tokens,
                                                                   graphs)
                    proposed, accepted = sum(r.draft_proposed for r in done), sum(r.draft_accepted for r in done)
                    replays = f"{mtp.stats['graph_proposals']}/{steps}"  # proposals replayed / decode steps
                    same = [r.token_ids for r in done] == [r.token_ids for r in plain]
                    cap = f"{cap:11.3f}" if cap is not None else f"{'-':>11}"
                    print(f"{batch:>5} {k:>2} {name:<8} {on:<6} {tokens / seconds:>9.1f} {tokens / seconds / plain_tps:>8.2f} "
                          f"{accepted / max(proposed, 1):>9.0%} {steps:>6} {1e3 * seconds / steps:>8.3f} {cap} "
                          f"{in_mtp / max(seconds, 1e-9):>7.0%} {replays:>10}  {same}", flush=True)


if __name__ == "__main__":
    main()
