"""OLMo 1, 2 and 3 (OlmoForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM).

OLMo 1 is Llama with parameter-free LayerNorms and optional clamping of q/k/v (``clip_qkv``).
OLMo 2/3 use post-norm blocks: no norm precedes a sub-layer, each sub-layer's output is
normalised before the residual add; QK-norm runs over the whole q/k projection. OLMo 3 adds
sliding-window layers (``layer_types``) with their own RoPE entry.
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import OLMO_OPTIONS, DecoderConfig, DecoderOptions, decoder_family

SPEC = decoder_family("olmo", ("Olmo2ForCausalLM", "Olmo3ForCausalLM"), OLMO_OPTIONS,
                      description="AllenAI OLMo 2 / OLMo 3: post-norm, full-projection QK-norm")


def configure_olmo1(cfg: DecoderConfig, opts: DecoderOptions) -> DecoderOptions:
    clip = cfg.extra.get("clip_qkv")
    return attrs.evolve(opts, clip_qkv=float(clip) if clip is not None else None)


OLMO1_SPEC = decoder_family(
    "olmo1",
    ("OlmoForCausalLM",),
    DecoderOptions(norm="layer_noparam"),
    configure_olmo1,
    read_config=lambda raw: DecoderConfig.from_hf(raw, rms_norm_eps=1e-5),  # fixed in the reference
    description="AllenAI OLMo 1: parameter-free LayerNorm, clip_qkv",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
    register(OLMO1_SPEC)
