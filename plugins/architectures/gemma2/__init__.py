"""Gemma 2 (Gemma2ForCausalLM): Gemma with sandwich norms, alternating sliding/full layers and softcaps.

Each sub-layer has a norm before it and one on its output; attention logits and final logits are
tanh-softcapped; the softmax scale is ``query_pre_attn_scalar ** -0.5``. Older configs give
``sliding_window_pattern`` instead of ``layer_types``.
"""
from __future__ import annotations

import trellm
from trellm.sdk import GEMMA2_OPTIONS, configure_gemma2, decoder_family, read_gemma2_config

SPEC = decoder_family("gemma2", ("Gemma2ForCausalLM",), GEMMA2_OPTIONS, configure_gemma2, read_gemma2_config,
                      description="Gemma 2: sandwich norms, local/global attention, logit softcaps")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
