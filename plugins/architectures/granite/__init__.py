"""Granite (GraniteForCausalLM): Llama with muP multipliers on embeddings, residuals, attention and logits.

Logits are divided by ``logits_scaling``; the softmax scale is ``attention_multiplier``.
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import DecoderOptions, decoder_family


def configure(cfg, opts: DecoderOptions, divide_logits: bool = True) -> DecoderOptions:
    x = cfg.extra
    logits = float(x.get("logits_scaling", 1.0))
    attn = x.get("attention_multiplier")
    return attrs.evolve(
        opts,
        embed_scale=float(x.get("embedding_multiplier", 1.0)),
        embed_scale_rounded=False,
        residual_multiplier=float(x.get("residual_multiplier", 1.0)),
        attn_scale=float(attn) if attn is not None else None,
        logit_scale=1.0 / logits if divide_logits else logits,
    )


SPEC = decoder_family("granite", ("GraniteForCausalLM",), configure=configure,
                      description="IBM Granite 3.x dense: muP multipliers")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
