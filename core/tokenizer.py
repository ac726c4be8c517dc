"""The tokenizer: HF `tokenizer.json` through the `tokenizers` library, plus the parts HF keeps
outside it (BOS/EOS ids, chat templates) and streaming detokenization.

Behaviour follows HF transformers (v5 `TokenizersBackend`) so that prompts encode to the same ids
and chat templates render to the same text as they do there.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import tokenizers

from .errors import TokenizerError

__all__ = ["Tokenizer", "IncrementalDecoder", "render_chat_template"]

_REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: Path) -> dict:
    """A JSON file as a dict, or {} when it is absent; a clear error when it is unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as configured: a plain string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


class Tokenizer:
    """Encodes text to token ids and back, renders chat templates, streams decoded text."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        chat_templates: dict[str, str] | None = None,
        source: str = "<memory>",
    ):
        self._backend = backend
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.bos_token_id = self.token_to_id(bos_token) if bos_token else None
        eos_ids = set(extra_eos_token_ids)
        if eos_token and self.token_to_id(eos_token) is not None:
            eos_ids.add(self.token_to_id(eos_token))
        self.eos_token_ids: set[int] = eos_ids
        if pad_token and self.token_to_id(pad_token) is not None:
            pad_token_id = self.token_to_id(pad_token)
        self.pad_token_id = pad_token_id
        self.chat_templates = dict(chat_templates or {})
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path, vocab_size: int | None = None) -> "Tokenizer":
        """Load from an HF model directory. `vocab_size` (the model's embedding rows; read from
        config.json when not given) must hold every token id the tokenizer can produce."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file}: not found (trellm needs an HF fast tokenizer file)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise TokenizerError(f"{tokenizer_file}: cannot parse ({exc})") from exc

        tok_config = _read_json(model_dir / "tokenizer_config.json")
        special_map = _read_json(model_dir / "special_tokens_map.json")
        gen_config = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")
        if isinstance(model_config.get("text_config"), dict):  # multimodal: the LM's ids live there
            token_ids = {k: v for k, v in model_config.items() if k.endswith("_token_id")}
            model_config = {**model_config["text_config"], **token_ids}

        def special(name: str) -> str | None:
            return _token_text(tok_config.get(name)) or _token_text(special_map.get(name))

        # As in transformers v5: with a tokenizer.json, its post-processor alone decides whether
        # BOS/EOS are added; tokenizer_config's add_bos_token/add_eos_token are ignored.
        bos_token, eos_token = special("bos_token"), special("eos_token")

        templates = _load_chat_templates(model_dir, tok_config)
        extra_eos = _as_id_list(gen_config.get("eos_token_id")) + _as_id_list(model_config.get("eos_token_id"))
        pad_id = gen_config.get("pad_token_id", model_config.get("pad_token_id"))
        tokenizer = cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            extra_eos_token_ids=extra_eos,
            pad_token_id=pad_id if isinstance(pad_id, int) else None,
            chat_templates=templates,
            source=str(model_dir),
        )
        origin = "given"
        if vocab_size is None:
            vocab_size, origin = model_config.get("vocab_size"), "config.json"
        if vocab_size is not None and tokenizer.vocab_size > int(vocab_size):
            raise TokenizerError(
                f"{tokenizer_file}: tokenizer has ids up to {tokenizer.vocab_size - 1} but the model's "
                f"vocab_size is {vocab_size} ({origin}): the tokenizer does not belong to this model"
            )
        return tokenizer

    # ---- vocabulary ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (highest id + 1, added tokens included)."""
        return self._vocab_size

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    # ---- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS the way HF does for this model."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        """A decoder that turns token ids, pushed one at a time, into text as it completes."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---- chat templates ------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        template_name: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation rendered as prompt text by the model's chat template (as HF's
        `apply_chat_template(..., tokenize=False)`); extra kwargs are visible to the template."""
        if not self.chat_templates:
            raise TokenizerError(
                f"{self.source}: the tokenizer has no chat template (none in tokenizer_config.json "
                "or chat_template.jinja); format the prompt yourself or add a template"
            )
        name = template_name
        if name is None:  # HF's choice: "tool_use" when tools are given and it exists, else "default"
            name = "tool_use" if tools is not None and "tool_use" in self.chat_templates else "default"
            if name not in self.chat_templates and len(self.chat_templates) == 1:
                name = next(iter(self.chat_templates))
        if name not in self.chat_templates:
            raise TokenizerError(
                f"{self.source}: no chat template named {name!r}; available: {sorted(self.chat_templates)}"
            )
        specials = {
            key: value
            for key, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                               ("pad_token", self.pad_token), ("unk_token", self.unk_token))
            if value is not None
        }
        return render_chat_template(
            self.chat_templates[name], messages, add_generation_prompt=add_generation_prompt,
            tools=tools, documents=documents, **{**specials, **kwargs},
        )


def _load_chat_templates(model_dir: Path, tok_config: dict) -> dict[str, str]:
    """Named chat templates: chat_template.jinja (HF's newer place) wins over tokenizer_config."""
    templates: dict[str, str] = {}
    raw = tok_config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(
                    f"{model_dir / 'tokenizer_config.json'}: chat_template list entries need "
                    f"'name' and 'template' strings, got {entry!r}"
                )
            templates[entry["name"]] = entry["template"]
    elif raw is not None:
        raise TokenizerError(
            f"{model_dir / 'tokenizer_config.json'}: chat_template must be a string or a list, "
            f"got {type(raw).__name__}"
        )
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    templates_dir = model_dir / "additional_chat_templates"
    if templates_dir.is_dir():
        for path in sorted(templates_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    return templates


# ---- chat template rendering ---------------------------------------------------------------------


def _hf_tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """`tojson` as HF templates expect it: plain json.dumps, no HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_TEMPLATE_CACHE: dict[str, Any] = {}


def _compile_template(source: str):
    """Compile once per template text, in the sandbox and with the options HF uses."""
    template = _TEMPLATE_CACHE.get(source)
    if template is not None:
        return template
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
        HF; for inference it renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _hf_tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        template = env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerError(f"chat template has a syntax error at line {exc.lineno}: {exc.message}") from exc
    _TEMPLATE_CACHE[source] = template
    return template


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    """Template inputs rebuilt from plain JSON-like types: the sandbox then sees no object with
    methods of its own, and the caller's data cannot be modified. Other objects (images, arrays)
    become a placeholder naming their type, as in HF."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) lose their extras
        if isinstance(value, base):
            return base(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _normalize_message(message: Any) -> dict:
    """A message as HF hands it to templates: keys set to None dropped (templates handle a missing
    key better than None), and reasoning text under every name templates read it by."""
    if not isinstance(message, dict):
        raise TokenizerError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
    message = {k: v for k, v in _plain(message).items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         tools: list[dict] | None = None, documents: list[dict] | None = None,
                         **kwargs: Any) -> str:
    """Render a chat template over `messages` the way HF does (sandboxed jinja2, trim_blocks and
    lstrip_blocks, HF's `tojson`, `raise_exception` and `strftime_now`)."""
    return _compile_template(template).render(
        messages=[_normalize_message(m) for m in messages],
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(kwargs),
    )


# ---- streaming detokenization --------------------------------------------------------------------


class IncrementalDecoder:
    """Turns token ids, one at a time, into text, emitting only text that is final.

    Decoding a token alone loses context (SentencePiece's leading-space marker, a UTF-8 character
    split over byte tokens), so each step decodes a short window of earlier tokens with and without
    the new ones and emits the difference (the prefix-offset technique). Text whose tail is still an
    incomplete character (decodes to U+FFFD) is held back until it completes or `flush()`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context tokens whose text was already emitted
        self._read_offset = 0  # tokens before this are emitted

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT_CHAR):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full_text[len(prefix_text):]
        return ""

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD, as in a full decode)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        held = self._ids[self._read_offset:]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if full_text.startswith(prefix_text):
            return full_text[len(prefix_text):]
        # A byte-fallback run cut mid-character decodes to U+FFFD as a whole, emitted text
        # included; what is held back is then best shown on its own.
        return self._decode(held)
