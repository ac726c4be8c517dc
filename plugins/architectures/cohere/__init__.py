"""Cohere Command-R (CohereForCausalLM): parallel attention + MLP under one weight-only LayerNorm.

GPT-J (interleaved) RoPE, logits multiplied by ``logit_scale``, optional per-head LayerNorm QK-norm
(``use_qk_norm``), tied embeddings.
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import DecoderOptions, decoder_family

OPTIONS = DecoderOptions(norm="layer_nobias", parallel_block=True, rope_interleaved=True, qk_norm_kind="layer_head")


def configure(cfg, opts: DecoderOptions) -> DecoderOptions:
    x = cfg.extra
    return attrs.evolve(opts, logit_scale=float(x.get("logit_scale", 1.0)), qk_norm=bool(x.get("use_qk_norm", False)))


SPEC = decoder_family("cohere", ("CohereForCausalLM",), OPTIONS, configure,
                      description="Cohere Command-R / R+: parallel block, LayerNorm, logit scale")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
