"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM): interleaved RoPE attention; softmax-scored experts chosen
with a correction bias (``moe_statics``), renormalised with a clamped denominator, plus shared experts,
in the layers ``moe_layer_start_index..moe_layer_end_index`` every ``moe_layer_interval``."""
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
    replace_mlps,
)


def build(cfg: DecoderConfig):
    x = cfg.extra
    bias = bool(x.get("use_bias", False))
    model = build_decoder(cfg, DecoderOptions(rope_interleaved=True, qkv_bias=bias, o_bias=bias))
    num_experts = config_int(x, "moe_num_experts", "num_experts")
    size = config_int(x, "moe_intermediate_size")
    n_shared = config_int(x, "moe_num_shared_experts", default=0)
    start = config_int(x, "moe_layer_start_index", default=0)
    end = config_int(x, "moe_layer_end_index", default=cfg.num_hidden_layers - 1)
    end = cfg.num_hidden_layers - 1 if end < 0 else end
    interval = config_int(x, "moe_layer_interval", default=1)
    strategy = ScoreTopK(config_int(x, "moe_k", "num_experts_per_tok"), score="softmax",
                         norm_eps=float(x.get("moe_norm_min", 1e-12)), norm_min=True)

    def moe(i: int, key: str):
        if not ((i + 1) % interval == 0 and start <= i <= end):
            return None
        k = f"{key}.mlp"
        return MoE(
            k,
            Router(f"{k}.gate", cfg.hidden_size, num_experts, strategy,
                   correction_bias_key=f"{k}.moe_statics.e_score_correction_bias", float32_logits=True),
            Experts(f"{k}.experts", num_experts, cfg.hidden_size, size, cfg.hidden_act, bias=bias),
            GatedMLP(f"{k}.shared_experts", cfg.hidden_size, size * n_shared, cfg.hidden_act, bias) if n_shared else None,
        )

    replace_mlps(model, moe)
    return model


SPEC = ArchitectureSpec(
    name="ernie4_5_moe",
    architectures=("Ernie4_5_MoeForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="Baidu ERNIE 4.5 MoE (21B-A3B, 300B-A47B): bias-steered softmax routing, shared experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
