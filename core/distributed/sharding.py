"""Tensor-parallel sharding: which part of each projection a rank holds, and the weights that hold it.

A shard is a kind of weights: a column shard (q/k/v, gate/up, the LM head's vocab rows) is the same
weights class holding fewer output columns, so every fused route of that class still serves it; a row
shard (o_proj, down_proj) holds fewer input rows and sums its partial outputs over the ranks
(:class:`RowParallel`, whose post step is the all-reduce). Modules keep their one ``forward``: the
model is built as on one device, each module is loaded, and :func:`shard_module` then swaps each
projection's weights for this rank's shard and shrinks the attention's head counts.

Split rules: attention by heads (each rank a contiguous block of query heads and the KV heads they
read; with fewer KV heads than ranks each KV head is replicated on the ranks whose query heads read
it); MLPs by intermediate columns; embedding and LM head by vocabulary rows. EXL3 weights split only
on 128-row / 128-column boundaries (a 128-block of the Hadamard transform must stay whole); dense
weights split anywhere. Any module this file does not know runs whole on every rank (replicated):
that is always correct, because only the inside of an attention or MLP block is ever sharded.
"""
from __future__ import annotations

import copy
from functools import singledispatch

import attrs
import torch

from ..modules.base import Module
from ..modules.layers import MLP, Attention, Embedding, GatedMLP, HeadLayerNorm
from ..modules.linear import DenseLinear, Linear
from ..modules.moe import MoE, dispatch_experts
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


@shard_columns.register
def _(weights: EXL3Linear, start: int, stop: int) -> EXL3Linear:
    _check_exl3_block(weights, start, stop, weights.out_features, "columns")
    end = stop if stop % 128 == 0 else weights.padded_out  # the last shard keeps the padding
    bias = None if weights.bias is None else weights.bias[start:end].clone()
    return EXL3Linear(
        weights.trellis[:, start // 16: end // 16].clone(), weights.suh, weights.svh[start:end].clone(), weights.codebook,
        weights.in_features, stop - start, bias, weights.key,
    )


@shard_rows.register
def _(weights: EXL3Linear, start: int, stop: int, keep_bias: bool) -> EXL3Linear:
    _check_exl3_block(weights, start, stop, weights.in_features, "rows")
    end = stop if stop % 128 == 0 else weights.padded_in
    return EXL3Linear(
        weights.trellis[start // 16: end // 16].clone(), weights.suh[start:end].clone(), weights.svh, weights.codebook,
        stop - start, weights.out_features, weights.bias if keep_bias else None, weights.key,
    )


class RowParallel:
    """A row shard whose partial outputs are summed over the ranks: the all-reduce is its post step."""

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


class VocabParallelHead:
    """The LM head's vocabulary rows [start, stop); ``forward`` gathers every rank's logits into the full vocab."""

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


def _columns(linear: Linear, start: int, stop: int) -> None:
    linear.impl = shard_columns(linear.impl, start, stop)
    linear.out_features = stop - start


def _rows(linear: Linear, start: int, stop: int, comm: Comm, reduce: bool = True) -> None:
    shard = shard_rows(linear.impl, start, stop, keep_bias=comm.rank == 0)
    linear.impl = RowParallel(shard, comm) if reduce else shard
    linear.in_features = stop - start


def shard_attention(attn: Attention, comm: Comm) -> None:
    """This rank's heads of ``attn``: q/k/v columns, o_proj rows (all-reduced), per-head norm weights."""
    if attn.qk_norm == "full" and attn.q_norm is not None:
        raise ShardingError(f"{attn.key}: a QK-norm over the whole projection (Olmo 2/3) needs every head; not split yet")
    s = head_shard(attn.num_heads, attn.num_kv_heads, comm.rank, comm.world, attn.key)
    d = attn.head_dim
    align = max(shard_align(lin.impl) for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    if getattr(attn, "sinks", None) is not None:  # one learned logit per query head (gpt-oss)
        attn.sinks = attn.sinks[s.q0: s.q1].clone()
    for lo, hi in ((s.q0 * d, s.q1 * d), (s.kv0 * d, s.kv1 * d)):
        if lo % align or hi % align:
            raise ShardingError(
                f"{attn.key}: heads of {d} dims give a rank columns [{lo}, {hi}), not on the {align}-column blocks its "
                f"weights split on; use fewer ranks"
            )
    _columns(attn.q_proj, s.q0 * d, s.q1 * d)
    _columns(attn.k_proj, s.kv0 * d, s.kv1 * d)
    _columns(attn.v_proj, s.kv0 * d, s.kv1 * d)
    _rows(attn.o_proj, s.q0 * d, s.q1 * d, comm)
    if isinstance(attn.q_norm, HeadLayerNorm):  # one weight row per head
        attn.q_norm.weight = attn.q_norm.weight[s.q0: s.q1].clone()
        attn.k_norm.weight = attn.k_norm.weight[s.kv0: s.kv1].clone()
        attn.q_norm.num_heads, attn.k_norm.num_heads = s.q1 - s.q0, s.kv1 - s.kv0
    attn.num_heads, attn.num_kv_heads = s.q1 - s.q0, s.kv1 - s.kv0


def shard_mlp(mlp: GatedMLP | MLP, comm: Comm, reduce: bool = True) -> None:
    """This rank's intermediate columns: gate/up columns, down rows (all-reduced; ``reduce=False``: the
    partial sum, for a caller that all-reduces it with more)."""
    column_parts = [mlp.gate_proj, mlp.up_proj] if isinstance(mlp, GatedMLP) else [mlp.up_proj]
    align = max(shard_align(lin.impl) for lin in (*column_parts, mlp.down_proj))
    size = mlp.down_proj.in_features
    start, stop = partition(size, comm.world, align, f"{mlp.key}: intermediate size")[comm.rank]
    for lin in column_parts:
        _columns(lin, start, stop)
    _rows(mlp.down_proj, start, stop, comm, reduce)
    if isinstance(mlp, GatedMLP):
        mlp.intermediate_size = stop - start


def shard_head(head: Linear, comm: Comm) -> None:
    """The LM head split by vocabulary rows, its logits gathered."""
    vocab = head.out_features
    ranges = partition(vocab, comm.world, shard_align(head.impl), f"{head.key}: vocabulary")
    start, stop = ranges[comm.rank]
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
        self.num_experts = stop - start + 1
        active = getattr(experts, "active", experts)  # Experts: the layout the checkpoint had
        self.per_expert: list[Module] | None = None  # one module per expert (per-expert tensors, EXL3)
        self.stacked: Module | None = None  # 3-D tensors, sliced
        if isinstance(getattr(active, "experts", None), list):
            self.per_expert = active.experts[start:stop]
        elif getattr(active, "stacked", None) is not None:
            self.stacked = _stacked_slice(active, start, stop)
        else:
            raise ShardingError(f"{experts.key}: expert parallel cannot split a {type(active).__name__} yet")

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if e == self.stop - self.start:
            return torch.zeros_like(x)
        return self.per_expert[e].forward(x) if self.per_expert is not None else self.stacked.run_expert(e, x)


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


class ExpertParallelMoE(Module):
    """A MoE block whose routed experts are spread over the ranks (each holds a contiguous range) and whose
    shared experts are split by columns: every rank routes all tokens, runs its own experts' pairs and its
    part of the shared MLP, and one all-reduce sums the parts."""

    def __init__(self, moe: MoE, comm: Comm):
        self.key, self.comm = moe.key, comm
        self.router, self.shared, self.shared_gate = moe.router, moe.shared, moe.shared_gate
        start, stop = partition(moe.experts.num_experts, comm.world, 1, f"{moe.key}: experts")[comm.rank]
        self.start, self.stop = start, stop
        self.experts = LocalExperts(moe.experts, start, stop)
        if self.shared is not None:
            shard_mlp(self.shared, comm, reduce=False)

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        weights, ids = self.router.forward(x)
        elsewhere = self.stop - self.start  # LocalExperts' zero expert
        local_ids = torch.where((ids >= self.start) & (ids < self.stop), ids - self.start, elsewhere)
        out = dispatch_experts(self.experts, x, weights, local_ids)
        if self.shared is not None:
            shared = self.shared.forward(x)  # this rank's partial sum
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return self.comm.all_reduce(out)


def shard_module(module: Module, comm: Comm, lm_head: Linear | None = None) -> Module:
    """``module`` (a loaded child of the model) with this rank's shards in place; returns the module to keep
    (a new one where the class changes: the embedding, a MoE block). ``lm_head``: the model's head, split by
    vocabulary. Modules of other kinds run whole on every rank."""
    if module is lm_head:
        shard_head(module, comm)
        return module
    kind = type(module)
    if kind is Embedding:
        return shard_embedding(module, comm)
    if kind is MoE:
        return ExpertParallelMoE(module, comm)
    if kind is Attention:
        shard_attention(module, comm)
    elif kind in (GatedMLP, MLP):
        shard_mlp(module, comm)
    else:
        for child in list(module.children()):
            new = shard_module(child, comm)
            if new is not child:
                replace_child(module, child, new)
    return module


def replace_child(parent: Module, old: Module, new: Module) -> None:
    """Put ``new`` where ``parent`` holds ``old`` (an attribute or a list item)."""
    for name, value in vars(parent).items():
        if value is old:
            setattr(parent, name, new)
        elif isinstance(value, list) and any(v is old for v in value):
            value[:] = [new if v is old else v for v in value]
