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

from ..capabilities import is_hybrid, is_state_layer
from ..errors import TrellmError
from ..weights import WeightStore
from .layer_split import can_cut, cache_reads, kept_together

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
                 cache_kwargs: dict) -> tuple[object, int, int, int, object]:
    """(model, weight bytes, KV bytes per token, state bytes per slot, a cache with one state slot) of one rank,
    loaded onto ``meta``."""
    from ..model import load_local
    from .sharding import shard_loaded_child

    split = comm is not None and comm.world > 1
    loaded = load_local(model_dir, torch.device("meta"), dtype, False, False, on_child_loaded=shard_loaded_child(comm) if split else None,
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
    return model, weights, kv, state, cache


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
        model, weights, kv, state, _ = _rank_memory(model_dir, comm, dt, chunk_tokens, max_batch, cache_kwargs or {})
        rank_dev = torch.device(dev.type, (dev.index or 0) + rank) if dev.type == "cuda" else dev
        graphs = _activations(model, max_batch, max_batch, element) if dev.type == "cuda" else 0
        ranks.append(RankMemory(
            str(rank_dev), weights, kv, state, _activations(model, chunk_tokens, max_batch, element), graphs,
            free=int(free[rank] * GiB) if free is not None else _free_bytes(rank_dev),
            reserve=RESERVE if dev.type == "cuda" else 0,
        ))
    return MemoryPlan(str(model_dir), tuple(ranks), chunk_tokens, max_batch)


@attrs.frozen
class LayerCosts:
    """What each part of a model costs on the device that holds it (bytes), from a load onto ``meta``: the
    embedding (and any other module that is not a decoder layer, final norm or head: they stay with it), each
    decoder layer's weights, KV cache per token and recurrent state per slot, the final norm with the head, and
    one device's temporaries of a prefill chunk."""

    embed: int
    layer_weights: tuple[int, ...]
    layer_kv: tuple[int, ...]  # bytes per cache token
    layer_state: tuple[int, ...]  # bytes per recurrent-state slot
    tail: int  # final norm and LM head (a tied head is a copy of the embedding when it sits on another device)
    tied_head: int  # bytes of that copy (0: the head has its own tensor)
    activations: int
    cache_reads: tuple[int, ...] = ()  # per layer, the earliest layer whose cache it reads (layer_split.cache_reads)

    def layer(self, i: int, context: int, slots: int) -> int:
        return self.layer_weights[i] + context * self.layer_kv[i] + slots * self.layer_state[i]


def layer_costs(model_dir: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                chunk_tokens: int = 2048, max_batch: int = 16, cache_kwargs: dict | None = None) -> LayerCosts:
    """:class:`LayerCosts` of ``model_dir`` loaded with this dtype (no tensor data is read)."""
    from ..modules.decoder import CausalLM

    model_dir = Path(model_dir)
    _, dt = device_and_dtype(model_dir, device, dtype)
    model, weights, _, _, cache = _rank_memory(model_dir, None, dt, chunk_tokens, max_batch, cache_kwargs or {})
    if not isinstance(model, CausalLM):
        raise MemoryPlanError(f"{model_dir}: a layer split places a decoder stack (embedding, layers, norm, head); "
                              f"{type(model).__name__} is not one (models with image input are not split yet)")
    tokens = cache.num_pages * cache.page_size
    kv, state = [], []
    for layer in cache.layers:
        size = 0 if layer is None else layer.nbytes()
        kv.append(0 if layer is None or is_state_layer(layer) else size // tokens)
        state.append(size if is_state_layer(layer) else 0)
    layer_weights = tuple(layer.nbytes() for layer in model.layers)
    head = model.lm_head.nbytes()
    tail = model.norm.nbytes() + head
    tied = head if _tied(model) else 0
    embed = weights - sum(layer_weights) - tail + tied  # embedding and the other modules (MTP head, per-layer inputs)
    element = torch.empty((), dtype=dt).element_size()
    return LayerCosts(embed, layer_weights, tuple(kv), tuple(state), tail, tied,
                      _activations(model, chunk_tokens, max_batch, element), cache_reads(model.layers))


def _tied(model) -> bool:
    """Whether the LM head holds the embedding's own tensor (the load hands a tied head that very tensor)."""
    head = getattr(getattr(model.lm_head, "impl", None), "weight", None)
    return head is not None and head is getattr(model.embed, "weight", None)


def split_devices(device: str | torch.device | None, count: int) -> list[torch.device]:
    """``count`` devices from ``device``: cuda:k, cuda:k+1, ... on CUDA; the one CPU ``count`` times (each entry a
    separate stage, which is how the CPU tests run the placement)."""
    from ..model import resolve_device

    base = resolve_device(device)
    if base.type != "cuda":
        return [base] * count
    first = base.index or 0
    if first + count > torch.cuda.device_count():
        raise MemoryPlanError(f"a split over {count} GPUs from cuda:{first} needs {first + count} visible GPUs, "
                              f"this machine has {torch.cuda.device_count()}")
    return [torch.device("cuda", first + i) for i in range(count)]


def plan_layer_split(model_dir: str | Path, split: Sequence[float] | str = "auto", context: int = 8192,
                     device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                     chunk_tokens: int = 2048, max_batch: int = 16, free: Sequence[float] | None = None,
                     slots: int | None = None, cache_kwargs: dict | None = None) -> MemoryPlan:
    """Decoder layers spread in order over devices of different sizes, each device holding its layers' weights,
    ``context`` tokens of their KV cache and ``slots`` recurrent-state slots (default ``2 * max_batch``: the
    Generator's jobs and prefix checkpoints), plus a prefill chunk's temporaries; the embedding on the first
    device, the final norm and head with the last layer. Devices are filled in order; one too small for the
    next layer is passed over. Raises MemoryPlanError (naming the devices, the need and the room) before
    anything is allocated when the layers do not fit.

    ``split``: GiB trellm may use on each device (beside the CUDA context), or "auto": each device's free
    memory less a reserve for the context. ``device``: the first device ("cuda:1": cuda:1, cuda:2, ...; "cpu":
    every stage on the CPU). ``free``: each device's free GiB to plan against (simulated sizes); default: what
    CUDA reports now.
    """
    model_dir = Path(model_dir)
    auto = isinstance(split, str)
    if auto and split != "auto":
        raise MemoryPlanError(f"gpu_split must be 'auto' or GiB per device, got {split!r}")
    if not auto and (not split or any(not float(g) > 0 for g in split)):
        raise MemoryPlanError(f"gpu_split needs a positive number of GiB per device, got {list(split)}")
    count = (len(free) if free is not None else _visible_from(device)) if auto else len(split)
    devices = split_devices(device, count)
    cuda = devices[0].type == "cuda"
    reserve = RESERVE if cuda else 0
    if free is not None:
        free_bytes: list[int | None] = [int(float(f) * GiB) for f in free]
    else:
        free_bytes = [_free_bytes(d) for d in devices]
    if auto:
        if any(f is None for f in free_bytes):
            raise MemoryPlanError("gpu_split='auto' reads each GPU's free memory: it needs CUDA devices; give GiB per device")
        budgets = [f - reserve for f in free_bytes]
    else:
        budgets = [int(float(g) * GiB) for g in split]
        for d, want, have in zip(devices, budgets, free_bytes):
            if have is not None and want + reserve > have:
                raise MemoryPlanError(f"gpu_split asks {gib(want)} of {d}, which has {gib(have)} free "
                                      f"({gib(reserve)} of it kept for the CUDA context and workspaces)")
    costs = layer_costs(model_dir, devices[0], dtype, chunk_tokens, max_batch, cache_kwargs)
    slots = 2 * max_batch if slots is None else slots
    stages = _fill(costs, budgets, context, slots, str(model_dir), devices)
    ranks = []
    for d, (first, last) in stages:
        on_first, on_last = first == 0, last == len(costs.layer_weights)
        weights = sum(costs.layer_weights[first:last]) + (costs.embed if on_first else 0)
        if on_last:
            weights += costs.tail - (costs.tied_head if on_first else 0)
        ranks.append(RankMemory(str(devices[d]), weights, sum(costs.layer_kv[first:last]), sum(costs.layer_state[first:last]),
                                costs.activations, 0, free=budgets[d] + reserve, layers=(first, last), reserve=reserve))
    return MemoryPlan(str(model_dir), tuple(ranks), chunk_tokens, max_batch)


def _visible_from(device) -> int:
    if not torch.cuda.is_available():
        raise MemoryPlanError("gpu_split='auto' reads each GPU's free memory: it needs CUDA devices; give GiB per device")
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        raise MemoryPlanError(f"gpu_split='auto' spreads layers over GPUs, not {dev}; give GiB per device")
    return torch.cuda.device_count() - (dev.index or 0)


def _fill(costs: LayerCosts, budgets: list[int], context: int, slots: int, name: str,
          devices: list[torch.device]) -> list[tuple[int, tuple[int, int]]]:
    """(device index, [first, last) layers) per device that holds layers: each filled in order, the last one
    also holding the norm and head (a device that cannot fit them with its last layer hands layers on)."""
    n = len(costs.layer_weights)
    need = [costs.layer(i, context, slots) for i in range(n)]
    stages, first = [], 0
    for d, budget in enumerate(budgets):
        if first == n:
            break
        room = budget - costs.activations - (costs.embed if first == 0 else 0)
        if first == 0 and room < need[0]:
            raise MemoryPlanError(
                f"{name}: the first device {devices[d]} holds the embedding and layer 0: it needs "
                f"{gib(costs.embed + need[0] + costs.activations)} (embedding {gib(costs.embed)}, layer 0 with {context} "
                f"tokens of cache {gib(need[0])}, activations {gib(costs.activations)}), the split gives it {gib(budget)}")
        last = first
        while last < n and room >= need[last]:
            room -= need[last]
            last += 1
        if last == n:  # the head goes here too; without room for it, hand layers on to the next device
            tail = costs.tail - (costs.tied_head if first == 0 else 0)
            while last > first and room < tail:
                last -= 1
                room += need[last]
            if room < tail and last == first:
                continue
        while first < last < n and not can_cut(costs.cache_reads, last):  # a layer and the cache it reads stay together
            last -= 1
        if last > first:
            stages.append((d, (first, last)))
            first = last
    if first < n:
        held = "; ".join(f"{devices[d]} layers {a}-{b - 1}" for d, (a, b) in stages) or "no device holds a layer"
        left = sum(need[first:]) + costs.tail
        together = "".join(f"; layers {a}-{b} stay on one device (a layer reading an earlier layer's KV cache sits with it)"
                           for a, b in kept_together(costs.cache_reads) if b >= first)
        raise MemoryPlanError(
            f"{name}: {n} layers with {context} tokens of cache do not fit the split "
            f"{', '.join(f'{devices[d]} {gib(b)}' for d, b in enumerate(budgets))} ({held}): layers {first}-{n - 1} "
            f"and the head are left, {gib(left)} more{together}")
    return stages


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
