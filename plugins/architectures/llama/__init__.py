"""Llama (LlamaForCausalLM): the reference dense decoder the other families build on."""
from __future__ import annotations

import trellm
from trellm.config import DecoderConfig
from trellm.modules.decoder import build_decoder
from trellm.spec import ArchitectureSpec

SPEC = ArchitectureSpec(
    name="llama",
    architectures=("LlamaForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build_decoder,
    description="Llama 1/2/3.x, SmolLM2 and other Llama-shaped checkpoints",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
