"""Mixtral (MixtralForCausalLM): Llama attention, every MLP a softmax top-k mixture of w1/w3/w2 experts."""
from __future__ import annotations

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    DecoderConfig,
    Experts,
    MoE,
    Router,
    SoftmaxTopK,
    build_decoder,
    replace_mlps,
)

# transformers 5 names the MoE block mlp (its checkpoints say block_sparse_moe): the names PEFT gives adapters on it
ALIASES = (("model.layers.*.block_sparse_moe.", ("model.layers.*.mlp.",)),)


def build(cfg: DecoderConfig):
    model = build_decoder(cfg)
    moe_cfg = cfg.require_moe()
    num_experts = moe_cfg.num_experts
    strategy = SoftmaxTopK(moe_cfg.experts_per_token, normalize=True)

    def moe(i: int, key: str):
        k = f"{key}.block_sparse_moe"
        return MoE(
            k,
            Router(f"{k}.gate", cfg.hidden_size, num_experts, strategy),
            Experts(f"{k}.experts", num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, names=("w1", "w3", "w2")),
        )

    replace_mlps(model, moe)
    model.aliases = ALIASES
    return model


SPEC = ArchitectureSpec(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="Mixtral 8x7B / 8x22B: softmax top-2 experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
