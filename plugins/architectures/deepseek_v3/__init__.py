"""DeepSeek V3 (DeepseekV3ForCausalLM): multi-head latent attention (MLA) and sigmoid-routed grouped experts.

MLA caches one latent per token, not per-head keys and values: the normalised compressed KV
``c`` [kv_lora_rank] and the shared rotary key ``k_pe`` [qk_rope_head_dim]. Attention runs in the
absorbed form: the per-head key up-projection is folded into the query (q_nope W_uk) and the value
up-projection is applied after attention, so every head attends to the same single-"head" latent,
MQA-style. The paged cache therefore holds K = [c | k_pe] and V = c for one KV head, and the shared
paged-attention op serves prefill and decode unchanged.
"""
from __future__ import annotations

import math

import torch
import trellm
from trellm.sdk import (
    ArchitectureSpec,
    Attention,
    DecoderConfig,
    ForwardBatch,
    Linear,
    LinearGroup,
    LoadContext,
    RMSNorm,
    RotaryEmbedding,
    build_decoder,
    config_int,
    ops,
    use_deepseek_moe_layers,
)


def _yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


class LatentAttention(Attention):
    """Multi-head latent attention; an :class:`Attention` to the cache (``kv_shape`` = one latent head)."""

    def __init__(self, key: str, layer_idx: int, cfg: DecoderConfig, rope: RotaryEmbedding, interleaved: bool):
        x = cfg.extra
        self.key, self.layer_idx, self.rope, self.interleaved = key, layer_idx, rope, interleaved
        self.num_heads = self.num_kv_heads = cfg.num_attention_heads
        self.q_lora_rank = x.get("q_lora_rank")
        self.kv_lora_rank = config_int(x, "kv_lora_rank")
        self.nope_dim, self.rope_dim = config_int(x, "qk_nope_head_dim"), config_int(x, "qk_rope_head_dim")
        self.v_dim = config_int(x, "v_head_dim")
        self.head_dim = self.nope_dim + self.rope_dim
        self.sliding_window, self.softcap = 0, 0.0
        h, hidden, bias = self.num_heads, cfg.hidden_size, cfg.attention_bias
        if self.q_lora_rank:
            self.q_a_proj = Linear(f"{key}.q_a_proj", hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(f"{key}.q_a_layernorm", self.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(f"{key}.q_b_proj", self.q_lora_rank, h * self.head_dim)
        else:
            self.q_proj = Linear(f"{key}.q_proj", hidden, h * self.head_dim)
        self.kv_a_proj_with_mqa = Linear(f"{key}.kv_a_proj_with_mqa", hidden, self.kv_lora_rank + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(f"{key}.kv_a_layernorm", self.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(f"{key}.kv_b_proj", self.kv_lora_rank, h * (self.nope_dim + self.v_dim))
        # the two projections of x: one kernel launch where the format groups them (EXL3)
        self.x_proj = LinearGroup(self.q_a_proj if self.q_lora_rank else self.q_proj, self.kv_a_proj_with_mqa)
        self.o_proj = Linear(f"{key}.o_proj", h * self.v_dim, hidden, bias)
        self.scale = self.head_dim**-0.5
        rp = cfg.rope
        if rp.type != "default" and rp.mscale_all_dim:
            self.scale *= _yarn_mscale(rp.factor, rp.mscale_all_dim) ** 2
        self.w_uk = self.w_uv = None

    def kv_shape(self) -> tuple[int, int, int]:
        return 1, self.kv_lora_rank + self.rope_dim, self.kv_lora_rank

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        w = self.kv_b_proj.impl.dense_weight().to(ctx.dtype).view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope_dim].contiguous()  # [H, nope, r]
        self.w_uv = w[:, self.nope_dim :].contiguous()  # [H, v, r]

    def unload(self) -> None:
        super().unload()
        self.w_uk = self.w_uv = None

    def attention(self, x, batch: ForwardBatch) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        q, kv = ops.project(x, self.x_proj.weights())
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm.forward(q))
        q_nope, q_pe = q.view(t, h, self.head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm.forward(c)
        cos, sin = self.rope.cos_sin(batch.positions, batch.max_seq_len)
        q_pe = ops.rotary_embedding(q_pe, cos, sin, self.interleaved)
        k_pe = ops.rotary_embedding(k_pe[:, None], cos, sin, self.interleaved)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)
        q = torch.cat([q_latent, q_pe], dim=-1)
        k = torch.cat([c[:, None], k_pe], dim=-1)
        v = c[:, None]
        if batch.cache is None:
            o = ops.attention_varlen(q, k, v, batch.cu_seqlens, self.scale)
        else:
            layer = batch.cache.layers[self.layer_idx]
            layer.store(k, v, batch.slots)
            o = layer.attend(q, batch, self.scale)
        o = torch.einsum("thr,hvr->thv", o, self.w_uv)
        return o.reshape(t, h * self.v_dim)


def build(cfg: DecoderConfig):
    model = build_decoder(cfg)
    x = cfg.extra
    interleaved = bool(x.get("rope_interleave", True))
    rope = RotaryEmbedding(cfg.rope, config_int(x, "qk_rope_head_dim"), cfg.max_position_embeddings)
    for i, layer in enumerate(model.layers):
        layer.attn = LatentAttention(f"{layer.key}.self_attn", i, cfg, rope, interleaved)
    use_deepseek_moe_layers(model, cfg)
    return model


SPEC = ArchitectureSpec(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    read_config=DecoderConfig.from_hf,
    build=build,
    description="DeepSeek V3 / R1 (and Kimi K2-shaped checkpoints): MLA with a latent KV cache, grouped sigmoid routing",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
