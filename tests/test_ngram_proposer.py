"""NgramProposer keeps an index of each job's n-grams; its drafts equal the plain scan of the window (the
latest earlier occurrence of the last n tokens, n from max_ngram down) as tokens grow, get rewound and
other jobs come and go."""
from __future__ import annotations

import random

from trellm.generator import DraftRequest, NgramProposer


def scan(tokens: list[int], k: int, max_ngram: int, min_ngram: int, window: int) -> list[int]:
    """The definition, by scanning the window backwards for every n."""
    tokens = tokens[-window:]
    if k <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail and tokens[start + n:start + n + k]:
                return tokens[start + n:start + n + k]
    return []


def test_indexed_drafts_equal_the_window_scan():
    rng = random.Random(0)
    for max_ngram, min_ngram, window in ((4, 1, 4096), (3, 2, 40), (5, 1, 17)):
        proposer = NgramProposer(num_tokens=4, max_ngram=max_ngram, min_ngram=min_ngram, window=window)
        jobs = {key: [rng.randrange(6) for _ in range(rng.randint(1, 8))] for key in range(5)}
        for _ in range(300):
            for key, tokens in jobs.items():
                roll = rng.random()
                if roll < 0.1:  # a rewind: the tail is dropped and regrows differently
                    del tokens[rng.randint(1, len(tokens)):]
                tokens += [rng.randrange(6) for _ in range(rng.choice([1, 1, 2, 5]))]
            keys = rng.sample(sorted(jobs), rng.randint(1, len(jobs)))
            requests = [DraftRequest(key, jobs[key], rng.choice([0, 2, 4, 9])) for key in keys]
            got = proposer.propose(requests)
            for r, draft in zip(requests, got):
                assert draft == scan(jobs[r.key], min(r.max_tokens, 4), max_ngram, min_ngram, window), (r, draft)
            if rng.random() < 0.05:  # a job ends; its key comes back as a new job
                key = rng.choice(sorted(jobs))
                proposer.release(key)
                jobs[key] = [rng.randrange(6)]
