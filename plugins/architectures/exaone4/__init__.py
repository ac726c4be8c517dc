"""EXAONE 4 (Exaone4ForCausalLM): OLMo-2-style post-norm blocks with per-head QK-norm.

When ``sliding_window`` is set, layers follow ``sliding_window_pattern`` (e.g. "LLLG") and the
global layers use no RoPE.
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import (
    OLMO_OPTIONS,
    DecoderConfig,
    DecoderOptions,
    decoder_family,
    layer_types_from_pattern,
    text_config,
)


def read_config(raw: dict) -> DecoderConfig:
    c = text_config(raw)
    n = int(c["num_hidden_layers"])
    if not c.get("sliding_window"):
        return DecoderConfig.from_hf(raw, sliding_window=0, layer_types=())
    types = c.get("layer_types")
    if not types:
        pattern = c.get("sliding_window_pattern") or 4
        pattern = len(pattern) if isinstance(pattern, str) else int(pattern)
        types = layer_types_from_pattern(n, pattern)
    return DecoderConfig.from_hf(raw, layer_types=tuple(types))


def configure(cfg: DecoderConfig, opts: DecoderOptions) -> DecoderOptions:
    return attrs.evolve(opts, nope_layer_types=("full_attention",)) if cfg.sliding_window else opts


SPEC = decoder_family("exaone4", ("Exaone4ForCausalLM",), attrs.evolve(OLMO_OPTIONS, qk_norm_kind="head"), configure, read_config,
                      description="LG EXAONE 4.0: post-norm, QK-norm, local RoPE + global NoPE layers")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
