"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama with q/k/v biases (no o_proj bias)."""
from __future__ import annotations

import trellm
from trellm.sdk import DecoderConfig, DecoderOptions, decoder_family, text_config


def read_config(raw: dict) -> DecoderConfig:
    """Qwen configs keep ``sliding_window`` even when ``use_sliding_window`` is false: honour the flag."""
    c = text_config(raw)
    if c.get("layer_types"):
        return DecoderConfig.from_hf(raw)
    if not c.get("use_sliding_window", False) or not c.get("sliding_window"):
        return DecoderConfig.from_hf(raw, sliding_window=0)
    first = int(c.get("max_window_layers", 0))
    n = int(c["num_hidden_layers"])
    return DecoderConfig.from_hf(raw, layer_types=tuple("sliding_attention" if i >= first else "full_attention" for i in range(n)))


SPEC = decoder_family(
    "qwen2",
    ("Qwen2ForCausalLM",),
    DecoderOptions(qkv_bias=True, o_bias=False),
    read_config=read_config,
    description="Qwen2, Qwen2.5 (and Qwen2.5-Coder/Math): q/k/v biases",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
