"""Qwen 3.8-Flash-Next (Qwen4ExpForConditionalGeneration): the Qwen hybrid (gated delta net + gated attention,
MoE with a gated shared expert on every layer) with three additions.

- Hyper-connections: the residual is ``hc_count`` streams ([T, n * hidden]); each sub-layer reads a
  low-rank-gated mean of the group-normalised streams and adds its output to every stream with a sigmoid
  weight per stream; the model's last step mixes the streams the same way (there is no final RMSNorm).
- Sparse attention (QSA): an indexer scores blocks of ``indexer_compress_ratio`` keys (the mean of the raw
  index keys, normed, rotated at the block start) against multi-head index queries (ReLU, summed); each
  query attends to the best ``indexer_budget / ratio`` whole blocks it sees plus its incomplete tail block, and
  reads only those tokens' K/V (:func:`trellm.ops.sparse.sparse_paged_attention`, as DSA does). The raw index key
  and the position of each token ride in the cache beside its K/V, and each block's key, pooled once by the step
  that completes the block, in the layer's entry pages.
- Per-layer embeddings (PLE) on ``ple_layer_ids`` (1-based; linear-attention layers): hashed n-gram
  embeddings of the last ``ngram_size`` tokens (reset at EOS) gate a value into every stream, plus a
  dilated causal conv of it. The token history and conv inputs ride in the layer's recurrent-state slot.

Images (a ``vision_config``): the Qwen3.5 tower (``qwen4_exp_vision``, the Qwen3-VL tower without DeepStack)
fills ``<|vision_start|><|image_pad|>*N<|vision_end|>``, and the attention layers take Qwen3.5's interleaved
M-RoPE (time, row, column) positions, the indexer's pooled block keys included. The n-gram embeddings hash
the placeholder ids as they are.
"""
from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F

import trellm
from trellm.sdk import (
    ArchitectureSpec,
    ConfigError,
    DecoderConfig,
    Embedding,
    ExtraRowsKVCacheLayer,
    ForwardBatch,
    GatedAttention,
    GatedDeltaNet,
    HybridCausalLM,
    Linear,
    LoadContext,
    Module,
    QwenVisionLanguageModel,
    QwenVLConfig,
    RMSNorm,
    RotaryEmbedding,
    WindowEntries,
    completed_windows,
    ops,
    pool_tokens,
    qwen_moe_mlp,
    read_keys,
    read_qwen_vl_config,
    shard_attention,
    shard_gated_delta_net,
    state_cache_inputs,
    token_indices,
    window_entry_pages,
    window_rows,
)

PREFIX = "model.language_model"
BLOCK_KEYS = "block_keys"  # the cache's entry of each complete indexer block


@attrs.frozen
class Qwen4ExpKeys:
    """The text config keys of Qwen 3.8-Flash-Next beyond the shared ones."""

    hc_count: int = attrs.field(default=4, converter=int)
    hc_lowrank: int = attrs.field(default=320, converter=int)
    ple_layer_ids: tuple[int, ...] = attrs.field(default=(), converter=lambda v: tuple(sorted({int(i) for i in v})))
    ple_embed_dim: int = attrs.field(default=0, converter=int)  # 0: hidden_size
    ple_conv_kernel_size: int = attrs.field(default=4, converter=int)
    ngram_size: int = attrs.field(default=3, converter=int)
    heads_per_ngram: int = attrs.field(default=8, converter=int)
    indexer_n_heads: int = attrs.field(default=0, converter=int)
    indexer_head_dim: int = attrs.field(default=0, converter=int)
    indexer_budget: int = attrs.field(default=0, converter=int)
    indexer_compress_ratio: int = attrs.field(default=0, converter=int)
    output_gate_type: str = attrs.field(default="", converter=str)


def read_qwen4_exp_keys(cfg: DecoderConfig) -> Qwen4ExpKeys:
    keys = read_keys(Qwen4ExpKeys, cfg)
    missing = [name for name in ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
               if getattr(keys, name) <= 0]
    if missing:
        raise ConfigError(f"config.json: the sparse attention indexer needs {', '.join(missing)} (positive)")
    if keys.indexer_budget % keys.indexer_compress_ratio:
        raise ConfigError(f"config.json: indexer_budget ({keys.indexer_budget}) must be a multiple of "
                          f"indexer_compress_ratio ({keys.indexer_compress_ratio})")
    if keys.hc_count < 2:
        raise ConfigError(f"config.json: hc_count={keys.hc_count}; Qwen 3.8-Flash-Next needs at least 2 streams")
    if keys.ple_layer_ids and (cfg.extra.get("eos_token_id") is None or keys.ngram_size < 2):
        raise ConfigError("config.json: per-layer n-gram embeddings (ple_layer_ids) need eos_token_id and ngram_size >= 2")
    return keys


class GroupRMSNorm(Module):
    """RMSNorm over each ``group`` columns of the streams, scaled by 1 + w (``{key}.weight`` [n * group])."""

    def __init__(self, key: str, dim: int, group: int, eps: float):
        self.key, self.dim, self.group, self.eps = key, dim, group, eps
        self.weight = None

    def load(self, ctx: LoadContext) -> None:
        self.weight = ctx.store.get(f"{self.key}.weight", shape=(self.dim,), dtype=ctx.dtype, device=ctx.device)

    def unload(self) -> None:
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.float().unflatten(-1, (-1, self.group))
        normed = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class StreamMixer(Module):
    """Reads one [T, hidden] input from the n streams: the mean of the group-normed streams under a sigmoid
    gate from a low-rank map; with ``inject``, also the per-stream weights 2 * sigmoid(...) of the output."""

    def __init__(self, key: str, hidden: int, streams: int, rank: int, eps: float, inject: bool = True):
        width = hidden * streams
        self.key, self.hidden, self.streams = key, hidden, streams
        self.hc_norm = GroupRMSNorm(f"{key}.hc_norm", width, hidden, eps)
        self.input_mix_weight_down = Linear(f"{key}.input_mix_weight_down", width, rank)
        self.input_mix_weight_up = Linear(f"{key}.input_mix_weight_up", rank, width)
        self.block_inject_weight = Linear(f"{key}.block_inject_weight", width, streams) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sub-layer input [T, hidden], normed streams [T, n * hidden])."""
        normed = self.hc_norm.forward(streams)
        gate = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.streams)))
        mixed = (gate * normed).unflatten(-1, (self.streams, self.hidden)).mean(-2)
        return mixed, normed

    def forward(self, streams: torch.Tensor, sublayer=None) -> torch.Tensor:
        """``streams`` after ``sublayer`` (a function of one [T, hidden] input); without one, the final read-out."""
        mixed, normed = self.mix(streams)
        if sublayer is None:
            return mixed
        weights = 2 * torch.sigmoid(self.block_inject_weight(normed) / self.streams)
        return streams + (sublayer(mixed)[:, None, :] * weights[..., None]).flatten(1)


class IndexedAttention(GatedAttention):
    """Gated attention over the tokens the QSA indexer picks (see the module docstring). The cache keeps each
    token's raw index key and its position value beside its K/V, and each complete block's key: a block key
    rotates at its first token's position, which with images is an M-RoPE (time, row, column) position, not its
    index, and that token may be an earlier chunk's."""

    def __init__(self, key: str, layer_idx: int, cfg: DecoderConfig, keys: Qwen4ExpKeys, rope: RotaryEmbedding):
        super().__init__(key, layer_idx, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim, rope, cfg.rms_norm_eps, norm_unit_offset=True, bias=cfg.attention_bias)
        self.index_heads, self.index_dim = keys.indexer_n_heads, keys.indexer_head_dim
        self.ratio, self.blocks_kept = keys.indexer_compress_ratio, keys.indexer_budget // keys.indexer_compress_ratio
        self.index_qk_proj = Linear(f"{key}.indexer.index_qk_proj", cfg.hidden_size, (self.index_heads + 1) * self.index_dim)
        self.index_q_norm = RMSNorm(f"{key}.indexer.q_layernorm", self.index_dim, cfg.rms_norm_eps, unit_offset=True)
        self.index_k_norm = RMSNorm(f"{key}.indexer.k_layernorm", self.index_dim, cfg.rms_norm_eps, unit_offset=True)

    def cache_layer(self, kv_layer) -> ExtraRowsKVCacheLayer:
        return ExtraRowsKVCacheLayer(kv_layer, self.index_dim, positions=True,
                                     entries=[WindowEntries(BLOCK_KEYS, self.ratio, self.index_dim)])

    def split_over_ranks(self, comm) -> None:
        """Tensor parallel: the attention heads split as any gated attention's; the indexer stays whole on every rank
        (its heads' ReLU scores are summed before the top-k, so split heads would need an all-reduce of [tokens,
        blocks] scores every layer, while whole it is one small projection that picks the same blocks on every rank;
        its raw keys are cached beside each rank's KV heads)."""
        shard_attention(self, comm)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """x [T, heads, dim] rotated at ``positions`` [T], all below ``max_seq_len`` (the batch's bound: reading
        the positions' maximum would be a host sync, which a decode graph cannot capture)."""
        cos, sin = self.rope.cos_sin(positions, max_seq_len)
        return ops.rotary_embedding(x, cos, sin)

    def block_keys(self, raw_keys: torch.Tensor, first_positions: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """The keys [N, dim] of N blocks from their tokens' raw index keys [N, ratio, dim]: the mean, normed, rotated
        at the position value of the block's first token (``first_positions`` [N], below ``max_seq_len``)."""
        pooled = self.index_k_norm.forward(raw_keys.float().mean(1).to(raw_keys.dtype))
        return self._rotate(pooled[:, None], first_positions, max_seq_len)[:, 0]

    def select(self, index_q: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch: ForwardBatch,
               index: torch.Tensor) -> torch.Tensor:
        """[T, kept * ratio + ratio - 1] token indices each query attends to (-1: none): the ``blocks_kept`` whole
        blocks it sees that score best (ReLU of each index head's dot product with the block key, summed over
        heads, / sqrt(dim)), then its own incomplete block. ``index_q`` [T, heads, dim] (rotated), ``keys``: the
        block keys' (pages, block table, count per sequence), ``index`` [T]: each query's token index."""
        weights = torch.full(index_q.shape[:2], self.index_dim**-0.5, dtype=torch.float32, device=index_q.device)
        chosen = ops.sparse.sparse_index_topk(index_q, weights, *keys[:2], batch.cu_seqlens, keys[2], index,
                                              self.blocks_kept, 1.0, rate=self.ratio)
        return pool_tokens(chosen, self.ratio, index)

    def _block_keys(self, raw_key: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every complete block's key as (pages, block table, count per sequence): the blocks this batch completes
        are pooled from their tokens' raw keys and positions (this batch's, or with a cache the cached ones, the
        new ones stored first) and join the cached ones."""
        layer = None if batch.cache is None else batch.cache.layers[self.layer_idx]
        if layer is not None:
            layer.store_rows(raw_key, batch.slots, batch.positions)
        windows = completed_windows(batch, self.ratio, self.ratio * (self.index_dim + 1))
        raw, _ = window_rows(windows, self.ratio, raw_key, batch, None if layer is None else layer.row_pages)
        firsts, _ = window_rows(windows, self.ratio, batch.positions[:, None], batch,
                                None if layer is None else layer.position_pages[..., None])
        keys = self.block_keys(raw, firsts[:, 0, 0], batch.max_seq_len) if windows.count else raw_key.new_zeros(0, self.index_dim)
        return window_entry_pages(batch, self.layer_idx, BLOCK_KEYS, windows, keys)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q_gate, k, v = ops.project(x, self.qkv.weights())
        q, gate = q_gate.view(t, h, 2, d).unbind(2)
        q = self._rotate(self.q_norm.forward(q), batch.positions, batch.max_seq_len)
        k = self._rotate(self.k_norm.forward(k.view(t, kvh, d)), batch.positions, batch.max_seq_len)
        v = v.view(t, kvh, d)
        index_q, raw_key = self.index_qk_proj(x).split([self.index_heads * self.index_dim, self.index_dim], dim=-1)
        index_q = self._rotate(self.index_q_norm.forward(index_q.view(t, self.index_heads, self.index_dim)), batch.positions,
                               batch.max_seq_len)
        chosen = self.select(index_q, self._block_keys(raw_key, batch), batch, token_indices(batch)[1])
        if batch.cache is None:
            k_pages, table, lengths = ops.sparse.varlen_as_pages(k, batch.cu_seqlens)
            v_pages = v.unsqueeze(1)
        else:
            layer = batch.cache.layers[self.layer_idx]
            layer.store(k, v, batch.slots)
            k_pages, v_pages, table, lengths = layer.k_pages, layer.v_pages, batch.block_table, batch.context_lens
        out = ops.sparse.sparse_paged_attention(q, k_pages, v_pages, table, batch.cu_seqlens, lengths, chosen, d**-0.5)
        return self.o_proj(out.reshape(t, h * d) * torch.sigmoid(gate.reshape(t, -1)))


class NGramEmbedding(Module):
    """Hashed n-gram embeddings (``{key}.ngram_embedding``, stored whole or in ``shard_{i}`` row blocks): for
    n = 2 .. ngram_size, ``heads_per_ngram`` heads each hash the last n tokens (XOR of token * multiplier, the
    multipliers ``{key}.layer_multipliers``) modulo the head's prime (``ngram_heads_vocab_sizes``), offset into
    the shared table (``ngram_heads_offsets``). Tokens before the sequence start or an EOS read as EOS."""

    def __init__(self, key: str, ngram_size: int, heads_per_ngram: int, dim: int, eos: int):
        self.key, self.ngram_size, self.heads_per_ngram, self.eos = key, ngram_size, heads_per_ngram, eos
        self.heads = (ngram_size - 1) * heads_per_ngram
        self.head_dim = dim // self.heads
        self.table = self.multipliers = self.vocab_sizes = self.offsets = None

    def load(self, ctx: LoadContext) -> None:
        get = lambda name, shape=None, dtype=None: ctx.store.get(f"{self.key}.{name}", shape=shape, dtype=dtype, device=ctx.device)
        self.multipliers = get("layer_multipliers", (self.ngram_size,), torch.long)
        self.vocab_sizes = get("ngram_heads_vocab_sizes", (self.heads,), torch.long)
        self.offsets = get("ngram_heads_offsets", (self.heads,), torch.long)
        whole = f"{self.key}.ngram_embedding.weight"
        names = [whole] if whole in ctx.store else []
        while not names or names[0] != whole and f"{self.key}.ngram_embedding.shard_{len(names)}.weight" in ctx.store:
            if f"{self.key}.ngram_embedding.shard_{len(names)}.weight" not in ctx.store:
                raise ConfigError(f"{ctx.store.model_dir}: neither {whole} nor {self.key}.ngram_embedding.shard_0.weight")
            names.append(f"{self.key}.ngram_embedding.shard_{len(names)}.weight")
        self.table = torch.cat([ctx.store.get(n, dtype=ctx.dtype, device=ctx.device) for n in names])
        needed = int((self.offsets[-1] + self.vocab_sizes[-1]).item())
        if self.table.shape[1] != self.head_dim or self.table.shape[0] < needed:
            raise ConfigError(f"{ctx.store.model_dir}: {self.key}.ngram_embedding holds {list(self.table.shape)}, "
                              f"needs at least [{needed}, {self.head_dim}]")

    def unload(self) -> None:
        self.table = self.multipliers = self.vocab_sizes = self.offsets = None

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, heads * head_dim] of tokens given as their n-gram windows [T, ngram_size] (the token last,
        the tokens before it in order; EOS before a sequence's start). A token before an EOS in its window reads
        as EOS (the n-gram restarts after it)."""
        last = self.ngram_size - 1
        crossed = torch.zeros_like(windows[:, last], dtype=torch.bool)  # an EOS between the token and this shift
        shifted = [windows[:, last]]
        for shift in range(1, self.ngram_size):
            crossed = crossed | (windows[:, last - shift] == self.eos)
            shifted.append(torch.where(crossed, self.eos, windows[:, last - shift]))
        ids = []
        for n in range(2, self.ngram_size + 1):
            mixed = shifted[0] * self.multipliers[0]
            for p in range(1, n):
                mixed = torch.bitwise_xor(mixed, shifted[p] * self.multipliers[p])
            heads = slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram)
            ids.append(torch.remainder(mixed[:, None], self.vocab_sizes[heads]) + self.offsets[heads])
        return self.table[torch.cat(ids, dim=-1)].flatten(-2)


def ngram_windows(before: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """[T, c + 1]: each new token of ``batch`` after the c tokens before it (its own sequence's: the new ones, then
    ``before`` [B, c], each sequence's last c tokens before this batch). Shapes only, no host read."""
    c = before.shape[1]
    seq = token_indices(batch)[0]
    rows = torch.arange(batch.input_ids.shape[0], device=before.device)
    back = rows[:, None] + torch.arange(-c, 1, device=before.device)  # [T, c + 1]: the flat row each token reads
    start = batch.cu_seqlens[:-1].long()[seq][:, None]
    carried = before[seq[:, None], (back - start + c).clamp(0, c - 1)]
    return torch.where(back >= start, batch.input_ids[back.clamp_min(0)], carried)


class PerLayerEmbedding(Module):
    """PLE: an n-gram embedding gates a value into each stream (a signed-sqrt key . query score through a
    sigmoid), plus a dilated causal conv (dilation ``ngram_size``) of the group-normed gated values."""

    def __init__(self, key: str, layer_idx: int, cfg: DecoderConfig, keys: Qwen4ExpKeys, eos: int):
        hidden, n, eps = cfg.hidden_size, keys.hc_count, cfg.rms_norm_eps
        dim = keys.ple_embed_dim or hidden
        self.key, self.layer_idx, self.hidden, self.streams, self.eos = key, layer_idx, hidden, n, eos
        self.context = keys.ngram_size - 1
        self.conv_width, self.dilation = keys.ple_conv_kernel_size, keys.ngram_size
        self.ple_embedding = NGramEmbedding(f"{key}.ple_embedding", keys.ngram_size, keys.heads_per_ngram, dim, eos)
        self.key_proj = Linear(f"{key}.key_proj", dim, n * hidden)
        self.value_proj = Linear(f"{key}.value_proj", dim, hidden)
        self.norm_key, self.norm_query, self.norm_conv = (GroupRMSNorm(f"{key}.norm_{name}", n * hidden, hidden, eps)
                                                          for name in ("key", "query", "conv"))
        self.conv_weight = None

    def load(self, ctx: LoadContext) -> None:
        super().load(ctx)
        width = self.streams * self.hidden
        self.conv_weight = ctx.store.get(f"{self.key}.conv1d.weight", shape=(width, 1, self.conv_width),
                                         dtype=ctx.dtype, device=ctx.device)[:, 0].contiguous()

    def unload(self) -> None:
        super().unload()
        self.conv_weight = None

    def state_shapes(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The per-sequence state it keeps in its layer's recurrent slot: the last tokens and the conv inputs."""
        span = (self.conv_width - 1) * self.dilation
        return {"ple_tokens": ((self.context,), torch.long), "ple_conv": ((self.streams * self.hidden, span), dtype)}

    def forward(self, streams: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = streams.shape[0]
        layer, fresh, decode = state_cache_inputs(self.key, self.layer_idx, batch, t)
        before = torch.full((batch.num_seqs, self.context), self.eos, dtype=torch.long, device=streams.device)
        conv_state = None
        if layer is not None:
            tokens, conv_state = (layer.extra[n][batch.state_slots] for n in ("ple_tokens", "ple_conv"))
            if fresh is not None:
                before = torch.where(fresh[:, None], before, tokens)
                conv_state = conv_state * (~fresh).view(-1, 1, 1).to(conv_state.dtype)
            else:
                before = tokens
        windows = ngram_windows(before, batch)
        embeds = self.ple_embedding.forward(windows).to(streams.dtype)
        key = self.norm_key.forward(self.key_proj(embeds)).unflatten(-1, (self.streams, self.hidden))
        query = self.norm_query.forward(streams).unflatten(-1, (self.streams, self.hidden))
        score = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        score = score.abs().clamp_min(1e-6).sqrt() * score.sign()
        gated = (torch.sigmoid(score) * self.value_proj(embeds)[:, None]).flatten(1)
        if decode:  # one token per sequence: the step op (no host read of cu_seqlens, a decode graph captures)
            conv, conv_state = ops.causal_conv1d_step(self.norm_conv.forward(gated), self.conv_weight, None, conv_state,
                                                      dilation=self.dilation)
        else:
            conv, conv_state = ops.causal_conv1d(self.norm_conv.forward(gated), self.conv_weight, None, batch.cu_seqlens,
                                                 conv_state, dilation=self.dilation)
        if layer is not None:
            ends = batch.cu_seqlens.long()
            last = windows[(ends[1:] - 1).clamp_min(0), 1:]  # each sequence's last c tokens now
            layer.extra["ple_tokens"][batch.state_slots] = torch.where((ends[1:] > ends[:-1])[:, None], last, before)
            layer.extra["ple_conv"][batch.state_slots] = conv_state.to(layer.extra["ple_conv"].dtype)
        return streams + gated + conv


class PLEDeltaNet(GatedDeltaNet):
    """A gated delta net whose recurrent slot also keeps its layer's PLE state (``ple_state(dtype)``: the
    extra per-slot tensors, or None)."""

    ple_state = None

    def split_over_ranks(self, comm) -> None:
        """Tensor parallel: by heads, as any gated delta net; the PLE state in its slot is the layer's (the PLE runs
        whole on every rank), so it stays whole."""
        shard_gated_delta_net(self, comm)

    def state_layer(self, max_slots: int, dtype: torch.dtype, device):
        layer = super().state_layer(max_slots, dtype, device)
        for name, (shape, dt) in (self.ple_state(dtype) if self.ple_state else {}).items():
            layer.extra[name] = torch.zeros(max_slots, *shape, dtype=dt, device=device)
        return layer


class Qwen4ExpLayer(Module):
    """PLE (where configured), then attention and MoE each behind a :class:`StreamMixer`."""

    def __init__(self, key: str, cfg: DecoderConfig, keys: Qwen4ExpKeys, mixer: Module, ple: PerLayerEmbedding | None):
        hc = lambda name: StreamMixer(f"{key}.{name}_hyper_connection", cfg.hidden_size, keys.hc_count, keys.hc_lowrank,
                                      cfg.rms_norm_eps)
        self.key, self.attn, self.ple = key, mixer, ple
        self.mlp = qwen_moe_mlp(cfg, f"{key}.mlp", normalize=cfg.moe.normalize_topk is not False)
        self.attn_hc, self.mlp_hc = hc("attn"), hc("mlp")

    def forward(self, streams: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.ple is not None:
            streams = self.ple.forward(streams, batch)
        streams = self.attn_hc.forward(streams, lambda h: self.attn.forward(h, batch))
        return self.mlp_hc.forward(streams, lambda h: self.mlp.forward(h))


class Qwen4ExpLM(HybridCausalLM):
    """The embedding repeated over ``streams`` streams, the layers, and the final :class:`StreamMixer` as the norm."""

    streams: int = 1

    def residual_stream(self, batch: ForwardBatch) -> ops.Hidden:
        streams = self.embed_tokens(batch).repeat(1, self.streams)
        for layer in self.layers:
            streams = layer.forward(streams, batch)
        return ops.Hidden(streams)


def build(cfg: DecoderConfig) -> Qwen4ExpLM:
    keys = read_qwen4_exp_keys(cfg)
    cfg.require_moe()
    eos = cfg.extra.get("eos_token_id")
    eos = int(eos[0] if isinstance(eos, list) else eos) if eos is not None else -1
    types = list(cfg.extra.get("layer_types") or [])
    n = cfg.num_hidden_layers
    if not types:
        interval = int(cfg.extra.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(n)]
    types = ["indexed_attention" if t == "full_attention" else t for t in types]
    if len(types) != n or set(types) - {"linear_attention", "indexed_attention"}:
        raise ConfigError(f"config.json: layer_types must give 'linear_attention'/'indexed_attention' for each of the "
                          f"{n} layers, got {types}")
    bad_ple = [i for i in keys.ple_layer_ids if not 1 <= i <= n or types[i - 1] != "linear_attention"]
    if bad_ple:
        raise ConfigError(f"config.json: ple_layer_ids {bad_ple} must name linear_attention layers (1-based)")
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    gate_activation = keys.output_gate_type or cfg.hidden_act
    layers = []
    for i, kind in enumerate(types):
        key = f"{PREFIX}.layers.{i}"
        ple = PerLayerEmbedding(f"{key}.ple", i, cfg, keys, eos) if i + 1 in keys.ple_layer_ids else None
        if kind == "linear_attention":
            mixer = PLEDeltaNet.from_config(f"{key}.linear_attn", i, cfg.hidden_size, cfg.require_linear_attention(),
                                            cfg.rms_norm_eps, "split", gate_activation=gate_activation)
            mixer.ple_state = ple.state_shapes if ple else None
        else:
            mixer = IndexedAttention(f"{key}.self_attn", i, cfg, keys, rope)
        layers.append(Qwen4ExpLayer(key, cfg, keys, mixer, ple))
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    final = StreamMixer(f"{PREFIX}.hyper_connection_mixer", hidden, keys.hc_count, keys.hc_lowrank, cfg.rms_norm_eps,
                        inject=False)
    model = Qwen4ExpLM(cfg, Embedding(f"{PREFIX}.embed_tokens", vocab, hidden), layers, final,
                       Linear("lm_head", hidden, vocab, alt_key=f"{PREFIX}.embed_tokens" if cfg.tie_word_embeddings else None))
    model.streams = keys.hc_count
    return model


class Qwen4ExpVisionLanguageModel(QwenVisionLanguageModel):
    """The text model with interleaved M-RoPE, fed by the Qwen3.5 tower (``model.visual``)."""

    interleaved_sections = True
    vision_key = "model.visual"
    aliases = ()

    def build_language(self, cfg: QwenVLConfig) -> Qwen4ExpLM:
        return build(cfg.text)


def read_config(raw: dict) -> QwenVLConfig | DecoderConfig:
    """With a ``vision_config`` the model takes images (and needs ``mrope_section``); without one it is text-only."""
    return read_qwen_vl_config(raw, DecoderConfig.from_hf) if "vision_config" in raw else DecoderConfig.from_hf(raw)


def build_model(cfg: QwenVLConfig | DecoderConfig) -> Module:
    return Qwen4ExpVisionLanguageModel(cfg) if isinstance(cfg, QwenVLConfig) else build(cfg)


SPEC = ArchitectureSpec(
    name="qwen4_exp",
    architectures=("Qwen4ExpForConditionalGeneration",),
    read_config=read_config,
    build=build_model,
    description="Qwen 3.8-Flash-Next: gated delta net + QSA sparse gated attention, hyper-connections, hashed n-gram "
                "per-layer embeddings, MoE, the Qwen3.5 vision tower with M-RoPE",
)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
