"""Qwen3 (Qwen3ForCausalLM): Llama with RMSNorm on each head of q and k."""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderOptions, decoder_family
from trellm.plugins.architectures.qwen2 import read_config

SPEC = decoder_family(
    "qwen3",
    ("Qwen3ForCausalLM",),
    DecoderOptions(qk_norm=True),
    read_config=read_config,
    description="Qwen3 dense models: per-head QK-norm",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
