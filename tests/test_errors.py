"""Bad input gets a clear error naming the file, tensor, key or value — never a crash or garbage."""
import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import trellm
from trellm.errors import ConfigError, TokenizerError, UnknownArchitectureError, WeightError
from trellm.sdk.testing import make_tiny_hf_model
from trellm.weights import SafetensorsFile

pytest.importorskip("transformers")


@pytest.fixture
def tiny(tmp_path):
    return make_tiny_hf_model("LlamaForCausalLM", tmp_path / "m", tie_word_embeddings=False)


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="missing config.json"):
        trellm.load(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        trellm.load(tmp_path / "nowhere")


def test_config_not_json(tiny):
    (tiny / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        trellm.load(tiny)


def test_unknown_architecture(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownArchitectureError, match="MysteryForCausalLM.*Installed architectures: .*LlamaForCausalLM"):
        trellm.load(tiny)


def test_bad_config_value(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["num_key_value_heads"] = 3  # 4 heads are not a multiple of 3
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        trellm.load(tiny)


def test_unsupported_rope_type(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "spiral", "rope_theta": 1e4}
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported rope type 'spiral'"):
        trellm.load(tiny)


def test_truncated_file(tiny):
    path = tiny / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError, match="model.safetensors.*truncated"):
        trellm.load(tiny)


def test_corrupt_header_length(tiny):
    path = tiny / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(data))
    with pytest.raises(WeightError, match="corrupt safetensors header"):
        SafetensorsFile(path)


def test_corrupt_header_json(tiny):
    path = tiny / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))
    with pytest.raises(WeightError, match="not valid JSON"):
        trellm.load(tiny)


def test_header_offsets_disagree_with_shape(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(64))
    with pytest.raises(WeightError, match="'w'.*needs 64 bytes but data_offsets span 32"):
        SafetensorsFile(path)


def test_missing_tensor(tiny):
    tensors = load_file(tiny / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(WeightError, match="model.layers.1.mlp.up_proj.weight.*missing"):
        trellm.load(tiny)


def test_wrong_shape(tiny):
    tensors = load_file(tiny / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(WeightError, match=r"k_proj.weight' has shape \[8, 64\], expected \[32, 64\]"):
        trellm.load(tiny)


def test_tokenizer_larger_than_vocab(tiny, smollm2_dir):
    """A tokenizer with more ids than the model's embedding rows is refused by name."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tiny / name)
    with pytest.raises(TokenizerError, match="vocab"):
        trellm.load(tiny)


def test_cli_reports_errors_without_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "trellm.cli", "info", "-m", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2
    assert "missing config.json" in out.stderr and "Traceback" not in out.stderr
