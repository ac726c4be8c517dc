"""Tensor-parallel sharding: which part of each projection a rank holds, and the weights that hold it.

A shard is a kind of weights: a column shard (q/k/v, gate/up, the LM head's vocab rows) is the same
weights class holding fewer output columns, so every fused route of that class still serves it; a row
shard (o_proj, down_proj) holds fewer input rows and sums its partial outputs over the ranks
(:class:`RowParallel`, whose post step is the all-reduce). Modules keep their one ``forward``: the
model is built as on one device, each module is loaded, and :func:`shard_module` then swaps each
projection's weights for this rank's shard and shrinks the attention's head counts.

Split rules: attention by heads (each rank a contiguous block of query heads and the KV heads they
read; with fewer KV heads than ranks each KV head is replicated on the ranks whose query heads read
it); what every head reads stays whole (MLA's latent and a DSA indexer, DeepSeek V4's K = V head, compressors
and indexer: :func:`shard_latent_attention`, :func:`shard_compressed_attention` say why); MLPs by intermediate
columns; embedding and LM head by vocabulary rows; recurrent mixers by heads
(gated delta net: key-head groups with their value heads; KDA: heads, its low-rank f_a / g_a whole; Mamba-2: head
groups with their B/C; a short conv: channels), their conv channels and per-rank recurrent state going with the heads (the cache a
rank builds from its shrunk mixers holds only its heads' state). A module of a plugin splits itself
(:class:`~trellm.capabilities.SplitsOverRanks`, with :func:`split_columns` / :func:`split_rows`). EXL3 weights split only
on 128-row / 128-column boundaries (a 128-block of the Hadamard transform must stay whole; columns off them, a
recurrent mixer's one per head, keep their covering blocks and are picked after: :class:`ColumnSelect`); dense
weights split anywhere. Any module this file does not know runs whole on every rank (replicated):
that is always correct, because only the inside of an attention or MLP block is ever sharded. A vision
tower runs on rank 0 alone (:func:`shard_loaded_child`).
"""
from __future__ import annotations

import copy
from functools import singledispatch
from typing import Any, Callable

import attrs
import torch

from ..capabilities import SplitsOverRanks, implements, supports_images
from ..modules.base import Module
from ..modules.compressed import CompressedAttention
from ..modules.layers import MLP, Attention, Embedding, GatedMLP, HeadLayerNorm, OutputGatedAttention
from ..modules.linear import DenseLinear, Linear
from ..modules.latent import LatentAttention, SparseLatentAttention
from ..modules.moe import ExpertMLP, MoE, dispatch_experts
from ..ops.projection import WrappedWeights, project
from ..modules.recurrent import GatedAttention, GatedDeltaNet, KimiDeltaAttention, Mamba2Mixer, ShortConv
from ..quant.exl3.format import EXL3Linear
from .comm import Comm


class ShardingError(ValueError):
    """A model cannot be split over the requested number of ranks (names the module and the sizes)."""


# ---- partitions -------------------------------------------------------------------------------------


def partition(size: int, world: int, align: int = 1, what: str = "") -> list[tuple[int, int]]:
    """``size`` split into ``world`` contiguous non-empty ranges whose starts are multiples of ``align``
    (sizes as even as the alignment allows; the last may be shorter)."""
    chunk = -(-size // world)
    chunk = -(-chunk // align) * align
    ranges = [(min(r * chunk, size), min((r + 1) * chunk, size)) for r in range(world)]
    if any(a >= b for a, b in ranges):
        raise ShardingError(
            f"{what or 'a dimension'} of {size} cannot be split over {world} ranks in blocks of {align}"
            + (" (EXL3 weights split on 128-column blocks)" if align > 1 else "")
        )
    return ranges


@attrs.frozen
class HeadShard:
    """A rank's attention heads: query heads [q0, q1), KV heads [kv0, kv1)."""

    q0: int
    q1: int
    kv0: int
    kv1: int


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int, key: str = "") -> HeadShard:
    """Rank ``rank``'s heads. Query heads split evenly; KV heads split evenly too, or, with fewer KV heads
    than ranks, each rank keeps the one KV head its query heads read (so it is replicated)."""
    where = f"{key}: " if key else ""
    if num_heads % world:
        raise ShardingError(f"{where}{num_heads} attention heads cannot be split evenly over {world} ranks")
    per = num_heads // world
    q0 = rank * per
    if num_kv_heads % world == 0:
        kv_per = num_kv_heads // world
        return HeadShard(q0, q0 + per, rank * kv_per, (rank + 1) * kv_per)
    if world % num_kv_heads == 0:
        group = num_heads // num_kv_heads
        kv = q0 // group
        return HeadShard(q0, q0 + per, kv, kv + 1)
    raise ShardingError(f"{where}{num_kv_heads} KV heads cannot be split over or replicated on {world} ranks")


@attrs.frozen
class LinearSplit:
    """The part of a whole projection [``out_features``, ``in_features``] a rank's Linear holds: output ``columns``
    (ranges of the whole's, in order; None: all) and input ``rows`` (None: all). A LoRA adapter's factors are cut the
    same way (:meth:`factors`), so the rank's update is its part of the whole update."""

    in_features: int
    out_features: int
    columns: tuple[tuple[int, int], ...] | None = None
    rows: tuple[int, int] | None = None

    def factors(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``a`` [rank, in] and ``b`` [out, rank] of whole-projection factors: A's columns of its input rows
        (a row shard's partial update, summed by the all-reduce after it), B's rows of its output columns."""
        if self.rows is not None:
            a = a[:, self.rows[0]: self.rows[1]]
        if self.columns is not None:
            b = torch.cat([b[lo:hi] for lo, hi in self.columns])
        return a, b


def record_split(linear: Linear, columns: list[tuple[int, int]] | None = None, rows: tuple[int, int] | None = None) -> None:
    """Note on ``linear`` (before its sizes shrink) which columns or rows of the whole projection it keeps."""
    whole = linear.split or LinearSplit(linear.in_features, linear.out_features)
    if columns is not None:
        if whole.columns is not None:
            raise ShardingError(f"{linear.key}: its output columns are split already")
        whole = attrs.evolve(whole, columns=tuple(columns))
    if rows is not None:
        if whole.rows is not None:
            raise ShardingError(f"{linear.key}: its input rows are split already")
        whole = attrs.evolve(whole, rows=rows)
    linear.split = whole


# ---- shards of weights (one implementation per weights class; a new format registers its own) -------


@singledispatch
def shard_align(weights: object) -> int:
    """The block a split of ``weights`` must respect (1: anywhere)."""
    raise ShardingError(f"tensor parallel cannot split {type(weights).__name__} weights yet")


@singledispatch
def shard_columns(weights: object, start: int, stop: int) -> object:
    """Output columns [start, stop) of ``weights`` (a column-parallel shard: no collective)."""
    raise ShardingError(f"tensor parallel cannot split {type(weights).__name__} weights yet")


@singledispatch
def shard_rows(weights: object, start: int, stop: int, keep_bias: bool) -> object:
    """Input rows [start, stop) of ``weights``; the bias only where ``keep_bias`` (one rank adds it)."""
    raise ShardingError(f"tensor parallel cannot split {type(weights).__name__} weights yet")


@shard_align.register
def _(weights: DenseLinear) -> int:
    return 1


@shard_columns.register
def _(weights: DenseLinear, start: int, stop: int) -> DenseLinear:
    bias = None if weights.bias is None else weights.bias[start:stop].clone()
    return DenseLinear(weights.weight[start:stop].clone(), bias)


@shard_rows.register
def _(weights: DenseLinear, start: int, stop: int, keep_bias: bool) -> DenseLinear:
    return DenseLinear(weights.weight[:, start:stop].contiguous(), weights.bias if keep_bias else None)


@shard_align.register
def _(weights: EXL3Linear) -> int:
    return 128


def _check_exl3_block(weights: EXL3Linear, start: int, stop: int, size: int, what: str) -> None:
    if start % 128 or (stop % 128 and stop != size):
        raise ShardingError(f"{weights.key}: EXL3 {what} [{start}, {stop}) do not lie on 128-wide Hadamard blocks")


def _decoded_like(whole: EXL3Linear, shard: EXL3Linear) -> EXL3Linear:
    """``shard``, decoded (its own slice of the trellis) where ``whole`` was (a CPU rank)."""
    if whole.decoded is not None:
        shard.decode(whole.decoded.dtype)
    return shard


@shard_columns.register
def _(weights: EXL3Linear, start: int, stop: int) -> EXL3Linear:
    _check_exl3_block(weights, start, stop, weights.out_features, "columns")
    end = stop if stop % 128 == 0 else weights.padded_out  # the last shard keeps the padding
    bias = None if weights.bias is None else weights.bias[start:end].clone()
    return _decoded_like(weights, EXL3Linear(
        weights.trellis[:, start // 16: end // 16].clone(), weights.suh, weights.svh[start:end].clone(), weights.codebook,
        weights.in_features, stop - start, bias, weights.key,
    ))


@shard_rows.register
def _(weights: EXL3Linear, start: int, stop: int, keep_bias: bool) -> EXL3Linear:
    _check_exl3_block(weights, start, stop, weights.in_features, "rows")
    end = stop if stop % 128 == 0 else weights.padded_in
    return _decoded_like(weights, EXL3Linear(
        weights.trellis[start // 16: end // 16].clone(), weights.suh[start:end].clone(), weights.svh, weights.codebook,
        stop - start, weights.out_features, weights.bias if keep_bias else None, weights.key,
    ))


@singledispatch
def join_columns(*parts: object) -> object:
    """Column shards of one weights class side by side: one projection whose output is their outputs in order."""
    raise ShardingError(f"tensor parallel cannot join column shards of {type(parts[0]).__name__} weights yet")


@join_columns.register
def _(*parts: DenseLinear) -> DenseLinear:
    biases = [p.bias for p in parts]
    bias = None if biases[0] is None else torch.cat(biases)
    return DenseLinear(torch.cat([p.weight for p in parts]), bias)


@join_columns.register
def _(*parts: EXL3Linear) -> EXL3Linear:
    first = parts[0]
    if any(p.out_features % 128 for p in parts[:-1]):
        raise ShardingError(f"{first.key}: EXL3 column shards joined must be whole 128-column blocks")
    biases = [p.bias for p in parts]
    return EXL3Linear(
        torch.cat([p.trellis for p in parts], dim=1), first.suh, torch.cat([p.svh for p in parts]), first.codebook,
        first.in_features, sum(p.out_features for p in parts), None if biases[0] is None else torch.cat(biases), first.key,
    )


class RowParallel:
    """A row shard whose partial outputs are summed over the ranks: the all-reduce is its post step. ``shard``: the
    rank's own projection before it (where a LoRA adapter wraps the weights, so its update is summed once)."""

    def __init__(self, shard: object, comm: Comm):
        self.shard, self.comm = shard, comm
        self.in_features, self.out_features = shard.in_features, shard.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.shard.forward(x))

    __call__ = forward

    def nbytes(self) -> int:
        return self.shard.nbytes()

    def dense_weight(self) -> torch.Tensor:
        """This rank's rows, as dense [out, in_shard] (the sum over ranks is the whole projection's)."""
        return self.shard.dense_weight()


class ColumnSelect(WrappedWeights):
    """Columns ``index`` of ``base``'s output: the column shard of weights that split only on blocks (EXL3: 128
    columns, a block of its Hadamard transform) where the rank's columns do not lie on them, as a recurrent mixer's
    per-head scalars do (one column per head: b, a, dt). ``base`` holds the blocks covering those columns (less than
    two blocks more per range than the rank needs); the projection runs on them (every fused route of their format)
    and the wanted columns are picked after."""

    def __init__(self, base: object, index: torch.Tensor):
        self.base, self.index = base, index
        self.in_features, self.out_features = base.in_features, index.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.forward(x)
        return y.index_select(-1, self._index_on(y.device))

    def project(self, x, pre=None, post=None):
        if post is not None:
            return project.reference(x, self, pre, post)
        y = project(x, self.base, pre)
        return y.index_select(-1, self._index_on(y.device))

    def _index_on(self, device: torch.device) -> torch.Tensor:
        if self.index.device != device:
            self.index = self.index.to(device)
        return self.index

    def nbytes(self) -> int:
        return self.base.nbytes()

    def dense_weight(self) -> torch.Tensor:
        whole = self.base.dense_weight()
        return whole[self._index_on(whole.device)]


def covering_blocks(ranges: list[tuple[int, int]], align: int, size: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The ``align``-blocks of [0, size) covering ``ranges`` (increasing, disjoint), merged where they touch, and
    where each column of ``ranges`` sits in the blocks' outputs side by side."""
    blocks: list[tuple[int, int]] = []
    for a, b in ranges:
        lo, hi = a // align * align, min(-(-b // align) * align, size)
        if blocks and lo <= blocks[-1][1]:
            blocks[-1] = (blocks[-1][0], max(hi, blocks[-1][1]))
        else:
            blocks.append((lo, hi))
    offsets = [0]
    for lo, hi in blocks:
        offsets.append(offsets[-1] + hi - lo)
    index = []
    for a, b in ranges:
        i = next(i for i, (lo, hi) in enumerate(blocks) if lo <= a and b <= hi)
        index.append(torch.arange(offsets[i] + a - blocks[i][0], offsets[i] + b - blocks[i][0]))
    return blocks, torch.cat(index)


class VocabParallelHead:
    """The LM head's vocabulary rows [start, stop); ``forward`` gathers every rank's logits into the full vocab.
    ``shard``: the rank's own projection before the gather (where a LoRA adapter wraps the weights)."""

    def __init__(self, shard: object, comm: Comm, vocab_size: int, chunk: int):
        self.shard, self.comm, self.vocab_size, self.chunk = shard, comm, vocab_size, chunk
        self.in_features, self.out_features = shard.in_features, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.shard.forward(x)
        if local.shape[-1] < self.chunk:  # the last rank's shorter range
            local = torch.nn.functional.pad(local, (0, self.chunk - local.shape[-1]))
        return self.comm.all_gather_last(local)[..., : self.vocab_size]

    __call__ = forward

    def nbytes(self) -> int:
        return self.shard.nbytes()


class VocabParallelEmbedding(Embedding):
    """Embedding rows [start, stop) of the vocabulary: each rank looks up its own ids, the sum fills the rest."""

    def __init__(self, whole: Embedding, comm: Comm, start: int, stop: int):
        super().__init__(whole.key, whole.vocab_size, whole.hidden_size, whole.scale, whole.round_scale)
        self.comm, self.start, self.stop = comm, start, stop
        self.weight = whole.weight[start:stop].clone()

    def load(self, ctx) -> None:
        raise ShardingError(f"{self.key}: a vocab-parallel embedding is made from a loaded one, not loaded again")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        x = self.weight[(ids - self.start).clamp(0, self.stop - self.start - 1)] * mine[:, None].to(self.weight.dtype)
        if self.scale is not None:
            x = x * (torch.tensor(self.scale, dtype=x.dtype) if self.round_scale else self.scale)
        return self.comm.all_reduce(x)


# ---- modules ----------------------------------------------------------------------------------------


def split_columns(linear: Linear, start: int, stop: int) -> None:
    """Keep output columns [start, stop) of ``linear`` (column parallel: no collective)."""
    split_column_ranges(linear, [(start, stop)])


def split_column_ranges(linear: Linear, ranges: list[tuple[int, int]]) -> None:
    """Keep the output columns of ``ranges`` (increasing), in order (a projection whose output is several parts:
    q|k|v). Ranges off the weights' split blocks keep the blocks covering them and pick their columns
    (:class:`ColumnSelect`)."""
    align, size = shard_align(linear.impl), linear.out_features
    on_blocks = all(a % align == 0 and (b % align == 0 or b == size) for a, b in ranges)
    blocks, index = (ranges, None) if on_blocks else covering_blocks(ranges, align, size)
    record_split(linear, columns=ranges)
    parts = [shard_columns(linear.impl, a, b) for a, b in blocks]
    impl = parts[0] if len(parts) == 1 else join_columns(*parts)
    linear.impl = impl if index is None else ColumnSelect(impl, index)
    linear.out_features = sum(b - a for a, b in ranges)


def split_rows(linear: Linear, start: int, stop: int, comm: Comm, reduce: bool = True) -> None:
    """Keep input rows [start, stop) of ``linear``; its partial outputs are all-reduced (``reduce=False``: left
    partial, for a caller that sums them with more)."""
    shard = shard_rows(linear.impl, start, stop, keep_bias=comm.rank == 0)
    record_split(linear, rows=(start, stop))
    linear.impl = RowParallel(shard, comm) if reduce else shard
    linear.in_features = stop - start


def take_ranges(t: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Rows ``ranges`` of ``t`` (dim 0), in order, as a new tensor."""
    return torch.cat([t[a:b] for a, b in ranges]).clone()


def rank_range(size: int, comm: Comm, what: str) -> tuple[int, int]:
    """This rank's even share [start, stop) of ``size`` heads/groups (raises when ``size`` does not split evenly)."""
    if size % comm.world:
        raise ShardingError(f"{what} ({size}) cannot be split evenly over {comm.world} ranks")
    per = size // comm.world
    return comm.rank * per, (comm.rank + 1) * per


def layer_name(module: Module) -> str:
    """``key (Class)``: where a refusal names the layer and its kind."""
    return f"{module.key} ({type(module).__name__})"


def shard_attention(attn: Attention, comm: Comm) -> HeadShard:
    """This rank's heads of ``attn``: q/k/v columns (a K=V layer has no v_proj), o_proj rows (all-reduced), per-head
    norm weights; returns them."""
    if attn.qk_norm == "full" and attn.q_norm is not None:
        raise ShardingError(f"{layer_name(attn)}: a QK-norm over the whole projection (Olmo 2/3) needs every head; not split yet")
    s = head_shard(attn.num_heads, attn.num_kv_heads, comm.rank, comm.world, layer_name(attn))
    d = attn.head_dim
    qd = attn.q_proj.out_features // attn.num_heads  # 2 d where q_proj also yields a gate per head (GatedAttention)
    projections = [lin for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj) if lin is not None]  # K=V: no v_proj
    align = max(shard_align(lin.impl) for lin in projections)
    if getattr(attn, "sinks", None) is not None:  # one learned logit per query head (gpt-oss)
        attn.sinks = attn.sinks[s.q0: s.q1].clone()
    for lo, hi in ((s.q0 * qd, s.q1 * qd), (s.kv0 * d, s.kv1 * d)):
        if lo % align or hi % align:
            raise ShardingError(
                f"{layer_name(attn)}: heads of {d} dims give a rank columns [{lo}, {hi}), not on the {align}-column blocks its "
                f"weights split on; use fewer ranks"
            )
    split_columns(attn.q_proj, s.q0 * qd, s.q1 * qd)
    split_columns(attn.k_proj, s.kv0 * d, s.kv1 * d)
    if attn.v_proj is not None:
        split_columns(attn.v_proj, s.kv0 * d, s.kv1 * d)
    split_rows(attn.o_proj, s.q0 * d, s.q1 * d, comm)
    if isinstance(attn.q_norm, HeadLayerNorm):  # one weight row per head
        attn.q_norm.weight = attn.q_norm.weight[s.q0: s.q1].clone()
        attn.k_norm.weight = attn.k_norm.weight[s.kv0: s.kv1].clone()
        attn.q_norm.num_heads, attn.k_norm.num_heads = s.q1 - s.q0, s.kv1 - s.kv0
    attn.num_heads, attn.num_kv_heads = s.q1 - s.q0, s.kv1 - s.kv0
    return s


def shard_output_gated_attention(attn: OutputGatedAttention, comm: Comm) -> None:
    """:func:`shard_attention`, and the gate projection's columns of this rank's heads (one per head, or per channel)."""
    s = shard_attention(attn, comm)
    per_head = attn.gate.width(1, attn.head_dim)
    split_columns(attn.gate_proj, s.q0 * per_head, s.q1 * per_head)


def shard_mlp(mlp: GatedMLP | MLP | ExpertMLP, comm: Comm, reduce: bool = True) -> None:
    """This rank's intermediate columns: gate/up columns, down rows (all-reduced; ``reduce=False``: the
    partial sum, for a caller that all-reduces it with more)."""
    column_parts = [mlp.up_proj] if isinstance(mlp, MLP) else [mlp.gate_proj, mlp.up_proj]
    align = max(shard_align(lin.impl) for lin in (*column_parts, mlp.down_proj))
    size = mlp.down_proj.in_features
    start, stop = partition(size, comm.world, align, f"{mlp.key}: intermediate size")[comm.rank]
    for lin in column_parts:
        split_columns(lin, start, stop)
    split_rows(mlp.down_proj, start, stop, comm, reduce)
    if isinstance(mlp, GatedMLP):
        mlp.intermediate_size = stop - start


def shard_gated_delta_net(gdn: GatedDeltaNet, comm: Comm) -> None:
    """This rank's key heads and the value heads that read them: q/k/v/z/a/b columns, the conv channels of its
    q|k|v, its heads' decay and dt bias, out_proj rows (all-reduced). Its state layer then holds its heads only."""
    k0, k1 = rank_range(gdn.num_k_heads, comm, f"{layer_name(gdn)}: linear-attention key heads")
    per, dk, dv = gdn.num_v_heads // gdn.num_k_heads, gdn.head_k_dim, gdn.head_v_dim
    v0, v1 = k0 * per, k1 * per
    channels = [(k0 * dk, k1 * dk), (gdn.key_dim + k0 * dk, gdn.key_dim + k1 * dk),
                (2 * gdn.key_dim + v0 * dv, 2 * gdn.key_dim + v1 * dv)]
    if gdn.projection == "split":
        split_column_ranges(gdn.in_proj_qkv, channels)
        split_columns(gdn.in_proj_z, v0 * dv, v1 * dv)
        split_columns(gdn.in_proj_b, v0, v1)
        split_columns(gdn.in_proj_a, v0, v1)
    elif gdn.projection == "fused":  # grouped per key head: [q | k | v | z] and [b | a] of one key head side by side
        width = 2 * dk + 2 * per * dv
        split_columns(gdn.in_proj_qkvz, k0 * width, k1 * width)
        split_columns(gdn.in_proj_ba, k0 * 2 * per, k1 * 2 * per)
    else:
        for lin, (lo, hi) in zip((gdn.q_proj, gdn.k_proj, gdn.v_proj, gdn.g_proj, gdn.b_proj, gdn.a_proj),
                                 ((k0 * dk, k1 * dk), (k0 * dk, k1 * dk), (v0 * dv, v1 * dv), (v0 * dv, v1 * dv), (v0, v1), (v0, v1))):
            split_columns(lin, lo, hi)
    gdn.conv_weight = take_ranges(gdn.conv_weight, channels)
    if gdn.conv_bias_t is not None:
        gdn.conv_bias_t = take_ranges(gdn.conv_bias_t, channels)
    gdn.dt_bias, gdn.A_log = gdn.dt_bias[v0:v1].clone(), gdn.A_log[v0:v1].clone()
    split_rows(gdn.out_proj, v0 * dv, v1 * dv, comm)
    gdn.num_k_heads, gdn.num_v_heads = k1 - k0, v1 - v0
    gdn.key_dim, gdn.value_dim = gdn.num_k_heads * dk, gdn.num_v_heads * dv
    gdn.conv_dim = 2 * gdn.key_dim + gdn.value_dim


def shard_kimi_delta_attention(kda: KimiDeltaAttention, comm: Comm) -> None:
    """KDA by heads, as the gated delta net (every KDA head has its own key and value head): q/k/v columns, the conv
    channels of its q|k|v, f_b's and g_b's columns (each head's decay and output gate channels), b columns, its heads'
    dt bias channels and A_log, o_proj rows (all-reduced). The low-rank f_a / g_a (hidden -> one head's width) feed
    every head and stay whole, as does the per-channel o_norm weight all heads share. Its state layer then holds
    its heads only."""
    h0, h1 = rank_range(kda.num_heads, comm, f"{layer_name(kda)}: linear-attention heads")
    d, dim = kda.head_dim, kda.dim
    lo, hi = h0 * d, h1 * d
    for lin in (kda.q_proj, kda.k_proj, kda.v_proj, kda.f_b_proj, kda.g_b_proj):
        split_columns(lin, lo, hi)
    split_columns(kda.b_proj, h0, h1)
    kda.conv_weight = take_ranges(kda.conv_weight, [(lo, hi), (dim + lo, dim + hi), (2 * dim + lo, 2 * dim + hi)])
    kda.dt_bias, kda.A_log = kda.dt_bias[lo:hi].clone(), kda.A_log[h0:h1].clone()
    split_rows(kda.o_proj, lo, hi, comm)
    kda.num_heads = h1 - h0
    kda.dim = kda.num_heads * d
    kda.conv_dim = 3 * kda.dim


def shard_mamba2(mixer: Mamba2Mixer, comm: Comm) -> None:
    """This rank's head groups (each group's heads share its B and C): in_proj's z/x/B/C/dt columns, the conv
    channels of x|B|C, the heads' A/D/dt bias and norm weights (the norm is per group), out_proj rows (all-reduced)."""
    g0, g1 = rank_range(mixer.num_groups, comm, f"{layer_name(mixer)}: Mamba-2 groups (n_groups)")
    per, p, n = mixer.num_heads // mixer.num_groups, mixer.head_dim, mixer.state_size
    h0, h1, inner, gn = g0 * per, g1 * per, mixer.inner, mixer.num_groups * mixer.state_size
    xbc = [(h0 * p, h1 * p), (inner + g0 * n, inner + g1 * n), (inner + gn + g0 * n, inner + gn + g1 * n)]
    split_column_ranges(mixer.in_proj, [(h0 * p, h1 * p), *((inner + a, inner + b) for a, b in xbc),
                                        (2 * inner + 2 * gn + h0, 2 * inner + 2 * gn + h1)])
    mixer.conv_weight = take_ranges(mixer.conv_weight, xbc)
    if mixer.conv_bias is not None:
        mixer.conv_bias = take_ranges(mixer.conv_bias, xbc)
    mixer.dt_bias, mixer.A_log, mixer.D = (t[h0:h1].clone() for t in (mixer.dt_bias, mixer.A_log, mixer.D))
    mixer.norm_weight = mixer.norm_weight[h0 * p: h1 * p].clone()
    split_rows(mixer.out_proj, h0 * p, h1 * p, comm)
    mixer.num_heads, mixer.num_groups = h1 - h0, g1 - g0
    mixer.inner = mixer.num_heads * p
    mixer.conv_dim = mixer.inner + 2 * mixer.num_groups * n


def shard_short_conv(conv: ShortConv, comm: Comm) -> None:
    """This rank's channels: in_proj's B/C/x columns, the conv channels, out_proj rows (all-reduced)."""
    c0, c1 = partition(conv.hidden_size, comm.world, 1, f"{conv.key}: conv channels")[comm.rank]
    h = conv.hidden_size
    split_column_ranges(conv.in_proj, [(c0, c1), (h + c0, h + c1), (2 * h + c0, 2 * h + c1)])
    conv.conv_weight = conv.conv_weight[c0:c1].clone()
    if conv.conv_bias is not None:
        conv.conv_bias = conv.conv_bias[c0:c1].clone()
    split_rows(conv.out_proj, c0, c1, comm)
    conv.hidden_size = c1 - c0  # the width of its state (the conv channels), no longer the model's


def shard_latent_attention(attn: LatentAttention, comm: Comm) -> None:
    """MLA by heads: q_b (or q) columns, the heads' absorbed w_uk/w_uv (and the kv_b_proj columns they came from),
    o_proj rows (all-reduced). The compressed latent (kv_a and its norm) stays whole and every rank caches it whole:
    each head attends over all of it, it is one small vector per token however many heads there are, and a split
    of its dims would need a reduction inside attention (scores sum over the latent) every layer. A DSA layer's
    indexer (:class:`SparseLatentAttention`) stays whole too: its heads' scores are summed before the top-k, so split
    heads would need an all-reduce of [tokens, context] scores every layer, while whole it is small and selects the
    same tokens on every rank (its keys are cached beside the latent, whole)."""
    h0, h1 = rank_range(attn.num_heads, comm, f"{layer_name(attn)}: attention heads")
    split_columns(attn.q_b_proj if attn.q_lora_rank else attn.q_proj, h0 * attn.head_dim, h1 * attn.head_dim)
    per_head = attn.nope_dim + attn.v_dim
    split_columns(attn.kv_b_proj, h0 * per_head, h1 * per_head)
    attn.w_uk, attn.w_uv = attn.w_uk[h0:h1].clone(), attn.w_uv[h0:h1].clone()
    split_rows(attn.o_proj, h0 * attn.v_dim, h1 * attn.v_dim, comm)
    attn.num_heads = attn.num_kv_heads = h1 - h0


def shard_compressed_attention(attn: CompressedAttention, comm: Comm) -> None:
    """DeepSeek V4 attention by whole output groups and their heads: wq_b columns, the heads' sinks, the groups' rows
    of wo_a, wo_b rows (all-reduced). The rest stays whole on every rank, as MLA's latent does: the query latent
    (wq_a, q_norm) that every head reads, the one shared K = V head and its cache, the compressors (they fold that
    head's windows) and the CSA indexer (its heads' scores are summed before its top-k, so split heads would need
    an all-reduce of [tokens, entries] scores every layer; it is small and picks the same entries on every rank)."""
    g0, g1 = rank_range(attn.o_groups, comm, f"{layer_name(attn)}: output groups (o_groups)")
    per, d = attn.heads // attn.o_groups, attn.head_dim
    h0, h1 = g0 * per, g1 * per
    split_columns(attn.wq_b, h0 * d, h1 * d)
    attn.sinks = attn.sinks[h0:h1].clone()
    rank = attn.wo_a.out_features // attn.o_groups
    split_columns(attn.wo_a, g0 * rank, g1 * rank)
    attn.wo_a_groups = attn.wo_a_groups[g0:g1].clone()
    split_rows(attn.wo_b, g0 * rank, g1 * rank, comm)
    attn.heads, attn.o_groups = h1 - h0, g1 - g0


def shard_head(head: Linear, comm: Comm) -> None:
    """The LM head split by vocabulary rows, its logits gathered."""
    vocab = head.out_features
    ranges = partition(vocab, comm.world, shard_align(head.impl), f"{head.key}: vocabulary")
    start, stop = ranges[comm.rank]
    record_split(head, columns=[(start, stop)])
    head.impl = VocabParallelHead(shard_columns(head.impl, start, stop), comm, vocab, ranges[0][1] - ranges[0][0])


def shard_embedding(embed: Embedding, comm: Comm) -> VocabParallelEmbedding:
    start, stop = partition(embed.vocab_size, comm.world, 1, f"{embed.key}: vocabulary")[comm.rank]
    return VocabParallelEmbedding(embed, comm, start, stop)


class LocalExperts(Module):
    """Experts [start, stop) of a loaded expert collection, numbered from 0, and one more numbered ``stop - start``
    that stands for every expert another rank holds: it outputs zeros, so the shared dispatch runs unchanged.
    Only this rank's experts stay referenced (the collection's other experts and its pair tables go)."""

    def __init__(self, experts: Module, start: int, stop: int):
        self.key, self.start, self.stop = experts.key, start, stop
        self.whole_experts = experts.num_experts  # HoldsSomeExperts: LoRA keeps these experts' factors alone
        self.num_experts = stop - start + 1
        active = getattr(experts, "active", experts)  # Experts: the layout the checkpoint had
        self.per_expert: list[Module] | None = None  # one module per expert (per-expert tensors, EXL3)
        self.stacked: Module | None = None  # 3-D tensors, sliced
        if isinstance(getattr(active, "experts", None), list):
            self.per_expert = active.experts[start:stop]
            _own_weights(self.per_expert)
        elif getattr(active, "stacked", None) is not None:
            self.stacked = _stacked_slice(active, start, stop)
        else:
            raise ShardingError(f"{experts.key}: expert parallel cannot split a {type(active).__name__} yet")

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if e == self.stop - self.start:
            return torch.zeros_like(x)
        return self.per_expert[e].forward(x) if self.per_expert is not None else self.stacked.run_expert(e, x)


def _own_weights(experts: list) -> None:
    """Dense expert weights that are views of the whole collection's stacks (a dense pair set, made at load on CUDA)
    get storage of their own, so this rank does not keep the other ranks' experts alive."""
    for mlp in experts:
        for lin in (getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")):
            impl = getattr(lin, "impl", None)
            if type(impl) is DenseLinear:
                for name in ("weight", "bias"):
                    t = getattr(impl, name)
                    if t is not None and t._base is not None:
                        setattr(impl, name, t.clone())


def _stacked_slice(experts: Module, start: int, stop: int) -> Module:
    """A copy of loaded stacked experts holding only experts [start, stop), numbered from 0."""
    local = copy.copy(experts)
    local.stacked = gate_up, gu_bias, down, d_bias = tuple(
        None if t is None else t[start:stop].clone() for t in experts.stacked
    )
    local.gate_up = [DenseLinear(gate_up[e], None if gu_bias is None else gu_bias[e]) for e in range(stop - start)]
    local.down = [DenseLinear(down[e], None if d_bias is None else d_bias[e]) for e in range(stop - start)]
    local.num_experts = stop - start
    return local


class SpreadExperts(Module):
    """Experts [start, stop) of a collection spread over the ranks (contiguous ranges). :meth:`dispatch` is
    :func:`~trellm.modules.moe.dispatch_experts` over the whole collection's expert ids with only this rank's
    experts: its partial sum, which the caller all-reduces. A LoRA adapter's factors of an expert live on the rank
    holding it (its update is part of that rank's partial sum), and the dispatch tells them each row's token."""

    def __init__(self, experts: Module, comm: Comm, key: str):
        self.key = experts.key
        self.start, self.stop = partition(experts.num_experts, comm.world, 1, f"{key}: experts")[comm.rank]
        self.local = LocalExperts(experts, self.start, self.stop)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        elsewhere = self.stop - self.start  # LocalExperts' zero expert
        local_ids = torch.where((ids >= self.start) & (ids < self.stop), ids - self.start, elsewhere)
        return dispatch_experts(self.local, x, weights, local_ids)


class ExpertParallelMoE(Module):
    """A MoE block whose routed experts are spread over the ranks (:class:`SpreadExperts`) and whose shared experts
    are split by columns: every rank routes all tokens (the block's own ``route``: by score, or by token id for
    DeepSeek V4's hash layers), runs its own experts' pairs and its part of the shared MLP, and one all-reduce
    sums the parts. ``moe`` keeps only this rank's experts."""

    def __init__(self, moe: MoE, comm: Comm):
        self.key, self.comm, self.moe = moe.key, comm, moe
        moe.experts = SpreadExperts(moe.experts, comm, moe.key)
        if moe.shared is not None:
            shard_mlp(moe.shared, comm, reduce=False)

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        moe = self.moe
        out = moe.experts.dispatch(x, *moe.route(x, batch))
        if moe.shared is not None:
            shared = moe.shared.forward(x)  # this rank's partial sum
            if moe.shared_gate is not None:
                shared = torch.sigmoid(moe.shared_gate(x)) * shared
            out = out + shared
        return self.comm.all_reduce(out)


def shard_module(module: Module, comm: Comm, lm_head: Linear | None = None) -> Module:
    """``module`` (a loaded child of the model) with this rank's shards in place; returns the module to keep
    (a new one where the class changes: the embedding, a MoE block). ``lm_head``: the model's head, split by
    vocabulary. Modules of other kinds run whole on every rank; a module holding no weights (a part the checkpoint
    lacks, e.g. an MTP head) stays as it is."""
    if module.nbytes() == 0:
        return module
    if module is lm_head:
        shard_head(module, comm)
        return module
    kind = type(module)
    if kind is Embedding:
        return shard_embedding(module, comm)
    if isinstance(module, MoE) and kind.forward is MoE.forward:  # a subclass that only routes otherwise
        return ExpertParallelMoE(module, comm)
    if implements(module, SplitsOverRanks):  # a plugin's module: it knows its own split
        module.split_over_ranks(comm)
    elif kind in SHARD_BY_KIND:
        SHARD_BY_KIND[kind](module, comm)
    else:
        for child in list(module.children()):
            new = shard_module(child, comm, lm_head)
            if new is not child:
                replace_child(module, child, new)
    return module


# exact classes: a subclass may add per-head state these do not know, so it runs whole until it is listed here
# (or splits itself, SplitsOverRanks)
SHARD_BY_KIND = {
    Attention: shard_attention, GatedAttention: shard_attention, OutputGatedAttention: shard_output_gated_attention,
    GatedMLP: shard_mlp, MLP: shard_mlp, LatentAttention: shard_latent_attention, SparseLatentAttention: shard_latent_attention,
    CompressedAttention: shard_compressed_attention, GatedDeltaNet: shard_gated_delta_net, Mamba2Mixer: shard_mamba2,
    ShortConv: shard_short_conv, KimiDeltaAttention: shard_kimi_delta_attention,
}


def vision_tower_part(model: Module, child: Module) -> bool:
    """Whether ``child`` (a top-level module of ``model``) is its vision tower."""
    tower = getattr(model, "vision", None) if supports_images(model) else None
    return tower is not None and getattr(child, "inner", child) is tower


def shard_loaded_child(comm: Comm) -> Callable[[Module, Module, Any], None]:
    """``load_local``'s ``on_child_loaded`` for one rank: each top-level module, once loaded, cut to the rank's shard
    (the whole tensors then go). A vision tower runs whole on rank 0 alone: rank 0 prepares every prompt, so its
    tower embeds the images there and the embeddings reach the other ranks in the step's batch (``input_embeds``,
    a few rows of hidden size per image, already part of the message), with no step of their own; the other ranks
    drop it. Split over the ranks, a tower of a few hundred million parameters would pay two all-reduces per
    block for little memory, and replicated it would need the pixels sent to every rank."""

    def shard_child(model: Module, child: Module, ctx: Any) -> None:
        if vision_tower_part(model, child):
            if comm.rank > 0:
                child.unload()
        else:
            new = shard_module(child, comm, lm_head=getattr(model, "lm_head", None))
            if new is not child:
                replace_child(model, child, new)
        ctx.loaded.clear()

    return shard_child


def replace_child(parent: Module, old: Module, new: Module) -> None:
    """Put ``new`` where ``parent`` holds ``old`` (an attribute or a list item)."""
    for name, value in vars(parent).items():
        if value is old:
            setattr(parent, name, new)
        elif isinstance(value, list) and any(v is old for v in value):
            value[:] = [new if v is old else v for v in value]
