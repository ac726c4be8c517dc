"""GLM 4 (Glm4ForCausalLM) and GLM (GlmForCausalLM): fused gate_up_proj, partial interleaved RoPE.

GLM 4 adds sandwich norms: ``post_self_attn_layernorm`` and ``post_mlp_layernorm`` on the
sub-layer outputs. q/k/v carry biases (``attention_bias``), o_proj does not.
"""
from __future__ import annotations

import trellm
from trellm.sdk import GLM4_OPTIONS, GLM_OPTIONS, decoder_family

SPECS = (
    decoder_family("glm4", ("Glm4ForCausalLM",), GLM4_OPTIONS, description="GLM-4 0414 dense: sandwich norms, partial RoPE"),
    decoder_family("glm", ("GlmForCausalLM",), GLM_OPTIONS, description="GLM-4 (2024) dense: partial interleaved RoPE"),
)


@trellm.hookimpl
def trellm_register_architectures(register):
    for spec in SPECS:
        register(spec)
