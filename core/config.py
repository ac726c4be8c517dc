"""Typed reading of HF ``config.json``.

HF configs spell the same thing several ways (``rope_theta`` + ``rope_scaling`` vs the newer
``rope_parameters``; a ``text_config`` nested in multimodal configs; missing ``head_dim``). This
module reads them once into attrs records so modules never see raw dicts.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch

from .errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")
R = TypeVar("R")


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path}: missing config.json (is {str(model_dir)!r} a Hugging Face model directory?)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config: ``text_config`` when nested, with outer keys as fallback."""
    inner = raw.get("text_config")
    if isinstance(inner, dict):
        merged = {k: v for k, v in raw.items() if k != "text_config"}
        merged.update(inner)
        return merged
    return raw


def _get(raw: dict, key: str, default: Any = None, *, required: bool = False, source: str = "config.json") -> Any:
    if key in raw and raw[key] is not None:
        return raw[key]
    if required:
        raise ConfigError(f"{source}: required key {key!r} is missing")
    return default


def is_per_layer_type(rope_params: dict[str, Any] | None) -> bool:
    """True for RoPE parameters keyed by layer type (``{"full_attention": {...}, ...}``)."""
    return bool(rope_params) and all(isinstance(v, dict) for v in rope_params.values())


def _first(raw: dict, keys: tuple[str, ...], default: Any) -> Any:
    """The first of ``keys`` set in ``raw`` (families spell the norm epsilon four ways)."""
    for k in keys:
        if raw.get(k) is not None:
            return raw[k]
    return default


@attrs.frozen
class RopeConfig:
    """Rotary embedding parameters, normalised from either HF spelling."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any], default_theta: float = 10000.0, layer_type: str = "full_attention") -> RopeConfig:
        """Read RoPE from ``rope_parameters`` (or legacy ``rope_theta`` + ``rope_scaling``).

        Configs with per-layer-type RoPE (Gemma 3, Olmo 3: ``{"full_attention": {...},
        "sliding_attention": {...}}``) give the entry of ``layer_type``, else the full-attention one.
        """
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if is_per_layer_type(params):
            params = dict(params.get(layer_type) or params.get("full_attention") or next(iter(params.values())))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type == "su":
            rope_type = "longrope"
        if rope_type == "mrope":
            rope_type = "default"
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"config.json: unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
        prf = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        omax = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        if omax is None and rope_type in ("llama3", "yarn", "longrope"):
            omax = raw.get("max_position_embeddings")
        factor = params.get("factor")
        if factor is None:
            factor = 1.0
            if rope_type in ("yarn", "longrope") and omax and raw.get("max_position_embeddings"):
                factor = raw["max_position_embeddings"] / omax
        if rope_type in ("linear", "dynamic", "yarn", "llama3") and factor < 1.0:
            raise ConfigError(f"config.json: rope factor must be >= 1 for rope type {rope_type!r}, got {factor}")
        tup = lambda v: tuple(float(x) for x in v) if v is not None else None
        return cls(
            theta=float(theta),
            type=rope_type,
            factor=float(factor),
            partial_rotary_factor=float(prf),
            original_max_position_embeddings=int(omax) if omax else None,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            short_factor=tup(params.get("short_factor")),
            long_factor=tup(params.get("long_factor")),
        )

    def rotary_dim(self, head_dim: int) -> int:
        """How many dims of each head rotate: ``partial_rotary_factor`` of them, or all for ``proportional``
        RoPE, whose frequencies past that share are zero (Gemma 4's global layers)."""
        return head_dim if self.type == "proportional" else int(head_dim * self.partial_rotary_factor)

    def inv_freq(self, head_dim: int, max_position_embeddings: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (float32, [rotary_dim/2]) and the cos/sin scaling factor.

        ``seq_len`` matters only for ``dynamic`` (NTK) and ``longrope``, which change with the
        longest position in the current forward pass.
        """
        if self.type == "proportional":  # the first angles spaced over the whole head, the rest not rotating
            angles = int(self.partial_rotary_factor * head_dim // 2)
            inv = 1.0 / self.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim)
            return torch.cat([inv, torch.zeros(head_dim // 2 - angles)]) / self.factor, 1.0
        dim = self.rotary_dim(head_dim)
        idx = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        base = self.theta
        inv = 1.0 / (base**idx)
        scale = 1.0
        t = self.type
        if t == "linear":
            inv = inv / self.factor
        elif t == "dynamic":
            if seq_len is not None and seq_len > max_position_embeddings:
                b = base * ((self.factor * seq_len / max_position_embeddings) - (self.factor - 1)) ** (dim / (dim - 2))
                inv = 1.0 / (b**idx)
        elif t == "llama3":
            old = self.original_max_position_embeddings or max_position_embeddings
            low_wl = old / self.low_freq_factor
            high_wl = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wl, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
            inv = torch.where(medium, smoothed, scaled)
        elif t == "yarn":
            inv, scale = self._yarn(dim, idx)
        elif t == "longrope":
            omax = self.original_max_position_embeddings or max_position_embeddings
            long = seq_len is not None and seq_len > omax
            ext = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float32)
            inv = 1.0 / (ext * base**idx)
            factor = max_position_embeddings / omax
            if self.attention_factor is not None:
                scale = float(self.attention_factor)
            else:
                scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omax))
        return inv, scale

    def _yarn(self, dim: int, idx: torch.Tensor) -> tuple[torch.Tensor, float]:
        factor = self.factor
        omax = self.original_max_position_embeddings

        def mscale_of(s: float, m: float = 1.0) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        if self.attention_factor is not None:
            scale = float(self.attention_factor)
        elif self.mscale and self.mscale_all_dim:
            scale = mscale_of(factor, self.mscale) / mscale_of(factor, self.mscale_all_dim)
        else:
            scale = mscale_of(factor)

        def corr_dim(rot: float) -> float:
            return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos = self.theta**idx
        extrap_w = 1 - ramp
        inv = (1.0 / (factor * pos)) * (1 - extrap_w) + (1.0 / pos) * extrap_w
        return inv, scale


def config_int(extra: dict[str, Any], *names: str, default: int | None = None) -> int:
    """The first of ``names`` set in an HF config, as an int (configs spell expert counts several ways)."""
    for n in names:
        if extra.get(n) is not None:
            return int(extra[n])
    if default is None:
        raise ConfigError(f"config.json: none of {', '.join(map(repr, names))} is set")
    return default


def read_keys(record: type[R], cfg: DecoderConfig | dict[str, Any]) -> R:
    """A family's own config keys as a typed attrs ``record``, whose fields name what the family reads.

    Each field is read from the (text) config under its own name; a missing or null key keeps the
    field's default; the field's converter types the value, and a value it cannot convert is a
    ConfigError naming the key.
    """
    raw = cfg.extra if isinstance(cfg, DecoderConfig) else text_config(cfg)
    values: dict[str, Any] = {}
    for field in attrs.fields(record):
        value = raw.get(field.name)
        if value is None:
            continue
        try:
            values[field.name] = field.converter(value) if field.converter else value
        except (TypeError, ValueError):
            raise ConfigError(f"config.json: {field.name}={value!r} is not a valid value for it") from None
    return record(**values)


@attrs.frozen
class MoEConfig:
    """The mixture-of-experts keys of an HF config, read once (families spell several of them two or
    three ways). Families with keys of their own read those themselves."""

    num_experts: int  # n_routed_experts / num_local_experts / num_experts
    experts_per_token: int  # num_experts_per_tok
    expert_size: int | None = None  # moe_intermediate_size (None: the family uses intermediate_size)
    num_shared_experts: int = 0  # n_shared_experts / num_shared_experts
    shared_expert_size: int = 0  # shared_expert_intermediate_size (Qwen: one shared expert of this width)
    first_dense_layers: int = 0  # first_k_dense_replace / num_dense_layers: leading layers with a dense MLP
    sparse_step: int = 1  # decoder_sparse_step: every n-th layer is MoE
    dense_layers: tuple[int, ...] = ()  # mlp_only_layers: dense whatever the step says
    scoring_func: str | None = None  # "softmax" / "sigmoid" (None: the family's default)
    normalize_topk: bool | None = None  # norm_topk_prob (None: the family's default)
    routed_scaling: float = 1.0  # routed_scaling_factor (Hy3: router_scaling_factor)
    num_groups: int = 1  # n_group: expert groups (DeepSeek-V3)
    topk_groups: int = 1  # topk_group: groups each token may use

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> MoEConfig | None:
        """The MoE section of a (text) config; None when it names no experts."""
        num_experts = config_int(c, "n_routed_experts", "num_local_experts", "num_experts", default=0)
        if num_experts <= 0:
            return None
        size = c.get("moe_intermediate_size")
        norm = c.get("norm_topk_prob")
        return cls(
            num_experts=num_experts,
            experts_per_token=config_int(c, "num_experts_per_tok", default=0),
            expert_size=int(size) if size is not None else None,
            num_shared_experts=config_int(c, "n_shared_experts", "num_shared_experts", default=0),
            shared_expert_size=config_int(c, "shared_expert_intermediate_size", default=0),
            first_dense_layers=config_int(c, "first_k_dense_replace", "num_dense_layers", default=0),
            sparse_step=max(1, config_int(c, "decoder_sparse_step", default=1)),
            dense_layers=tuple(int(i) for i in c.get("mlp_only_layers") or ()),
            scoring_func=str(c["scoring_func"]) if c.get("scoring_func") is not None else None,
            normalize_topk=bool(norm) if norm is not None else None,
            routed_scaling=float(c.get("routed_scaling_factor") or c.get("router_scaling_factor") or 1.0),
            num_groups=config_int(c, "n_group", default=1),
            topk_groups=config_int(c, "topk_group", default=1),
        )

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` has experts (after the leading dense layers, every ``sparse_step``-th)."""
        return i >= self.first_dense_layers and i not in self.dense_layers and (i + 1) % self.sparse_step == 0

    def expert_width(self) -> int:
        """``moe_intermediate_size``, required by the families that call this."""
        if self.expert_size is None:
            raise ConfigError("config.json: moe_intermediate_size is not set")
        return self.expert_size


@attrs.frozen
class LinearAttentionConfig:
    """The ``linear_*`` keys sizing gated-delta-net layers (Qwen3-Next, Qwen3.5, OLMo Hybrid)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    full_attention_interval: int = 4  # without layer_types: every n-th layer is full attention

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> LinearAttentionConfig | None:
        """The linear-attention section of a (text) config; None when it has none."""
        if c.get("linear_num_key_heads") is None:
            return None
        return cls(
            num_key_heads=config_int(c, "linear_num_key_heads"),
            num_value_heads=config_int(c, "linear_num_value_heads"),
            key_head_dim=config_int(c, "linear_key_head_dim"),
            value_head_dim=config_int(c, "linear_value_head_dim"),
            conv_kernel=config_int(c, "linear_conv_kernel_dim", default=4),
            full_attention_interval=config_int(c, "full_attention_interval", default=4),
        )


@attrs.frozen
class DecoderConfig:
    """What a decoder-only transformer needs to know, read from a (text) HF config.

    Family plugins pass overrides for what their HF config spells differently or implies.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = attrs.field(factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" / "sliding_attention" (empty: all full)
    layer_ropes: dict[str, RopeConfig] = attrs.field(factory=dict, hash=False)  # per layer type, when it differs
    nope_layers: tuple[int, ...] = ()  # layers that apply no RoPE at all (SmolLM3, Cohere2 and EXAONE 4 global layers)
    layer_heads: tuple[int, ...] = ()  # per layer, its query-head count where layers differ (Laguna; empty: all the same)
    torch_dtype: str | None = None
    architecture: str = ""
    moe: MoEConfig | None = None  # mixture-of-experts keys, when the config names experts
    linear_attention: LinearAttentionConfig | None = None  # gated-delta-net sizes, when the config has them
    extra: dict[str, Any] = attrs.field(factory=dict, hash=False)  # the raw (text) config, for a family's own keys

    @classmethod
    def from_hf(cls, raw: dict[str, Any], **overrides: Any) -> DecoderConfig:
        c = text_config(raw)
        hidden = int(_get(c, "hidden_size", required=True))
        heads = int(_get(c, "num_attention_heads", required=True))
        if hidden <= 0 or heads <= 0:
            raise ConfigError(f"config.json: hidden_size ({hidden}) and num_attention_heads ({heads}) must be positive")
        kv = int(_get(c, "num_key_value_heads", heads))
        if heads % kv:
            raise ConfigError(f"config.json: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})")
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        archs = raw.get("architectures") or [""]
        values: dict[str, Any] = dict(
            hidden_size=hidden,
            num_hidden_layers=int(_get(c, "num_hidden_layers", required=True)),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=int(_get(c, "head_dim", hidden // heads)),
            intermediate_size=int(_get(c, "intermediate_size", 4 * hidden)),
            vocab_size=int(_get(c, "vocab_size", required=True)),
            max_position_embeddings=int(_get(c, "max_position_embeddings", 2048)),
            rms_norm_eps=float(_first(c, ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "norm_eps"), 1e-6)),
            rope=RopeConfig.from_hf(c),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
            attention_bias=bool(_get(c, "attention_bias", False)),
            mlp_bias=bool(_get(c, "mlp_bias", False)),
            hidden_act=str(_get(c, "hidden_act", _get(c, "hidden_activation", "silu"))),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=c.get("pad_token_id"),
            sliding_window=int(_get(c, "sliding_window", 0) or 0),
            layer_types=tuple(c.get("layer_types") or ()),
            layer_ropes=_layer_ropes(c),
            torch_dtype=c.get("torch_dtype") or c.get("dtype"),
            architecture=archs[0],
            moe=MoEConfig.from_hf(c),
            linear_attention=LinearAttentionConfig.from_hf(c),
            extra=c,
        )
        values.update(overrides)
        cfg = cls(**values)
        cfg.validate_layers()
        return cfg

    def require_moe(self) -> MoEConfig:
        """The MoE section, or a ConfigError when the config names no experts."""
        if self.moe is None:
            raise ConfigError("config.json: no expert count is set (n_routed_experts / num_local_experts / num_experts)")
        if self.moe.experts_per_token <= 0:
            raise ConfigError("config.json: num_experts_per_tok is not set")
        return self.moe

    def require_linear_attention(self) -> LinearAttentionConfig:
        """The linear-attention sizes, or a ConfigError when they are missing."""
        if self.linear_attention is None:
            raise ConfigError("config.json: linear_num_key_heads is not set (gated delta net layers need the linear_* sizes)")
        return self.linear_attention

    def layer_type(self, i: int) -> str:
        """``"full_attention"`` or ``"sliding_attention"`` (or a family's own kind) for layer ``i``."""
        return self.layer_types[i] if self.layer_types else "full_attention"

    def layer_sliding_window(self, i: int) -> int:
        """Window of layer ``i`` (0: full attention)."""
        return self.sliding_window if self.layer_type(i) == "sliding_attention" else 0

    def attention_heads(self, i: int) -> int:
        """Query heads of layer ``i`` (``num_attention_heads`` unless ``layer_heads`` says otherwise)."""
        return self.layer_heads[i] if self.layer_heads else self.num_attention_heads

    def rope_for(self, layer_type: str) -> RopeConfig:
        """The RoPE of layers of ``layer_type`` (Gemma 3 local layers use their own base)."""
        return self.layer_ropes.get(layer_type, self.rope)

    def validate_layers(self) -> None:
        n = self.num_hidden_layers
        if self.layer_types and len(self.layer_types) != n:
            raise ConfigError(f"config.json: layer_types has {len(self.layer_types)} entries for {n} layers")
        if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
            raise ConfigError("config.json: layer_types has sliding_attention layers but sliding_window is not set")
        if self.layer_heads and len(self.layer_heads) != n:
            raise ConfigError(f"config.json: the per-layer head counts list {len(self.layer_heads)} entries for {n} layers")
        uneven = [h for h in self.layer_heads if h <= 0 or h % self.num_key_value_heads]
        if uneven:
            raise ConfigError(f"config.json: per-layer head counts {uneven} are not positive multiples of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        bad = [i for i in self.nope_layers if not 0 <= i < n]
        if bad:
            raise ConfigError(f"config.json: NoPE layer indices {bad} are outside 0..{n - 1}")


def _layer_ropes(c: dict[str, Any]) -> dict[str, RopeConfig]:
    """Per-layer-type RoPE configs when ``rope_parameters`` is keyed by layer type, else empty."""
    params = c.get("rope_parameters")
    if not is_per_layer_type(params):
        return {}
    return {lt: RopeConfig.from_hf(c, layer_type=lt) for lt in params}


def sliding_on_every_layer(cfg: DecoderConfig) -> DecoderConfig:
    """Mistral / Phi-3: a set ``sliding_window`` applies to every layer (their configs list no layer_types)."""
    if cfg.sliding_window > 0 and not cfg.layer_types:
        return attrs.evolve(cfg, layer_types=("sliding_attention",) * cfg.num_hidden_layers)
    return cfg


def layer_types_from_pattern(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Sliding layers with every ``pattern``-th layer full (Gemma 2/3, Cohere2, EXAONE 4 spell it this way)."""
    if pattern <= 0:
        return ("full_attention",) * num_layers
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))
