"""Parity of HyperCLOVA X with images, Step 3.5 / 3.7 Flash and DeciLM (Nemotron-Super) against their references (issue 30).

HyperCLOVA X vision is held against transformers with and without images (the Qwen2.5-VL tower of
tests/test_vision_qwen.py: 4-pixel patches merged 2x2, 16-pixel windows, layer 1 over the whole image).
Step 3.7 with images: a 48-pixel global view (12 x 12 patches, the position table's size) and 32-pixel crops
(8 x 8 patches, so the table is resized), 9 and 4 tokens after the two convolutions.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

import trellm  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from trellm.multimodal import ImageError, prepare_prompt  # noqa: E402
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


# ---- Step 3.5 / 3.7 Flash ------------------------------------------------------------------------------

STEP_LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
STEP_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0, moe_intermediate_size=32, share_expert_dim=48, n_routed_experts=8, num_experts_per_tok=2,
                 layer_types=STEP_LAYER_TYPES, sliding_window=8, num_sliding_attention_heads=8,
                 mlp_layer_types=["dense", "sparse", "sparse", "sparse"], rope_theta=[10000.0, 500.0, 10000.0, 500.0],
                 partial_rotary_factors=[0.5, 1.0, 0.5, 1.0], swiglu_limits=[0, 0, 0.3, 0.05],
                 swiglu_limits_shared=[0.1, 0, 0.3, 0.05], moe_router_scaling_factor=2.5)


STEP_VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=48, patch_size=4)
STEP_PROCESSOR = dict(size={"height": 48, "width": 48}, patch_size=32, max_image_size=160)  # 9 tokens a view, 4 a crop
STEP_IMAGE = 250
STEP_DELIMITERS = ("<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>")  # ids 251..255


def _step_hf_model():
    """A tiny random Step 3.7 (its text model is Step 3.5's): clamps small enough to bite, norms and router bias
    random; in the tower, weights of unit gain and norms, biases and layer scales random."""
    config = transformers.Step3p7Config(text_config=dict(STEP_TEXT), image_token_id=STEP_IMAGE, vision_config=STEP_VISION)
    torch.manual_seed(0)
    hf = transformers.Step3p7ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                p.normal_(0, 0.3)  # stored as w - 1
            elif "language_model" in name and p.dim() >= 2:
                p.normal_(0, 0.15)
            elif p.dim() >= 2:  # the tower and the projector
                p.normal_(0, p[0].numel() ** -0.5)
            else:
                p.normal_(1 if "norm" in name else 0.3, 0.3)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return hf


def _step_tokenizer(path) -> None:
    """A word-level tokenizer (w0 ... w249) with Step 3.7's image tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ("<im_patch>",) + STEP_DELIMITERS
    vocab = {f"w{i}": i for i in range(STEP_IMAGE)} | {t: STEP_IMAGE + i for i, t in enumerate(special)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(special))
    tok.save(str(path / "tokenizer.json"))


def _pil_step_processor():
    """transformers' Step3p7ImageProcessor with its torchvision calls (resize, pad, normalize) done by Pillow and
    torch, torchvision not being installed: its planning, cutting, crop order and newline marks run as they are."""
    from PIL import Image
    from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor

    class PilStep3p7ImageProcessor(Step3p7ImageProcessor):
        def resize(self, image, size, resample=None, **kwargs):
            flat = [Image.fromarray(im.permute(1, 2, 0).numpy()).resize((size.width, size.height), resample=int(resample))
                    for im in image.reshape(-1, *image.shape[-3:])]
            out = torch.stack([torch.tensor(np.array(im)).permute(2, 0, 1) for im in flat])
            return out.reshape(*image.shape[:-2], size.height, size.width)

        def pad(self, images, pad_size=None, **kwargs):
            return [F.pad(im, (0, pad_size.width - im.shape[-1], 0, pad_size.height - im.shape[-2])) for im in images]

        def normalize(self, image, mean, std, **kwargs):
            return (image - torch.as_tensor(mean)[:, None, None]) / torch.as_tensor(std)[:, None, None]

    return PilStep3p7ImageProcessor(**STEP_PROCESSOR, vision_patch_size=STEP_VISION["patch_size"])


@pytest.fixture(scope="module")
def step3p7(tmp_path_factory):
    """(HF model, HF processor, checkpoint dir, trellm model) of a tiny random Step 3.7 with its processor and tokenizer."""
    from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor

    hf, path = _step_hf_model(), tmp_path_factory.mktemp("step3p7")
    hf.save_pretrained(path)
    Step3p7ImageProcessor(**STEP_PROCESSOR).save_pretrained(path)
    _step_tokenizer(path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    proc = transformers.Step3p7Processor(image_processor=_pil_step_processor(), tokenizer=fast)
    with torch_threads(1):
        yield hf, proc, path, trellm.load(path, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def step3p7_dir(step3p7):
    return step3p7[2]


def _stepfun_config() -> dict:
    """STEP_TEXT as StepFun's Step3p5ForCausalLM config.json writes it: its own key names, per-layer lists
    padded with one MTP layer, the sliding layers' heads in ``attention_other_setting``."""
    pad = lambda values, extra: list(values) + [extra]  # noqa: E731
    return dict(
        architectures=["Step3p5ForCausalLM"], model_type="step3p5", vocab_size=256, hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_attention_groups=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_nextn_predict_layers=1, sliding_window=8,
        layer_types=pad(STEP_LAYER_TYPES, "full_attention"),
        attention_other_setting={"num_attention_heads": 8, "num_attention_groups": 2, "head_dim": 16},
        rope_theta=pad(STEP_TEXT["rope_theta"], 10000.0), partial_rotary_factors=pad(STEP_TEXT["partial_rotary_factors"], 0.5),
        moe_num_experts=8, moe_top_k=2, moe_intermediate_size=32, share_expert_dim=48, moe_router_scaling_factor=2.5,
        moe_layers_enum="1,2,3,4", swiglu_limits=pad(STEP_TEXT["swiglu_limits"], 0), norm_expert_weight=True,
        swiglu_limits_shared=pad(STEP_TEXT["swiglu_limits_shared"], 0), use_moe_router_bias=True, hidden_act="swigluoai",
    )


def test_step3p5_stepfun_config_against_transformers(step3p7_dir, tmp_path):
    """Step3p5ForCausalLM (StepFun's text checkpoint, which transformers runs only inside Step 3.7): the text
    tensors of the Step 3.7 checkpoint under StepFun's config, held against transformers running the Step 3.7 one."""
    text = {k: t for k, t in load_file(step3p7_dir / "model.safetensors").items() if k.startswith(("model.", "lm_head"))}
    save_file(text, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(_stepfun_config()))
    report = check_parity(tmp_path, reference_dir=step3p7_dir)
    print(report)
    report.assert_ok()


def test_step3p5_sliding_head_size_of_its_own_is_refused(tmp_path):
    from trellm.errors import ConfigError

    config = _stepfun_config()
    config["attention_other_setting"]["head_dim"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="attention_other_setting.head_dim 32 differs from head_dim 16"):
        trellm.load(tmp_path, device="cpu", dtype="float32")


def test_step3p7_text_parity(step3p7_dir):
    """Step 3.7 Flash on text prompts (the checkpoint save_pretrained writes: StepFun's tensor names, a nested text config)."""
    report = check_parity(step3p7_dir)
    print(report)
    report.assert_ok()


STEP_PROMPTS = ([5, 6, STEP_IMAGE, 7, 8, 9], [11, STEP_IMAGE, 12])
STEP_IMAGES = ((61, 37), (20, 90))  # two crops in a row; padded to a square, 3 x 3 crops with newlines


def step_hf_inputs(proc, img) -> dict:
    out = proc.image_processor(img, return_tensors="pt")
    return dict(pixel_values=out["pixel_values"], pixel_values_local=out.get("pixel_values_local"),
                num_local_patches=out["num_local_patches"].tolist())


def step_hf_logits(hf, ids, inputs) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), **inputs).logits[0]


def test_step3p7_plans_crops_like_transformers():
    """The crop plan (square padding, downscaling, window choice, rounding to whole windows) of every size in a
    grid around the thresholds, at the released sizes and the tiny ones, is transformers' own."""
    from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor as HFProcessor
    from trellm.plugins.vision.step3p7 import Step3p7ImageProcessor

    sides = [1, 5, 20, 31, 32, 33, 47, 49, 100, 161, 300, 503, 504, 505, 600, 727, 729, 1000, 1092, 2000, 3025, 7000]
    for size, crop, largest in ((728, 504, 3024), (48, 32, 160)):
        hf, mine = HFProcessor(size={"height": size, "width": size}, patch_size=crop, max_image_size=largest), \
            Step3p7ImageProcessor(size, crop, largest)
        for w in sides:
            for h in sides:
                try:
                    want = hf._plan_patches(w, h, size, crop)
                except ZeroDivisionError:  # a side scaled down to no pixels
                    with pytest.raises(ImageError, match="aspect ratio is too extreme"):
                        mine.plan(w, h)
                    continue
                p = mine.plan(w, h)
                assert (p.view_size, p.crop_size, p.window, p.cols, p.rows, p.pad_to_square) == want, (w, h, size)


@pytest.mark.parametrize("size", [(61, 37), (20, 90), (40, 40), (200, 120), (30, 130)])
def test_step3p7_pixels_and_prompt_like_transformers(step3p7, size):
    """Global view, crops (their order and count), and the expanded prompt (crop rows, newlines, delimiters) as
    transformers' processor makes them, from a text prompt and from ids."""
    _, proc, _, lm = step3p7
    img = random_image(7, size=size)
    ref = proc(text="w5 w6 <im_patch> w7", images=[img], return_tensors="pt")
    item = lm.model.preprocess(img)
    assert torch.allclose(item.pixels, ref["pixel_values"][0], atol=1e-5)
    local = ref.get("pixel_values_local", torch.zeros(0, 3, 32, 32))
    assert item.crops.shape == local.shape and torch.allclose(item.crops, local, atol=1e-5)
    by_text = prepare_prompt(lm, "w5 w6 <im_patch> w7", [img])
    assert by_text.input_ids == ref["input_ids"][0].tolist()
    assert prepare_prompt(lm, [5, 6, STEP_IMAGE, 7], [img]).input_ids == by_text.input_ids


def test_step3p7_image_features_logits_and_greedy(step3p7):
    """Image embeddings within 1e-4, prompt logits within 1e-3 of the range, then 32 greedy tokens of both prompts
    (images of different sizes) decoded in one batch through the paged cache, as transformers gives them."""
    hf, proc, _, lm = step3p7
    images = [random_image(i, size=size) for i, size in enumerate(STEP_IMAGES)]
    prompts = [prepare_prompt(lm, p, [img]) for p, img in zip(STEP_PROMPTS, images)]
    refs = []
    for text, img, mm in zip(STEP_PROMPTS, images, prompts):
        inputs = step_hf_inputs(proc, img)
        with torch.no_grad():
            features = hf.model.get_image_features(**inputs).pooler_output[0]
        assert mm.embeds.shape == features.shape and (mm.embeds - features).abs().max() < 1e-4
        want = step_hf_logits(hf, mm.input_ids, inputs)
        got = lm.logits([text], images=[[img]])[0]
        assert (got - want).abs().max() < 1e-3 * float(want.max() - want.min())
        ids = list(mm.input_ids)
        for _ in range(32):
            ids.append(int(step_hf_logits(hf, ids, inputs)[-1].argmax()))
        refs.append(ids[len(mm.input_ids):])
    assert refs[0] != refs[1]
    assert batched_greedy(lm, prompts, 32, page_size=8) == refs
    assert list(lm.generate_ids(STEP_PROMPTS[1], max_new_tokens=32, stop_token_ids=[], images=[images[1]])) == refs[1]


@pytest.mark.parametrize("change", ["no rotation", "rows before columns"])
def test_step3p7_tower_needs_its_2d_rope(step3p7, monkeypatch, change):
    """The image-embedding comparison above fails without the tower's 2D RoPE or with its bands swapped."""
    hf, proc, _, lm = step3p7
    tower, img = lm.model.vision.tower, random_image(1, size=STEP_IMAGES[1])
    with torch.no_grad():
        features = hf.model.get_image_features(**step_hf_inputs(proc, img)).pooler_output[0]
    rope = tower.rope  # cos, sin: column angles, then row angles
    if change == "no rotation":
        changed = lambda rows, cols: tuple(f(t) for f, t in zip((torch.ones_like, torch.zeros_like), rope(rows, cols)))  # noqa: E731
    else:
        changed = lambda rows, cols: tuple(torch.cat(t.chunk(2, -1)[::-1], -1) for t in rope(rows, cols))  # noqa: E731
    assert (prepare_prompt(lm, STEP_PROMPTS[1], [img]).embeds - features).abs().max() < 1e-4
    monkeypatch.setattr(tower, "rope", changed)
    assert (prepare_prompt(lm, STEP_PROMPTS[1], [img]).embeds - features).abs().max() > 1e-2


def test_step3p7_loads_stepfuns_vision_config_spelling(step3p7, tmp_path):
    """StepFun's vision_config (``width``, ``layers``, ``heads``, its own model_type, the MLP width from ``mlp_ratio``)
    gives the same model; transformers reads it the same way."""
    _, _, path, lm = step3p7
    for name in ("model.safetensors", "preprocessor_config.json", "tokenizer.json"):
        (tmp_path / name).symlink_to(path / name)
    config = json.loads((path / "config.json").read_text())
    v = config["vision_config"]
    config["vision_config"] = dict(model_type="step3_vision_encoder", width=v["hidden_size"], layers=v["num_hidden_layers"],
                                   heads=v["num_attention_heads"], image_size=v["image_size"], patch_size=v["patch_size"],
                                   mlp_ratio=v["mlp_ratio"], hidden_act="quick_gelu")
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = transformers.AutoConfig.from_pretrained(tmp_path).vision_config
    assert (read.hidden_size, read.num_hidden_layers, read.intermediate_size) == (32, 2, v["intermediate_size"])
    img = random_image(3, size=STEP_IMAGES[1])
    with torch_threads(1):
        stepfun = trellm.load(tmp_path, device="cpu", dtype="float32")
        assert torch.equal(stepfun.logits([STEP_PROMPTS[1]], images=[[img]]), lm.logits([STEP_PROMPTS[1]], images=[[img]]))


def test_step3p7_image_errors_name_the_problem(step3p7, tmp_path):
    from trellm.errors import ConfigError

    _, _, path, _ = step3p7
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        (tmp_path / name).symlink_to(path / name)
    no_tokenizer = trellm.load(tmp_path, device="cpu", dtype="float32")
    with pytest.raises(ImageError, match="needs the model's tokenizer to find <im_start>"):
        prepare_prompt(no_tokenizer, [5, STEP_IMAGE, 6], [random_image(0)])
    _step_tokenizer(tmp_path)
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<patch_newline>"]
    del tok["model"]["vocab"]["<patch_newline>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ImageError, match="the tokenizer has no <patch_newline>"):
        prepare_prompt(trellm.load(tmp_path, device="cpu", dtype="float32"), [5, STEP_IMAGE, 6], [random_image(0)])
    (tmp_path / "preprocessor_config.json").unlink()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 48, "width": 32}}))
    with pytest.raises(ConfigError, match="must be square"):
        trellm.load(tmp_path, device="cpu", dtype="float32")
    config = json.loads((path / "config.json").read_text())
    config["image_token_id"] = 300
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="image_token_id 300 is outside the vocabulary"):
        trellm.load(tmp_path, device="cpu", dtype="float32")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
def test_step3p7_with_images_on_cuda(step3p7):
    from test_vision import check_on_cuda

    check_on_cuda(step3p7[3], STEP_PROMPTS[1], [random_image(1, size=STEP_IMAGES[1])])


# ---- DeciLM / Nemotron-Super ----------------------------------------------------------------------------------

DECI_BLOCKS = [  # every kind of block NVIDIA's published format has, and MLP widths of 256 and 512
    {"attention": {"n_heads_in_group": 1}, "ffn": {"ffn_mult": 2.0}},
    {"attention": {"no_op": True}, "ffn": {"ffn_mult": 7.0}},
    {"attention": {"n_heads_in_group": 4}, "ffn": {"replace_with_linear": True}},
    {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}},
    {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.3}},
    {"attention": {"no_op": True}, "ffn": {"no_op": True}},
]
DECI_CONFIG = dict(architectures=["DeciLMForCausalLM"], model_type="nemotron-nas", vocab_size=256, hidden_size=64,
                   num_attention_heads=4, num_hidden_layers=len(DECI_BLOCKS), max_position_embeddings=512,
                   rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
                   bos_token_id=1, eos_token_id=2, block_configs=DECI_BLOCKS)


class DeciReference:
    """DeciLM written from NVIDIA's description (not trellm's modules): per block, an optional pre-norm
    attention (GQA with ``heads / n_heads_in_group`` KV heads and NeoX RoPE, or one linear map), then an
    optional pre-norm SwiGLU MLP ``2 * ffn_mult * hidden / 3`` wide rounded up to 256 (or one linear map)."""

    def __init__(self, cfg: dict):
        self.cfg, h, self.heads = cfg, cfg["hidden_size"], cfg["num_attention_heads"]
        self.head_dim = h // self.heads
        lin = lambda i, o: torch.randn(o, i) * 0.2  # noqa: E731
        norm = lambda: 1 + 0.3 * torch.randn(h)  # noqa: E731
        self.params = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h), "model.norm.weight": norm(),
                       "lm_head.weight": lin(h, cfg["vocab_size"])}
        for i, block in enumerate(cfg["block_configs"]):
            a, f, p = block["attention"], block["ffn"], f"model.layers.{i}"
            if not a.get("no_op"):
                self.params[f"{p}.input_layernorm.weight"] = norm()
                if a.get("replace_with_linear"):
                    self.params[f"{p}.self_attn.linear_attn.weight"] = lin(h, h)
                else:
                    kv = self.heads // a["n_heads_in_group"] * self.head_dim
                    for name, i_, o in (("q", h, h), ("k", h, kv), ("v", h, kv), ("o", h, h)):
                        self.params[f"{p}.self_attn.{name}_proj.weight"] = lin(i_, o)
            if not f.get("no_op"):
                self.params[f"{p}.post_attention_layernorm.weight"] = norm()
                if f.get("replace_with_linear"):
                    self.params[f"{p}.mlp.linear_mlp.weight"] = lin(h, h)
                else:
                    width = -(-int(2 * f["ffn_mult"] * h / 3) // 256) * 256
                    for name, i_, o in (("gate", h, width), ("up", h, width), ("down", width, h)):
                        self.params[f"{p}.mlp.{name}_proj.weight"] = lin(i_, o)

    def rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * self.params[name]

    def attention(self, x, p, group):
        t, d = x.shape[0], self.head_dim
        q = (x @ self.params[f"{p}.q_proj.weight"].T).view(t, -1, d).transpose(0, 1)
        k = (x @ self.params[f"{p}.k_proj.weight"].T).view(t, -1, d).transpose(0, 1)
        v = (x @ self.params[f"{p}.v_proj.weight"].T).view(t, -1, d).transpose(0, 1)
        inv = 1.0 / self.cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
        ang = torch.arange(t).float()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        rot = lambda z: z * cos + torch.cat([-z[..., d // 2:], z[..., : d // 2]], -1) * sin  # noqa: E731
        k, v = rot(k).repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        o = torch.nn.functional.scaled_dot_product_attention(rot(q), k, v, is_causal=True)
        return o.transpose(0, 1).reshape(t, -1) @ self.params[f"{p}.o_proj.weight"].T

    def __call__(self, ids: list[int]) -> torch.Tensor:
        x = self.params["model.embed_tokens.weight"][torch.tensor(ids)]
        for i, block in enumerate(self.cfg["block_configs"]):
            a, f, p = block["attention"], block["ffn"], f"model.layers.{i}"
            if not a.get("no_op"):
                y = self.rms(x, f"{p}.input_layernorm.weight")
                x = x + (y @ self.params[f"{p}.self_attn.linear_attn.weight"].T if a.get("replace_with_linear")
                         else self.attention(y, f"{p}.self_attn", a["n_heads_in_group"]))
            if not f.get("no_op"):
                y = self.rms(x, f"{p}.post_attention_layernorm.weight")
                if f.get("replace_with_linear"):
                    x = x + y @ self.params[f"{p}.mlp.linear_mlp.weight"].T
                else:
                    g = torch.nn.functional.silu(y @ self.params[f"{p}.mlp.gate_proj.weight"].T)
                    x = x + (g * (y @ self.params[f"{p}.mlp.up_proj.weight"].T)) @ self.params[f"{p}.mlp.down_proj.weight"].T
        return self.rms(x, "model.norm.weight") @ self.params["lm_head.weight"].T


@pytest.fixture(scope="module")
def decilm(tmp_path_factory):
    """(reference, checkpoint dir, trellm model) of a tiny random DeciLM in NVIDIA's checkpoint format."""
    torch.manual_seed(0)
    ref = DeciReference(DECI_CONFIG)
    path = tmp_path_factory.mktemp("decilm")
    save_file({k: v.contiguous() for k, v in ref.params.items()}, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(DECI_CONFIG))
    with torch_threads(1):
        yield ref, path, trellm.load(path, device="cpu", dtype="float32")


def test_decilm_logits_cached_decode_and_greedy(decilm):
    from trellm.sdk.testing import trellm_cached_logits

    ref, _, lm = decilm
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (23, 9)]
    with torch.no_grad():
        refs = [ref(p) for p in prompts]
    allowed = 1e-3 * max(float(r.max() - r.min()) for r in refs)
    for r, mine, cached in zip(refs, lm.logits(prompts), trellm_cached_logits(lm, prompts)):
        assert (r - mine[: len(r)]).abs().max() < allowed and (r - cached).abs().max() < allowed
    for p in prompts:
        ids = list(p)
        with torch.no_grad():
            for _ in range(32):
                ids.append(int(ref(ids)[-1].argmax()))
        assert list(lm.generate_ids(p, max_new_tokens=32, stop_token_ids=[])) == ids[len(p):]
    kv_layers = [a is not None for a in lm.model.attention_layers()]
    assert kv_layers == [True, False, True, False, True, False]  # no-op and linear blocks hold no KV cache


@pytest.mark.parametrize("block, message", [
    ({"attention": {"n_heads_in_group": 3}, "ffn": {"ffn_mult": 1.0}}, r"block_configs\[1\].attention.n_heads_in_group = 3"),
    ({"attention": {"no_op": True}, "ffn": {}}, r"block_configs\[1\].ffn.ffn_mult is not set"),
    ({"attention": {"n_heads_in_group": 1, "num_sink_tokens": 4}, "ffn": {"no_op": True}},
     r"block_configs\[1\].attention.num_sink_tokens = 4 is not supported"),
])
def test_decilm_bad_block_configs_are_named(decilm, tmp_path, block, message):
    from trellm.errors import ConfigError

    _, path, _ = decilm
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    blocks = [DECI_BLOCKS[0], block] + DECI_BLOCKS[2:]
    (tmp_path / "config.json").write_text(json.dumps({**DECI_CONFIG, "block_configs": blocks}))
    with pytest.raises(ConfigError, match=message):
        trellm.load(tmp_path, device="cpu", dtype="float32")
