"""Per-request limits on what costs CPU before any job exists: prompt text, images and their pixels.

They are checked before the work they bound (tokenizing, templating, decoding images), and the work
itself runs in worker threads, so one large request never stalls the event loop for the others.
"""
from __future__ import annotations

import io
from typing import Any, Iterable, Sequence

from .config import ServerConfig
from .errors import bad_request


def check_prompt_bytes(config: ServerConfig, texts: Iterable[str], param: str) -> None:
    """400 ``prompt_too_large`` when the texts hold more than ``max_prompt_bytes`` UTF-8 bytes together."""
    total = 0
    for text in texts:
        total += len(text.encode("utf-8", "surrogatepass"))
        if total > config.max_prompt_bytes:
            raise bad_request(f"{param}: more than {config.max_prompt_bytes} bytes of text (this server's "
                              "max_prompt_bytes)", param=param, code="prompt_too_large")


def message_texts(messages: Sequence[Any]) -> Iterable[str]:
    """The text of every message: string contents and text parts."""
    for m in messages:
        if isinstance(m.content, str):
            yield m.content
        elif isinstance(m.content, list):
            for part in m.content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


def image_urls(messages: Sequence[Any]) -> list[Any]:
    return [part.get("image_url") for m in messages if isinstance(m.content, list)
            for part in m.content if isinstance(part, dict) and part.get("type") == "image_url"]


def check_chat_request(config: ServerConfig, messages: Sequence[Any]) -> None:
    """Cheap checks (no decoding): message text bytes and the number of images."""
    check_prompt_bytes(config, message_texts(messages), "messages")
    count = len(image_urls(messages))
    if count > config.max_images:
        raise bad_request(f"messages: {count} images; this server takes at most {config.max_images} per request",
                          param="messages", code="too_many_images")


def check_image_pixels(config: ServerConfig, messages: Sequence[Any]) -> None:
    """Read only each image's header (no pixel decoding) and refuse a request whose images hold more than
    ``max_image_pixels`` pixels together. Blocking (base64): call it in a worker thread."""
    try:
        from PIL import Image
    except ImportError:  # no image support installed: the full decode refuses the images
        return
    from trellm.multimodal import ImageError, decode_data_url

    total = 0
    for ref in image_urls(messages):
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str):
            continue  # the full decode names the problem
        try:
            with Image.open(io.BytesIO(decode_data_url(url))) as img:
                width, height = img.size
        except ImageError as exc:
            raise bad_request(str(exc), param="messages", code="invalid_image") from None
        except Exception:
            continue  # not an image: the full decode names the problem
        total += width * height
        if total > config.max_image_pixels:
            raise bad_request(f"messages: the images hold more than {config.max_image_pixels} pixels together "
                              f"(this server's max_image_pixels)", param="messages", code="too_many_pixels")
