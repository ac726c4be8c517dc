"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): Qwen2 text with multimodal RoPE + the Qwen-VL tower.

Everything is the Qwen-VL recipe (:mod:`trellm.sdk.qwen_vl`: M-RoPE positions, the image-pad
expansion, the windowed ViT), which Qwen3-VL and GLM 4.1V reuse.
"""
from __future__ import annotations

import trellm
from trellm.sdk import ArchitectureSpec, QwenVisionLanguageModel, read_qwen_vl_config

SPEC = ArchitectureSpec(
    name="qwen2_5_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    read_config=read_qwen_vl_config,
    build=QwenVisionLanguageModel,
    description="Qwen2.5-VL: Qwen2 text with M-RoPE, dynamic-resolution windowed ViT",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
