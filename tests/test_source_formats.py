"""Quantized source checkpoints (FP8 block / channel scales, MXFP4 experts): tiny real safetensors with
known values load dequantized, run like their dense equivalent and convert to EXL3; other methods are refused."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import trellm
from trellm.errors import WeightError
from trellm.quant.source import E2M1_VALUES, dequantize_fp8, dequantize_mxfp4
from trellm.weights import WeightStore

pytest.importorskip("transformers")
from trellm.sdk.testing import make_tiny_hf_model  # noqa: E402

FP8_MAX = 448.0


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> Path:
    """A copy of the model dir ``src`` with ``tensors`` as its only weights and ``quantization_config``."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def _logits(model_dir: Path, ids: list[list[int]]) -> torch.Tensor:
    return trellm.load(model_dir, device="cpu", dtype=torch.float32, tokenizer=False).logits(ids)


IDS = [[1, 5, 9, 200, 33, 17, 4, 250]]

# ---------------------------------------------------------------------------------------------
# FP8


def test_fp8_dequantization_known_values():
    w = torch.tensor([[1.5, -2.0, 0.25], [4.0, 0.5, -1.0], [3.0, -0.5, 2.0]]).to(torch.float8_e4m3fn)
    block = torch.tensor([[2.0, 0.5], [-1.0, 10.0]])  # 2x2 blocks over a 3x3 weight: the edges are partial
    assert dequantize_fp8(w, block, [2, 2]).tolist() == [[3.0, -4.0, 0.125], [8.0, 1.0, -0.5], [-3.0, 0.5, 20.0]]
    channel = torch.tensor([[2.0], [1.0], [0.5]])
    assert dequantize_fp8(w, channel).tolist() == [[3.0, -4.0, 0.5], [4.0, 0.5, -1.0], [1.5, -0.25, 1.0]]
    assert dequantize_fp8(w, torch.tensor(0.5)).tolist()[0] == [0.75, -1.0, 0.125]


def _fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 values, scale per block, dense value it encodes) of w, block by block with explicit loops."""
    out, inp = w.shape
    bo, bi = block
    scales = torch.empty(math.ceil(out / bo), math.ceil(inp / bi))
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    dense = torch.empty(out, inp)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]
            s = part.abs().max().clamp_min(1e-12) / FP8_MAX
            scales[i, j] = s
            qp = (part / s).to(torch.float8_e4m3fn)
            q[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = qp
            dense[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = qp.float() * s
    return q, scales, dense


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    """A 1-layer Llama stored as DeepSeek-style FP8 (32x32 blocks, odd edges), and the dense model it encodes."""
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny_hf_model("LlamaForCausalLM", root / "src", num_hidden_layers=1, intermediate_size=96,
                             tie_word_embeddings=False)
    fp8, dense = {}, {}
    for name, t in _tensors(src).items():
        if t.dim() == 2 and "embed" not in name and "lm_head" not in name:
            q, s, d = _fp8_blocks(t.float(), (32, 32))
            fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = q, s
            dense[name] = d
        else:
            fp8[name] = dense[name] = t
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    return _rewrite(src, root / "fp8", fp8, qc), _rewrite(src, root / "dense", dense, None), dense


def test_fp8_checkpoint_loads_its_dense_values(fp8_llama):
    fp8_dir, dense_dir, dense = fp8_llama
    store = WeightStore(fp8_dir)
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 96]: the last block column is half full
    assert store.info(name).dtype == torch.bfloat16 and store.info(name).shape == (64, 96)
    assert torch.equal(store.get(name, dtype=torch.float32), dense[name])
    assert not any(n.endswith("weight_scale_inv") for n in store.keys())
    torch.testing.assert_close(_logits(fp8_dir, IDS), _logits(dense_dir, IDS), rtol=1e-5, atol=1e-5)


def test_fp8_checkpoint_converts_to_exl3(fp8_llama, tmp_path):
    from trellm.convert import convert

    fp8_dir, dense_dir, _ = fp8_llama
    convert(fp8_dir, tmp_path / "q", tmp_path / "w", 5.0, head_bits=16, device="cpu", progress=False, cal_rows=4,
            cal_cols=32, scale_search=False)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "exl3"
    assert config["quantization_config"]["original_quantization_config"]["quant_method"] == "fp8"
    store = WeightStore(tmp_path / "q")
    assert "model.layers.0.mlp.down_proj.trellis" in store and not any("scale_inv" in n for n in store.keys())
    p = _logits(dense_dir, IDS).log_softmax(-1)
    q = _logits(tmp_path / "q", IDS).log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    assert kl < 0.05, kl


def test_compressed_tensors_channel_scales(fp8_llama, tmp_path):
    fp8_dir, _, _ = fp8_llama
    tensors = _tensors(fp8_dir)
    name = "model.layers.0.self_attn.q_proj.weight"
    for n in [n for n in tensors if n.endswith("weight_scale_inv")]:
        del tensors[n]
    for n in [n for n in tensors if tensors[n].dtype == torch.float8_e4m3fn]:
        tensors[n.replace(".weight", ".weight_scale")] = torch.linspace(0.5, 2.0, tensors[n].shape[0])[:, None]
        tensors[n.replace(".weight", ".input_scale")] = torch.tensor([1.0])
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    store = WeightStore(_rewrite(fp8_dir, tmp_path / "ct", tensors, qc))
    expect = tensors[name].float() * torch.linspace(0.5, 2.0, tensors[name].shape[0])[:, None]
    assert torch.equal(store.get(name, dtype=torch.float32), expect)
    assert not any(n.endswith(("input_scale", "weight_scale")) for n in store.keys())


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_unsupported_quantization_is_refused_by_name(fp8_llama, tmp_path, method):
    _, dense_dir, _ = fp8_llama
    bad = _rewrite(dense_dir, tmp_path / method, _tensors(dense_dir), {"quant_method": method, "bits": 4})
    with pytest.raises(WeightError, match=f"quant_method '{method}' is not supported"):
        trellm.load(bad, device="cpu", tokenizer=False)


def test_fp8_scale_of_the_wrong_shape_is_named(fp8_llama, tmp_path):
    fp8_dir, _, _ = fp8_llama
    tensors = _tensors(fp8_dir)
    tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(5, 5)
    bad = _rewrite(fp8_dir, tmp_path / "bad", tensors, json.loads((fp8_dir / "config.json").read_text())["quantization_config"])
    with pytest.raises(WeightError, match="up_proj.weight_scale_inv"):
        WeightStore(bad)
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    bad2 = _rewrite(fp8_dir, tmp_path / "bad2", tensors, json.loads((fp8_dir / "config.json").read_text())["quantization_config"])
    with pytest.raises(WeightError, match="scales\\) is missing"):
        WeightStore(bad2)


# ---------------------------------------------------------------------------------------------
# MXFP4


def test_mxfp4_dequantization_known_values():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21  # low nibble first: codes 1 (0.5) then 2 (1.0)
    blocks[0, 1] = 0xF7  # 7 (6.0) then 15 (-6.0)
    blocks[0, 2] = 0x9B  # 11 (-1.5) then 9 (-0.5)
    got = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8))  # 2^(128-127) = 2
    assert got.shape == (32,)
    assert got[:6].tolist() == [1.0, 2.0, 12.0, -12.0, -3.0, -1.0] and got[6:].abs().sum() == 0
    assert dequantize_mxfp4(blocks, torch.tensor([125], dtype=torch.uint8))[:2].tolist() == [0.125, 0.25]  # 2^-2


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks [.., G, 16], exponents [.., G], dense value they encode) of w [.., in], nearest E2M1 per value."""
    lut = torch.tensor(E2M1_VALUES[:8])
    g = w.reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(1e-8) / 6.0)).clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp)[..., None]
    code = (scaled.abs()[..., None] - lut).abs().argmin(-1) + 8 * (scaled < 0)
    dense = torch.tensor(E2M1_VALUES)[code] * torch.pow(2.0, exp)[..., None]
    pairs = code.reshape(*code.shape[:-1], 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8), dense.reshape(w.shape)


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory):
    """A 1-layer gpt-oss with MXFP4 experts (as released), and the stacked dense checkpoint it encodes."""
    root = tmp_path_factory.mktemp("mxfp4")
    src = make_tiny_hf_model("GptOssForCausalLM", root / "src", num_hidden_layers=1, num_local_experts=4,
                             num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=8,
                             layer_types=["sliding_attention"], hidden_size=64)
    mx, dense = {}, {}
    for name, t in _tensors(src).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] in the HF checkpoint
            blocks, scales, d = _mxfp4(t.float().transpose(1, 2).contiguous())  # quantized along "in"
            mx[name + "_blocks"], mx[name + "_scales"] = blocks, scales
            dense[name] = d.transpose(1, 2).contiguous()
        else:
            mx[name] = dense[name] = t
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens", "lm_head"]}
    return _rewrite(src, root / "mxfp4", mx, qc), _rewrite(src, root / "dense", dense, None), dense


def test_mxfp4_experts_load_per_expert_and_match_the_stacked_model(mxfp4_gpt_oss):
    mx_dir, dense_dir, dense = mxfp4_gpt_oss
    store = WeightStore(mx_dir)
    experts = "model.layers.0.mlp.experts"
    stacked_gate_up = dense[f"{experts}.gate_up_proj"]  # [E, H, 2I], gate and up interleaved along 2I
    assert torch.equal(store.get(f"{experts}.2.gate_proj.weight", dtype=torch.float32), stacked_gate_up[2, :, 0::2].t())
    assert torch.equal(store.get(f"{experts}.2.up_proj.weight", dtype=torch.float32), stacked_gate_up[2, :, 1::2].t())
    assert torch.equal(store.get(f"{experts}.3.down_proj.weight", dtype=torch.float32), dense[f"{experts}.down_proj"][3].t())
    torch.testing.assert_close(store.get(f"{experts}.1.up_proj.bias", dtype=torch.float32),
                               dense[f"{experts}.gate_up_proj_bias"][1, 1::2].float())
    assert f"{experts}.gate_up_proj_blocks" not in store and f"{experts}.gate_up_proj" not in store
    # the MXFP4 dir runs per-expert Linears, the dense dir the stacked path: one function
    torch.testing.assert_close(_logits(mx_dir, IDS), _logits(dense_dir, IDS), rtol=1e-4, atol=1e-4)


def test_mxfp4_checkpoint_converts_to_exl3(mxfp4_gpt_oss, tmp_path):
    from trellm.convert import convert

    mx_dir, dense_dir, _ = mxfp4_gpt_oss
    convert(mx_dir, tmp_path / "q", tmp_path / "w", 6.0, head_bits=16, device="cpu", progress=False, cal_rows=4,
            cal_cols=32, scale_search=False)
    store = WeightStore(tmp_path / "q")
    assert "model.layers.0.mlp.experts.3.down_proj.trellis" in store
    assert not any(n.endswith(("_blocks", "_scales")) for n in store.keys())
    p = _logits(dense_dir, IDS).log_softmax(-1)
    q = _logits(tmp_path / "q", IDS).log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    assert kl < 0.05, kl
