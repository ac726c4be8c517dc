"""ERNIE 4.5 dense (Ernie4_5ForCausalLM, and Ernie4_5_ForCausalLM as Baidu's own checkpoints spell it):
Llama with GPT-J (interleaved) RoPE and one ``use_bias`` flag."""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import DecoderOptions, decoder_family


def configure(cfg, opts: DecoderOptions) -> DecoderOptions:
    bias = bool(cfg.extra.get("use_bias", False))
    return attrs.evolve(opts, qkv_bias=bias, o_bias=bias, mlp_bias=bias)


SPEC = decoder_family("ernie4_5", ("Ernie4_5ForCausalLM", "Ernie4_5_ForCausalLM"), DecoderOptions(rope_interleaved=True), configure,
                      description="Baidu ERNIE 4.5 dense (0.3B): interleaved RoPE, use_bias")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
