"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama with q/k/v biases (no o_proj bias)."""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderOptions, decoder_family, read_qwen2_config

SPEC = decoder_family(
    "qwen2",
    ("Qwen2ForCausalLM",),
    DecoderOptions(qkv_bias=True, o_bias=False),
    read_config=read_qwen2_config,
    description="Qwen2, Qwen2.5 (and Qwen2.5-Coder/Math): q/k/v biases",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
