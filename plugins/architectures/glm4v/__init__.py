"""GLM 4.1V (Glm4vForConditionalGeneration): GLM 4 text with M-RoPE + the GLM 4.1V tower.

The text model is GLM 4 (sandwich norms, fused gate_up, q/k/v biases) whose RoPE rotates half of
each head with GPT-J pairing; M-RoPE bands (``mrope_section``) are taken from the time / row /
column positions as in Qwen2.5-VL, whose prompt handling (``<|begin_of_image|><|image|>*N<|end_of_image|>``
and per-prompt positions with a delta) this family reuses.

GLM 4.5V (Glm4vMoeForConditionalGeneration) keeps the tower and the prompt handling and swaps the text model
for GLM 4.5 MoE's: pre-norm layers, RoPE on the first part of each head with NeoX halves, and DeepSeek-style
experts after ``first_k_dense_replace`` dense layers.
"""
from __future__ import annotations

import attrs

import trellm
from trellm.sdk import (
    GLM4_OPTIONS,
    ArchitectureSpec,
    DecoderConfig,
    DecoderOptions,
    QwenVLConfig,
    QwenVisionLanguageModel,
    build_decoder,
    read_qwen_vl_config,
    text_config,
    use_deepseek_moe_layers,
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


class Glm4vMoeVisionLanguageModel(Glm4vVisionLanguageModel):
    text_options = DecoderOptions(
        o_bias=False,
        embed_key="model.language_model.embed_tokens",
        layer_prefix="model.language_model.layers",
        final_norm_key="model.language_model.norm",
    )

    def build_language(self, cfg: QwenVLConfig):
        language = build_decoder(cfg.text, self.text_options)
        use_deepseek_moe_layers(language, cfg.text)
        return language


def read_moe_config(raw: dict) -> QwenVLConfig:
    return read_qwen_vl_config(raw, DecoderConfig.from_hf)


MOE_SPEC = ArchitectureSpec(
    name="glm4v_moe",
    architectures=("Glm4vMoeForConditionalGeneration",),
    read_config=read_moe_config,
    build=Glm4vMoeVisionLanguageModel,
    description="GLM 4.5V: GLM 4.5 MoE text with M-RoPE, the GLM 4.1V tower",
)


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
    register(MOE_SPEC)
