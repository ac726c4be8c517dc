"""Qwen3 MoE (Qwen3MoeForCausalLM) and Qwen2 MoE-style routing: softmax top-k experts, QK-norm attention."""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    DecoderConfig,
    DecoderOptions,
    Experts,
    MoE,
    Router,
    SoftmaxTopK,
    build_decoder,
    config_int,
    replace_mlps,
)


def is_moe_layer(cfg: DecoderConfig, i: int) -> bool:
    x = cfg.extra
    step = int(x.get("decoder_sparse_step", 1) or 1)
    return i not in (x.get("mlp_only_layers") or []) and config_int(x, "num_experts", "num_local_experts", default=0) > 0 and (i + 1) % step == 0


def build(cfg: DecoderConfig):
    model = build_decoder(cfg, DecoderOptions(qk_norm=True))
    x = cfg.extra
    num_experts, top_k = config_int(x, "num_experts", "num_local_experts"), config_int(x, "num_experts_per_tok")
    strategy = SoftmaxTopK(top_k, normalize=bool(x.get("norm_topk_prob", False)))

    def moe(i: int, key: str):
        if not is_moe_layer(cfg, i):
            return None
        return MoE(
            f"{key}.mlp",
            Router(f"{key}.mlp.gate", cfg.hidden_size, num_experts, strategy),
            Experts(f"{key}.mlp.experts", num_experts, cfg.hidden_size, int(x["moe_intermediate_size"]), cfg.hidden_act),
        )

    replace_mlps(model, moe)
    return model


SPEC = ArchitectureSpec(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="Qwen3 MoE (30B-A3B, 235B-A22B): softmax top-k routing, QK-norm",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
