"""gpt-oss (GptOssForCausalLM): attention with learned sinks on alternating sliding/full layers, and a
top-k-then-softmax router (bias added before top-k) over stacked experts with a clamped SwiGLU."""
from __future__ import annotations

import functools

import torch
import trellm
from trellm.sdk import (
    ArchitectureSpec,
    Attention,
    DecoderConfig,
    Experts,
    ForwardBatch,
    LoadContext,
    MoE,
    Router,
    TopKSoftmax,
    build_decoder,
    clamped_swiglu,
    config_int,
    ops,
)


class SinkAttention(Attention):
    """Attention whose softmax has one extra learned logit per head (``{key}.sinks``) that takes mass but no value."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sinks: torch.Tensor | None = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        self.sinks = ctx.store.get(f"{self.key}.sinks", shape=(self.num_heads,), dtype=torch.float32, device=ctx.device)

    def unload(self) -> None:
        super().unload()
        self.sinks = None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        cos, sin = self.rope.cos_sin(batch.positions, batch.max_seq_len)
        q = ops.rotary_embedding(q, cos, sin, self.rope.interleaved)
        k = ops.rotary_embedding(k, cos, sin, self.rope.interleaved)
        if batch.cache is None:
            o = ops.attention_varlen(q, k, v, batch.cu_seqlens, self.scale, self.sliding_window, self.softcap, self.sinks)
        else:
            layer = batch.cache.layers[self.layer_idx]
            layer.store(k, v, batch.slots)
            o = layer.attend(q, batch, self.scale, self.sliding_window, self.softcap, self.sinks)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


def build(cfg: DecoderConfig):
    model = build_decoder(cfg)
    x = cfg.extra
    num_experts = config_int(x, "num_local_experts", "num_experts")
    act = functools.partial(clamped_swiglu, alpha=float(x.get("swiglu_alpha", 1.702)), limit=float(x.get("swiglu_limit", 7.0)))
    for i, layer in enumerate(model.layers):
        a = layer.attn
        layer.attn = SinkAttention(
            a.key, i, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, a.rope,
            qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, sliding_window=a.sliding_window,
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
