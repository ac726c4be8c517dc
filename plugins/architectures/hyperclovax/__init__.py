"""HyperCLOVA X SEED text (HyperCLOVAXForCausalLM): Granite's muP multipliers plus Peri-LN.

Peri-LN (``use_post_norm``) normalises each sub-layer's output (``post_norm1``, ``post_norm2``)
before the scaled residual add; logits are *multiplied* by ``logits_scaling`` (Granite divides).
Both are :func:`trellm.sdk.configure_hyperclovax`, which HyperCLOVA X with images reuses.
"""
from __future__ import annotations

import trellm
from trellm.sdk import configure_hyperclovax, decoder_family

SPEC = decoder_family("hyperclovax", ("HyperCLOVAXForCausalLM",), configure=configure_hyperclovax,
                      description="NAVER HyperCLOVA X SEED (text): muP multipliers, Peri-LN")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
