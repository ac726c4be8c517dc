"""The Gemma 4 language model (Gemma4ForCausalLM, and the text half of Gemma4ForConditionalGeneration):
Gemma 3's sandwich-normed block with these differences.

- Attention: softmax scale 1; q/k RMS-normed per head (plain weights, not 1 + w) and v normed without a
  weight. Global (full) layers have their own head size (``global_head_dim``) and KV heads, and RoPE of type
  "proportional" (only the first quarter of the frequencies turn); with ``attention_k_eq_v`` they have no
  v_proj: the values are the keys before their norm and RoPE.
- KV sharing: the last ``num_kv_shared_layers`` layers make only queries and attend over the keys and values
  of the last earlier layer of their kind (:class:`SharedKVAttention`); their MLP is twice as wide with
  ``use_double_wide_mlp``.
- Per-layer inputs (``hidden_size_per_layer_input``, the E2B/E4B models): a second embedding table gives each
  token a small vector per layer, mixed with a projection of the token's embedding; after its MLP each layer
  adds ``norm(up(act(gate(h)) * that vector))``. Every layer's output is multiplied by its ``layer_scalar``.
- MoE (``enable_moe_block``, 26B-A4B): beside the dense MLP, experts on the same residual input with their own
  norms; the router RMS-normalises its input, scales it by ``router.scale`` / sqrt(hidden), takes the softmax
  top-k, renormalises and multiplies by ``per_expert_scale``.

Configs written by transformers 5 give the global layers' shapes in ``per_layer_config``; the hub's spell them
``global_head_dim`` / ``num_global_key_value_heads``; both are read.
"""
from __future__ import annotations

import math

import attrs
import torch

from trellm import ops
from trellm.batch import ForwardBatch
from trellm.config import DecoderConfig, read_keys, text_config
from trellm.distributed.sharding import SpreadExperts, layer_name, rank_range, shard_attention, shard_mlp, split_columns, split_rows
from trellm.errors import ConfigError
from trellm.modules.base import LoadContext, Module
from trellm.modules.decoder import CausalLM, DecoderLayer
from trellm.modules.layers import Attention, Embedding, GatedMLP, RMSNorm, RotaryEmbedding
from trellm.modules.linear import Linear
from trellm.modules.moe import Experts, Router, SoftmaxTopK, dispatch_experts
from trellm.ops.dense import activation_fn
from trellm.sdk.vision import attend_image_blocks


@attrs.frozen
class Gemma4Keys:
    """The config keys Gemma 4 text reads beyond :class:`DecoderConfig`."""

    global_head_dim: int = attrs.field(default=512, converter=int)
    num_global_key_value_heads: int | None = attrs.field(default=None, converter=attrs.converters.optional(int))
    attention_k_eq_v: bool = attrs.field(default=False, converter=bool)
    num_kv_shared_layers: int = attrs.field(default=0, converter=int)
    use_double_wide_mlp: bool = attrs.field(default=False, converter=bool)
    hidden_size_per_layer_input: int = attrs.field(default=0, converter=int)
    vocab_size_per_layer_input: int | None = attrs.field(default=None, converter=attrs.converters.optional(int))
    enable_moe_block: bool = attrs.field(default=False, converter=bool)
    num_experts: int = attrs.field(default=0, converter=int)
    top_k_experts: int = attrs.field(default=0, converter=int)
    moe_intermediate_size: int = attrs.field(default=0, converter=int)
    final_logit_softcapping: float = attrs.field(default=0.0, converter=float)
    per_layer_config: dict = attrs.field(factory=dict)
    use_bidirectional_attention: str | None = None  # "vision": image rows see their whole image (below)
    model_type: str = ""  # "gemma4_unified_text": on every layer, beyond the sliding window


@attrs.frozen
class LayerShape:
    """One layer's attention geometry and, for a KV-sharing layer, the layer whose keys and values it reads."""

    head_dim: int
    kv_heads: int
    kv_source: int | None = None


def read_gemma4_config(raw: dict) -> DecoderConfig:
    c = text_config(raw)
    if c.get("use_bidirectional_attention") == "all":
        raise ConfigError("config.json: use_bidirectional_attention='all' is an encoder; trellm serves causal LMs")
    return DecoderConfig.from_hf(raw)


def layer_shapes(cfg: DecoderConfig, keys: Gemma4Keys) -> list[LayerShape]:
    """Per layer: head size and KV heads (global layers differ), and where KV-sharing layers read K/V."""
    n = cfg.num_hidden_layers
    overrides = {int(i): v for i, v in keys.per_layer_config.items()}
    shapes = []
    for i in range(n):
        if overrides or cfg.layer_type(i) != "full_attention":
            o = overrides.get(i, {})
            shape = LayerShape(int(o.get("head_dim", cfg.head_dim)), int(o.get("num_key_value_heads", cfg.num_key_value_heads)))
        else:
            kv = keys.num_global_key_value_heads if keys.attention_k_eq_v and keys.num_global_key_value_heads else None
            shape = LayerShape(keys.global_head_dim, kv or cfg.num_key_value_heads)
        if cfg.num_attention_heads % shape.kv_heads:
            raise ConfigError(f"config.json: layer {i} has {shape.kv_heads} KV heads, which do not divide "
                              f"num_attention_heads ({cfg.num_attention_heads})")
        shapes.append(shape)
    first_shared = n - keys.num_kv_shared_layers
    if not 0 <= keys.num_kv_shared_layers < n:
        raise ConfigError(f"config.json: num_kv_shared_layers={keys.num_kv_shared_layers} leaves no layer that makes "
                          f"keys and values (of {n})")
    for i in range(first_shared, n):
        kind = cfg.layer_type(i)
        sources = [j for j in range(first_shared) if cfg.layer_type(j) == kind]
        if not sources:
            raise ConfigError(f"config.json: layer {i} ({kind}) shares keys and values, but no earlier layer of that kind makes them")
        shapes[i] = attrs.evolve(shapes[sources[-1]], kv_source=sources[-1])
    return shapes


@attrs.define
class SharedKV:
    """The rotated keys and values a layer made in the current cacheless forward pass, for the layers that
    reuse them (with a cache they read its pages instead)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None


def has_image_rows(batch: ForwardBatch) -> bool:
    return batch.embed_mask is not None and bool(batch.embed_mask.any())


class Gemma4Attention(Attention):
    """:class:`Attention` that hands its rotated keys and values to the later layers reusing them (``shared``)
    when they cannot read them from the cache: a cacheless pass, or image rows to recompute; with
    ``image_blocks``, image rows also see their whole image (:func:`~trellm.sdk.attend_image_blocks`)."""

    shared: SharedKV | None = None
    image_blocks = False
    window_cuts_images = True

    def attention(self, x, batch: ForwardBatch) -> torch.Tensor:
        images = self.image_blocks and has_image_rows(batch)
        if not images and (self.shared is None or batch.cache is not None):
            return super().attention(x, batch)
        q, k, v = self.project_qkv(x)
        o = self.attend(q, k, v, batch)
        q, k = self.rotate(q, batch), self.rotate(k, batch)
        if self.shared is not None:
            self.shared.k, self.shared.v = k, v
        if images:
            layer = batch.cache.layers[self.layer_idx] if batch.cache is not None else None
            attend_image_blocks(o, q, k, v, batch, layer, self.scale, self.sliding_window, 0.0, self.window_cuts_images)
        return o.reshape(x.shape[0], self.num_heads * self.head_dim)

    def split_over_ranks(self, comm) -> None:
        """Tensor parallel: by heads, as any :class:`Attention` (a K=V layer's key heads are its values too). The
        KV-sharing layers reading this layer's keys split their queries alike, so each finds its KV heads here."""
        shard_attention(self, comm)


class SharedKVAttention(Module):
    """Attention of a KV-sharing layer: its own queries over the keys and values of layer ``source``
    (its cache pages, or ``shared`` in a cacheless pass). It stores nothing in the cache."""

    def __init__(self, key: str, source: int, shared: SharedKV, hidden_size: int, num_heads: int, head_dim: int,
                 rope: RotaryEmbedding, eps: float, sliding_window: int, image_blocks: bool = False,
                 window_cuts_images: bool = True):
        self.key, self.source, self.shared, self.image_blocks = key, source, shared, image_blocks
        self.window_cuts_images = window_cuts_images
        self.num_heads, self.head_dim, self.rope, self.sliding_window = num_heads, head_dim, rope, sliding_window
        self.q_proj = Linear(f"{key}.q_proj", hidden_size, num_heads * head_dim)
        self.q_norm = RMSNorm(f"{key}.q_norm", head_dim, eps)
        self.o_proj = Linear(f"{key}.o_proj", num_heads * head_dim, hidden_size)

    @property
    def cache_source(self) -> int:
        """The layer whose cache pages this one reads (ReadsEarlierCache: a layer split keeps them on one device)."""
        return self.source

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm.forward(self.q_proj(x).reshape(t, self.num_heads, self.head_dim))
        cos, sin = self.rope.cos_sin(batch.positions, batch.max_seq_len)
        q = ops.rotary_embedding(q, cos, sin, self.rope.interleaved)
        layer = batch.cache.layers[self.source] if batch.cache is not None else None
        if layer is None:
            o = ops.attention_varlen(q, self.shared.k, self.shared.v, batch.cu_seqlens, 1.0, self.sliding_window)
        else:
            o = layer.attend(q, batch, 1.0, self.sliding_window)
        if self.image_blocks and has_image_rows(batch):
            attend_image_blocks(o, q, self.shared.k, self.shared.v, batch, layer, 1.0, self.sliding_window, 0.0,
                                self.window_cuts_images)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))

    def split_over_ranks(self, comm) -> None:
        """Tensor parallel: this rank's query heads (q_proj columns, o_proj rows, all-reduced), the same contiguous
        block :func:`~trellm.distributed.sharding.head_shard` gives the source layer, so they read the KV heads that
        layer keeps on this rank (a replicated one included)."""
        h0, h1 = rank_range(self.num_heads, comm, f"{layer_name(self)}: attention heads")
        split_columns(self.q_proj, h0 * self.head_dim, h1 * self.head_dim)
        split_rows(self.o_proj, h0 * self.head_dim, h1 * self.head_dim, comm)
        self.num_heads = h1 - h0


class Gemma4Router(Router):
    """Softmax top-k over ``proj`` of the RMS-normed input times ``scale`` / sqrt(hidden); the renormalised
    weights are multiplied by each chosen expert's ``per_expert_scale``."""

    def __init__(self, key: str, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__(f"{key}.proj", hidden_size, num_experts, SoftmaxTopK(top_k, normalize=True))
        self.prefix, self.hidden_size = key, hidden_size
        self.norm = RMSNorm(f"{key}.norm", hidden_size, eps, has_weight=False)
        self.scale = self.per_expert_scale = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        get = ctx.store.get
        self.scale = get(f"{self.prefix}.scale", shape=(self.hidden_size,), dtype=ctx.dtype, device=ctx.device)
        self.per_expert_scale = get(f"{self.prefix}.per_expert_scale", shape=(self.num_experts,), dtype=torch.float32,
                                    device=ctx.device)

    def unload(self) -> None:
        super().unload()
        self.scale = self.per_expert_scale = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.norm.forward(x) * self.scale * self.hidden_size**-0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().forward(x)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Feedforward(Module):
    """The MoE layer's feed-forward: ``post_1(mlp(pre(x))) + post_2(experts(pre_2(x)))`` routed on x itself."""

    def __init__(self, key: str, cfg: DecoderConfig, keys: Gemma4Keys, mlp: GatedMLP):
        norm = lambda name: RMSNorm(f"{key}.{name}", cfg.hidden_size, cfg.rms_norm_eps)
        self.key, self.mlp = key, mlp
        self.pre_norm, self.post_norm_1 = norm("pre_feedforward_layernorm"), norm("post_feedforward_layernorm_1")
        self.pre_norm_2, self.post_norm_2 = norm("pre_feedforward_layernorm_2"), norm("post_feedforward_layernorm_2")
        self.router = Gemma4Router(f"{key}.router", cfg.hidden_size, keys.num_experts, keys.top_k_experts, cfg.rms_norm_eps)
        self.experts = Experts(f"{key}.experts", keys.num_experts, cfg.hidden_size, keys.moe_intermediate_size, cfg.hidden_act)
        self.comm = None  # tensor parallel: the group the spread experts' parts are summed over

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        dense = self.post_norm_1.forward(self.mlp.forward(self.pre_norm.forward(x)))
        if self.comm is None:
            routed = dispatch_experts(self.experts, self.pre_norm_2.forward(x), *self.router.forward(x))
        else:
            routed = self.comm.all_reduce(self.experts.dispatch(self.pre_norm_2.forward(x), *self.router.forward(x)))
        return dense + self.post_norm_2.forward(routed)

    def split_over_ranks(self, comm) -> None:
        """Tensor parallel: the dense MLP by columns, the experts spread over the ranks; each part is all-reduced
        before its own output norm (two all-reduces: the norms of the two sums cannot share one)."""
        shard_mlp(self.mlp, comm)
        self.experts, self.comm = SpreadExperts(self.experts, comm, self.key), comm


class Gemma4DecoderLayer(DecoderLayer):
    """The sandwich-normed block, then (with per-layer inputs) ``h + norm(up(act(gate(h)) * input))``, then
    the whole output times ``layer_scalar``."""

    def __init__(self, key: str, cfg: DecoderConfig, per_layer_size: int, *block, **kwargs):
        super().__init__(key, *block, **kwargs)
        self.per_layer_size = per_layer_size
        if per_layer_size:
            self.per_layer_input_gate = Linear(f"{key}.per_layer_input_gate", cfg.hidden_size, per_layer_size)
            self.per_layer_projection = Linear(f"{key}.per_layer_projection", per_layer_size, cfg.hidden_size)
            self.post_per_layer_input_norm = RMSNorm(f"{key}.post_per_layer_input_norm", cfg.hidden_size, cfg.rms_norm_eps)
            self.act = activation_fn(cfg.hidden_act)
        self.layer_scalar = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        self.layer_scalar = ctx.store.get(f"{self.key}.layer_scalar", shape=(1,), dtype=ctx.dtype, device=ctx.device)

    def unload(self) -> None:
        super().unload()
        self.layer_scalar = None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, per_layer_input: torch.Tensor | None = None) -> torch.Tensor:
        h = super().forward(x, batch)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm.forward(self.per_layer_projection(gated))
        return h * self.layer_scalar


class PerLayerInputs(Module):
    """Each token's input vector for every layer [T, layers, size]: ``(norm(proj(embeds) / sqrt(hidden)) +
    table[token] * sqrt(size)) / sqrt(2)``, the table row of ``pad_token_id`` for image tokens."""

    def __init__(self, cfg: DecoderConfig, keys: Gemma4Keys, prefix: str):
        n, size = cfg.num_hidden_layers, keys.hidden_size_per_layer_input
        self.key, self.num_layers, self.size, self.hidden_size = prefix, n, size, cfg.hidden_size
        vocab = keys.vocab_size_per_layer_input or cfg.vocab_size
        self.embed = Embedding(f"{prefix}.embed_tokens_per_layer", vocab, n * size, math.sqrt(size))
        self.projection = Linear(f"{prefix}.per_layer_model_projection", cfg.hidden_size, n * size)
        self.norm = RMSNorm(f"{prefix}.per_layer_projection_norm", size, cfg.rms_norm_eps)
        self.pad_token_id = cfg.pad_token_id or 0

    def forward(self, ids: torch.Tensor, embeds: torch.Tensor, embed_mask: torch.Tensor | None) -> torch.Tensor:
        if embed_mask is not None:
            ids = torch.where(embed_mask, self.pad_token_id, ids)
        tokens = self.embed.forward(ids).reshape(-1, self.num_layers, self.size)
        mixed = self.projection(embeds) * self.hidden_size**-0.5
        return (self.norm.forward(mixed.reshape(-1, self.num_layers, self.size)) + tokens) * 2**-0.5


class Gemma4CausalLM(CausalLM):
    """CausalLM whose layers also take their per-layer input; KV-sharing layers own no cache layer."""

    def __init__(self, *args, per_layer_inputs: PerLayerInputs | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.per_layer_inputs = per_layer_inputs

    def residual_stream(self, batch: ForwardBatch) -> ops.Hidden:
        x = self.embed_tokens(batch)
        per_layer = None
        if self.per_layer_inputs is not None:
            per_layer = self.per_layer_inputs.forward(batch.input_ids, x, batch.embed_mask)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, None if per_layer is None else per_layer[:, i])
        return ops.Hidden(x)


def build_gemma4_text(cfg: DecoderConfig, prefix: str = "model", lm_head_key: str = "lm_head") -> Gemma4CausalLM:
    """The Gemma 4 language model with its tensors under ``prefix`` (``model.language_model`` in the
    multimodal checkpoints)."""
    keys = read_keys(Gemma4Keys, cfg)
    if keys.enable_moe_block and not (keys.num_experts and keys.top_k_experts and keys.moe_intermediate_size):
        raise ConfigError("config.json: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
    hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
    shapes = layer_shapes(cfg, keys)
    ropes: dict[tuple[str, int], RotaryEmbedding] = {}
    shared: dict[int, SharedKV] = {}
    layers: list[Module] = []
    for i, shape in enumerate(shapes):
        key, kind = f"{prefix}.layers.{i}", cfg.layer_type(i)
        if (kind, shape.head_dim) not in ropes:
            ropes[kind, shape.head_dim] = RotaryEmbedding(cfg.rope_for(kind), shape.head_dim, cfg.max_position_embeddings)
        rope, window = ropes[kind, shape.head_dim], cfg.layer_sliding_window(i)
        unified = keys.model_type == "gemma4_unified_text"
        image_blocks = keys.use_bidirectional_attention == "vision" and (unified or kind == "sliding_attention")
        if shape.kv_source is None:
            attn: Module = Gemma4Attention(
                f"{key}.self_attn", i, hidden, cfg.num_attention_heads, shape.kv_heads, shape.head_dim, rope,
                qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm_eps=eps, sliding_window=window, scale=1.0,
                values_from_keys=keys.attention_k_eq_v and kind == "full_attention", v_norm_eps=eps,
            )
            attn.image_blocks, attn.window_cuts_images = image_blocks, not unified
        else:
            source = shared.setdefault(shape.kv_source, SharedKV())
            layers[shape.kv_source].attn.shared = source
            attn = SharedKVAttention(f"{key}.self_attn", shape.kv_source, source, hidden, cfg.num_attention_heads,
                                     shape.head_dim, rope, eps, window, image_blocks, not unified)
        wide = 2 if keys.use_double_wide_mlp and shape.kv_source is not None else 1
        mlp = GatedMLP(f"{key}.mlp", hidden, cfg.intermediate_size * wide, cfg.hidden_act)
        norm = lambda name: RMSNorm(f"{key}.{name}", hidden, eps)
        ffn, pre_ffn = (Gemma4Feedforward(key, cfg, keys, mlp), None) if keys.enable_moe_block else (mlp, norm("pre_feedforward_layernorm"))
        layers.append(Gemma4DecoderLayer(
            key, cfg, keys.hidden_size_per_layer_input, norm("input_layernorm"), attn, pre_ffn, ffn,
            attn_out_norm=norm("post_attention_layernorm"), mlp_out_norm=norm("post_feedforward_layernorm"),
        ))
    embed_key = f"{prefix}.embed_tokens"
    return Gemma4CausalLM(
        cfg,
        Embedding(embed_key, cfg.vocab_size, hidden, math.sqrt(hidden)),
        layers,
        RMSNorm(f"{prefix}.norm", hidden, eps),
        Linear(lm_head_key, hidden, cfg.vocab_size, alt_key=embed_key if cfg.tie_word_embeddings else None),
        final_logit_softcap=keys.final_logit_softcapping,
        per_layer_inputs=PerLayerInputs(cfg, keys, prefix) if keys.hidden_size_per_layer_input else None,
    )
