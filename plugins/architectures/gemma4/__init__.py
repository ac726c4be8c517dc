"""Gemma 4 text (Gemma4ForCausalLM); the model is :func:`trellm.sdk.gemma4.build_gemma4_text` (its docstring says
how Gemma 4 differs from Gemma 3), shared with Gemma 4 with images."""
from __future__ import annotations

import trellm
from trellm.sdk import ArchitectureSpec
from trellm.sdk.gemma4 import build_gemma4_text, read_gemma4_config

SPEC = ArchitectureSpec(
    name="gemma4",
    architectures=("Gemma4ForCausalLM",),
    read_config=read_gemma4_config,
    build=build_gemma4_text,
    description="Gemma 4 text: sliding/global layers of two head sizes, K=V and KV-sharing layers, per-layer inputs, MoE",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
