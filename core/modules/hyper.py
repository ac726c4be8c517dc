"""Hyper-connections (mHC): a residual stream of N parallel streams instead of one.

A model keeps ``streams`` [T, N, D] between blocks (:func:`expand_streams` makes them from the
embeddings). Around each attention or MLP block a :class:`HyperConnection` collapses the streams
into the block's input and, after the block, merges its output back::

    x, mix = hc.forward(streams)                 # x [T, D]: the block's input (before its norm)
    streams = mix.merge(streams, block(norm(x)))  # [T, N, D]

The final hidden state is a collapse of the streams: :class:`HyperHead` (DeepSeek V4's learned
weights) or their mean (GLM 5.3). :class:`HyperDecoderLayer` and :class:`HyperCausalLM` are the pre-norm
block and the model built this way; :class:`HybridHyperCausalLM` is the one some of whose mixers keep
recurrent state (GLM 5.3's delta-attention layers). The numbers are the ops in :mod:`trellm.ops.hyper`.
"""
from __future__ import annotations

import attrs
import torch

from ..batch import ForwardBatch
from ..capabilities import implements
from ..ops.hyper import hyper_connection_merge, hyper_connection_weights, hyper_head
from ..ops.projection import Hidden
from .base import LoadContext, Module
from .decoder import CausalLM
from .recurrent import HybridCausalLM, RecurrentMixer


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """[T, D] -> [T, N, D]: every stream starts as a copy of the embedding."""
    return x.unsqueeze(1).expand(-1, n, -1).contiguous()


@attrs.frozen
class HyperMix:
    """What a :class:`HyperConnection` computed from the streams for writing the block's output back:
    ``post`` [T, N] and ``comb`` [T, N, N] (float32)."""

    post: torch.Tensor
    comb: torch.Tensor

    def merge(self, streams: torch.Tensor, block_output: torch.Tensor) -> torch.Tensor:
        """The new streams: the block output spread by ``post`` plus the old streams mixed by ``comb``."""
        return hyper_connection_merge(streams, block_output, self.post, self.comb)


class HyperConnection(Module):
    """One block's hyper-connection: tensors ``{prefix}fn`` [(2 + N) * N, N * D], ``{prefix}base`` [(2 + N) * N]
    and ``{prefix}scale`` [3], kept in float32. ``prefix`` carries its separator: DeepSeek V4's hub names are
    ``model.layers.0.hc_attn_fn`` (prefix ``model.layers.0.hc_attn_``), transformers' ``...attn_hc.fn``
    (prefix ``...attn_hc.``). ``norm_eps`` is the epsilon of the unweighted RMS norm of the flattened streams,
    ``eps`` the floor of the Sinkhorn normalisation."""

    def __init__(self, prefix: str, hidden_size: int, streams: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        self.key, self.hidden_size, self.streams = prefix, hidden_size, streams
        self.sinkhorn_iters, self.eps, self.norm_eps = sinkhorn_iters, eps, norm_eps
        self.fn = self.base = self.scale = None

    def load(self, ctx: LoadContext) -> None:
        n, width = self.streams, (2 + self.streams) * self.streams
        get = lambda name, shape: ctx.store.get(f"{self.key}{name}", shape=shape, dtype=torch.float32, device=ctx.device)
        self.fn = get("fn", (width, n * self.hidden_size))
        self.base, self.scale = get("base", (width,)), get("scale", (3,))

    def unload(self) -> None:
        self.fn = self.base = self.scale = None

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, HyperMix]:
        """The block's input [T, D] collapsed from ``streams`` [T, N, D], and the mix that writes its output back."""
        x, post, comb = hyper_connection_weights(streams, self.fn, self.base, self.scale, self.sinkhorn_iters, self.eps, self.norm_eps)
        return x, HyperMix(post, comb)


class HyperHead(Module):
    """The learned final collapse of the streams (DeepSeek V4): ``{prefix}fn`` [N, N * D], ``{prefix}base`` [N],
    ``{prefix}scale`` [1], float32 (hub names ``model.hc_head.hc_fn`` ...: prefix ``model.hc_head.hc_``)."""

    def __init__(self, prefix: str, hidden_size: int, streams: int, eps: float, norm_eps: float):
        self.key, self.hidden_size, self.streams, self.eps, self.norm_eps = prefix, hidden_size, streams, eps, norm_eps
        self.fn = self.base = self.scale = None

    def load(self, ctx: LoadContext) -> None:
        n = self.streams
        get = lambda name, shape: ctx.store.get(f"{self.key}{name}", shape=shape, dtype=torch.float32, device=ctx.device)
        self.fn, self.base, self.scale = get("fn", (n, n * self.hidden_size)), get("base", (n,)), get("scale", (1,))

    def unload(self) -> None:
        self.fn = self.base = self.scale = None

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return hyper_head(streams, self.fn, self.base, self.scale, self.eps, self.norm_eps)


class HyperDecoderLayer(Module):
    """A pre-norm block on hyper-connection streams: ``attn_hc`` collapses the streams into the attention's
    input (then ``input_norm``), its output merges back; the same for the MLP with ``mlp_hc`` and
    ``post_attn_norm``. ``forward(streams [T, N, D], batch)`` gives the new streams; the MLP gets the batch too
    (token-id routing reads it)."""

    def __init__(self, key: str, attn_hc: HyperConnection, input_norm: Module, attn: Module,
                 mlp_hc: HyperConnection, post_attn_norm: Module, mlp: Module):
        self.key, self.attn_hc, self.input_norm, self.attn = key, attn_hc, input_norm, attn
        self.mlp_hc, self.post_attn_norm, self.mlp = mlp_hc, post_attn_norm, mlp

    def forward(self, streams: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x, mix = self.attn_hc.forward(streams)
        streams = mix.merge(streams, self.attn.forward(self.input_norm.forward(x), batch))
        x, mix = self.mlp_hc.forward(streams)
        return mix.merge(streams, self.mlp.forward(self.post_attn_norm.forward(x), batch))


class HyperCausalLM(CausalLM):
    """A :class:`~trellm.modules.decoder.CausalLM` whose layers are :class:`HyperDecoderLayer` blocks on ``streams``
    copies of the embedding; ``hyper_head`` collapses them before the final norm (None: their mean, GLM 5.3)."""

    def __init__(self, config, embed: Module, layers: list[HyperDecoderLayer], norm: Module, lm_head: Module,
                 streams: int, hyper_head: HyperHead | None = None):
        super().__init__(config, embed, layers, norm, lm_head)
        self.streams, self.hyper_head = streams, hyper_head

    def attention_layers(self) -> list:
        """Every layer's mixer owns a KV cache layer, except the recurrent ones (their state lives in slots)."""
        return [None if implements(layer.attn, RecurrentMixer) else layer.attn for layer in self.layers]

    def residual_stream(self, batch: ForwardBatch) -> Hidden:
        streams = expand_streams(self.embed_tokens(batch), self.streams)
        for layer in self.layers:
            streams = layer.forward(streams, batch)
        return Hidden(streams.mean(dim=1) if self.hyper_head is None else self.hyper_head.forward(streams))


class HybridHyperCausalLM(HyperCausalLM, HybridCausalLM):
    """A :class:`HyperCausalLM` whose layers mix attention and recurrent mixers (GLM 5.3's delta attention): it
    builds the hybrid cache, paged KV plus recurrent-state slots."""
