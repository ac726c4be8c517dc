"""Tencent Hy3 (HYV3ForCausalLM): Llama attention with per-head QK-norm, and MoE layers where
``mlp_layer_types`` says "sparse": a sigmoid router steered by a correction bias (no expert groups),
top-k weights renormalised then scaled by ``router_scaling_factor``, plus always-on shared experts.

Hub names differ from DeepSeek's: ``mlp.router.gate``, ``mlp.expert_bias`` and ``mlp.shared_mlp``.
The checkpoint's MTP layers (``model.layers.{num_hidden_layers}``) are not loaded.
"""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    DecoderConfig,
    DecoderOptions,
    Experts,
    GatedMLP,
    MoE,
    Router,
    ScoreTopK,
    build_decoder,
    config_int,
    mlp_layer_types,
    replace_mlps,
)


def hy_v3_moe(cfg: DecoderConfig, key: str) -> MoE:
    x = cfg.extra
    num_experts = config_int(x, "num_experts", "num_local_experts")
    size = config_int(x, "moe_intermediate_size")
    strategy = ScoreTopK(config_int(x, "num_experts_per_tok"), score="sigmoid", normalize=True,
                         scaling=float(x.get("router_scaling_factor", 1.0)))
    router = Router(f"{key}.router.gate", cfg.hidden_size, num_experts, strategy,
                    correction_bias_key=f"{key}.expert_bias", float32_logits=True)
    n_shared = config_int(x, "num_shared_experts", default=0)
    shared = GatedMLP(f"{key}.shared_mlp", cfg.hidden_size, size * n_shared, cfg.hidden_act) if n_shared else None
    return MoE(key, router, Experts(f"{key}.experts", num_experts, cfg.hidden_size, size, cfg.hidden_act), shared)


def build(cfg: DecoderConfig):
    kinds = mlp_layer_types(cfg)
    model = build_decoder(cfg, DecoderOptions(qk_norm=True))
    replace_mlps(model, lambda i, key: hy_v3_moe(cfg, f"{key}.mlp") if kinds[i] == "sparse" else None)
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
