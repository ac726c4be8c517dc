"""Mistral 3 (Pixtral tower) parity with HF on a tiny random model: processor, embeddings, logits, greedy.

The tower has 4-pixel patches merged 2x2, so images are fitted to 48 pixels and rounded up to
multiples of 8; a 61x37 image becomes 48x32 pixels, 6x4 merged tokens in four [IMG] rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

import trellm  # noqa: E402
from trellm.multimodal import prepare_prompt  # noqa: E402
from trellm.sdk.testing import torch_threads  # noqa: E402
from test_vision import batched_greedy, check_on_cuda  # noqa: E402  (tests/ is on sys.path)

IMG, BREAK, END = 10, 12, 13
PROMPT = [1, 5, 6, IMG, 7, 8, 9]


def random_image(seed: int, size=(61, 37)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    torch.manual_seed(0)
    config = transformers.Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, patch_size=4, image_size=64, head_dim=8),
        image_token_id=IMG, spatial_merge_size=2,
    )
    hf = transformers.Mistral3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.3)
    path = tmp_path_factory.mktemp("mistral3")
    hf.save_pretrained(path)
    PixtralImageProcessorPil(patch_size={"height": 4, "width": 4}, size={"longest_edge": 48}).save_pretrained(path)
    # HF's processor resizes to multiples of patch * merge: call the image processor the same way
    proc = PixtralImageProcessorPil(patch_size={"height": 8, "width": 8}, size={"longest_edge": 48})
    with torch_threads(1):
        yield hf, proc, trellm.load(path, device="cpu", dtype="float32")


def hf_logits(hf, ids, pixels, sizes) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), pixel_values=pixels, image_sizes=sizes).logits[0]


def hf_greedy(hf, ids, pixels, sizes, n: int) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(hf_logits(hf, ids, pixels, sizes)[-1].argmax()))
        ids.append(out[-1])
    return out


def hf_inputs(proc, img):
    out = proc(img, return_tensors="pt")
    return out["pixel_values"], out["image_sizes"]


def test_mistral3_processor_embeddings_and_logits(mistral3):
    hf, proc, lm = mistral3
    for img in (random_image(0), random_image(1, size=(17, 90)), random_image(2, size=(20, 20))):
        pixels, sizes = hf_inputs(proc, img)
        item = lm.model.preprocess(img)
        h, w = sizes[0].tolist()
        assert item.pixels.shape[1:] == (h, w) and torch.allclose(item.pixels, pixels[0, :, :h, :w], atol=1e-5)
        mm = prepare_prompt(lm, PROMPT, [img])
        rows, cols = h // 8, w // 8
        assert mm.input_ids.count(BREAK) == rows - 1 and mm.input_ids.count(END) == 1 and mm.input_ids.count(IMG) == rows * cols
        with torch.no_grad():
            ref = hf.model.get_image_features(pixels, sizes).pooler_output[0]
        assert (mm.embeds - ref).abs().max() < 1e-5
        assert (lm.logits([PROMPT], images=[[img]])[0] - hf_logits(hf, mm.input_ids, pixels, sizes)).abs().max() < 1e-4


def test_mistral3_greedy_and_two_images_in_one_batch(mistral3):
    hf, proc, lm = mistral3
    images = [Image.new("RGB", (61, 37), (255, 0, 0)), Image.new("RGB", (37, 61), (0, 40, 255))]
    prompts = [prepare_prompt(lm, PROMPT, [img]) for img in images]
    refs = [hf_greedy(hf, p.input_ids, *hf_inputs(proc, img), 6) for p, img in zip(prompts, images)]
    assert refs[0] != refs[1]
    assert list(lm.generate_ids(PROMPT, max_new_tokens=6, stop_token_ids=[], images=[images[0]])) == refs[0]
    assert batched_greedy(lm, prompts, 6, page_size=8) == refs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mistral3_on_cuda(mistral3):
    _, _, lm = mistral3
    check_on_cuda(lm, PROMPT, [random_image(3)])
