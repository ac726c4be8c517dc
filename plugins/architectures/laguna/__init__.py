"""Poolside Laguna (LagunaForCausalLM): Llama attention with per-head QK-norm, a query-head count per layer
(``num_attention_heads_per_layer``), and a softplus output gate from ``g_proj`` (one value per head, or per
channel when ``gating`` is ``"per-element"``); sliding and full layers with their own RoPE (full layers rotate
half of each head by default); MoE layers where ``mlp_layer_types`` says "sparse".

The router softcaps its logits (``moe_router_logit_softcapping``), scores them with a sigmoid, steers the
choice with a correction bias and renormalises the top k; the routed sum is scaled by
``moe_routed_scaling_factor`` and one shared expert is added. Hub names: ``mlp.experts.e_score_correction_bias``
and ``mlp.shared_expert``.
"""
from __future__ import annotations

import attrs

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    ConfigError,
    DecoderConfig,
    DecoderOptions,
    Experts,
    GatedMLP,
    MoE,
    OutputGate,
    Router,
    ScoreTopK,
    build_decoder,
    mlp_layer_types,
    read_keys,
    replace_mlps,
    text_config,
)

# transformers 5 names the shared expert shared_experts (the checkpoints say shared_expert): the names PEFT gives it
ALIASES = (("model.layers.*.mlp.shared_expert.", ("model.layers.*.mlp.shared_experts.",)),)


@attrs.frozen
class LagunaKeys:
    """The config keys Laguna reads beyond :class:`DecoderConfig`."""

    gating: bool | str = True  # True / "per-head": one gate per head; "per-element" (or False, as HF reads it): per channel
    moe_routed_scaling_factor: float = attrs.field(default=1.0, converter=float)
    moe_router_logit_softcapping: float = attrs.field(default=0.0, converter=float)
    moe_apply_router_weight_on_input: bool = attrs.field(default=False, converter=bool)

    def output_gate(self) -> OutputGate:
        if self.gating not in (True, False, "per-head", "per-element"):
            raise ConfigError(f"config.json: gating={self.gating!r}; known: true, 'per-head', 'per-element'")
        return OutputGate("softplus", per_head=self.gating in (True, "per-head"))


def read_config(raw: dict) -> DecoderConfig:
    heads = text_config(raw).get("num_attention_heads_per_layer") or ()
    return DecoderConfig.from_hf(raw, layer_heads=tuple(int(h) for h in heads))


def laguna_moe(cfg: DecoderConfig, keys: LagunaKeys, key: str) -> MoE:
    moe = cfg.require_moe()
    strategy = ScoreTopK(moe.experts_per_token, score="sigmoid", normalize=True, scaling=keys.moe_routed_scaling_factor,
                         softcap=keys.moe_router_logit_softcapping)
    router = Router(f"{key}.gate", cfg.hidden_size, moe.num_experts, strategy,
                    correction_bias_key=f"{key}.experts.e_score_correction_bias")
    experts = Experts(f"{key}.experts", moe.num_experts, cfg.hidden_size, moe.expert_width(), cfg.hidden_act)
    return MoE(key, router, experts, GatedMLP(f"{key}.shared_expert", cfg.hidden_size, moe.shared_expert_size, cfg.hidden_act))


def build(cfg: DecoderConfig):
    keys = read_keys(LagunaKeys, cfg)
    if keys.moe_apply_router_weight_on_input:
        raise ConfigError("config.json: moe_apply_router_weight_on_input=true is not supported (nor by transformers)")
    kinds = mlp_layer_types(cfg)
    model = build_decoder(cfg, DecoderOptions(qk_norm=True, output_gate=keys.output_gate(), output_gate_name="g_proj"))
    replace_mlps(model, lambda i, key: laguna_moe(cfg, keys, f"{key}.mlp") if kinds[i] == "sparse" else None)
    model.aliases = ALIASES
    return model


SPEC = ArchitectureSpec(
    name="laguna",
    architectures=("LagunaForCausalLM",),
    read_config=read_config,
    build=build,
    description="Poolside Laguna: per-layer head counts, softplus output gate, sliding/full RoPE, sigmoid-routed experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
