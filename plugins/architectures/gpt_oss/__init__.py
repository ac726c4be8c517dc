"""gpt-oss (GptOssForCausalLM): attention with learned sinks on alternating sliding/full layers, and a
top-k-then-softmax router (bias added before top-k) over stacked experts with a clamped SwiGLU."""
from __future__ import annotations

import functools

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    Attention,
    DecoderConfig,
    Experts,
    MoE,
    Router,
    TopKSoftmax,
    build_decoder,
    clamped_swiglu,
    config_int,
)


def build(cfg: DecoderConfig):
    model = build_decoder(cfg)
    x = cfg.extra
    num_experts = config_int(x, "num_local_experts", "num_experts")
    act = functools.partial(clamped_swiglu, alpha=float(x.get("swiglu_alpha", 1.702)), limit=float(x.get("swiglu_limit", 7.0)))
    for i, layer in enumerate(model.layers):
        a = layer.attn
        layer.attn = Attention(  # with learned sinks: one extra logit per head that takes mass but no value
            a.key, i, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, a.rope,
            qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, sliding_window=a.sliding_window, sinks=True,
        )
        k = f"{layer.key}.mlp"
        layer.mlp = MoE(
            k,
            Router(f"{k}.router", cfg.hidden_size, num_experts, TopKSoftmax(config_int(x, "num_experts_per_tok")), bias=True),
            Experts(f"{k}.experts", num_experts, cfg.hidden_size, cfg.intermediate_size, act, bias=True, transposed=True, interleaved=True),
        )
    return model


SPEC = ArchitectureSpec(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="gpt-oss 20b/120b: attention sinks, sliding/full layers, clamped-SwiGLU experts",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
