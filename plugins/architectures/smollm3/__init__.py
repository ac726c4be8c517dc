"""SmolLM3 (SmolLM3ForCausalLM): Llama where every few layers skip RoPE (NoPE).

``no_rope_layers`` holds 1 for layers that rotate and 0 for NoPE layers.
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import ConfigError, DecoderConfig, decoder_family, read_qwen2_config, text_config


def read_config(raw: dict) -> DecoderConfig:
    c = text_config(raw)
    n = int(c["num_hidden_layers"])
    flags = c.get("no_rope_layers")
    if flags is None:
        interval = int(c.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise ConfigError(f"config.json: no_rope_layers has {len(flags)} entries for {n} layers")
    cfg = attrs.evolve(read_qwen2_config(raw), nope_layers=tuple(i for i, rotate in enumerate(flags) if not rotate))
    cfg.validate_layers()
    return cfg


SPEC = decoder_family("smollm3", ("SmolLM3ForCausalLM",), read_config=read_config,
                      description="SmolLM3: Llama with NoPE layers")


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
