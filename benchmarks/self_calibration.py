"""Calibration text sampled from the model itself: does more varied natural text than the built-in mix close
trellm's KL gap to ExLlamaV3 (issue 29)?

The same-input A/B (``exl3_linear_ab.py``) found trellm's quantizer level with ExLlamaV3's procedure and the
calibration text moving the error: the built-in mix's prose, multilingual and chat sources are 1,300-1,800
tokens each and fill 46% of the rows by repetition. A model's own samples are as varied as its training
text and need nothing bundled. This script writes them as a ``--calibration`` file for ``trellm convert``:

    python benchmarks/self_calibration.py -m MODEL_DIR -o /tmp/self.txt [--rows 256] [--tokens 512] [--device cuda]
    python benchmarks/exl3_compare.py ... --trellm-variant self='--no-sequential --error-target 0 --calibration /tmp/self.txt'

Each row continues a seed: the first words of a paragraph of the built-in sources (prose, code, multilingual,
technical, the chat users' messages), taken in turn, sampled with the "default" preset (temperature 0.8, top-k
50, top-p 0.95) and the row's own seed. Rows are written one after another, separated by blank lines (the
converter cuts its rows of ``--cal-cols`` tokens from the whole text).

Measured (``exl3_linear_ab.py``, SmolLM2-135M-Instruct, 56 rows x 512 tokens sampled on the CPU in one batch:
317 s of CPU time on one thread): the held-out error is higher than on the built-in mix, L3 q/k/v 0.000960
against 0.000874 and L3 down 0.004546 against 0.004104 at 4 bpw, and higher than on the first 25 KB mix too;
a model this small loops on a phrase within a few hundred tokens. Not wired into ``trellm convert``.
"""
from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import trellm
from trellm.data import calibration_sources, chat_dialogues
from trellm.generator import Generator, Job, JobFinished, SamplerSettings

SEED_WORDS = 8  # words of a paragraph that start a row


def seeds(count: int) -> list[str]:
    """``count`` row seeds, one source after another: the first words of each paragraph (user messages of chat)."""
    per_source = []
    for source in calibration_sources():
        if source.chat:
            texts = [m["content"] for d in chat_dialogues(source.text) for m in d if m["role"] == "user"]
        else:
            texts = [p for p in source.text.split("\n\n") if len(p.split()) >= SEED_WORDS]
        per_source.append([" ".join(t.split()[:SEED_WORDS]) for t in texts] or [source.name])
    mixed = [s for group in itertools.zip_longest(*per_source) for s in group if s]
    return list(itertools.islice(itertools.cycle(mixed), count))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="HF model directory (the dense model to be converted)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="UTF-8 text file to write")
    ap.add_argument("--rows", type=int, default=256, help="sampled rows (default 256)")
    ap.add_argument("--tokens", type=int, default=512, help="new tokens per row (default 512)")
    ap.add_argument("--batch", type=int, default=32, help="rows sampled together (default 32)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0, help="first row's seed (row i uses seed + i)")
    args = ap.parse_args()
    if args.rows < 1 or args.tokens < 1 or args.batch < 1:
        raise SystemExit("--rows, --tokens and --batch must be at least 1")
    lm = trellm.load(args.model, device=args.device)
    sampler = SamplerSettings.preset("default")
    prompts = seeds(args.rows)
    gen = Generator(lm, cache_tokens=args.batch * (args.tokens + 256), max_batch_size=args.batch)
    texts: dict[int, str] = {}
    t0 = time.perf_counter()
    for first in range(0, args.rows, args.batch):
        batch = range(first, min(first + args.batch, args.rows))
        gen.enqueue([Job(lm.tokenizer.encode(prompts[i]), args.tokens, identifier=i, sampler=sampler,
                         seed=args.seed + i, stop_token_ids=[]) for i in batch])
        while gen.has_work():
            for r in gen.iterate():
                if isinstance(r, JobFinished):
                    texts[r.identifier] = prompts[r.identifier] + r.text
        print(f"{len(texts)}/{args.rows} rows, {time.perf_counter() - t0:.1f} s", flush=True)
    args.out.write_text("\n\n".join(texts[i].strip() for i in range(args.rows)) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {args.rows} rows of {args.tokens} sampled tokens, {args.out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
