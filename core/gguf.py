"""Import a GGUF file (llama.cpp's format) of a llama or gemma3 model as an HF model directory.

The result is what trellm (and transformers) load natively: config.json, model.safetensors
(dequantised to bf16; llama Q/K rows put back in HF's order, gemma norm weights back to HF's
``1 + w`` convention), tokenizer.json rebuilt from the GGUF vocabulary (byte-level BPE, or
SentencePiece BPE with byte fallback), tokenizer_config.json with the chat template, and
generation_config.json. The directory appears atomically: it is written under a temporary name
and renamed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError, TokenizerError, TrellmError, WeightError

__all__ = ["import_gguf", "add_cli", "run", "GGUFImportError"]


class GGUFImportError(TrellmError):
    """The GGUF file cannot be imported (unsupported architecture, tokenizer or tensor)."""


# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# GGUF tensor name suffix -> HF name suffix, per layer (blk.N.*) and at top level.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
# gemma3 names its four norms differently (llama's ffn_norm is gemma's pre-feedforward norm).
_GEMMA3_LAYER_TENSORS = {
    **{k: v for k, v in _LAYER_TENSORS.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_ARCH_LAYER_TENSORS = {"llama": _LAYER_TENSORS, "gemma3": _GEMMA3_LAYER_TENSORS}
# llama.cpp stores gemma's RMSNorm weights with the +1 of HF's ``x * (1 + w)`` already added.
_NORM_SHIFT = {"llama": 0.0, "gemma3": 1.0}
_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Pre-tokenizer split regexes, by `tokenizer.ggml.pre` (facts about how llama.cpp splits text).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = {"default", "gpt2", "mpt", "olmo", "jais", "trillion"}
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}


def _progress(label: str, done: int, total: int, enabled: bool) -> None:
    """A progress line on stderr every 10% (overwritten in place on a terminal; no tqdm needed)."""
    step = max(1, total // 10)
    if not enabled or (done % step and done != total):
        return
    percent = f"{label}: {done}/{total} ({100 * done // total}%)"
    if sys.stderr.isatty():
        print("\r" + percent, end="\n" if done >= total else "", file=sys.stderr, flush=True)
    else:
        print(percent, file=sys.stderr, flush=True)


# ---- reading metadata ---------------------------------------------------------------------------


class _Metadata:
    """GGUF key/value metadata with typed, error-naming accessors."""

    def __init__(self, reader, path: Path):
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFImportError(f"{self.path}: metadata key {key!r} is missing")
        return value


def _build_config(meta: _Metadata, has_output: bool, tensor_names: set[str], dtype: str) -> dict:
    """config.json (LlamaForCausalLM or Gemma3ForCausalLM) from the GGUF hyperparameters."""
    arch = meta.require("general.architecture")
    if arch not in _ARCH_LAYER_TENSORS:
        raise GGUFImportError(
            f"{meta.path}: architecture {arch!r} is not supported by the GGUF importer "
            f"(supported: {', '.join(sorted(_ARCH_LAYER_TENSORS))})"
        )
    p = arch + "."
    hidden = int(meta.require(p + "embedding_length"))
    n_heads = int(meta.require(p + "attention.head_count"))
    n_kv = int(meta.get(p + "attention.head_count_kv", n_heads))
    head_dim = int(meta.get(p + "attention.key_length", hidden // n_heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = int(meta.get(p + "vocab_size", len(tokens) if tokens else 0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(p + "feed_forward_length")),
        "num_hidden_layers": int(meta.require(p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": not has_output,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "torch_dtype": dtype,
    }
    if arch == "gemma3":
        # Facts of llama.cpp's gemma3 graph that the GGUF does not store: local layers use RoPE base
        # 10000, every 6th layer is global, the query scale is 1/sqrt(head_dim), GELU (tanh) MLP.
        config.update(
            architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
            rope_local_base_freq=10000.0, sliding_window=int(meta.get(p + "attention.sliding_window", 4096)),
            sliding_window_pattern=6, query_pre_attn_scalar=head_dim, final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
        config.pop("hidden_act")
        config.pop("mlp_bias")
    rope_scaling = _rope_scaling(meta, p)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        value = meta.get("tokenizer.ggml." + gguf_key)
        if value is not None:
            config[key] = int(value)
    return config


def _rope_scaling(meta: _Metadata, p: str) -> dict | None:
    kind = meta.get(p + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(meta.require(p + "rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(meta.require(p + "rope.scaling.original_context_length")),
        }
    raise GGUFImportError(f"{meta.path}: rope scaling type {kind!r} is not supported by the GGUF importer")


# ---- tensors ------------------------------------------------------------------------------------


def _hf_tensor_name(gguf_name: str, path: Path, arch: str = "llama") -> str:
    """HF name of a GGUF tensor (a clear error for tensors the architecture does not have)."""
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    if gguf_name == "rope_freqs.weight":
        raise GGUFImportError(
            f"{path}: tensor 'rope_freqs.weight' holds llama3-style RoPE scaling factors, which the GGUF "
            "importer cannot turn back into HF's rope_scaling parameters; convert from the HF checkpoint instead"
        )
    parts = gguf_name.split(".", 2)
    layer_tensors = _ARCH_LAYER_TENSORS[arch]
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}"
    raise GGUFImportError(f"{path}: tensor {gguf_name!r} has no known HF name for a {arch} model")


def _arch(config: dict) -> str:
    return "gemma3" if config["model_type"] == "gemma3_text" else "llama"


def _unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: it stores each head's rotary halves interleaved (pairs),
    HF keeps the first half then the second half of every head."""
    rest = weight.shape[1:]
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def _convert_tensors(reader, config: dict, path: Path, dtype: str, show_progress: bool) -> dict:
    import torch
    from gguf.quants import dequantize

    torch_dtype = getattr(torch, dtype)
    tensors: dict[str, torch.Tensor] = {}
    arch = _arch(config)
    total = len(reader.tensors)
    for index, tensor in enumerate(reader.tensors, 1):
        hf_name = _hf_tensor_name(tensor.name, path, arch)
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise GGUFImportError(
                f"{path}: tensor {tensor.name!r} uses quantisation {tensor.tensor_type.name}, "
                f"which the gguf package cannot dequantise ({exc})"
            ) from exc
        expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = np.array(values, dtype=np.float32).reshape(expected)  # a copy: the reader maps the file read-only
        if arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            values = _unpermute_rows(values, config["num_attention_heads"])
        elif arch == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            values = _unpermute_rows(values, config["num_key_value_heads"])
        elif tensor.name.endswith("norm.weight"):
            values = values - _NORM_SHIFT[arch]
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(values)).to(torch_dtype)
        _progress("dequantising tensors", index, total, show_progress)
    return tensors


# ---- tokenizer ----------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str | None, path: Path):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre is None or pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is None:
        print(f"warning: {path}: unknown pre-tokenizer {pre!r}; splitting text as GPT-2 does",
              file=sys.stderr)
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])


def _byte_level_bpe(meta: _Metadata, tokens: list[str]):
    """GPT-2 style BPE: (model, pre-tokenizer, decoder, spell) where spell maps a GGUF token to its vocab key."""
    from tokenizers import decoders, models

    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())

    # Tokens are stored as text; the BPE vocabulary spells every byte in GPT-2's alphabet, so
    # anything written with other characters (raw added tokens) is re-spelled byte by byte.
    def spell(token: str) -> str:
        return token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(spell(token), index)
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    return model, _pre_tokenizer(meta.get("tokenizer.ggml.pre"), meta.path), decoders.ByteLevel(), spell, spelled


def _sentencepiece_bpe(meta: _Metadata, tokens: list[str], types: list[int]):
    """SentencePiece BPE (gemma, llama 1/2 GGUFs, ``tokenizer.ggml.model == 'llama'``) as a `tokenizers` BPE.

    Spaces are written as U+2581, unknown bytes fall back to the <0xNN> tokens. SentencePiece merges the
    pair whose result scores highest; a BPE merge list ranks every split of every normal token (both
    halves in the vocabulary) by that token's score, which gives the same order.
    """
    from tokenizers import decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    vocab = {token: index for index, token in enumerate(tokens)}
    candidates = []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind != 1 or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-float(scores[index]), vocab[left], vocab[right], left, right))
    candidates.sort()
    merges = [(left, right) for *_, left, right in candidates]
    unk = next((t for t, kind in zip(tokens, types) if kind == 2), None) or ("<unk>" if "<unk>" in vocab else None)
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    steps = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                + ([decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True) else []))
    model_parts = (model, None, decoder, lambda token: token, None)
    return model_parts, normalizers.Sequence(steps)


def build_tokenizer(meta: _Metadata):
    """A `tokenizers.Tokenizer` from the GGUF vocabulary, merges or scores, and token types."""
    from tokenizers import AddedToken, Tokenizer, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise TokenizerError(
            f"{meta.path}: tokenizer model {kind!r} is not supported by the GGUF importer "
            "(only byte-level BPE 'gpt2' and SentencePiece BPE 'llama')"
        )
    tokens = [str(t) for t in meta.require("tokenizer.ggml.tokens")]
    types = [int(t) for t in (meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))]
    normalizer = None
    if kind == "gpt2":
        model, pre_tokenizer, decoder, spell, spelled = _byte_level_bpe(meta, tokens)
    else:
        (model, pre_tokenizer, decoder, spell, spelled), normalizer = _sentencepiece_bpe(meta, tokens, types)
    backend = Tokenizer(model)
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoder

    # Control tokens match whole and are special; user-defined ones match whole but are text.
    # A token only joins when its text is its vocabulary entry, so no new ids appear.
    def whole(t: str) -> bool:
        return spelled is None or set(t) <= spelled

    control = [AddedToken(t, special=True, normalized=False)
               for t, kind_ in zip(tokens, types) if kind_ == _TOKEN_CONTROL and whole(t)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind_ in zip(tokens, types) if kind_ == _TOKEN_USER_DEFINED and whole(t)]
    backend.add_special_tokens(control)
    backend.add_tokens(user)

    def token_of(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None

    bos, eos = token_of("bos"), token_of("eos")
    ids = {spell(t): i for i, t in enumerate(tokens)}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = ([(bos, ids[spell(bos)])] if add_bos else []) + ([(eos, ids[spell(eos)])] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    arch = meta.get("general.architecture", "llama")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_of("unknown"),
        "pad_token": token_of("padding"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{arch}.context_length", 2048)),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = str(template)
    return backend, {k: v for k, v in tokenizer_config.items() if v is not None}


# ---- the importer -------------------------------------------------------------------------------


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16",
                overwrite: bool = False, show_progress: bool = True) -> Path:
    """Write an HF directory for the llama GGUF at `gguf_path` to `out_dir`; returns `out_dir`.

    Nothing appears at `out_dir` unless the whole import succeeds."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"dtype {dtype!r} is not supported; use bfloat16, float16 or float32")
    if not gguf_path.is_file():
        raise GGUFImportError(f"{gguf_path}: GGUF file not found")
    if out_dir.exists() and not overwrite:
        raise GGUFImportError(f"{out_dir}: already exists (pass overwrite=True / --overwrite to replace it)")
    started = time.perf_counter()
    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:  # the gguf package raises ValueError/struct errors on bad files
        raise GGUFImportError(f"{gguf_path}: not a readable GGUF file ({exc})") from exc
    meta = _Metadata(reader, gguf_path)
    names = {t.name for t in reader.tensors}
    config = _build_config(meta, has_output="output.weight" in names, tensor_names=names, dtype=dtype)
    for name in names:  # refuse unknown tensors before any work is done
        _hf_tensor_name(name, gguf_path, _arch(config))
    if "token_embd.weight" not in names:
        raise WeightError(f"{gguf_path}: tensor 'token_embd.weight' is missing")
    backend, tokenizer_config = build_tokenizer(meta)
    generation_config = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        backend.save(str(tmp_dir / "tokenizer.json"))
        for name, data in (("config.json", config), ("tokenizer_config.json", tokenizer_config),
                           ("generation_config.json", generation_config)):
            (tmp_dir / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (tmp_dir / "trellm_import.json").write_text(
            json.dumps({"source": str(gguf_path), "source_bytes": gguf_path.stat().st_size}, indent=2) + "\n"
        )
        tensors = _convert_tensors(reader, config, gguf_path, dtype, show_progress)
        if config["tie_word_embeddings"]:
            tensors.pop("lm_head.weight", None)
        if show_progress:
            print(f"writing {out_dir}/model.safetensors", file=sys.stderr)
        save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        for item in [tmp_dir, *tmp_dir.iterdir()]:  # mkdtemp makes it private; make it like any dir
            item.chmod(0o755 if item.is_dir() else 0o644)
        if out_dir.exists():  # overwrite: move the old one aside first, so the swap is quick
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "dir")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    if show_progress:
        print(f"imported {gguf_path.name} -> {out_dir} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return out_dir


# ---- CLI ----------------------------------------------------------------------------------------


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `import-gguf GGUF_PATH [-o OUT_DIR]` to the trellm CLI."""
    parser = subparsers.add_parser("import-gguf", help="convert a llama or gemma3 GGUF file into an HF model directory")
    parser.add_argument("gguf_path", metavar="GGUF_PATH", help="the .gguf file")
    parser.add_argument("-o", "--out-dir", default=None,
                        help="output directory (default: $TRELLM_CACHE/models/<GGUF name without .gguf>)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from .default_model import cache_dir

    gguf_path = Path(args.gguf_path)
    out_dir = Path(args.out_dir) if args.out_dir else cache_dir() / "models" / gguf_path.stem
    try:
        import_gguf(gguf_path, out_dir, dtype=args.dtype, overwrite=args.overwrite)
    except TrellmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out_dir)
    return 0
