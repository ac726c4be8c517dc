"""Images through the real server: the official ``openai`` client sends data-URL image parts to a tiny
random Gemma 3 VL model (tests/test_vision.py) served on 127.0.0.1; bad and remote images get 400."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("PIL")
openai = pytest.importorskip("openai")

from PIL import Image  # noqa: E402

from test_vision import CHAT_TEMPLATE, data_url, gemma3  # noqa: E402,F401  (tests/ is on sys.path; gemma3 is a fixture)
from trellm.multimodal import split_openai_messages  # noqa: E402
from trellm.server.config import ServerConfig  # noqa: E402
from trellm.server.testing import ServerThread  # noqa: E402

RED = Image.new("RGB", (40, 50), (255, 0, 0))
BLUE = Image.new("RGB", (40, 50), (0, 40, 255))
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def served(gemma3):
    _, lm, path = gemma3
    config = ServerConfig(model=str(path), disable_auth=True, device="cpu", dtype="float32", cache_size=512, page_size=4,
                          max_batch_size=4, allow_request_chat_template=True)
    with ServerThread(config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield lm, server, client


def image_messages(image) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "what is this ?"},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
    ]}]


def reference(lm, messages) -> str:
    """What the model says, run in-process: template -> ids -> greedy with the images, special tokens skipped."""
    template_messages, images = split_openai_messages(messages)
    ids = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(template_messages, add_generation_prompt=True),
                              add_special_tokens=False)
    out = list(lm.generate_ids(ids, max_new_tokens=NEW_TOKENS, stop_token_ids=[], images=images))
    return lm.tokenizer.decode(out, skip_special_tokens=True)


def ask(client, server, messages, **extra):
    return client.chat.completions.create(model=server.host.model_name, messages=messages, max_tokens=NEW_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True, **extra})


def test_chat_with_data_url_images(served):
    lm, server, client = served
    replies = [ask(client, server, image_messages(img)).choices[0].message.content for img in (RED, BLUE)]
    assert replies == [reference(lm, image_messages(img)) for img in (RED, BLUE)]
    assert replies[0] != replies[1]
    # the request's own chat template (a model without one) gives the same
    again = ask(client, server, image_messages(RED), chat_template=CHAT_TEMPLATE)
    assert again.choices[0].message.content == replies[0]
    assert again.usage.prompt_tokens > 4  # the image's placeholder rows are counted


def test_chat_with_image_streams(served):
    lm, server, client = served
    stream = client.chat.completions.create(model=server.host.model_name, messages=image_messages(BLUE),
                                            max_tokens=NEW_TOKENS, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reference(lm, image_messages(BLUE))


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "only base64 data URLs"),
    ("data:image/png;base64,!!!notbase64", "not valid base64"),
    ("data:image/png;base64,aGVsbG8=", "not a readable image"),
])
def test_bad_images_are_400_on_messages(served, url, message):
    lm, server, client = served
    messages = [{"role": "user", "content": [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, server, messages)
    assert info.value.status_code == 400 and message in info.value.message
    assert info.value.body["param"] == "messages"
    # the server keeps working, text-only content parts are still joined
    reply = ask(client, server, [{"role": "user", "content": [{"type": "text", "text": "what "}, {"type": "text", "text": "is"}]}])
    assert reply.choices[0].finish_reason == "length"
    server.host.generator.verify_pages()


def test_marker_count_mismatch_is_400(served):
    lm, server, client = served
    template = CHAT_TEMPLATE.replace("<start_of_image>", "")  # a template that writes no image marker
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, server, image_messages(RED), chat_template=template)
    assert "image markers" in info.value.message and info.value.body["param"] == "messages"
