"""DeciLM / NVIDIA Nemotron-Super and -Ultra (DeciLMForCausalLM): Llama whose blocks were searched one by one.

``block_configs`` holds one entry per layer. Its ``attention`` is GQA with ``num_attention_heads //
n_heads_in_group`` KV heads, or ``no_op`` (the block has no attention and no input norm), or
``replace_with_linear`` (one hidden x hidden matrix, ``self_attn.linear_attn``, after the norm). Its ``ffn``
is a SwiGLU MLP ``ffn_mult`` wide (``2 * ffn_mult * hidden / 3`` rounded up to a multiple of 256), or
``no_op``, or ``replace_with_linear`` (``mlp.linear_mlp``). transformers has no DeciLM class: the checkpoint
format is NVIDIA's published one (their remote ``modeling_decilm.py``).
"""
from __future__ import annotations

import math
from typing import Any

import attrs

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    Attention,
    CausalLM,
    ConfigError,
    DecoderConfig,
    DecoderLayer,
    ForwardBatch,
    GatedMLP,
    Linear,
    Module,
    RMSNorm,
    RotaryEmbedding,
)

# block_configs keys of variants this plugin does not run; a block that sets one is refused by name
UNSUPPORTED_ATTENTION = ("num_sink_tokens", "sparsify", "unshifted_sink", "use_prefill_window_in_sink_attention", "window_length")
UNSUPPORTED_FFN = ("sparsify",)


@attrs.frozen
class AttentionBlock:
    no_op: bool = False
    replace_with_linear: bool = False
    n_heads_in_group: int | None = None


@attrs.frozen
class FFNBlock:
    no_op: bool = False
    replace_with_linear: bool = False
    ffn_mult: float | None = None


@attrs.frozen
class Block:
    attention: AttentionBlock
    ffn: FFNBlock


def _read_part(cls, raw: Any, where: str, unsupported: tuple[str, ...]):
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json: {where} must be an object, got {raw!r}")
    for name in unsupported:
        if raw.get(name):
            raise ConfigError(f"config.json: {where}.{name} = {raw[name]!r} is not supported")
    fields = {f.name for f in attrs.fields(cls)}
    return cls(**{k: v for k, v in raw.items() if k in fields and v is not None})


def read_blocks(cfg: DecoderConfig) -> list[Block]:
    """The per-layer blocks, checked: GQA needs ``n_heads_in_group`` dividing the heads, an MLP its ``ffn_mult``."""
    raw = cfg.extra.get("block_configs")
    if not isinstance(raw, list) or len(raw) != cfg.num_hidden_layers:
        n = len(raw) if isinstance(raw, list) else "no"
        raise ConfigError(f"config.json: block_configs must list one block per layer ({cfg.num_hidden_layers}), found {n}")
    blocks = []
    for i, b in enumerate(raw):
        where = f"block_configs[{i}]"
        block = Block(_read_part(AttentionBlock, (b or {}).get("attention"), f"{where}.attention", UNSUPPORTED_ATTENTION),
                      _read_part(FFNBlock, (b or {}).get("ffn"), f"{where}.ffn", UNSUPPORTED_FFN))
        a, f = block.attention, block.ffn
        if not (a.no_op or a.replace_with_linear):
            group = a.n_heads_in_group
            if not group or cfg.num_attention_heads % group:
                raise ConfigError(f"config.json: {where}.attention.n_heads_in_group = {group!r} must divide "
                                  f"num_attention_heads ({cfg.num_attention_heads})")
        if not (f.no_op or f.replace_with_linear) and not f.ffn_mult:
            raise ConfigError(f"config.json: {where}.ffn.ffn_mult is not set")
        blocks.append(block)
    return blocks


def ffn_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """DeciLM's MLP width: 2/3 of ``ffn_mult * hidden`` (SwiGLU), rounded up to a multiple of 256."""
    return math.ceil(int(2 * ffn_mult * hidden_size / 3) / 256) * 256


class LinearMixer(Linear):
    """A sub-layer replaced by one linear map of the normed hidden state."""

    def forward(self, x, batch: ForwardBatch | None = None):
        return super().forward(x)


def build(cfg: DecoderConfig) -> CausalLM:
    hidden, eps, heads = cfg.hidden_size, cfg.rms_norm_eps, cfg.num_attention_heads
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    layers: list[Module] = []
    for i, block in enumerate(read_blocks(cfg)):
        key, a, f = f"model.layers.{i}", block.attention, block.ffn
        attn_norm = attn = mlp_norm = mlp = None
        if not a.no_op:
            attn_norm = RMSNorm(f"{key}.input_layernorm", hidden, eps)
            attn = (LinearMixer(f"{key}.self_attn.linear_attn", hidden, hidden) if a.replace_with_linear else
                    Attention(f"{key}.self_attn", i, hidden, heads, heads // a.n_heads_in_group, cfg.head_dim, rope,
                              cfg.attention_bias, cfg.attention_bias))
        if not f.no_op:
            mlp_norm = RMSNorm(f"{key}.post_attention_layernorm", hidden, eps)
            mlp = (LinearMixer(f"{key}.mlp.linear_mlp", hidden, hidden) if f.replace_with_linear else
                   GatedMLP(f"{key}.mlp", hidden, ffn_intermediate_size(f.ffn_mult, hidden), cfg.hidden_act, cfg.mlp_bias))
        layers.append(DecoderLayer(key, attn_norm, attn, mlp_norm, mlp))
    return CausalLM.from_layers(cfg, layers)


SPEC = ArchitectureSpec(
    name="decilm",
    architectures=("DeciLMForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="DeciLM / NVIDIA Nemotron-Super: per-layer GQA width, MLP width, no-op or linear sub-layers",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
