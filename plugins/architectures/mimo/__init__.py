"""Xiaomi MiMo (MiMoForCausalLM): Qwen2 with multi-token-prediction layers (``model.mtp_layers.0``).

The main model is Qwen2's (q/k/v biases). The MTP layer loads as ``model.mtp`` and drafts through
``trellm.generator.mtp`` like Qwen3.5's head, with MiMo's names and order: ``hidden_layernorm(h)`` and
``token_layernorm(embed(t))`` joined as ``[hidden | embedding]``, ``input_proj``, a Qwen2 decoder layer
whose tensors sit directly under ``model.mtp_layers.0``, and ``final_layernorm``. The checkpoint ships
remote code only (not in transformers): its main model is checked against transformers' Qwen2, its MTP
head against a reference written from that description.
"""
from __future__ import annotations

import attrs
import trellm
from trellm.sdk import ArchitectureSpec, DecoderConfig, DecoderOptions, MTPHead, MTPLayout, build_decoder

MIMO_MTP = MTPLayout(embedding_norm="token_layernorm", hidden_norm="hidden_layernorm", fc="input_proj",
                     output_norm="final_layernorm", hidden_first=True, unit_offset=False)
QWEN2 = DecoderOptions(qkv_bias=True, o_bias=False)


def build(cfg: DecoderConfig):
    model = build_decoder(cfg, QWEN2)
    # The MTP decoder layer is a one-layer Qwen2 stack's layer, keyed under mtp_layers (its own KV layer 0).
    mtp_stack = build_decoder(attrs.evolve(cfg, num_hidden_layers=1), attrs.evolve(QWEN2, layer_prefix="model.mtp_layers"))
    model.mtp = MTPHead("model.mtp_layers.0", cfg.hidden_size, cfg.rms_norm_eps, mtp_stack.layers[0], MIMO_MTP)
    return model


SPEC = ArchitectureSpec(
    name="mimo",
    architectures=("MiMoForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="Xiaomi MiMo: Qwen2 body with an MTP layer that drafts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
