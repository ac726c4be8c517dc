"""The third-party plugin path: examples/trellm-example-plugin is pip-installed like any plugin."""
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import trellm
from trellm.sdk.testing import make_tiny_hf_model

pytest.importorskip("transformers")


def test_example_plugin_is_installed_and_listed():
    out = subprocess.run([sys.executable, "-m", "trellm.cli", "plugins"], capture_output=True, text=True, check=True).stdout
    assert "example" in out and "ExampleLlamaForCausalLM" in out, (
        "the example plugin is not installed: pip install ./examples/trellm-example-plugin\n" + out
    )


def test_load_uses_the_example_plugin(tmp_path):
    import json

    import transformers

    src = make_tiny_hf_model("LlamaForCausalLM", tmp_path / "llama", tie_word_embeddings=False)
    renamed = {
        k.replace("model.embed_tokens", "backbone.embed").replace("model.layers", "backbone.blocks")
        .replace("model.norm", "backbone.final_norm").replace("lm_head", "head"): v
        for k, v in load_file(src / "model.safetensors").items()
    }
    dst = tmp_path / "example"
    dst.mkdir()
    save_file(renamed, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["ExampleLlamaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))

    lm = trellm.load(dst, device="cpu")
    assert lm.spec.name == "example-llama"
    ids = torch.arange(10)[None]
    ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        torch.testing.assert_close(lm.logits(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
