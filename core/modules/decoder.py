"""The decoder-only transformer that most families are: layers of (norm, attention, norm, MLP).

A family describes how it differs from Llama with :class:`DecoderOptions` (tensor names and
feature flags); :func:`build_decoder` composes the shared modules. A family that is Llama with a
flag is a few lines of options, not a copy of this file.
"""
from __future__ import annotations

import attrs
import torch

from ..batch import ForwardBatch
from ..config import DecoderConfig
from .base import Module
from .layers import Attention, Embedding, GatedMLP, RMSNorm, RotaryEmbedding
from .linear import Linear


@attrs.frozen
class DecoderOptions:
    """How a family's checkpoint and forward pass differ from Llama's."""

    embed_key: str = "model.embed_tokens"
    layer_prefix: str = "model.layers"
    final_norm_key: str = "model.norm"
    lm_head_key: str = "lm_head"
    attn_name: str = "self_attn"
    mlp_name: str = "mlp"
    input_norm_name: str = "input_layernorm"
    post_attn_norm_name: str = "post_attention_layernorm"
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3, Olmo ...)
    o_bias: bool | None = None  # None: same as attention_bias
    rope_interleaved: bool = False  # GPT-J pairing instead of NeoX halves
    embed_scale: float | None = None
    final_logit_softcap: float = 0.0
    logit_scale: float = 1.0


class DecoderLayer(Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, key: str, input_norm: Module, attn: Attention, post_attn_norm: Module, mlp: Module):
        self.key = key
        self.input_norm, self.attn, self.post_attn_norm, self.mlp = input_norm, attn, post_attn_norm, mlp

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = x + self.attn.forward(self.input_norm.forward(x), batch)
        return h + self.mlp.forward(self.post_attn_norm.forward(h), batch)


class CausalLM(Module):
    """Embedding, decoder layers, final norm and LM head; ``forward(batch)`` returns float32 logits."""

    def __init__(
        self,
        config: DecoderConfig,
        embed: Embedding,
        layers: list[Module],
        norm: Module,
        lm_head: Linear,
        final_logit_softcap: float = 0.0,
        logit_scale: float = 1.0,
    ):
        self.key = ""
        self.config = config
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.final_logit_softcap, self.logit_scale = final_logit_softcap, logit_scale

    def attention_layers(self) -> list[Attention | None]:
        """Per decoder layer, the attention module that owns KV cache layer ``i`` (None: no KV cache)."""
        return [getattr(layer, "attn", None) if isinstance(getattr(layer, "attn", None), Attention) else None for layer in self.layers]

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed.forward(batch.input_ids)
        if batch.input_embeds is not None:
            emb = batch.input_embeds.to(x.dtype)
            x = emb if batch.embed_mask is None else torch.where(batch.embed_mask[:, None], emb, x)
        return x

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch)
        for layer in self.layers:
            x = layer.forward(x, batch)
        return x

    def logits_from_hidden(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]
        logits = self.lm_head.forward(self.norm.forward(x)).float()
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.final_logit_softcap > 0:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.logits_from_hidden(self.hidden_states(batch), batch)


def build_decoder(cfg: DecoderConfig, opts: DecoderOptions = DecoderOptions()) -> CausalLM:
    """Compose a Llama-style decoder from shared modules according to ``opts``."""
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, opts.rope_interleaved)
    layers: list[Module] = []
    for i in range(cfg.num_hidden_layers):
        key = f"{opts.layer_prefix}.{i}"
        attn = Attention(
            f"{key}.{opts.attn_name}",
            layer_idx=i,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            rope=rope,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias if opts.o_bias is None else opts.o_bias,
            qk_norm_eps=cfg.rms_norm_eps if opts.qk_norm else None,
        )
        mlp = GatedMLP(f"{key}.{opts.mlp_name}", cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        layers.append(
            DecoderLayer(
                key,
                RMSNorm(f"{key}.{opts.input_norm_name}", cfg.hidden_size, cfg.rms_norm_eps),
                attn,
                RMSNorm(f"{key}.{opts.post_attn_norm_name}", cfg.hidden_size, cfg.rms_norm_eps),
                mlp,
            )
        )
    head = Linear(
        opts.lm_head_key, cfg.hidden_size, cfg.vocab_size, bias=False, alt_key=opts.embed_key if cfg.tie_word_embeddings else None
    )
    return CausalLM(
        cfg,
        Embedding(opts.embed_key, cfg.vocab_size, cfg.hidden_size, opts.embed_scale),
        layers,
        RMSNorm(opts.final_norm_key, cfg.hidden_size, cfg.rms_norm_eps),
        head,
        opts.final_logit_softcap,
        opts.logit_scale,
    )
