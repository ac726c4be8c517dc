"""GLM 5.3-Flash and Qwen 3.8-Flash-Next with images (issue 30), held against transformers on tiny random weights.

The towers see 4-pixel patches merged 2x2. GLM 5.3's tower (GLM-OCR) RMS-norms each head's q and k and clamps
its SwiGLU inputs (limit 0.5 here, so the clamps bite); its processor pads the resized image with black to whole
merge blocks within a budget of 16..64 merged tokens. Qwen 3.8's tower is Qwen3.5's; what is its own is that the
sparse-attention indexer rotates each pooled block key at the M-RoPE position of the block's first token.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

import trellm  # noqa: E402
from trellm.multimodal import prepare_prompt  # noqa: E402
from trellm.sdk import supports_images  # noqa: E402
from trellm.sdk.testing import make_tiny_hf_model, torch_threads  # noqa: E402

from test_families_next import GLM5_NEXT, QWEN4_EXP_TEXT, QWEN4_EXP_VISION, glm5_next_checkpoint, require_next_configs  # noqa: E402
from test_vision import batched_greedy, check_on_cuda  # noqa: E402
from test_vision_qwen import random_image  # noqa: E402

IMAGE, START, END = 250, 252, 253
PROMPT = [5, 6, START, IMAGE, END, 7, 8, 9]
TINY_TOWER = dict(patch_size=4, spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.2)


def hf_and_trellm(path, proc) -> tuple:
    """The checkpoint at ``path`` with ``proc``'s preprocessor_config.json, in transformers (the class its
    config names) and in trellm."""
    proc.save_pretrained(path)
    cls = getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])
    hf = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return hf, proc, trellm.load(path, device="cpu", dtype="float32")


def hf_inputs(proc, img) -> tuple[torch.Tensor, torch.Tensor]:
    out = proc(img, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def hf_call(hf, ids: list[int], pixels, grid) -> dict:
    x = torch.tensor([ids])
    return dict(input_ids=x, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(x == IMAGE).int())


def hf_logits(hf, ids, pixels, grid) -> torch.Tensor:
    with torch.no_grad():
        return hf(**hf_call(hf, ids, pixels, grid)).logits[0]


def hf_generate(hf, ids, pixels, grid, n: int) -> list[int]:
    """transformers' own cached greedy decoding with the image."""
    with torch.no_grad():
        out = hf.generate(**hf_call(hf, ids, pixels, grid), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def within_range(mine: torch.Tensor, ref: torch.Tensor, tolerance: float = 1e-3) -> bool:
    return float((mine - ref).abs().max()) <= tolerance * float(ref.max() - ref.min())


def check_image_parity(hf, proc, lm, images) -> None:
    """Pixels and grids as the HF processor's, tower tokens within 1e-4, prompt logits within 1e-3 of the range."""
    for img in images:
        pixels, grid = hf_inputs(proc, img)
        item = lm.model.preprocess(img)
        assert item.grid == tuple(grid[0].tolist()) and torch.allclose(item.pixels, pixels, atol=1e-5)
        mm = prepare_prompt(lm, PROMPT, [img])
        with torch.no_grad():
            ref = hf.model.get_image_features(pixels, grid).pooler_output[0]
        assert ref.abs().max() > 0.1  # embeddings large enough that 1e-4 means something
        assert mm.embeds.shape == ref.shape and (mm.embeds - ref).abs().max() < 1e-4
        assert within_range(lm.logits([PROMPT], images=[[img]])[0], hf_logits(hf, mm.input_ids, pixels, grid))


def check_greedy_and_batch(hf, proc, lm) -> None:
    """32 greedy tokens with an image as transformers' generate; two images of other sizes decoded side by side
    through the paged cache (hybrid: recurrent-state slots too), each as transformers decodes it alone."""
    img = random_image(3)
    mm = prepare_prompt(lm, PROMPT, [img])
    ref = hf_generate(hf, mm.input_ids, *hf_inputs(proc, img), 32)
    assert list(lm.generate_ids(PROMPT, max_new_tokens=32, stop_token_ids=[], images=[img])) == ref
    images = [random_image(4, size=(61, 37)), random_image(5, size=(20, 90))]
    prompts = [prepare_prompt(lm, PROMPT, [im]) for im in images]
    assert len(prompts[0].input_ids) != len(prompts[1].input_ids)
    refs = [hf_generate(hf, p.input_ids, *hf_inputs(proc, im), 8) for p, im in zip(prompts, images)]
    assert refs[0] != refs[1]
    assert batched_greedy(lm, prompts, 8, page_size=8) == refs


# ---- GLM 5.3-Flash -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glm5v(tmp_path_factory):
    """(HF model, HF image processor, trellm model) of a tiny random GLM 5.3-Flash with its tower."""
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    path = tmp_path_factory.mktemp("glm5_next_vision")
    tower = dict(GLM5_NEXT["vision_config"], **TINY_TOWER, depth=2, swiglu_limit=0.5)
    glm5_next_checkpoint(path, vision_config=tower)
    proc = Glm5NextImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_image_tokens=16,
                                     max_image_tokens=64)
    with torch_threads(1):
        yield hf_and_trellm(path, proc)


def test_glm5_next_processor_embeddings_and_logits(glm5v):
    # padded to whole blocks; tall; shrunk to the 64-token budget; grown to the 16-token minimum
    check_image_parity(*glm5v, [random_image(0), random_image(1, size=(20, 90)), random_image(2, size=(300, 200)),
                                random_image(6, size=(6, 5))])


def test_glm5_next_greedy_and_two_images_batched(glm5v):
    with torch_threads(1):
        check_greedy_and_batch(*glm5v)


def test_glm5_next_tower_features_are_needed(glm5v):
    """Without each of the GLM 5.3 tower's own steps (q/k norms, SwiGLU clamps, padding instead of stretching)
    the checks above fail: the tokens move by far more than their 1e-4."""
    hf, proc, lm = glm5v
    img = random_image(0)
    pixels, grid = hf_inputs(proc, img)
    with torch.no_grad():
        ref = hf.model.get_image_features(pixels, grid).pooler_output[0]
    tower = lm.model.vision.tower
    item = lm.model.preprocess(img)
    limit = tower.cfg.swiglu_limit

    def error() -> float:
        return float((lm.model.encode([item])[0] - ref).abs().max())

    assert error() < 1e-4
    norms = [(b.q_norm, b.k_norm) for b in tower.blocks]
    try:
        for b in tower.blocks:
            b.q_norm = b.k_norm = None
        assert error() > 1e-2
    finally:
        for b, (q, k) in zip(tower.blocks, norms):
            b.q_norm, b.k_norm = q, k
    from trellm.sdk import limited_swiglu

    try:
        for mlp in [b.mlp for b in tower.blocks] + [tower.merger_mlp]:
            mlp.act = limited_swiglu(1e6)
        assert error() > 1e-2
    finally:
        for mlp in [b.mlp for b in tower.blocks] + [tower.merger_mlp]:
            mlp.act = limited_swiglu(limit)
    stretched = lm.model.vision.processor.steps.resize(img, *lm.model.vision.processor.fit(img.size[1], img.size[0]))
    padded = lm.model.vision.processor.canvas(img)
    assert stretched.size == padded.size and stretched.tobytes() != padded.tobytes()


def test_glm5_next_without_vision_config_is_text_only(glm5v, tmp_path):
    """A flat config (the text keys at the top, no vision_config) loads the text model alone, same logits."""
    _, _, lm = glm5v
    config = json.loads((lm.model_dir / "config.json").read_text())
    flat = {**config.pop("text_config"), **{k: v for k, v in config.items() if k != "vision_config"}}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    (tmp_path / "model.safetensors").symlink_to(lm.model_dir / "model.safetensors")
    with torch_threads(1):
        text = trellm.load(tmp_path, device="cpu", dtype="float32", tokenizer=False)
        assert not supports_images(text.model)
        assert torch.equal(text.logits([[5, 6, 7, 8]])[0], lm.logits([[5, 6, 7, 8]])[0])


# ---- Qwen 3.8-Flash-Next -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen4v(tmp_path_factory):
    """(HF model, HF image processor, trellm model) of a tiny random Qwen 3.8-Flash-Next with its tower."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    require_next_configs()
    path = tmp_path_factory.mktemp("qwen4_exp_vision")
    tower = dict(QWEN4_EXP_VISION, **TINY_TOWER, num_position_embeddings=16)
    make_tiny_hf_model("Qwen4ExpForConditionalGeneration", path, text_config=QWEN4_EXP_TEXT, vision_config=tower,
                       image_token_id=IMAGE, video_token_id=251, vision_start_token_id=START, vision_end_token_id=END)
    proc = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    with torch_threads(1):
        yield hf_and_trellm(path, proc)


def test_qwen4_exp_processor_embeddings_and_logits(qwen4v):
    check_image_parity(*qwen4v, [random_image(0), random_image(1, size=(20, 90))])


def test_qwen4_exp_greedy_and_two_images_batched(qwen4v):
    with torch_threads(1):
        check_greedy_and_batch(*qwen4v)


def test_qwen4_exp_indexer_rotates_blocks_at_mrope_positions(qwen4v, monkeypatch):
    """Rotating the pooled block keys at their first token's index instead of its M-RoPE position (what a
    text-only indexer would do) moves the logits of a prompt with an image past the tolerance."""
    from trellm.plugins.architectures.qwen4_exp import IndexedAttention

    hf, proc, lm = qwen4v
    img = random_image(0)
    mm = prepare_prompt(lm, PROMPT, [img])
    assert mm.position_delta < 0  # 40 image tokens over max(8, 5) positions: index and position part ways
    ref = hf_logits(hf, mm.input_ids, *hf_inputs(proc, img))
    assert within_range(lm.logits([PROMPT], images=[[img]])[0], ref)
    block_keys = IndexedAttention.block_keys  # (one sequence, no cache: every block, in order)
    monkeypatch.setattr(IndexedAttention, "block_keys",
                        lambda self, raw, first_positions, bound: block_keys(self, raw, torch.arange(len(raw)) * self.ratio, bound))
    assert not within_range(lm.logits([PROMPT], images=[[img]])[0], ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["glm5v", "qwen4v"])
def test_next_vision_on_cuda(family, request):
    """On the GPU (float32; bf16 finite and close): the CPU's logits with an image and its greedy tokens."""
    _, _, lm = request.getfixturevalue(family)
    check_on_cuda(lm, PROMPT, [random_image(6)])
