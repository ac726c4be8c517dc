"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM): post-norm blocks and QK-norm over the whole projection.

No norm precedes a sub-layer; each sub-layer's output is normalised before the residual add.
OLMo 3 adds sliding-window layers (``layer_types``) with their own RoPE entry.
"""
from __future__ import annotations

import trellm
from trellm.modules.decoder import DecoderOptions, decoder_family

OPTIONS = DecoderOptions(
    input_norm_name=None,
    post_attn_norm_name=None,
    attn_out_norm_name="post_attention_layernorm",
    mlp_out_norm_name="post_feedforward_layernorm",
    qk_norm=True,
    qk_norm_kind="full",
)

SPEC = decoder_family("olmo", ("Olmo2ForCausalLM", "Olmo3ForCausalLM"), OPTIONS,
                      description="AllenAI OLMo 2 / OLMo 3: post-norm, full-projection QK-norm")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
