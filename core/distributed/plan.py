"""The memory plan: what each device will hold, computed before anything is allocated.

Per rank (tensor parallel) or per device (layer split): the weights as loaded, the KV cache per token
(every cache layer with this rank's heads: full and sliding-window layers alike, since pages are shared;
MLA latents and quantized K/V through the cache layers' own byte counts), recurrent state per slot,
the temporaries of one prefill chunk and the CUDA-graph pool of the decode step.

Weights and cache come from the real code: the model is built and loaded onto the ``meta`` device from
the safetensors headers (no tensor data is read), each rank's shard is cut by :mod:`.sharding` exactly
as a real load cuts it, and a cache is made on ``meta``. Only the activations are an estimate.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import attrs
import torch

from ..capabilities import is_hybrid
from ..errors import TrellmError
from ..weights import WeightStore

GiB = 1 << 30
RESERVE = 512 << 20  # CUDA context, allocator slack and kernel workspaces, per device
TINY = 64  # tensors this small are read for real (codebook markers, scalars the loaders inspect)


class MemoryPlanError(TrellmError):
    """The model (or the asked context) does not fit a device: names the device, the need and the free memory."""


def gib(n: float) -> str:
    """Bytes in the unit that reads best (GiB down to KiB)."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


class MetaWeightStore(WeightStore):
    """A WeightStore whose tensors are shapes on the ``meta`` device (from the headers; no data read)."""

    def get(self, name: str, shape=None, dtype=None, device=None) -> torch.Tensor:
        info = self.info(name)
        if info.numel <= TINY:
            return super().get(name, shape, dtype)
        if shape is not None and tuple(info.shape) != tuple(shape):
            return super().get(name, shape)  # the store's shape error
        return torch.empty(info.shape, dtype=dtype or info.dtype, device="meta")


@attrs.frozen
class PlanComm:
    """The rank and world size a plan cuts shards for (loading runs no collective)."""

    rank: int
    world: int
    device: torch.device = torch.device("meta")


@attrs.frozen
class RankMemory:
    """One device's share. Bytes throughout; ``free`` None when unknown (CPU, or not asked)."""

    device: str
    weights: int
    kv_per_token: int
    state_per_slot: int
    activations: int
    graph_pool: int
    free: int | None = None
    layers: tuple[int, int] | None = None  # layer split: decoder layers [first, last)
    reserve: int = RESERVE  # CUDA context and workspaces (0 on the CPU)

    @property
    def fixed(self) -> int:
        """Everything but the KV cache: weights, activations, graph pool and the per-device reserve."""
        return self.weights + self.activations + self.graph_pool + self.reserve

    def need(self, context: int, slots: int = 0) -> int:
        return self.fixed + context * self.kv_per_token + slots * self.state_per_slot

    def max_context(self, slots: int = 0) -> int | None:
        """The most cache tokens that fit beside the rest (None: free memory unknown, or no KV cache here)."""
        if self.free is None or not self.kv_per_token:
            return None
        return max(0, (self.free - self.fixed - slots * self.state_per_slot) // self.kv_per_token)


@attrs.frozen
class MemoryPlan:
    model_dir: str
    ranks: tuple[RankMemory, ...]
    chunk_tokens: int
    max_batch: int

    def max_context(self, slots: int = 0) -> int | None:
        """The most cache tokens every device can hold (None when no device's free memory is known)."""
        fits = [f for f in (r.max_context(slots) for r in self.ranks) if f is not None]
        return min(fits) if fits else None

    def check(self, context: int, slots: int = 0) -> None:
        """Raise MemoryPlanError when ``context`` cache tokens do not fit some device."""
        for r in self.ranks:
            if r.free is not None and r.need(context, slots) > r.free:
                raise MemoryPlanError(
                    f"{self.model_dir} does not fit {r.device}: it needs {gib(r.need(context, slots))} (weights "
                    f"{gib(r.weights)}, KV cache {gib(context * r.kv_per_token)} for {context} tokens, activations "
                    f"{gib(r.activations)}, graph pool {gib(r.graph_pool)}, reserve {gib(r.reserve)}), "
                    f"{gib(r.free)} is free"
                )

    def lines(self, context: int | None = None) -> list[str]:
        out = []
        for i, r in enumerate(self.ranks):
            where = f"rank {i}" if r.layers is None else f"layers {r.layers[0]}-{r.layers[1] - 1}"
            fit = r.max_context()
            line = (f"{r.device} ({where}): weights {gib(r.weights)}, KV cache {gib(r.kv_per_token)}/token, "
                    f"activations {gib(r.activations)} (chunk {self.chunk_tokens}), graph pool {gib(r.graph_pool)}")
            if r.state_per_slot:
                line += f", recurrent state {gib(r.state_per_slot)}/slot"
            if context is not None:
                line += f"; {gib(r.need(context))} for {context} tokens"
            if r.free is not None:
                line += f"; free {gib(r.free)}" + (f", fits {fit} tokens" if fit is not None else "")
            out.append(line)
        return out


def _activations(model, tokens: int, logits_rows: int, element: int) -> int:
    """Peak temporaries of one forward of ``tokens`` rows (an estimate): the residual stream and norms, this
    rank's q/k/v and attention output, its MLP intermediate, the logits, and an EXL3 weight decoded for a
    matmul of more than 64 rows."""
    from ..modules.layers import Attention, GatedMLP
    from ..modules.linear import Linear

    hidden = model.config.hidden_size
    attn = max((m.num_heads + 2 * m.num_kv_heads) * m.head_dim for m in model.modules() if isinstance(m, Attention)) \
        if any(isinstance(m, Attention) for m in model.modules()) else 0
    inter = max((getattr(m, "intermediate_size", 0) for m in model.modules() if isinstance(m, GatedMLP)), default=0)
    decoded = 0
    if tokens > 64:
        for m in model.modules():
            impl = getattr(m, "impl", None) if isinstance(m, Linear) else None
            impl = getattr(impl, "shard", impl)
            if type(impl).__name__ == "EXL3Linear":
                decoded = max(decoded, impl.padded_in * impl.padded_out * 2)
    vocab = model.config.vocab_size
    per_token = (6 * hidden + 2 * attn + 3 * inter) * element
    return tokens * per_token + logits_rows * vocab * (4 + 2 * element) + decoded


def device_and_dtype(model_dir: Path, device, dtype) -> tuple[torch.device, torch.dtype]:
    """The device and dtype a load of ``model_dir`` with these arguments uses."""
    from ..config import read_config_json
    from ..model import _resolve_dtype, resolve_device

    dev = resolve_device(device)
    raw = read_config_json(model_dir)
    config_dtype = raw.get("torch_dtype") or raw.get("dtype")
    return dev, _resolve_dtype(dtype, dev, config_dtype if isinstance(config_dtype, str) else None)


def _rank_memory(model_dir: Path, comm: PlanComm | None, dtype: torch.dtype, chunk_tokens: int, max_batch: int,
                 cache_kwargs: dict) -> tuple[object, int, int, int]:
    """(model, weight bytes, KV bytes per token, state bytes per slot) of one rank, loaded onto ``meta``."""
    from ..model import load_local
    from .sharding import replace_child, shard_module

    def shard_child(model, child, ctx):  # as launch.load_rank does
        new = shard_module(child, comm, lm_head=getattr(model, "lm_head", None))
        if new is not child:
            replace_child(model, child, new)
        ctx.loaded.clear()

    split = comm is not None and comm.world > 1
    loaded = load_local(model_dir, torch.device("meta"), dtype, False, False, on_child_loaded=shard_child if split else None,
                        store=MetaWeightStore(model_dir))
    model = loaded.model
    weights = model.nbytes()
    head = getattr(getattr(getattr(model, "lm_head", None), "impl", None), "weight", None)
    embed = getattr(getattr(model, "embed", None), "weight", None)
    if head is not None and embed is not None and head is not embed:  # meta tensors all have data_ptr 0:
        weights += head.numel() * head.element_size()  # CausalLM.nbytes took an untied head for the embedding
    pages, page = 4, 256
    kwargs = dict(max_tokens=pages * page, page_size=page, device="meta", **cache_kwargs)
    if is_hybrid(model):
        cache = model.make_cache(max_slots=1, **kwargs)
    else:
        from ..cache import KVCache

        cache = KVCache.for_model(model, **kwargs)
    state = sum(l.nbytes() for l in cache.state_layers())
    kv = (cache.nbytes() - state) // (cache.num_pages * cache.page_size)
    return model, weights, kv, state


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info(device)[0]


def plan_memory(model_dir: str | Path, tensor_parallel: int = 1, device: str | torch.device | None = None,
                dtype: torch.dtype | str | None = None, chunk_tokens: int = 2048, max_batch: int = 16,
                free: Sequence[float] | None = None, cache_kwargs: dict | None = None) -> MemoryPlan:
    """Each rank's memory for ``model_dir`` split over ``tensor_parallel`` ranks from ``device``.

    ``free``: each device's free GiB to plan against (simulated sizes); default: what CUDA reports now.
    ``cache_kwargs``: passed to the cache (e.g. ``layer_factory`` of a quantized cache).
    """
    model_dir = Path(model_dir)
    dev, dt = device_and_dtype(model_dir, device, dtype)
    element = torch.empty((), dtype=dt).element_size()
    ranks = []
    for rank in range(tensor_parallel):
        comm = PlanComm(rank, tensor_parallel)
        model, weights, kv, state = _rank_memory(model_dir, comm, dt, chunk_tokens, max_batch, cache_kwargs or {})
        rank_dev = torch.device(dev.type, (dev.index or 0) + rank) if dev.type == "cuda" else dev
        graphs = _activations(model, max_batch, max_batch, element) if dev.type == "cuda" else 0
        ranks.append(RankMemory(
            str(rank_dev), weights, kv, state, _activations(model, chunk_tokens, max_batch, element), graphs,
            free=int(free[rank] * GiB) if free is not None else _free_bytes(rank_dev),
            reserve=RESERVE if dev.type == "cuda" else 0,
        ))
    return MemoryPlan(str(model_dir), tuple(ranks), chunk_tokens, max_batch)


def plan_layer_split(model_dir: str | Path, split: Sequence[float] | str = "auto", context: int = 8192,
                     device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                     chunk_tokens: int = 2048, max_batch: int = 16) -> MemoryPlan:
    """Decoder layers spread in order over devices of different sizes so each holds its layers' weights and
    ``context`` tokens of their cache, the embedding on the first device and the final norm and head with the
    last layer (room for them is kept on every device, since any may hold the last layer).

    ``split``: GiB to use on each device, or "auto" (each visible GPU's free memory).
    """
    base = plan_memory(model_dir, 1, device, dtype, chunk_tokens, max_batch)
    one = base.ranks[0]
    model, _, _, _ = _rank_memory(Path(model_dir), None, device_and_dtype(Path(model_dir), device, dtype)[1], chunk_tokens,
                                  max_batch, {})
    if split == "auto":
        if not torch.cuda.is_available():
            raise MemoryPlanError("--gpu-split auto needs CUDA devices; give GiB per device instead")
        budgets = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
    else:
        budgets = [int(float(g) * GiB) for g in split]
    layers = list(model.layers)
    per_layer_kv = _per_layer_kv(model, one.kv_per_token)
    layer_bytes = [layer.nbytes() + context * kv for layer, kv in zip(layers, per_layer_kv)]
    embed = model.embed.nbytes()
    tail = one.weights - embed - sum(layer.nbytes() for layer in layers)  # final norm and head
    ranks, first = [], 0
    for d, budget in enumerate(budgets):
        if first == len(layers):
            break
        room = budget - one.activations - one.graph_pool - RESERVE - tail - (embed if d == 0 else 0)
        last = first
        while last < len(layers) and room >= layer_bytes[last]:
            room -= layer_bytes[last]
            last += 1
        if last == first:
            continue  # too small for even one layer
        weights = sum(layers[i].nbytes() for i in range(first, last)) + (embed if d == 0 else 0)
        weights += tail if last == len(layers) else 0
        ranks.append(RankMemory(f"cuda:{d}", weights, sum(per_layer_kv[first:last]), 0, one.activations, one.graph_pool,
                                free=budget, layers=(first, last)))
        first = last
    if first < len(layers):
        raise MemoryPlanError(
            f"{model_dir}: {len(layers)} layers with {context} tokens of cache do not fit the split "
            f"{', '.join(gib(b) for b in budgets)}: layers {first}-{len(layers) - 1} are left "
            f"({gib(sum(layer_bytes[first:]))} more)"
        )
    return MemoryPlan(str(model_dir), tuple(ranks), chunk_tokens, max_batch)


def _per_layer_kv(model, total: int) -> list[int]:
    """KV bytes per token of each decoder layer (attention layers share ``total`` in proportion to their KV size)."""
    attn = model.attention_layers() if hasattr(model, "attention_layers") else [None] * len(model.layers)
    sizes = [0 if a is None else a.kv_shape()[0] * (a.kv_shape()[1] + a.kv_shape()[2]) for a in attn]
    whole = sum(sizes) or 1
    return [total * s // whole for s in sizes]


MIN_CONTEXT = 256  # cache tokens a load must leave room for (one page)


def refuse_unfit(model_dir: str | Path, tensor_parallel: int, device: torch.device, dtype: torch.dtype) -> None:
    """Before a CUDA load allocates anything: raise MemoryPlanError when a device cannot hold its share and a
    page of cache (naming the device, the need and the free memory)."""
    if device.type != "cuda":
        return
    from .sharding import ShardingError

    try:
        plan = plan_memory(model_dir, tensor_parallel, device, dtype)
    except (TrellmError, ShardingError):
        raise
    except Exception as e:  # noqa: BLE001 - a module that cannot load onto meta: load without the check
        warnings.warn(f"trellm: no memory plan for {model_dir} ({type(e).__name__}: {e}); loading without the check")
        return
    plan.check(MIN_CONTEXT)
