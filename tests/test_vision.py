"""Images in prompts: loading and its errors, OpenAI content parts, and Gemma 3 vision parity with HF.

The Gemma 3 model is a tiny random Gemma3ForConditionalGeneration (SigLIP tower of 8x8 patches
pooled to 4 soft tokens, two text layers: one sliding, one full) saved with a preprocessor_config.json.
"""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

import trellm  # noqa: E402
from trellm import multimodal  # noqa: E402
from trellm.batch import ForwardBatch  # noqa: E402
from trellm.cache import SequenceState  # noqa: E402
from trellm.cache.prefix import page_hashes  # noqa: E402
from trellm.multimodal import ImageError, attach_images, load_image, prepare_prompt, split_openai_messages  # noqa: E402
from trellm.sdk.testing import torch_threads  # noqa: E402

IMAGE, BOI, EOI = 299, 297, 298
PROMPT = [2, 10, 11, BOI, 12, 13, 14, 15, 16, 17, 18]


def random_image(seed: int, size=(40, 50), mode="RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8).squeeze(), mode)


def encoded(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(img: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(encoded(img)).decode()


# ---- image loading and errors -----------------------------------------------------------------------


def test_load_image_sources_agree(tmp_path):
    img = random_image(1)
    path = tmp_path / "a.png"
    path.write_bytes(encoded(img))
    rgba = img.convert("RGBA")
    digests = {multimodal.image_digest(load_image(src)) for src in (img, encoded(img), str(path), path, data_url(img), rgba)}
    assert len(digests) == 1  # same pixels, any source
    assert multimodal.image_digest(load_image(random_image(2))) not in digests


@pytest.mark.parametrize(
    "source, message",
    [
        (b"not an image at all", "not a readable image"),
        ("https://example.com/cat.png", "only base64 data URLs"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/png,rawbytes", "must be base64"),
        (12345, "unsupported image input of type int"),
        ("/nonexistent/cat.png", "image file not found"),
    ],
)
def test_bad_image_sources(source, message):
    with pytest.raises(ImageError, match=message):
        load_image(source)


def test_truncated_unsupported_and_oversized_images(monkeypatch):
    png = encoded(random_image(3))
    with pytest.raises(ImageError, match="corrupt or truncated PNG"):
        load_image(png[: len(png) // 2])
    with pytest.raises(ImageError, match="format 'TIFF' is not supported"):
        load_image(encoded(random_image(3), "TIFF"))
    monkeypatch.setattr(multimodal, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageError, match="40x50 = 2000 pixels, more than the limit of 100"):
        load_image(png)
    monkeypatch.setattr(multimodal, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(ImageError, match="more than the limit of 10"):
        load_image(png)


def test_openai_messages_with_image_parts():
    img = random_image(4)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": data_url(img), "detail": "auto"}},
        ]},
    ]
    out, images = split_openai_messages(messages)
    assert out[0] == messages[0]
    assert out[1]["content"] == [{"type": "text", "text": "What is this?"}, {"type": "image"}]
    assert len(images) == 1 and multimodal.image_digest(images[0]) == multimodal.image_digest(img)
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://host/x.png"}}]}]
    with pytest.raises(ImageError, match=r"messages\[0\].content\[0\]|scheme 'http' refused"):
        split_openai_messages(remote)
    with pytest.raises(ImageError, match="unsupported content part type 'input_audio'"):
        split_openai_messages([{"role": "user", "content": [{"type": "input_audio"}]}])


def test_vision_tower_registered():
    from trellm import registry

    assert "siglip_vision_model" in registry.vision_towers()
    assert "Gemma3ForConditionalGeneration" in registry.architectures()


@pytest.mark.parametrize("reader", ["plugins.architectures.hyperclovax_vision:read_config",
                                    "plugins.architectures.mistral3:read_config", "sdk.qwen_vl:read_qwen_vl_config"])
def test_image_token_outside_vocabulary_is_refused(reader):
    """Every vision family's config record (VisionLanguageConfig) checks the image token against the vocabulary."""
    import importlib

    from trellm.errors import ConfigError

    module, name = reader.split(":")
    read_config = getattr(importlib.import_module(f"trellm.{module}"), name)
    text = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "rope_parameters": {"mrope_section": [8, 12, 12]}}
    raw = {**text, "text_config": text, "vision_config": {}, "image_token_id": 127}
    assert read_config(raw).image_token_id == 127
    with pytest.raises(ConfigError, match="image_token_id 128 is outside the vocabulary \\(128\\)"):
        read_config({**raw, "image_token_id": 128})


# ---- Gemma 3 with vision --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(HF model, trellm model) of a tiny random Gemma3ForConditionalGeneration."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=4
    )
    text = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI,
    )
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms and the projection are zero / one at init: give them values
        for name, p in hf.named_parameters():
            if "norm" in name or "mm_input" in name:
                p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("gemma3_vl")
    hf.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "do_resize": True, "size": {"height": 32, "width": 32},
        "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": False,
    }))
    write_tiny_tokenizer(path)
    with torch_threads(1):  # tiny models: one thread is fastest and spares a loaded machine
        yield hf, trellm.load(path, device="cpu", dtype="float32"), path


CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn> {{ m.role }} "
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<start_of_image>{% else %}{{ p.text }}{% endif %} {% endfor %}{% endif %}"
    "<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}"
)


def write_tiny_tokenizer(path) -> None:
    """A word-level tokenizer with Gemma 3's image tokens and a chat template that writes one marker per image."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "user", "model", "what", "is", "this", "?"]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), 297)})
    vocab.update({"<start_of_image>": BOI, "<end_of_image>": EOI, "<image_soft_token>": IMAGE})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                            "<end_of_image>", "<image_soft_token>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "bos_token": "<bos>", "chat_template": CHAT_TEMPLATE}))


def hf_pixels(path, img) -> torch.Tensor:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    proc = Gemma3ImageProcessorPil.from_pretrained(path)
    return torch.tensor(np.array(proc(img, return_tensors="np")["pixel_values"]))


def hf_logits(hf, ids: list[int], pixels: torch.Tensor, bidirectional: bool = True) -> torch.Tensor:
    x = torch.tensor([ids])
    with torch.no_grad():
        kwargs = {"token_type_ids": (x == IMAGE).long()} if bidirectional else {}
        return hf(input_ids=x, pixel_values=pixels, **kwargs).logits[0]


def hf_greedy(hf, ids: list[int], pixels: torch.Tensor, n: int) -> list[int]:
    """Greedy tokens by full recomputation (the image block stays bidirectional, new tokens causal)."""
    ids = list(ids)
    out = []
    for _ in range(n):
        token = int(hf_logits(hf, ids, pixels)[-1].argmax())
        out.append(token)
        ids.append(token)
    return out


def test_gemma3_preprocessing_matches_hf(gemma3):
    _, lm, path = gemma3
    for img in (random_image(5), random_image(6, size=(17, 90)), random_image(7, mode="RGBA")):
        mine = lm.model.preprocess(load_image(img)).pixels
        assert torch.allclose(mine, hf_pixels(path, img.convert("RGB"))[0], atol=1e-5)


def test_gemma3_embeddings_and_prompt_logits(gemma3):
    hf, lm, path = gemma3
    img = random_image(8)
    mm = prepare_prompt(lm, PROMPT, [img])
    assert mm.input_ids == PROMPT[:3] + [BOI] + [IMAGE] * 4 + [EOI] + PROMPT[4:]
    pixels = hf_pixels(path, img)
    with torch.no_grad():
        ref = hf.model.get_image_features(pixels).pooler_output[0]
    assert (mm.embeds - ref).abs().max() < 1e-5
    ref_logits = hf_logits(hf, mm.input_ids, pixels)
    mine = lm.logits([PROMPT], images=[[img]])[0]
    assert (mine - ref_logits).abs().max() < 1e-4
    # the image block really is bidirectional: causal-only attention gives other logits there
    assert (hf_logits(hf, mm.input_ids, pixels, bidirectional=False) - ref_logits).abs().max() > 1e-3


def test_gemma3_greedy_continuation_and_chunked_prefill(gemma3):
    hf, lm, path = gemma3
    img = random_image(9)
    mm = prepare_prompt(lm, PROMPT, [img])
    ref = hf_greedy(hf, mm.input_ids, hf_pixels(path, img), 8)
    assert list(lm.generate_ids(PROMPT, max_new_tokens=8, stop_token_ids=[], images=[img])) == ref
    # chunked prefill: text prefix first (cached), then the chunk with the image block (reads the cached prefix)
    cache = lm.new_cache(max_tokens=64, page_size=4)
    seq = SequenceState(cache)
    split = mm.safe_chunk_end(0, 5)
    assert split == 4  # the image run starts at row 4: a chunk may not cut it
    logits = []
    for a, b in ((0, split), (split, len(mm.input_ids))):
        seq.reserve(b)
        batch = ForwardBatch.with_cache([mm.input_ids[a:b]], [a], [seq.pages], cache, all_logits=True)
        attach_images(batch, [(mm, a)])
        logits.append(lm.model.forward(batch))
        seq.length = b
    seq.release()
    assert (torch.cat(logits) - hf_logits(hf, mm.input_ids, hf_pixels(path, img))).abs().max() < 1e-4


def batched_greedy(lm, prompts, n: int, page_size: int = 4) -> list[list[int]]:
    """Prefill every prompt in one batch, then decode all of them together through the paged cache
    (hybrid models: each sequence also holds a recurrent-state slot)."""
    cache = lm.new_cache(max_tokens=sum(len(p.input_ids) + n + page_size for p in prompts), page_size=page_size)
    states = [SequenceState(cache, with_state_slot=True) for _ in prompts]
    feeds = [p.input_ids for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    try:
        for step in range(n):
            for s, f in zip(states, feeds):
                s.reserve(s.length + len(f))
            slots = None if states[0].state_slot is None else [s.state_slot for s in states]
            batch = ForwardBatch.with_cache(
                feeds, [s.length for s in states], [s.pages for s in states], cache, state_slots=slots
            )
            attach_images(batch, [(p, s.length) for p, s in zip(prompts, states)])
            with torch.inference_mode():
                tokens = lm.model.forward(batch).argmax(-1).tolist()
            for i, (s, f) in enumerate(zip(states, feeds)):
                s.length += len(f)
                outs[i].append(tokens[i])
            feeds = [[t] for t in tokens]
    finally:
        for s in states:
            s.release()
    return outs


def test_gemma3_two_images_in_one_batch_no_cross_talk(gemma3):
    hf, lm, path = gemma3
    images = [Image.new("RGB", (40, 50), (255, 0, 0)), Image.new("RGB", (40, 50), (0, 40, 255))]
    prompts = [prepare_prompt(lm, PROMPT, [img]) for img in images]
    assert prompts[0].input_ids == prompts[1].input_ids  # same text and placeholders ...
    names = [page_hashes(p.hash_ids(), 4) for p in prompts]
    assert names[0][0] == names[1][0] and names[0][1] != names[1][1]  # ... but the image pages are named apart
    assert page_hashes(prepare_prompt(lm, PROMPT, [encoded(images[0])]).hash_ids(), 4) == names[0]
    refs = [hf_greedy(hf, p.input_ids, hf_pixels(path, img), 6) for p, img in zip(prompts, images)]
    assert refs[0] != refs[1]  # the images matter
    assert batched_greedy(lm, prompts, 6) == refs


def test_gemma3_bad_requests_leave_model_working(gemma3):
    hf, lm, path = gemma3
    img = random_image(12)
    before = lm.logits([PROMPT], images=[[img]])
    with pytest.raises(ImageError, match="1 image markers .* but 2 images"):
        prepare_prompt(lm, PROMPT, [img, img])
    with pytest.raises(ImageError, match="0 image markers"):
        prepare_prompt(lm, [2, 10, 11], [img])
    with pytest.raises(ImageError, match="at most 16 per prompt"):
        prepare_prompt(lm, [BOI] * 17, [img] * 17)
    with pytest.raises(ImageError, match="not a readable image"):
        list(lm.generate_ids(PROMPT, max_new_tokens=2, images=[b"garbage"]))
    assert torch.equal(lm.logits([PROMPT], images=[[img]]), before)
    assert len(list(lm.generate_ids([2, 10, 11], max_new_tokens=3, stop_token_ids=[]))) == 3  # text-only still works


def test_gemma3_openai_chat_with_data_url_image(gemma3):
    """The server's path: OpenAI messages -> chat template with image markers -> text prompt + images -> generate."""
    hf, lm, path = gemma3
    img = random_image(13)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what is this ?"},
        {"type": "image_url", "image_url": {"url": data_url(img)}},
    ]}]
    template_messages, images = split_openai_messages(messages)
    prompt = lm.tokenizer.apply_chat_template(template_messages)
    assert prompt.count("<start_of_image>") == 1
    by_text = prepare_prompt(lm, prompt, images)  # text-level expansion, as HF's processor does
    by_ids = prepare_prompt(lm, lm.tokenizer.encode(prompt), images)
    assert by_text.input_ids == by_ids.input_ids and by_text.input_ids.count(IMAGE) == 4
    ids = list(lm.generate_ids(by_ids.input_ids, max_new_tokens=5, stop_token_ids=[], images=by_ids))
    assert ids == hf_greedy(hf, by_ids.input_ids, hf_pixels(path, img), 5)
    assert lm.generate(prompt, max_new_tokens=5, stop_token_ids=[], images=images) == lm.tokenizer.decode(ids)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def check_on_cuda(lm, prompt, images) -> None:
    """The model on the GPU (float32, decode through CUDA graphs) gives the CPU's logits and greedy tokens; bf16 runs."""
    gpu = trellm.load(lm.model_dir, device="cuda", dtype="float32")
    ref = lm.logits([prompt], images=[images])[0]
    # 1e-3 of the logit range: cuDNN runs float32 convolutions (patch embeddings) in TF32 by default
    assert (gpu.logits([prompt], images=[images])[0].cpu() - ref).abs().max() < 1e-3 * (ref.max() - ref.min())
    want = list(lm.generate_ids(prompt, max_new_tokens=6, stop_token_ids=[], images=images))
    assert list(gpu.generate_ids(prompt, max_new_tokens=6, stop_token_ids=[], images=images)) == want
    half = trellm.load(lm.model_dir, device="cuda", dtype="bfloat16")
    got = half.logits([prompt], images=[images])[0].cpu()
    assert torch.isfinite(got).all() and (got - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.cuda
@cuda
def test_gemma3_on_cuda(gemma3):
    _, lm, _ = gemma3
    check_on_cuda(lm, PROMPT, [random_image(14)])
