"""Llama (LlamaForCausalLM): the reference dense decoder the other families build on.

IQuest-Coder (IQuestCoderForCausalLM) is this body with head_dim decoupled from hidden / heads, which
the config reader already takes from ``head_dim``: one more name on the spec."""
from __future__ import annotations

import trellm
from trellm.sdk import ArchitectureSpec, DecoderConfig, build_decoder

SPEC = ArchitectureSpec(
    name="llama",
    architectures=("LlamaForCausalLM", "IQuestCoderForCausalLM"),
    read_config=DecoderConfig.from_hf,
    build=build_decoder,
    description="Llama 1/2/3.x, SmolLM2, IQuest-Coder and other Llama-shaped checkpoints",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
