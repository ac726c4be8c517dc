"""GLM 4.1V (Glm4vForConditionalGeneration): GLM 4 text with M-RoPE + the GLM 4.1V tower.

The text model is GLM 4 (sandwich norms, fused gate_up, q/k/v biases) whose RoPE rotates half of
each head with GPT-J pairing; M-RoPE bands (``mrope_section``) are taken from the time / row /
column positions as in Qwen2.5-VL, whose prompt handling (``<|begin_of_image|><|image|>*N<|end_of_image|>``
and per-prompt positions with a delta) this family reuses.
"""
from __future__ import annotations

import attrs

import trellm
from trellm.sdk import (
    GLM4_OPTIONS,
    ArchitectureSpec,
    DecoderConfig,
    QwenVLConfig,
    QwenVisionLanguageModel,
    read_qwen_vl_config,
    text_config,
)


def read_text(raw: dict) -> DecoderConfig:
    """GLM 4.1V's text config leaves ``attention_bias`` (true) implicit."""
    return DecoderConfig.from_hf(raw, attention_bias=bool(text_config(raw).get("attention_bias", True)))


def read_config(raw: dict) -> QwenVLConfig:
    return read_qwen_vl_config(raw, read_text)


class Glm4vVisionLanguageModel(QwenVisionLanguageModel):
    aliases = (
        ("model.language_model.", ("model.",)),
        ("model.visual.", ("visual.",)),
    )
    text_options = attrs.evolve(
        GLM4_OPTIONS,
        embed_key="model.language_model.embed_tokens",
        layer_prefix="model.language_model.layers",
        final_norm_key="model.language_model.norm",
    )
    vision_key = "model.visual"


SPEC = ArchitectureSpec(
    name="glm4v",
    architectures=("Glm4vForConditionalGeneration",),
    read_config=read_config,
    build=Glm4vVisionLanguageModel,
    description="GLM 4.1V: GLM 4 text with M-RoPE, dynamic-resolution ViT with conv merge",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
