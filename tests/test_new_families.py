"""Parity of the families added for the seed list's missing names (issue 30), each against transformers.

Some names are spelled differently from the transformers class that runs them (Baidu's
``Ernie4_5_ForCausalLM``; IQuest-Coder, which transformers runs with its Llama class): the test builds the
checkpoint with the transformers model and writes the checkpoint's own architecture name into config.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from trellm.sdk.testing import check_parity, make_tiny_hf_model

from test_moe_families import randomize


def _rename_architecture(model_dir: Path, name: str) -> Path:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = [name]
    path.write_text(json.dumps(config, indent=2))
    return model_dir


def test_ernie4_5_underscore_spelling(tmp_path):
    model_dir = make_tiny_hf_model("Ernie4_5ForCausalLM", tmp_path, use_bias=True)
    report = check_parity(_rename_architecture(model_dir, "Ernie4_5_ForCausalLM"))
    print(report)
    report.assert_ok()


def test_iquestcoder_decoupled_head_dim(tmp_path):
    import torch
    from transformers.models.iquestcoder import IQuestCoderConfig

    config = IQuestCoderConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                               initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    model.config.architectures = ["IQuestCoderForCausalLM"]
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "iquestcoder"
    report = check_parity(tmp_path)
    print(report)
    report.assert_ok()


SOLAR_OPEN = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2,
              "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "head_dim": 16}


def test_solar_open_moe_on_every_layer(tmp_path):
    model_dir = make_tiny_hf_model("SolarOpenForCausalLM", tmp_path, **SOLAR_OPEN)
    randomize(model_dir, "e_score_correction_bias")
    report = check_parity(model_dir)
    print(report)
    report.assert_ok()


HY_V3 = {"num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
         "head_dim": 16, "router_scaling_factor": 2.5, "mlp_layer_types": ["dense", "sparse"]}


def test_hy_v3_sigmoid_router_with_bias_and_shared_experts(tmp_path):
    model_dir = make_tiny_hf_model("HYV3ForCausalLM", tmp_path, **HY_V3)
    randomize(model_dir, "expert_bias")
    report = check_parity(model_dir, max_new_tokens=12)
    print(report)
    report.assert_ok()
