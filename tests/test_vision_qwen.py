"""Qwen2.5-VL, Qwen3-VL (dense and MoE), GLM 4.1V and GLM 4.5V parity with HF on tiny random models: processors, towers, M-RoPE, DeepStack.

The tower sees 4-pixel patches merged 2x2 and 16-pixel windows, so a 61x37 image becomes a 16x10
patch grid, 8x5 merged tokens and (Qwen2.5-VL) partial windows at the edges; layer 1 attends over the
whole image. Qwen3-VL resamples a 4x4 learned position table and taps tower layers 0 and 1 for DeepStack.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

import trellm  # noqa: E402
from trellm.multimodal import ImageError, prepare_prompt  # noqa: E402
from trellm.sdk.testing import torch_threads  # noqa: E402
from test_vision import batched_greedy, check_on_cuda  # noqa: E402  (tests/ is on sys.path)

IMAGE, START, END = 310, 308, 309
PROMPT = [5, 6, START, IMAGE, END, 7, 8, 9]


def random_image(seed: int, size=(61, 37)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def tiny_config(transformers, family: str):
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64)
    tokens = dict(image_token_id=IMAGE, video_token_id=311, vision_start_token_id=START, vision_end_token_id=END)
    if family.startswith("glm4v"):
        text["rope_parameters"].update(mrope_section=[2, 1, 1], partial_rotary_factor=0.5)
        vision.update(intermediate_size=48, image_size=16)
        tokens = dict(image_token_id=IMAGE, video_token_id=311, image_start_token_id=START, image_end_token_id=END)
        if family == "glm4v_moe":  # GLM 4.5V: DeepSeek-style experts after one dense layer, biased q/k/v
            text.update(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_group=2, topk_group=1,
                        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, attention_bias=True)
            return (transformers.Glm4vMoeConfig(text_config=text, vision_config=vision, **tokens),
                    transformers.Glm4vMoeForConditionalGeneration)
        return transformers.Glm4vConfig(text_config=text, vision_config=vision, **tokens), transformers.Glm4vForConditionalGeneration
    if family == "qwen2_5_vl":
        vision.update(window_size=16, fullatt_block_indexes=[1])
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens), transformers.Qwen2_5_VLForConditionalGeneration
    text["rope_parameters"]["mrope_interleaved"] = True
    vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    if family == "qwen3_vl_moe":  # expert width 24: the stacked [E, 2I, H] tensors are not square
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[0])
        return (transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **tokens),
                transformers.Qwen3VLMoeForConditionalGeneration)
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens), transformers.Qwen3VLForConditionalGeneration


def save_tiny_vl(family: str, path):
    """A tiny random Qwen2.5-VL / Qwen3-VL / GLM 4.1V checkpoint with its image processor written to ``path``:
    (HF model, HF image processor)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # GLM 4.5V's tiny model at seed 0 greedily emits the image token in the two-image test, which HF's
    # forward then counts as a marker without features: another seed.
    torch.manual_seed(1 if family == "glm4v_moe" else 0)
    config, cls = tiny_config(transformers, family)
    hf = cls(config).eval()
    with torch.no_grad():  # norms start at one / zero: give them values
        for name, p in hf.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1, 0.3)
    hf.save_pretrained(path)
    mean = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if family.startswith("qwen3_vl") else {}
    proc_cls = Qwen2VLImageProcessorPil
    if family.startswith("glm4v"):
        from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil as proc_cls
    proc = proc_cls(patch_size=4, merge_size=2, temporal_patch_size=2,
                    size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64}, **mean)
    proc.save_pretrained(path)
    return hf, proc


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe"])
def qwen(request, tmp_path_factory):
    """(HF model, HF image processor, trellm model) of a tiny random Qwen2.5-VL / Qwen3-VL / GLM 4.1V."""
    path = tmp_path_factory.mktemp(request.param)
    hf, proc = save_tiny_vl(request.param, path)
    with torch_threads(1):
        yield hf, proc, trellm.load(path, device="cpu", dtype="float32")


def hf_image_features(hf, pixels, grid) -> torch.Tensor:
    """Merged tokens, then (Qwen3-VL) each DeepStack feature, side by side: the layout trellm carries."""
    with torch.no_grad():
        out = hf.model.get_image_features(pixels, grid)
    deep = [d[0] for d in getattr(out, "deepstack_features", None) or []]
    return torch.cat([out.pooler_output[0]] + deep, dim=-1)


def hf_inputs(proc, img):
    out = proc(img, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def hf_logits(hf, ids, pixels, grid) -> torch.Tensor:
    x = torch.tensor([ids])
    with torch.no_grad():
        return hf(input_ids=x, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(x == IMAGE).int()).logits[0]


def hf_greedy(hf, ids, pixels, grid, n: int) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(hf_logits(hf, ids, pixels, grid)[-1].argmax()))
        ids.append(out[-1])
    return out


def test_qwen_processor_embeddings_and_logits(qwen):
    hf, proc, lm = qwen
    for img in (random_image(0), random_image(1, size=(20, 90)), random_image(2, size=(300, 200))):
        pixels, grid = hf_inputs(proc, img)
        item = lm.model.preprocess(img)
        assert item.grid == tuple(grid[0].tolist()) and torch.allclose(item.pixels, pixels, atol=1e-5)
        mm = prepare_prompt(lm, PROMPT, [img])
        ref = hf_image_features(hf, pixels, grid)
        assert mm.embeds.shape == ref.shape and (mm.embeds - ref).abs().max() < 1e-5
        mine = lm.logits([PROMPT], images=[[img]])[0]
        assert (mine - hf_logits(hf, mm.input_ids, pixels, grid)).abs().max() < 1e-4


def test_qwen_greedy_continuation_with_position_delta(qwen):
    hf, proc, lm = qwen
    img = random_image(3)
    mm = prepare_prompt(lm, PROMPT, [img])
    assert mm.position_delta < 0  # 40 image tokens span only max(8, 5) positions
    ref = hf_greedy(hf, mm.input_ids, *hf_inputs(proc, img), 8)
    assert list(lm.generate_ids(PROMPT, max_new_tokens=8, stop_token_ids=[], images=[img])) == ref


def test_qwen_two_images_in_one_batch_no_cross_talk(qwen):
    hf, proc, lm = qwen
    images = [Image.new("RGB", (61, 37), (255, 0, 0)), Image.new("RGB", (37, 61), (0, 40, 255))]  # other grid, other delta
    prompts = [prepare_prompt(lm, PROMPT, [img]) for img in images]
    refs = [hf_greedy(hf, p.input_ids, *hf_inputs(proc, img), 6) for p, img in zip(prompts, images)]
    assert refs[0] != refs[1]
    assert batched_greedy(lm, prompts, 6, page_size=8) == refs


def test_qwen_marker_count_error(qwen):
    _, _, lm = qwen
    with pytest.raises(ImageError, match="1 image markers"):
        prepare_prompt(lm, PROMPT, [random_image(4), random_image(5)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qwen_on_cuda(qwen):
    _, _, lm = qwen
    check_on_cuda(lm, PROMPT, [random_image(6)])


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """A tiny Qwen3.5 (hybrid) with vision, served by QWEN3_5_VISION_SPEC registered as a plugin for this module."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from trellm import registry
    from trellm.plugins.architectures.qwen3_vl import QWEN3_5_VISION_SPEC

    torch.manual_seed(0)
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True, "partial_rotary_factor": 0.25})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=311,
                                        vision_start_token_id=START, vision_end_token_id=END)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0 if "language_model" in name else 1, 0.3)  # text norms are 1 + w
    path = tmp_path_factory.mktemp("qwen3_5_vl")
    hf.save_pretrained(path)
    proc = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    proc.save_pretrained(path)

    class VisionPlugin:
        @trellm.hookimpl
        def trellm_register_architectures(register):
            register(QWEN3_5_VISION_SPEC)

        @trellm.hookimpl
        def trellm_resolve_architecture(architecture, claims):  # over the text-only qwen3_5 plugins
            return next((c for c in claims if c.spec is QWEN3_5_VISION_SPEC), None)

    registry.load_plugins()
    registry.pm.register(VisionPlugin, name="test_qwen3_5_vision")
    try:
        with torch_threads(1):
            yield hf, proc, trellm.load(path, device="cpu", dtype="float32")
    finally:
        registry.pm.unregister(name="test_qwen3_5_vision")


def test_qwen3_5_hybrid_with_vision(qwen3_5):
    hf, proc, lm = qwen3_5
    img = random_image(7)
    pixels, grid = hf_inputs(proc, img)
    mm = prepare_prompt(lm, PROMPT, [img])
    assert (mm.embeds - hf_image_features(hf, pixels, grid)).abs().max() < 1e-5
    assert (lm.logits([PROMPT], images=[[img]])[0] - hf_logits(hf, mm.input_ids, pixels, grid)).abs().max() < 1e-4



def test_qwen3_5_two_images_in_one_batch(qwen3_5):
    """Hybrid model: paged KV + recurrent-state slots, two images decoded side by side (no cross-talk)."""
    hf, proc, lm = qwen3_5
    images = [Image.new("RGB", (61, 37), (255, 0, 0)), Image.new("RGB", (37, 61), (0, 40, 255))]
    prompts = [prepare_prompt(lm, PROMPT, [img]) for img in images]
    refs = [hf_greedy(hf, p.input_ids, *hf_inputs(proc, img), 5) for p, img in zip(prompts, images)]
    assert refs[0] != refs[1]
    assert batched_greedy(lm, prompts, 5, page_size=8) == refs
