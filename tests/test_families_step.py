"""Parity of HyperCLOVA X with images, Step 3.5 / 3.7 Flash and DeciLM (Nemotron-Super) against their references (issue 30).

HyperCLOVA X vision is held against transformers with and without images (the Qwen2.5-VL tower of
tests/test_vision_qwen.py: 4-pixel patches merged 2x2, 16-pixel windows, layer 1 over the whole image).
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

import trellm  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from trellm.multimodal import prepare_prompt  # noqa: E402
from trellm.sdk.testing import check_parity, torch_threads  # noqa: E402

from test_vision import batched_greedy  # noqa: E402
from test_vision_qwen import IMAGE, hf_greedy, hf_image_features, hf_inputs, hf_logits, random_image  # noqa: E402

HCX_PROMPT = [5, 6, IMAGE, 7, 8, 9]


def _hcx_hf_model(seed: int = 0):
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                logits_scaling=0.5, embedding_multiplier=2.0, residual_multiplier=0.7, attention_multiplier=0.3)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=48, window_size=16, fullatt_block_indexes=[1])
    config = transformers.HyperCLOVAXVisionV2Config(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                                    video_token_id=311)
    torch.manual_seed(seed)
    hf = transformers.HyperCLOVAXVisionV2ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start at one: give them values
        for name, p in hf.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1, 0.3)
    return hf


@pytest.fixture(scope="module")
def hcx(tmp_path_factory):
    """(HF model, HF image processor, checkpoint dir, trellm model) of a tiny random HyperCLOVA X with images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = _hcx_hf_model()
    path = tmp_path_factory.mktemp("hcx_vision")
    hf.save_pretrained(path)
    proc = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    proc.save_pretrained(path)
    with torch_threads(1):
        yield hf, proc, path, trellm.load(path, device="cpu", dtype="float32")


def test_hcx_vision_text_parity(hcx):
    report = check_parity(hcx[2])
    print(report)
    report.assert_ok()


def test_hcx_vision_image_features_logits_and_greedy(hcx):
    hf, proc, _, lm = hcx
    for img in (random_image(0), random_image(1, size=(20, 90))):
        pixels, grid = hf_inputs(proc, img)
        mm = prepare_prompt(lm, HCX_PROMPT, [img])
        ref = hf_image_features(hf, pixels, grid) * hf.config.text_config.embedding_multiplier  # HF scales after placing them
        assert mm.embeds.shape == ref.shape and (mm.embeds - ref).abs().max() < 1e-5
        mine, theirs = lm.logits([HCX_PROMPT], images=[[img]])[0], hf_logits(hf, mm.input_ids, pixels, grid)
        assert (mine - theirs).abs().max() < 1e-3 * float(theirs.max() - theirs.min())
    ref = hf_greedy(hf, mm.input_ids, pixels, grid, 32)
    assert list(lm.generate_ids(HCX_PROMPT, max_new_tokens=32, stop_token_ids=[], images=[img])) == ref


def test_hcx_vision_two_images_in_one_batch(hcx):
    hf, proc, _, lm = hcx
    images = [random_image(2), random_image(3, size=(37, 61))]
    prompts = [prepare_prompt(lm, HCX_PROMPT, [img]) for img in images]
    refs = [hf_greedy(hf, p.input_ids, *hf_inputs(proc, img), 6) for p, img in zip(prompts, images)]
    assert refs[0] != refs[1]
    assert batched_greedy(lm, prompts, 6, page_size=8) == refs


def test_hcx_vision_loads_navers_tensor_names(hcx, tmp_path):
    """NAVER's upload nests the text model (``model.language_model.model.*``, its own head) and names the projector ``mm_projector``."""
    hf, _, path, lm = hcx
    tensors = load_file(path / "model.safetensors")
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("model.language_model."):
            name = "model.language_model.model." + name[len("model.language_model."):]
        renamed[name.replace("model.vision_projector.", "model.mm_projector.")] = t
    renamed["model.language_model.lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["HCXVisionV2ForCausalLM"], model_type="vlm", tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("preprocessor_config.json",):
        (tmp_path / name).write_text((path / name).read_text())
    img = random_image(4)
    with torch_threads(1):
        hub = trellm.load(tmp_path, device="cpu", dtype="float32")
        assert hub.spec.name == "hyperclovax_vision"
        assert torch.equal(hub.logits([HCX_PROMPT], images=[[img]])[0], lm.logits([HCX_PROMPT], images=[[img]])[0])
