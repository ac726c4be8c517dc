"""Qwen3 (Qwen3ForCausalLM): Llama with RMSNorm on each head of q and k."""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderOptions, decoder_family, read_qwen2_config

SPEC = decoder_family(
    "qwen3",
    ("Qwen3ForCausalLM",),
    DecoderOptions(qk_norm=True),
    read_config=read_qwen2_config,
    description="Qwen3 dense models: per-head QK-norm",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
