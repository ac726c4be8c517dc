"""MiniMax-M2 (MiniMaxM2ForCausalLM): QK-norm over all heads at once, partial RoPE, and sigmoid-scored
w1/w3/w2 experts chosen with a correction bias and renormalised."""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    DecoderConfig,
    DecoderOptions,
    Experts,
    MoE,
    Router,
    ScoreTopK,
    build_decoder,
    replace_mlps,
)

# transformers 5 names the MoE block mlp (its checkpoints say block_sparse_moe): the names PEFT gives adapters on it
ALIASES = (("model.layers.*.block_sparse_moe.", ("model.layers.*.mlp.",)),)


def build(cfg: DecoderConfig):
    model = build_decoder(cfg, DecoderOptions(qk_norm=True, qk_norm_kind="full"))
    moe_cfg = cfg.require_moe()
    num_experts = moe_cfg.num_experts
    strategy = ScoreTopK(moe_cfg.experts_per_token, score="sigmoid", normalize=True)

    def moe(i: int, key: str):
        k = f"{key}.block_sparse_moe"
        return MoE(
            k,
            Router(f"{k}.gate", cfg.hidden_size, num_experts, strategy, correction_bias_key=f"{k}.e_score_correction_bias"),
            Experts(f"{k}.experts", num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, names=("w1", "w3", "w2")),
        )

    replace_mlps(model, moe)
    model.aliases = ALIASES
    return model


SPEC = ArchitectureSpec(
    name="minimax_m2",
    architectures=("MiniMaxM2ForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="MiniMax-M2: full-width QK-norm, sigmoid routing with correction bias",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
