"""``trellm generate --image`` and ``trellm chat --image`` / ``/image`` with the tiny Gemma 3 VL model."""
from __future__ import annotations

import io

import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from test_vision import gemma3  # noqa: E402,F401  (tests/ is on sys.path; gemma3 is a fixture)
from trellm import cli  # noqa: E402

TOKENS = "5"


def chat_ids(lm, messages) -> list[int]:
    tok = lm.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def image_message(text: str, count: int) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * count + [{"type": "text", "text": text}]}


@pytest.fixture
def pictures(tmp_path):
    paths = []
    for i, color in enumerate([(255, 0, 0), (0, 40, 255)]):
        paths.append(str(tmp_path / f"img{i}.png"))
        Image.new("RGB", (40, 50), color).save(paths[-1])
    return paths


def model_args(path) -> list[str]:
    return ["-m", str(path), "--device", "cpu", "--dtype", "float32", "--max-tokens", TOKENS]


def test_generate_with_image(gemma3, pictures, capsys):
    _, lm, path = gemma3
    assert cli.main(["generate", *model_args(path), "--chat", "--image", pictures[0], "what is this ?"]) == 0
    want = "".join(lm.stream(chat_ids(lm, [image_message("what is this ?", 1)]), int(TOKENS), images=pictures[:1]))
    assert capsys.readouterr().out == want + "\n"
    assert cli.main(["generate", *model_args(path), "--chat", "--image", "missing.png", "what"]) == 2
    assert "missing.png: image file not found" in capsys.readouterr().err


def test_chat_with_images_over_turns(gemma3, pictures, capsys, monkeypatch):
    _, lm, path = gemma3
    lines = ["what is this ?", "/image missing.png", "is this ?", "/image " + pictures[1], "what ?", "/exit"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert cli.main(["chat", *model_args(path), "--image", pictures[0]]) == 0
    out = capsys.readouterr()
    first = [image_message("what is this ?", 1)]
    reply1 = "".join(lm.stream(chat_ids(lm, first), int(TOKENS), images=pictures[:1]))
    second = first + [{"role": "assistant", "content": reply1}, image_message("what ?", 1)]
    reply2 = "".join(lm.stream(chat_ids(lm, second), int(TOKENS), images=pictures))
    assert "missing.png: image file not found" in out.err  # the failed turn is dropped, the chat goes on
    assert [r.strip("\n") for r in out.out.split(">>> ") if r.strip()] == [reply1, reply2]
