"""Images in prompts: decoding, preprocessing, placeholder expansion and embedding injection.

The flow for one prompt with images::

    images (paths, bytes, data URLs, PIL)  --load_image-->  RGB PIL images (size/format checked)
    prompt (text or ids) with one image marker per image  --VisionLanguageModel.expand-->  ids with
        every image's placeholder run  +  the tower's embeddings of each image  =  MultimodalPrompt
    MultimodalPrompt.chunk_embeds(start, end)  -->  ForwardBatch.input_embeds / embed_mask rows

A family with vision subclasses :class:`VisionLanguageModel` (it wraps the language model and a
vision tower; everything else is delegated to the language model, so the generator, cache and graph
runner see an ordinary CausalLM). Each image gets a content digest; :meth:`MultimodalPrompt.hash_ids`
replaces its placeholder ids by a value derived from the digest, so the prefix cache never takes the
cached pages of one image for another image behind the same placeholder ids.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import attrs
import numpy as np
import torch

from .capabilities import supports_images
from .errors import ConfigError, TrellmError
from .modules.base import LoadContext, Module
from .weights import Aliases, CheckpointNames

if TYPE_CHECKING:
    from .config import DecoderConfig

MAX_IMAGE_BYTES = 32 * 1024 * 1024  # encoded size
MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # decoded width * height
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(TrellmError):
    """An image is unreadable, corrupt, too large, of an unsupported format, or does not fit the prompt."""


ImageSource = Any  # str path / data URL, pathlib.Path, bytes, or PIL.Image.Image


# ---- decoding ---------------------------------------------------------------------------------------


def _pil():
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        raise ImageError("images need Pillow: pip install pillow") from None
    return Image


def decode_data_url(url: str) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL. Remote URLs are refused (no fetching)."""
    head, sep, payload = url.partition(",")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "(none)"
        raise ImageError(
            f"image URL with scheme {scheme!r} refused: only base64 data URLs (data:image/png;base64,...) are accepted; "
            "trellm never fetches remote images"
        )
    if not sep or not head.endswith(";base64"):
        raise ImageError(f"image data URL must be base64 encoded (data:image/<type>;base64,...), got header {head[:60]!r}")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"image data URL holds more than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"image data URL is not valid base64 ({e})") from None


def load_image(source: ImageSource, name: str | None = None) -> Any:
    """An RGB PIL image from a file path, bytes, a data URL or a PIL image; checked and fully decoded.

    Raises :class:`ImageError` naming the image for a missing file, an unsupported format, a
    corrupt or truncated file, or one larger than MAX_IMAGE_BYTES / MAX_IMAGE_PIXELS.
    """
    Image = _pil()
    if isinstance(source, Image.Image):
        img, label = source, name or "PIL image"
        _check_pixels(img, label)
        return img if img.mode == "RGB" else img.convert("RGB")
    if isinstance(source, (bytes, bytearray, memoryview)):
        data, label = bytes(source), name or "image bytes"
    elif isinstance(source, str) and (source.startswith("data:") or "://" in source):
        data, label = decode_data_url(source), name or "data URL image"  # remote URLs raise here
    elif isinstance(source, (str, Path)):
        path = Path(source)
        label = name or str(path)
        if not path.is_file():
            raise ImageError(f"{label}: image file not found")
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise ImageError(f"{label}: image file is {path.stat().st_size} bytes, more than the limit of {MAX_IMAGE_BYTES}")
        data = path.read_bytes()
    else:
        raise ImageError(f"unsupported image input of type {type(source).__name__}: pass a path, bytes, a data URL or a PIL image")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{label}: image is {len(data)} bytes, more than the limit of {MAX_IMAGE_BYTES}")
    try:
        img = Image.open(io.BytesIO(data))
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, ...
        raise ImageError(f"{label}: not a readable image ({type(e).__name__}: {e})") from None
    if img.format not in SUPPORTED_FORMATS:
        raise ImageError(f"{label}: image format {img.format!r} is not supported; supported: {', '.join(SUPPORTED_FORMATS)}")
    _check_pixels(img, label)
    try:
        img.load()
    except Exception as e:
        raise ImageError(f"{label}: corrupt or truncated {img.format} image ({type(e).__name__}: {e})") from None
    return img if img.mode == "RGB" else img.convert("RGB")


def _check_pixels(img, label: str) -> None:
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"{label}: image has no pixels ({w}x{h})")
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageError(f"{label}: image is {w}x{h} = {w * h} pixels, more than the limit of {MAX_IMAGE_PIXELS}")


def image_digest(img) -> bytes:
    """A content hash of a decoded RGB image (size and pixels), the same for any encoding of it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.digest()


# ---- preprocessing ----------------------------------------------------------------------------------


def read_preprocessor_config(model_dir: str | Path) -> dict[str, Any] | None:
    """``preprocessor_config.json`` of a model directory, or None when there is none."""
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def read_vision_config(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The ``vision_config`` object of a vision-language config.json (an error naming the architecture if absent)."""
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError(f"config.json: {architecture} needs a 'vision_config' object")
    return vision


def config_token(raw: dict[str, Any], *names: str, default: int) -> int:
    """The first of ``names`` set in config.json as an int (configs spell token ids ``*_token_id`` or ``*_token_index``)."""
    for name in names:
        if raw.get(name) is not None:
            return int(raw[name])
    return default


@attrs.frozen
class VisionLanguageConfig:
    """A text decoder with a vision tower: both configs and the token id image rows take in the prompt.
    Families subclass it with their own keys."""

    text: "DecoderConfig"
    vision: dict[str, Any] = attrs.field(hash=False)
    image_token_id: int

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.image_token_id < self.text.vocab_size:
            raise ConfigError(f"config.json: image_token_id {self.image_token_id} is outside the vocabulary "
                              f"({self.text.vocab_size})")

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size


def vision_tower_spec(vision_config: dict[str, Any], default_model_type: str):
    """The installed vision tower that serves ``vision_config.model_type`` (an error listing the installed ones if none)."""
    from . import registry  # the registry loads the plugins, which import this module

    model_type = vision_config.get("model_type", default_model_type)
    towers = registry.vision_towers()
    if model_type not in towers:
        raise ConfigError(f"config.json: no installed vision tower serves vision_config.model_type {model_type!r}; "
                          f"installed: {', '.join(sorted(towers)) or '(none)'}")
    return towers[model_type]


def load_image_processor(model_dir: str | Path, tower_spec, vision_config: dict[str, Any], *args: Any):
    """The tower's image processor built from the model directory's preprocessor config; None when it has none."""
    pre = read_preprocessor_config(model_dir)
    return None if pre is None else tower_spec.processor(pre, vision_config, *args)


@attrs.frozen
class PixelSteps:
    """The rescale / normalise steps every HF image processor shares, as its preprocessor_config.json says."""

    resample: int = 2  # PIL resampling filter (2 = bilinear, 3 = bicubic)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "PixelSteps":
        def triple(v, default):
            if v is None:
                return default
            return tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else (float(v),) * 3

        return cls(
            resample=int(cfg.get("resample", 2) if cfg.get("resample") is not None else 2),
            do_rescale=bool(cfg.get("do_rescale", True)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            do_normalize=bool(cfg.get("do_normalize", True)),
            image_mean=triple(cfg.get("image_mean"), (0.5, 0.5, 0.5)),
            image_std=triple(cfg.get("image_std"), (0.5, 0.5, 0.5)),
        )

    def resize(self, img, height: int, width: int):
        """PIL resize to (height, width) with the configured filter (what HF's PIL backend does)."""
        if img.size == (width, height):
            return img
        return img.resize((width, height), resample=self.resample)

    def to_array(self, img) -> np.ndarray:
        """[3, H, W] float32 after rescale and normalise."""
        x = np.asarray(img, dtype=np.float32).transpose(2, 0, 1)
        if self.do_rescale:
            x = x * np.float32(self.rescale_factor)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
            x = (x - mean) / std
        return x


@attrs.frozen
class FixedSizeProcessor:
    """Resize every image to one size, then rescale and normalise (SigLIP, Gemma 3 without pan-and-scan)."""

    height: int
    width: int
    steps: PixelSteps = PixelSteps()

    @classmethod
    def from_config(cls, cfg: dict[str, Any], default_size: int) -> "FixedSizeProcessor":
        size = cfg.get("size") or {}
        if cfg.get("do_pan_and_scan"):
            raise ConfigError("preprocessor_config.json: do_pan_and_scan is not supported; set it to false")
        if "height" in size and "width" in size:
            h, w = int(size["height"]), int(size["width"])
        elif "shortest_edge" in size:
            h = w = int(size["shortest_edge"])
        else:
            h = w = default_size
        if cfg.get("do_resize") is False:
            h = w = default_size
        return cls(h, w, PixelSteps.from_config(cfg))

    def __call__(self, img) -> torch.Tensor:
        """[3, height, width] float32 pixels."""
        return torch.from_numpy(self.steps.to_array(self.steps.resize(img, self.height, self.width)))


# ---- prompts with images ----------------------------------------------------------------------------


@attrs.define
class VisionInput:
    """One preprocessed image: model-ready pixels, how many placeholder tokens it becomes, its digest."""

    pixels: torch.Tensor
    num_tokens: int
    digest: bytes
    grid: tuple[int, ...] = ()  # family-specific layout (Qwen: (t, h, w) patches)


@attrs.frozen
class ImageSpan:
    """Where one image's embeddings go: ``length`` placeholder rows, not necessarily contiguous ids."""

    rows: tuple[int, ...]  # token indices in the prompt
    digest: bytes


@attrs.define
class MultimodalPrompt:
    """Prompt ids with placeholders expanded, each image's rows, and their embeddings in row order."""

    input_ids: list[int]
    spans: list[ImageSpan]
    embeds: torch.Tensor  # [total image rows, hidden]
    # a family's own position values for the prompt rows (Qwen M-RoPE, packed 3D); None: the row index
    own_positions: torch.Tensor | None = None
    position_delta: int = 0  # with own_positions: rows after the prompt sit at index + delta

    @property
    def image_rows(self) -> list[int]:
        return [r for s in self.spans for r in s.rows]

    def hash_ids(self) -> list[int]:
        """Ids for prefix-cache page hashing: each image's rows carry a negative id derived from its digest."""
        out = list(self.input_ids)
        for span in self.spans:
            value = -1 - int.from_bytes(span.digest[:7], "little")
            for r in span.rows:
                out[r] = value
        return out

    def chunk_embeds(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(input_embeds [end-start, hidden], embed_mask [end-start]) for prompt rows start..end; None without image rows."""
        rows = torch.tensor(self.image_rows, dtype=torch.long)
        pick = (rows >= start) & (rows < end)
        if not bool(pick.any()):
            return None
        emb = self.embeds.new_zeros(end - start, self.embeds.shape[-1])
        mask = torch.zeros(end - start, dtype=torch.bool, device=self.embeds.device)
        local = (rows[pick] - start).to(self.embeds.device)
        emb[local] = self.embeds[pick.to(self.embeds.device)]
        mask[local] = True
        return emb, mask

    def positions(self, start: int, n: int) -> torch.Tensor:
        """Position values of sequence rows start..start+n: the prompt's own, then index + delta."""
        own = self.own_positions
        idx = torch.arange(start, start + n)
        inside = idx < own.shape[0]
        shifted = idx + self.position_delta
        return torch.where(inside, own[idx.clamp(max=own.shape[0] - 1)], shifted)

    def safe_chunk_end(self, start: int, end: int) -> int:
        """``end`` moved back to the start of an image span it would cut (when that leaves a non-empty chunk)."""
        for span in self.spans:
            a, b = span.rows[0], span.rows[-1] + 1
            if a < end < b and a > start:
                return a
        return end


def attach_images(batch, chunks: Sequence[tuple[MultimodalPrompt | None, int]]) -> None:
    """Fill ``batch.input_embeds`` / ``embed_mask`` (and family positions) for a batch of sequences.

    ``chunks[i] = (prompt or None, index in its sequence of the first token fed now)`` for sequence
    i of the batch, in batch order. Pass the prompt on every step of a job, decode steps included:
    a prompt that carries its own positions (``own_positions``, Qwen M-RoPE) sets the rows
    inside the prompt and shifts every later row by ``position_delta``.
    """
    bounds = batch.cu_seqlens.tolist()
    parts: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]] = []
    for (mm, start), a, b in zip(chunks, bounds[:-1], bounds[1:]):
        if mm is None or b == a:
            continue
        if (got := mm.chunk_embeds(start, start + (b - a))) is not None:
            parts.append((a, b, got))
        if mm.own_positions is not None:
            batch.positions[a:b] = mm.positions(start, b - a).to(batch.positions.device)
    if not parts:
        batch.input_embeds = batch.embed_mask = None
        return
    first = parts[0][2][0]
    emb = first.new_zeros(batch.num_tokens, first.shape[-1])
    mask = torch.zeros(batch.num_tokens, dtype=torch.bool, device=first.device)
    for a, b, (e, m) in parts:
        emb[a:b], mask[a:b] = e, m
    device = batch.input_ids.device
    batch.input_embeds, batch.embed_mask = emb.to(device), mask.to(device)


# ---- the composite model ----------------------------------------------------------------------------


class Renamed(Module):
    """Loads ``inner`` through :class:`CheckpointNames` (so its keys can use one canonical spelling)."""

    def __init__(self, inner: Module, aliases: Aliases):
        self.key, self.inner, self.aliases = inner.key, inner, aliases

    def load(self, ctx: LoadContext) -> None:
        names = CheckpointNames(ctx.store, self.aliases)
        self.inner.load(attrs.evolve(ctx, store=names))


class VisionLanguageModel(Module):
    """A language model plus a vision encoder. Forward passes are the language model's.

    Subclasses set ``image_token_id`` (the placeholder filled with embeddings), ``marker_id`` /
    ``marker_text`` (what the chat template writes per image) and implement :meth:`preprocess`,
    :meth:`expansion_ids`, :meth:`expansion_text` and :meth:`encode`. Any attribute not found here
    is looked up on the language model, so code written for a CausalLM works unchanged.
    """

    image_token_id: int
    marker_id: int
    max_images: int = 16

    def __init__(self, language: Module, vision: Module, aliases: Aliases = ()):
        self.key = ""
        self.language, self.vision, self.aliases = language, vision, aliases
        self._parts = (Renamed(language, aliases), Renamed(vision, aliases))

    def __getattr__(self, name: str):
        if name in ("language", "vision", "_parts"):
            raise AttributeError(name)
        return getattr(self.language, name)

    def children(self) -> Iterator[Module]:
        yield from self._parts

    def forward(self, batch) -> torch.Tensor:
        return self.language.forward(batch)

    # -- what a family implements ------------------------------------------------------------------
    def preprocess(self, image) -> VisionInput:
        raise NotImplementedError

    def expansion_ids(self, item: VisionInput) -> list[int]:
        """The ids that replace one image marker id (the placeholder run and its delimiters)."""
        raise NotImplementedError

    def expansion_text(self, item: VisionInput, tokenizer) -> str:
        """The text that replaces one image marker in a text prompt (as the HF processor writes it)."""
        raise NotImplementedError

    def marker_text(self, tokenizer) -> str:
        return tokenizer.decode([self.marker_id])

    def encode(self, items: Sequence[VisionInput]) -> list[torch.Tensor]:
        """Per image, its embeddings [num_tokens, hidden] in the language model's dtype."""
        raise NotImplementedError

    def finish_prompt(self, prompt: MultimodalPrompt, items: Sequence[VisionInput]) -> None:
        """Hook for family data computed from the expanded prompt (Qwen: M-RoPE positions)."""

    def use_tokenizer(self, tokenizer) -> None:
        """Hook to read special token ids from the model's tokenizer (Mistral 3: [IMG_BREAK], [IMG_END])."""

    # -- shared -------------------------------------------------------------------------------------
    def image_processor(self):
        """``self.vision.processor``, which exists only when the model directory has a preprocessor config."""
        if self.vision.processor is None:
            raise ImageError("the model directory has no preprocessor_config.json, so images cannot be prepared")
        return self.vision.processor

    @torch.inference_mode()
    def prepare(self, prompt: str | Sequence[int], images: Sequence[ImageSource], tokenizer=None) -> MultimodalPrompt:
        """Expand each image marker of ``prompt`` and encode the images (one marker per image, in order)."""
        if len(images) > self.max_images:
            raise ImageError(f"{len(images)} images given; this model takes at most {self.max_images} per prompt")
        pil = [load_image(img, name=None if _is_path(img) else f"image {i}") for i, img in enumerate(images)]
        items = [self.preprocess(img) for img in pil]
        if tokenizer is not None:
            self.use_tokenizer(tokenizer)
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ImageError("a text prompt with images needs the model's tokenizer; pass token ids instead")
            marker = self.marker_text(tokenizer)
            pieces = prompt.split(marker)
            _check_marker_count(len(pieces) - 1, len(items), repr(marker))
            text = pieces[0] + "".join(self.expansion_text(it, tokenizer) + p for it, p in zip(items, pieces[1:]))
            ids = tokenizer.encode(text)
        else:
            src = [int(t) for t in prompt]
            _check_marker_count(src.count(self.marker_id), len(items), f"id {self.marker_id}")
            ids, k = [], 0
            for t in src:
                if t == self.marker_id:
                    ids += self.expansion_ids(items[k])
                    k += 1
                else:
                    ids.append(t)
        rows = [i for i, t in enumerate(ids) if t == self.image_token_id]
        need = sum(it.num_tokens for it in items)
        if len(rows) != need:
            raise ImageError(f"the prompt holds {len(rows)} image placeholder tokens (id {self.image_token_id}) but its images need {need}")
        spans, at = [], 0
        for it in items:
            spans.append(ImageSpan(tuple(rows[at: at + it.num_tokens]), it.digest))
            at += it.num_tokens
        embeds = self.encode(items) if items else []
        hidden = self.language.config.hidden_size
        flat = torch.cat(embeds) if embeds else torch.zeros(0, hidden)
        out = MultimodalPrompt(ids, spans, flat)
        self.finish_prompt(out, items)
        return out


def _is_path(source: ImageSource) -> bool:
    """A file path (its errors name the file itself) rather than data."""
    return isinstance(source, Path) or (isinstance(source, str) and not source.startswith("data:") and "://" not in source)


def _check_marker_count(found: int, wanted: int, what: str) -> None:
    if found != wanted:
        raise ImageError(f"the prompt has {found} image markers ({what}) but {wanted} images were given; put one marker per image")


def prepare_prompt(lm, prompt: str | Sequence[int], images: Sequence[ImageSource]) -> MultimodalPrompt:
    """A :class:`MultimodalPrompt` for a loaded model (``trellm.load``); ImageError when it takes no images."""
    model = lm.model
    if not supports_images(model):  # a VisionLanguageModel, or a tensor-parallel one (rank 0 holds the tower)
        raise ImageError(f"{lm.model_dir}: {lm.spec.name} ({type(model).__name__}) takes no image input")
    return model.prepare(prompt, list(images), lm.tokenizer)


# ---- OpenAI-style chat messages ---------------------------------------------------------------------


def split_openai_messages(messages: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """OpenAI chat messages with ``image_url`` parts -> (messages for the chat template, decoded images).

    Each ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` part becomes
    ``{"type": "image"}`` (what HF chat templates expect) and its image is decoded and checked, in
    order of appearance; ``{"type": "text"}`` parts stay. Remote (http/https) URLs raise ImageError.
    """
    out_messages: list[dict[str, Any]] = []
    images: list[Any] = []
    for m_index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out_messages.append(dict(message))
            continue
        parts = []
        for p_index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{m_index}].content[{p_index}]"
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str):
                    raise ImageError(f"{where}: image_url needs a 'url' string")
                images.append(load_image(decode_data_url(url), name=where))
                parts.append({"type": "image"})
            else:
                raise ImageError(f"{where}: unsupported content part type {kind!r}; supported: text, image_url")
        out_messages.append({**message, "content": parts})
    return out_messages, images
