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


# ---- MiMo: Qwen2 + an MTP layer (remote code upstream: checked against transformers' Qwen2 and by hand) ----


def _mimo_checkpoint(tmp_path, **overrides) -> tuple[Path, Path, dict]:
    """A tiny Qwen2 (config ``overrides``) saved twice: as is, and as MiMo (architecture renamed, random
    ``model.mtp_layers.0.*``)."""
    import shutil

    from test_mtp import add_mtp_tensors

    plain = make_tiny_hf_model("Qwen2ForCausalLM", tmp_path / "qwen2", **overrides)
    mimo = tmp_path / "mimo"
    shutil.copytree(plain, mimo)
    layer = "model.mtp_layers.0."
    mtp = add_mtp_tensors(mimo, seed=5, layer=layer, fc=layer + "input_proj.weight", norm_center=1.0,
                          norms=tuple(layer + n for n in ("token_layernorm", "hidden_layernorm", "final_layernorm")))
    config = json.loads((mimo / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (mimo / "config.json").write_text(json.dumps(config, indent=2))
    return plain, mimo, mtp


def test_mimo_main_model_and_mtp_head(tmp_path):
    import torch

    import trellm
    from trellm.batch import ForwardBatch
    from trellm.generator import Generator, Job, JobFinished
    from trellm.generator.mtp import MTPProposer, mtp_head_of

    plain, mimo, mtp = _mimo_checkpoint(tmp_path)
    check_parity(mimo, max_new_tokens=12).assert_ok()  # transformers runs it as the Qwen2 it is

    lm = trellm.load(mimo, device="cpu", dtype=torch.float32, tokenizer=False)
    head = mtp_head_of(lm)
    assert head is not None and torch.equal(head.fc.impl.weight, mtp["model.mtp_layers.0.input_proj.weight"])

    # The head against MiMo's math by hand, around transformers' Qwen2 decoder layer holding the MTP weights.
    hf = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    layer = hf.model.layers[0]
    layer.load_state_dict({k[len("model.mtp_layers.0."):]: v for k, v in mtp.items()
                           if k[len("model.mtp_layers.0."):].split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})
    eps = hf.config.rms_norm_eps
    norm = lambda x, name: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * mtp[f"model.mtp_layers.0.{name}.weight"]
    tokens = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        h = hf.model(torch.tensor([tokens])).last_hidden_state[0][:-1]
        e = hf.model.embed_tokens(torch.tensor(tokens[1:]))
        x = torch.cat([norm(h, "hidden_layernorm"), norm(e, "token_layernorm")], -1) @ mtp["model.mtp_layers.0.input_proj.weight"].T
        n = x.shape[0]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x[None], position_embeddings=hf.model.rotary_emb(x[None], positions), attention_mask=mask, position_ids=positions)
        want = norm(out[0] if isinstance(out, tuple) else out, "final_layernorm")[0]
    batch = ForwardBatch.no_cache([tokens[1:]])
    with torch.inference_mode():
        got = head.forward(lm.model.embed.forward(batch.input_ids), h, batch)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # Drafting with the head leaves greedy output unchanged.
    def run(proposer):
        gen = Generator(lm, max_batch_size=2, max_chunk_tokens=16, cache_tokens=512, page_size=16, proposer=proposer,
                        num_draft_tokens=3 if proposer else 0)
        gen.enqueue([Job(list(p), 12, stop_token_ids=[], identifier=i) for i, p in enumerate([tokens, tokens[:7]])])
        done = []
        with torch.inference_mode():
            while gen.has_work():
                done += [r for r in gen.iterate() if isinstance(r, JobFinished)]
        return sorted(done, key=lambda r: r.identifier)

    plain_out = run(None)
    drafted = run(MTPProposer(lm, num_tokens=3, cache_tokens=512, page_size=16))
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain_out]
    assert sum(r.draft_proposed for r in drafted) > 0
