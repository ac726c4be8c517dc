"""HyperCLOVA X SEED text (HyperCLOVAXForCausalLM): Granite's muP multipliers plus Peri-LN.

Peri-LN (``use_post_norm``) normalises each sub-layer's output (``post_norm1``, ``post_norm2``)
before the scaled residual add; logits are *multiplied* by ``logits_scaling`` (Granite divides).
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import DecoderOptions, configure_granite, decoder_family


def configure(cfg, opts: DecoderOptions) -> DecoderOptions:
    opts = configure_granite(cfg, opts, divide_logits=False)
    if cfg.extra.get("use_post_norm", True):
        opts = attrs.evolve(opts, attn_out_norm_name="post_norm1", mlp_out_norm_name="post_norm2")
    return opts


SPEC = decoder_family("hyperclovax", ("HyperCLOVAXForCausalLM",), configure=configure,
                      description="NAVER HyperCLOVA X SEED (text): muP multipliers, Peri-LN")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
