"""StarCoder2 (Starcoder2ForCausalLM): LayerNorm with bias, ungated GELU MLP (c_fc, c_proj), one ``use_bias``.

A set ``sliding_window`` applies to every layer, as in Mistral.
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import DecoderConfig, DecoderOptions, decoder_family, sliding_on_every_layer

OPTIONS = DecoderOptions(norm="layer", mlp_gated=False, mlp_up_name="c_fc", mlp_down_name="c_proj")


def configure(cfg: DecoderConfig, opts: DecoderOptions) -> DecoderOptions:
    bias = bool(cfg.extra.get("use_bias", True))
    return attrs.evolve(opts, qkv_bias=bias, o_bias=bias, mlp_bias=bias)


SPEC = decoder_family(
    "starcoder2",
    ("Starcoder2ForCausalLM",),
    OPTIONS,
    configure,
    read_config=lambda raw: sliding_on_every_layer(DecoderConfig.from_hf(raw)),
    description="BigCode StarCoder2: LayerNorm, GELU MLP with biases, sliding window",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
