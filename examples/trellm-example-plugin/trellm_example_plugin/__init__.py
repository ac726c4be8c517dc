"""An example architecture plugin, installed like any third-party one (``pip install``).

It serves ``ExampleLlamaForCausalLM``: a Llama whose checkpoint stores its tensors under
``backbone.*`` instead of ``model.*``. Everything a family needs is one ArchitectureSpec built from
trellm's shared decoder with different tensor names.
"""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderConfig, DecoderOptions, build_decoder

OPTIONS = DecoderOptions(
    embed_key="backbone.embed",
    layer_prefix="backbone.blocks",
    final_norm_key="backbone.final_norm",
    lm_head_key="head",
)

SPEC = trellm.ArchitectureSpec(
    name="example-llama",
    architectures=("ExampleLlamaForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=lambda config: build_decoder(config, OPTIONS),
    description="example third-party plugin: Llama with backbone.* tensor names",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
