"""The decoder-only transformer that most families are: layers of (norm, attention, norm, MLP).

A family describes how it differs from Llama with :class:`DecoderOptions` (tensor names and
feature flags); :func:`build_decoder` composes the shared modules. A family that is Llama with a
flag is a few lines of options, not a copy of this file. Values that come from the checkpoint's
config (a softcap, a scale) are set by the family's ``build`` with ``attrs.evolve(options, ...)``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from .. import ops
from ..batch import ForwardBatch
from ..config import DecoderConfig
from ..ops.projection import Hidden, Normed
from ..spec import ArchitectureSpec
from ..weights import Aliases
from .base import Module, Sublayer
from .layers import (
    MLP,
    Attention,
    Embedding,
    GatedMLP,
    OutputGate,
    OutputGatedAttention,
    RMSNorm,
    RotaryEmbedding,
    make_norm,
)
from .linear import Linear


@attrs.frozen
class DecoderOptions:
    """How a family's checkpoint and forward pass differ from Llama's.

    Norm placement: ``input_norm_name`` normalises the attention input and ``post_attn_norm_name``
    the MLP input (HF's Llama names); ``attn_out_norm_name`` / ``mlp_out_norm_name`` normalise a
    sub-layer's output before the residual add (Gemma 2/3 and GLM 4 "sandwich", Olmo 2/3 and
    EXAONE 4 post-norm with the input norms set to None, HyperCLOVAX Peri-LN).
    """

    # tensor names
    embed_key: str = "model.embed_tokens"
    layer_prefix: str = "model.layers"
    final_norm_key: str = "model.norm"
    lm_head_key: str = "lm_head"
    attn_name: str = "self_attn"
    mlp_name: str = "mlp"
    input_norm_name: str | None = "input_layernorm"
    post_attn_norm_name: str | None = "post_attention_layernorm"
    attn_out_norm_name: str | None = None
    mlp_out_norm_name: str | None = None
    # norms
    norm: str = "rms"  # "rms", "layer" (LayerNorm with bias), "layer_nobias" (Cohere), "layer_noparam" (OLMo 1)
    norm_unit_offset: bool = False  # stored norm weights are w - 1 (Gemma, Nemotron): scale by 1 + w
    # block structure
    parallel_block: bool = False  # x + attn(norm(x)) + mlp(norm(x)) with one norm (Cohere)
    residual_multiplier: float = 1.0  # sub-layer outputs scaled before the residual add (Granite, HyperCLOVAX)
    # attention
    qk_norm: bool = False  # normalise q and k before RoPE (Qwen3, Olmo ...)
    qk_norm_kind: str = "head"  # "head", "full" (whole projection, Olmo 2/3) or "layer_head" (Cohere)
    o_proj_name: str = "o_proj"  # Phi-2: "dense"
    qkv_bias: bool | None = None  # None: config.attention_bias
    o_bias: bool | None = None  # None: same as attention_bias
    fused_qkv: str | None = None  # fused [q; k; v] checkpoint tensor split at load (Phi-3 "qkv_proj")
    rope_interleaved: bool = False  # GPT-J pairing instead of NeoX halves
    nope_layer_types: tuple[str, ...] = ()  # layer types without RoPE (Cohere2 / EXAONE 4 global layers)
    attn_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # tanh softcap of attention logits (Gemma 2)
    clip_qkv: float | None = None  # clamp q/k/v projections (OLMo 1)
    output_gate: OutputGate | None = None  # attention output gated by a projection of its input (Laguna)
    output_gate_name: str = "gate_proj"  # that projection's tensor name (Laguna: "g_proj")
    # MLP
    mlp_gated: bool = True  # False: down(act(up(x))) (Arcee, Apertus)
    mlp_up_name: str = "up_proj"  # tensor names of the ungated MLP (Starcoder2: c_fc / c_proj)
    mlp_down_name: str = "down_proj"
    fused_gate_up: str | None = None  # fused [gate; up] checkpoint tensor split at load (Phi-3, GLM 4 "gate_up_proj")
    mlp_bias: bool | None = None  # None: config.mlp_bias
    activation: str | None = None  # None: config.hidden_act
    # embedding and head
    embed_scale: float | None = None
    embed_scale_rounded: bool = True  # scale rounded to the model dtype first (Gemma); False: exact (Granite)
    final_logit_softcap: float = 0.0
    logit_scale: float = 1.0
    lm_head_bias: bool = False  # Phi-2


class DecoderLayer(Module):
    """One block. Pre-norm by default: ``h = x + attn(norm(x))``, then ``h + mlp(norm(h))``.

    Any norm may be None (absent). ``attn_out_norm`` / ``mlp_out_norm`` normalise the sub-layer
    output before the residual add. ``parallel``: ``x + attn(norm(x)) + mlp(norm(x))``. A sequential
    block's ``attn`` or ``mlp`` may be None: that sub-layer is skipped (DeciLM's no-op blocks).
    """

    def __init__(
        self,
        key: str,
        input_norm: Module | None,
        attn: Module | None,
        post_attn_norm: Module | None,
        mlp: Module | None,
        attn_out_norm: Module | None = None,
        mlp_out_norm: Module | None = None,
        parallel: bool = False,
        residual_multiplier: float = 1.0,
    ):
        self.key = key
        self.input_norm, self.attn, self.post_attn_norm, self.mlp = input_norm, attn, post_attn_norm, mlp
        self.attn_out_norm, self.mlp_out_norm = attn_out_norm, mlp_out_norm
        self.parallel, self.residual_multiplier = parallel, residual_multiplier

    def forward(self, x: torch.Tensor | Hidden, batch: ForwardBatch) -> torch.Tensor | Hidden:
        """The block on x: a tensor in, the output tensor out; a :class:`~trellm.ops.Hidden` in (CausalLM's residual
        stream), a Hidden out, whose last residual add may be left to the next norm (``add_rms_norm``: one launch)
        or made by a sub-layer's last projection, with the sums of squares the next norm can use. Same numbers
        either way (up to the order of those sums)."""
        hidden = x if isinstance(x, Hidden) else Hidden(x)
        if self.parallel:
            normed, hidden = _input(self.input_norm, hidden, isinstance(self.attn, Sublayer) and isinstance(self.mlp, Sublayer))
            out = Hidden(hidden.x + self.attn.forward(normed, batch), self.mlp.forward(normed, batch))
        else:
            a = self._sublayer(self.attn, self.input_norm, self.attn_out_norm, hidden, batch)
            out = self._sublayer(self.mlp, self.post_attn_norm, self.mlp_out_norm, a, batch)
        return out if isinstance(x, Hidden) else out.value()

    def _sublayer(self, mixer: Module | None, norm: Module | None, out_norm: Module | None, hidden: Hidden,
                  batch: ForwardBatch) -> Hidden:
        """``hidden + mixer(norm(hidden))`` (the output normed by ``out_norm`` and scaled by the residual
        multiplier first); ``hidden`` itself without a mixer. A :class:`~trellm.modules.base.Sublayer` gets its
        input norm to apply in its first projections and, when nothing comes between its output and the add,
        makes the add in its last one."""
        if mixer is None:
            return hidden
        sublayer = isinstance(mixer, Sublayer)
        x, hidden = _input(norm, hidden, sublayer)
        if sublayer and out_norm is None and self.residual_multiplier == 1.0:
            return mixer.forward(x, batch, residual=hidden)
        y = mixer.forward(x, batch)
        if out_norm is not None:
            y = out_norm.forward(y)
        if self.residual_multiplier != 1.0:
            y = y * self.residual_multiplier
        return Hidden(y, hidden.x)


def _input(norm: Module | None, hidden: Hidden, lazy: bool) -> tuple[torch.Tensor | Normed, Hidden]:
    """``norm(hidden)`` and ``hidden`` with its pending add made (in the norm's launch: ``add_rms_norm``).
    ``lazy``: an RMSNorm of a summed hidden state is left to the projections (:class:`~trellm.ops.Normed`)."""
    if hidden.residual is not None:
        normed, h = add_norm(norm, hidden.x, hidden.residual)
        return normed, Hidden(h)
    if lazy and isinstance(norm, RMSNorm):
        return Normed(hidden.x, norm.row_norm(hidden.ssq)), hidden
    return (hidden.x if norm is None else norm.forward(hidden.x)), hidden


def add_norm(norm: Module | None, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (``x`` when residual is None) and ``norm(h)``, as ``(norm(h), h)``; one fused op
    for an RMSNorm."""
    if residual is None:
        return (x if norm is None else norm.forward(x)), x
    if isinstance(norm, RMSNorm):
        return ops.add_rms_norm(x, residual, norm.weight, norm.eps, norm.unit_offset)
    h = x + residual
    return (h if norm is None else norm.forward(h)), h


class CausalLM(Module):
    """Embedding, decoder layers, final norm and LM head; ``forward(batch)`` returns float32 logits."""

    lora = None  # a trellm.lora.LoraSet once an adapter is loaded
    aliases: Aliases = ()  # other spellings of its module names (trellm.weights.Aliases), which adapters may use
    layer_split = None  # a trellm.distributed.layer_split.LayerSplit when the layers sit on several devices

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

    @classmethod
    def from_layers(cls, cfg: DecoderConfig, layers: list[Module], embed_key: str = "model.embed_tokens",
                    norm_key: str = "model.norm", norm_unit_offset: bool = False, embed_scale: float | None = None,
                    aliases: Aliases = ()):
        """``layers`` between the token embedding (times ``embed_scale``) and a final RMSNorm; a tied lm_head reads
        the embedding. The tail of every family that writes its own layers."""
        hidden, vocab = cfg.hidden_size, cfg.vocab_size
        model = cls(
            cfg,
            Embedding(embed_key, vocab, hidden, embed_scale),
            layers,
            RMSNorm(norm_key, hidden, cfg.rms_norm_eps, unit_offset=norm_unit_offset),
            Linear("lm_head", hidden, vocab, alt_key=embed_key if cfg.tie_word_embeddings else None),
        )
        model.aliases = aliases
        return model

    def nbytes(self) -> int:
        """Bytes held, counting a tied LM head that shares the embedding's tensor once."""
        total = super().nbytes()
        head_weight = getattr(self.lm_head.impl, "weight", None)
        if head_weight is not None and self.embed.weight is not None and head_weight.data_ptr() == self.embed.weight.data_ptr():
            total -= head_weight.numel() * head_weight.element_size()
        return total

    def attention_layers(self) -> list[Attention | None]:
        """Per decoder layer, the attention module that owns KV cache layer ``i`` (None: no KV cache)."""
        return [getattr(layer, "attn", None) if isinstance(getattr(layer, "attn", None), Attention) else None for layer in self.layers]

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        if self.lora is not None:  # every forward starts here: the adapters learn each row's choice
            self.lora.bind(batch)
        x = self.embed.forward(batch.input_ids)
        if batch.input_embeds is not None:
            emb = batch.input_embeds.to(x.dtype)
            x = emb if batch.embed_mask is None else torch.where(batch.embed_mask[:, None], emb, x)
        return x

    def residual_stream(self, batch: ForwardBatch) -> Hidden:
        """The last layer's hidden state. :class:`DecoderLayer` blocks hand it on as a :class:`~trellm.ops.Hidden`
        (each residual add fused into the next norm or into a projection); other layers take and give tensors."""
        hidden = Hidden(self.embed_tokens(batch))
        for layer in self.layers:
            if isinstance(layer, DecoderLayer):
                hidden = layer.forward(hidden, batch)
            else:
                hidden = Hidden(layer.forward(hidden.value(), batch))
        return hidden

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        return self.residual_stream(batch).value()

    def logits_from_hidden(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]
        return self.logits_from_normed(self.norm.forward(x), batch.logits_out)

    def logits_from_normed(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of final-normed hidden rows: LM head, logit scale, softcap; written into ``out`` when it
        has their shape (a captured graph's shared output rows), else into a new tensor."""
        head = self.lm_head.forward(x)
        logits = out.copy_(head) if out is not None and out.shape == head.shape else head.float()
        if self.logit_scale != 1.0:
            logits.mul_(self.logit_scale)  # in place: ``logits`` is new (or ``out``), never the head's weights
        if self.final_logit_softcap > 0:
            logits.div_(self.final_logit_softcap).tanh_().mul_(self.final_logit_softcap)
        return logits

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.residual_stream(batch)
        if hidden.residual is None:
            return self.logits_from_hidden(hidden.x, batch)
        normed, _ = add_norm(self.norm, hidden.x, hidden.residual)  # all rows: one launch, where picking rows first takes two
        return self.logits_from_normed(normed if batch.logits_indices is None else normed[batch.logits_indices], batch.logits_out)


def layer_ropes(cfg: DecoderConfig, opts: DecoderOptions) -> list[RotaryEmbedding | None]:
    """Per layer, the shared RoPE table it uses (one per distinct layer type) or None for NoPE layers."""
    tables: dict[str, RotaryEmbedding] = {}
    out: list[RotaryEmbedding | None] = []
    nope = set(cfg.nope_layers)
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_type(i)
        if i in nope or kind in opts.nope_layer_types:
            out.append(None)
            continue
        if kind not in tables:
            tables[kind] = RotaryEmbedding(cfg.rope_for(kind), cfg.head_dim, cfg.max_position_embeddings, opts.rope_interleaved)
        out.append(tables[kind])
    return out


def build_attention(cfg: DecoderConfig, opts: DecoderOptions, i: int, key: str, rope: RotaryEmbedding | None) -> Attention:
    qkv_bias = cfg.attention_bias if opts.qkv_bias is None else opts.qkv_bias
    gated = {} if opts.output_gate is None else {"gate": opts.output_gate, "gate_name": opts.output_gate_name}
    return (Attention if opts.output_gate is None else OutputGatedAttention)(
        key,
        layer_idx=i,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.attention_heads(i),
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rope=rope,
        qkv_bias=qkv_bias,
        o_bias=cfg.attention_bias if opts.o_bias is None else opts.o_bias,
        qk_norm_eps=cfg.rms_norm_eps if opts.qk_norm else None,
        sliding_window=cfg.layer_sliding_window(i),
        softcap=opts.attn_softcap,
        scale=opts.attn_scale,
        qk_norm=opts.qk_norm_kind,
        qk_norm_unit_offset=opts.norm_unit_offset,
        fused_qkv=opts.fused_qkv,
        o_proj_name=opts.o_proj_name,
        clip_qkv=opts.clip_qkv,
        **gated,
    )


def build_mlp(cfg: DecoderConfig, opts: DecoderOptions, key: str) -> Module:
    act = opts.activation or cfg.hidden_act
    bias = cfg.mlp_bias if opts.mlp_bias is None else opts.mlp_bias
    if not opts.mlp_gated:
        return MLP(key, cfg.hidden_size, cfg.intermediate_size, act, bias, opts.mlp_up_name, opts.mlp_down_name)
    return GatedMLP(key, cfg.hidden_size, cfg.intermediate_size, act, bias, opts.fused_gate_up)


def build_decoder(cfg: DecoderConfig, opts: DecoderOptions = DecoderOptions()) -> CausalLM:
    """Compose a Llama-style decoder from shared modules according to ``opts``."""

    def norm(name: str | None, prefix: str) -> Module | None:
        if name is None:
            return None
        return make_norm(opts.norm, f"{prefix}.{name}" if prefix else name, cfg.hidden_size, cfg.rms_norm_eps, opts.norm_unit_offset)

    ropes = layer_ropes(cfg, opts)
    layers: list[Module] = []
    for i in range(cfg.num_hidden_layers):
        key = f"{opts.layer_prefix}.{i}"
        layers.append(
            DecoderLayer(
                key,
                norm(opts.input_norm_name, key),
                build_attention(cfg, opts, i, f"{key}.{opts.attn_name}", ropes[i]),
                None if opts.parallel_block else norm(opts.post_attn_norm_name, key),
                build_mlp(cfg, opts, f"{key}.{opts.mlp_name}"),
                attn_out_norm=norm(opts.attn_out_norm_name, key),
                mlp_out_norm=norm(opts.mlp_out_norm_name, key),
                parallel=opts.parallel_block,
                residual_multiplier=opts.residual_multiplier,
            )
        )
    head = Linear(
        opts.lm_head_key, cfg.hidden_size, cfg.vocab_size, bias=opts.lm_head_bias,
        alt_key=opts.embed_key if cfg.tie_word_embeddings else None,
    )
    return CausalLM(
        cfg,
        Embedding(opts.embed_key, cfg.vocab_size, cfg.hidden_size, opts.embed_scale, opts.embed_scale_rounded),
        layers,
        norm(opts.final_norm_key, ""),
        head,
        opts.final_logit_softcap,
        opts.logit_scale,
    )


def decoder_family(
    name: str,
    architectures: tuple[str, ...],
    options: DecoderOptions = DecoderOptions(),
    configure: Callable[[DecoderConfig, DecoderOptions], DecoderOptions] | None = None,
    read_config: Callable[[dict[str, Any]], DecoderConfig] = DecoderConfig.from_hf,
    description: str = "",
) -> ArchitectureSpec:
    """The spec of a family that is :func:`build_decoder` with ``options``.

    ``configure(cfg, options)`` returns the options completed with values from the checkpoint's
    config (softcaps, scales); ``read_config`` turns the raw HF config into a DecoderConfig.
    """

    def build(cfg: DecoderConfig) -> CausalLM:
        return build_decoder(cfg, configure(cfg, options) if configure else options)

    return ArchitectureSpec(name=name, architectures=architectures, read_config=read_config, build=build, description=description)
