"""``trellm serve --draft-model ngram``: prompt-lookup speculation behind the real server on loopback,
driven by the openai client. Greedy output equals the model decoding alone, and drafts were kept."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from trellm.generator import NgramProposer  # noqa: E402
from trellm.server.cli import config_from_args  # noqa: E402
from trellm.server.config import ServerConfig  # noqa: E402
from trellm.server.testing import ServerThread  # noqa: E402

API_KEY = "test-api-key-0123456"
# the answer copies the list, so the last tokens' earlier occurrence predicts what follows
PROMPT = ("Copy the list exactly.\nList:\n" + "".join(f"- item {k}: apples, pears, plums\n" for k in range(6))
          + "Copy:\n- item 0: apples, pears, plums\n")


def test_serve_flag_selects_the_ngram_proposer():
    import argparse

    from trellm.server.cli import add_cli

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    config = config_from_args(parser.parse_args(["serve", "--draft-model", "ngram", "--num-draft-tokens", "5"]))
    assert config.draft_model == "ngram" and config.num_draft_tokens == 5


def test_ngram_speculation_in_the_server_keeps_greedy_output(smollm2_dir):
    config = ServerConfig(model=str(smollm2_dir), api_key=API_KEY, admin_key=API_KEY + "-admin", device="cpu",
                          cache_size=2048, page_size=64, max_batch_size=4, draft_model="ngram", num_draft_tokens=4)
    with ServerThread(config) as server:
        gen = server.host.generator
        assert isinstance(gen.proposer, NgramProposer) and gen.proposer.num_tokens == 4
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        out = client.completions.create(model=server.host.model_name, prompt=PROMPT, max_tokens=24, temperature=0)
        text, tokens = out.choices[0].text, out.usage.completion_tokens
        assert text == server.host.lm.generate(PROMPT, max_new_tokens=24)  # the model decoding alone, no draft
        assert gen.stats["draft_accepted"] > 0 and gen.stats["steps"] < tokens, (gen.stats, tokens)  # fewer forwards than tokens
