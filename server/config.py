"""Server settings: one record filled from defaults, then a config file, then the command line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from trellm.errors import ConfigError, TrellmError


def parse_cache_bits(value: Any) -> tuple[int, int] | None:
    """``"4,4"`` / ``"8"`` / ``[4, 6]`` -> (k_bits, v_bits); None or "" or "16" for an fp16 cache."""
    if value is None or value == "" or value == 16 or value == "16":
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
    elif isinstance(value, int):
        parts = [value]
    else:
        parts = list(value)
    try:
        bits = [int(p) for p in parts]
    except (TypeError, ValueError):
        raise ConfigError(f"cache_bits: expected 'K,V' with integers 2..8 (or 16 for fp16), got {value!r}") from None
    if len(bits) == 1:
        bits = bits * 2
    if len(bits) != 2 or not all(2 <= b <= 8 for b in bits):
        raise ConfigError(f"cache_bits: expected 'K,V' with integers 2..8 (or 16 for fp16), got {value!r}")
    return bits[0], bits[1]


def parse_gpu_split(value: Any) -> str | list[float] | None:
    """'auto', GiB per device ("20,24" or a list), or None."""
    from trellm.distributed.layer_split import parse_gpu_split as parse

    try:
        return parse(value)
    except TrellmError as e:
        raise ConfigError(str(e)) from None


def parse_loras(value: Any) -> dict[str, str]:
    """``["NAME=DIR", ...]`` or ``{NAME: DIR}`` -> {NAME: DIR}: the LoRA adapters served as ``<model>:NAME``."""
    if not value:
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    else:
        items = []
        for entry in [value] if isinstance(value, str) else value:
            name, sep, path = str(entry).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ConfigError(f"lora: expected NAME=DIR, got {entry!r}")
            items.append((name.strip(), path.strip()))
    out: dict[str, str] = {}
    for name, path in items:
        if ":" in str(name) or str(name) in out:
            raise ConfigError(f"lora: adapter name {name!r} is {'repeated' if name in out else 'not allowed (no colons)'}")
        out[str(name)] = str(path)
    return out


def _known_parser(setting: str, value: str | None) -> None:
    from .chat_parsing import REASONING_PARSERS, TOOL_FORMATS

    known = sorted(TOOL_FORMATS) if setting == "tool_parser" else list(REASONING_PARSERS)
    if value is not None and value not in known:
        raise ConfigError(f"{setting}: unknown parser {value!r}; known: {', '.join(known)}")


@attrs.define
class ServerConfig:
    """Everything ``trellm serve`` can be told; keys of a config file use these names."""

    model: str | None = None  # HF model directory; None = the default model (SmolLM2)
    model_name: str | None = None  # id under /v1/models; default: the directory's name
    host: str = "127.0.0.1"
    port: int = 5000
    api_key: str | None = None  # None: generate one at start (printed) unless disable_auth
    admin_key: str | None = None  # None: generate one at start (printed) unless disable_auth
    disable_auth: bool = False
    max_queue: int = 64  # jobs waiting for admission beyond the running batch; more get 429
    max_batch_size: int = 16
    max_chunk_tokens: int = 512
    cache_size: int = 8192  # KV cache tokens
    page_size: int = 256
    cache_bits: tuple[int, int] | None = attrs.field(default=None, converter=parse_cache_bits)
    draft_model: str | None = None
    num_draft_tokens: int = 4
    lora: dict[str, str] = attrs.field(factory=dict, converter=parse_loras)  # NAME -> PEFT adapter directory
    device: str | None = None
    dtype: str | None = None
    tensor_parallel: int = 1  # ranks the model is split over (GPUs from device; gloo processes on cpu)
    gpu_split: str | list[float] | None = attrs.field(default=None, converter=parse_gpu_split)  # layers over GPUs
    default_max_tokens: int = 512  # chat requests without max_tokens: at most this many (and what the context allows)
    max_tokens_limit: int | None = 4096  # requests asking for more new tokens get 400; None = what the context allows
    max_request_bytes: int = 4 * 1024 * 1024
    max_prompt_bytes: int = 1024 * 1024  # UTF-8 bytes of prompt text or message contents; more get 400
    max_images: int = 8  # image parts per request
    max_image_pixels: int = 32 * 1024 * 1024  # width * height summed over a request's images
    max_n: int = 16
    strict_model_name: bool = True  # 404 for a request naming another model
    allow_request_chat_template: bool = False  # a request's own Jinja template (rendered in a limited subprocess)
    template_timeout_s: float = 2.0  # a request template rendering longer is stopped (400)
    template_memory_mb: int = 1024  # address-space limit of the process that renders request templates
    models_dir: str | None = None  # admin loads take model names under this directory only; None = no admin loads
    request_timeout_s: float = 30.0  # a client has this long to send a whole request (headers and body)
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 512  # more open connections are closed at once (stay below the process's file limit)
    shutdown_grace_s: float = 10.0  # on SIGTERM, running requests get this long to finish before they are cancelled
    max_failed_auth: int = 20  # failed authentications per client address per minute; more get 429
    # proxies whose X-Forwarded-For names the client (comma-separated addresses or networks, "*": any, "": none):
    # behind a reverse proxy every request would otherwise come from the proxy's one address
    trusted_proxies: str = "127.0.0.1"
    # how the model writes tool calls and reasoning (server/chat_parsing.py); None: read from the chat template
    tool_parser: str | None = attrs.field(default=None, validator=lambda _, a, v: _known_parser(a.name, v))
    reasoning_parser: str | None = attrs.field(default=None, validator=lambda _, a, v: _known_parser(a.name, v))
    log_level: str = "info"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in attrs.fields(cls)]

    def updated(self, values: dict[str, Any], source: str) -> "ServerConfig":
        """A copy with ``values`` applied; unknown keys raise naming ``source``."""
        unknown = sorted(set(values) - set(self.field_names()))
        if unknown:
            raise ConfigError(f"{source}: unknown setting(s) {unknown}; known: {', '.join(self.field_names())}")
        return attrs.evolve(self, **{k.replace("-", "_"): v for k, v in values.items()})

    def public_dict(self) -> dict[str, Any]:
        """Settings without secrets (for logs and /v1/model)."""
        d = attrs.asdict(self)
        for secret in ("api_key", "admin_key"):
            d[secret] = "***" if d[secret] else None
        return d


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file holding a mapping of ServerConfig keys (dashes or underscores)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix.lower() == '.json' else 'YAML'}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
