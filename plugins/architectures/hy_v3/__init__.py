"""Tencent Hy3 (HYV3ForCausalLM): Llama attention with per-head QK-norm, and MoE layers where
``mlp_layer_types`` says "sparse": a sigmoid router steered by a correction bias (no expert groups),
top-k weights renormalised then scaled by ``router_scaling_factor``, plus always-on shared experts.

Hub names differ from DeepSeek's: ``mlp.router.gate``, ``mlp.expert_bias`` and ``mlp.shared_mlp``.
The checkpoint's MTP layers (``model.layers.{num_hidden_layers}``) are not loaded.
"""
from __future__ import annotations

import trellm
from trellm.sdk import ArchitectureSpec, DecoderConfig, DecoderOptions, build_decoder, deepseek_moe, mlp_layer_types, replace_mlps

# transformers 5 names the shared experts shared_experts (the checkpoints say shared_mlp): the names PEFT gives them
ALIASES = (("model.layers.*.mlp.shared_mlp.", ("model.layers.*.mlp.shared_experts.",)),)


def build(cfg: DecoderConfig):
    kinds = mlp_layer_types(cfg)
    model = build_decoder(cfg, DecoderOptions(qk_norm=True))
    replace_mlps(model, lambda i, key: deepseek_moe(cfg, f"{key}.mlp", shared_name="shared_mlp", router_name="router.gate",
                                                   correction_bias_name="expert_bias") if kinds[i] == "sparse" else None)
    model.aliases = ALIASES
    return model


SPEC = ArchitectureSpec(
    name="hy_v3",
    architectures=("HYV3ForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="Tencent Hy3: QK-norm, sigmoid-routed experts with a correction bias, shared experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
