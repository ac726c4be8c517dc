"""NemotronH (NemotronHForCausalLM): one-mixer residual blocks, each Mamba-2, NoPE attention, a plain
(non-gated, relu^2) MLP, or an MoE of plain experts with sigmoid grouped routing, shared experts and an
optional latent projection around the routed experts."""
from __future__ import annotations

import torch
import trellm
from trellm.sdk import (
    ArchitectureSpec,
    Attention,
    ConfigError,
    DecoderConfig,
    ExpertList,
    ForwardBatch,
    HybridCausalLM,
    Linear,
    Mamba2Mixer,
    Module,
    RMSNorm,
    ResidualBlock,
    Router,
    ScoreTopK,
    activation_fn,
    config_int,
    dispatch_experts,
    text_config,
)

BLOCK_TYPES = ("linear_attention", "full_attention", "mlp", "moe")
# transformers 5's NemotronHForCausalLM nests the blocks as model.layers (its checkpoints keep backbone.*): the names
# PEFT gives adapters trained on it
ALIASES = (("backbone.", ("model.",)),)


class PlainMLP(Module):
    """down(act(up(x))), no gate."""

    def __init__(self, key: str, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        self.key, self.act = key, activation_fn(activation)
        self.up_proj = Linear(f"{key}.up_proj", hidden_size, intermediate_size, bias)
        self.down_proj = Linear(f"{key}.down_proj", intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronMoE(Module):
    """Routed plain experts (in a latent space when ``latent_size``) plus shared experts."""

    def __init__(self, key: str, cfg: DecoderConfig):
        x = cfg.extra
        hidden, act = cfg.hidden_size, str(x.get("mlp_hidden_act", "relu2"))
        num_experts = config_int(x, "n_routed_experts", "num_local_experts")
        latent = x.get("moe_latent_size")
        strategy = ScoreTopK(
            config_int(x, "num_experts_per_tok"), score="sigmoid", normalize=bool(x.get("norm_topk_prob", True)),
            scaling=float(x.get("routed_scaling_factor", 1.0) or 1.0),
            num_groups=config_int(x, "n_group", default=1), topk_groups=config_int(x, "topk_group", default=1),
        )
        self.key = key
        self.router = Router(f"{key}.gate", hidden, num_experts, strategy,
                             correction_bias_key=f"{key}.gate.e_score_correction_bias", float32_logits=True)
        dim = int(latent) if latent else hidden
        self.experts = ExpertList(f"{key}.experts", num_experts, dim, config_int(x, "moe_intermediate_size"), act, gated=False)
        self.fc1_latent_proj = Linear(f"{key}.fc1_latent_proj", hidden, dim) if latent else None
        self.fc2_latent_proj = Linear(f"{key}.fc2_latent_proj", dim, hidden) if latent else None
        self.shared_experts = PlainMLP(f"{key}.shared_experts", hidden, config_int(x, "moe_shared_expert_intermediate_size"), act)

    def forward(self, h: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        weights, ids = self.router.forward(h)
        z = self.fc1_latent_proj(h) if self.fc1_latent_proj is not None else h
        routed = dispatch_experts(self.experts, z, weights, ids)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts.forward(h)


def read_config(raw: dict) -> DecoderConfig:
    c = text_config(raw)
    types = tuple(c.get("layers_block_type") or c.get("layer_types") or ())
    if c.get("num_hidden_layers") is None:  # newer configs derive it from the block list
        raw = {**raw, "num_hidden_layers": len(types)}
    return DecoderConfig.from_hf(raw, rms_norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), layer_types=types)


def build(cfg: DecoderConfig) -> HybridCausalLM:
    x = cfg.extra
    hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
    types = list(cfg.layer_types)
    if len(types) != cfg.num_hidden_layers or set(types) - set(BLOCK_TYPES):
        raise ConfigError(f"config.json: layers_block_type {types} must name one of {BLOCK_TYPES} for each layer")
    layers: list[Module] = []
    for i, kind in enumerate(types):
        key = f"backbone.layers.{i}"
        m = f"{key}.mixer"
        if kind == "linear_attention":
            mixer: Module = Mamba2Mixer(
                m, i, hidden, config_int(x, "mamba_num_heads"), config_int(x, "mamba_head_dim"),
                config_int(x, "ssm_state_size"), config_int(x, "n_groups"), config_int(x, "conv_kernel", default=4), eps,
                conv_bias=bool(x.get("use_conv_bias", True)), proj_bias=bool(x.get("use_bias", False)),
                dt_min=float(x.get("time_step_min", 0.0)), chunk_size=config_int(x, "chunk_size", default=64),
            )
        elif kind == "full_attention":
            mixer = Attention(m, i, hidden, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, None,
                              cfg.attention_bias, cfg.attention_bias)
        elif kind == "mlp":
            mixer = PlainMLP(m, hidden, cfg.intermediate_size, str(x.get("mlp_hidden_act", "relu2")), bool(x.get("mlp_bias", False)))
        else:
            mixer = NemotronMoE(m, cfg)
        layers.append(ResidualBlock(key, RMSNorm(f"{key}.norm", hidden, eps), mixer))
    return HybridCausalLM.from_layers(cfg, layers, "backbone.embeddings", "backbone.norm_f", aliases=ALIASES)


SPEC = ArchitectureSpec(
    name="nemotron_h",
    architectures=("NemotronHForCausalLM",),
    read_config=read_config,
    build=build,
    description="NVIDIA Nemotron-H / Nemotron 3 Nano: Mamba-2 + attention + (MoE) MLP blocks",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
