"""Layer split: a model's decoder layers spread in order over several devices (GPUs of different sizes).

:func:`~trellm.distributed.plan.plan_layer_split` decides the boundaries before anything is allocated (each
device's free memory, or the GiB given per device, against its layers' weights and their KV cache for the asked
context). The load then puts the embedding on the first device, each decoder layer on its stage's device, the
final norm, head and any other top-level module (an MTP head, a hyper-connection head) on the last; each cache
layer is made on its layer's device (``KVCache.for_model`` asks ``model.layer_split``). A layer that reads an
earlier layer's cache (Gemma 4's KV sharing) sits on that layer's device (:func:`cache_reads`).

How a step crosses devices, with every family's own layer loop unchanged: each placed module's ``forward`` is
preceded by one that brings its inputs to its device (an instance attribute over the method, as accelerate's
device hooks do). The hidden state moves where a stage begins; the step's batch (positions, page tables,
lengths, slots, LoRA rows) is copied to a stage's device once, when its first module asks, and reused by the
stage's other layers. The model's ``forward`` hands the logits back on the first device, where the batch was
built and the sampler runs.

No CUDA graphs under a split: a torch graph captures the stream of one device, and capturing each device's
segment apart would need every family's layer loop cut into per-device pieces. Steps run eagerly; the load says
so in one line. A split model serves models too large for one GPU, whose steps read so many weight bytes that
the launch overhead graphs save is a smaller share than on the small models graphs were measured for.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import attrs
import torch

from ..batch import ForwardBatch
from ..capabilities import cache_source
from ..errors import UsageError
from ..ops import Hidden


def cache_reads(layers: Sequence[Any]) -> tuple[int, ...]:
    """Per decoder layer, the earliest layer whose cache it reads: itself, or the earlier layer a mixer of it attends
    over (:class:`~trellm.capabilities.ReadsEarlierCache`, Gemma 4's KV-sharing layers). Such a layer and its source
    share a device: its attention reads the source's cache pages where they are, every step, and a copy of them on
    its own device would cost the source's whole cache again and a write on both devices per token."""
    out = []
    for i, layer in enumerate(layers):
        sources = [s for s in map(cache_source, layer.modules()) if s is not None]
        out.append(min([i, *sources]))
    return tuple(out)


def can_cut(reads: Sequence[int], boundary: int) -> bool:
    """Whether a stage may end before layer ``boundary`` (``reads``: :func:`cache_reads`): no layer from there on
    reads the cache of a layer before it."""
    return all(r >= boundary for r in reads[boundary:])


def kept_together(reads: Sequence[int]) -> list[tuple[int, int]]:
    """The runs of layers [first, last] (inclusive) that no stage boundary may cut."""
    runs: list[tuple[int, int]] = []
    for b in range(1, len(reads)):
        if can_cut(reads, b):
            continue
        if runs and runs[-1][1] == b - 1:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((b - 1, b))
    return runs


@attrs.frozen
class Stage:
    """One device's share: decoder layers ``[first, last)``; stage 0 also holds the embedding, the last stage the
    final norm and head."""

    index: int
    device: torch.device
    first: int
    last: int


@attrs.define
class TransferCounts:
    """Crossings since the split was made: hidden states moved into a stage (one move per stage entry, however
    many tensors it carries: Gemma 4's per-layer inputs ride beside the hidden state), batches copied to a stage's
    device, and the bytes of both (what the benchmark prices per step)."""

    hidden_moves: int = 0
    batch_copies: int = 0
    hidden_bytes: int = 0
    batch_bytes: int = 0


class LayerSplit:
    """Where each part of a split model sits, and the moves between its stages (see the module docstring)."""

    def __init__(self, stages: Sequence[Stage]):
        if not stages:
            raise UsageError("a layer split needs at least one stage")
        self.stages = tuple(stages)
        self.home, self.tail = self.stages[0], self.stages[-1]
        self.counts = TransferCounts()
        self._layer_stage = [s for s in self.stages for _ in range(s.first, s.last)]
        self._batches: list[tuple[ForwardBatch, ForwardBatch] | None] = [None] * len(self.stages)

    @classmethod
    def from_plan(cls, plan: Any) -> "LayerSplit":
        """The stages of a :func:`~trellm.distributed.plan.plan_layer_split` plan (its devices that hold layers)."""
        return cls([Stage(i, torch.device(rank.device), *rank.layers) for i, rank in enumerate(plan.ranks)])

    @property
    def devices(self) -> list[torch.device]:
        return [s.device for s in self.stages]

    def layer_device(self, i: int) -> torch.device:
        """The device of decoder layer ``i`` (its cache layer is made there)."""
        return self._layer_stage[i].device

    def stage_of(self, model: Any, child: Any) -> Stage:
        """The stage a top-level module of ``model`` belongs to."""
        if child is model.embed:
            return self.home
        for i, layer in enumerate(model.layers):
            if child is layer:
                return self._layer_stage[i]
        return self.tail  # final norm, head, and what reads the last hidden state (MTP head, hyper-connection head)

    def placement(self, model: Any, child: Any) -> torch.device:
        """``load_local``'s placement: the device a top-level module loads onto."""
        return self.stage_of(model, child).device

    # ---- running -----------------------------------------------------------------------------------

    def install(self, model: Any) -> None:
        """Route ``model``'s steps across the stages (``model``: the loaded decoder stack, each part on its device)."""
        from ..modules.decoder import CausalLM

        if not isinstance(model, CausalLM):
            raise UsageError(f"a layer split places a decoder stack; {type(model).__name__} is not one")
        if len(model.layers) != len(self._layer_stage):
            raise UsageError(f"the split places {len(self._layer_stage)} layers, the model has {len(model.layers)}")
        for i, source in enumerate(cache_reads(model.layers)):
            if self._layer_stage[source] is not self._layer_stage[i]:
                raise UsageError(f"layer {i} reads the KV cache of layer {source}, but the split puts them on different "
                                 f"stages ({self._layer_stage[source].device} and {self._layer_stage[i].device}); keep "
                                 "them on one device (plan_layer_split does)")
        for child in model.children():
            stage = self.stage_of(model, child)
            child.forward = _OnStage(self, stage, child.forward, entry=stage.index > 0 and child is model.layers[stage.first])
        model.forward = _Step(self, model.forward)
        model.logits_from_hidden = _Step(self, model.logits_from_hidden)
        model.layer_split = self
        model.capturable = False  # see the module docstring
        if any(s.device.type == "cuda" for s in self.stages):
            warnings.warn(f"trellm: layer split over {', '.join(map(str, self.devices))}: decode steps run eagerly "
                          "(no CUDA graphs: a graph captures one device)", stacklevel=3)

    def batch_on(self, stage: Stage, batch: ForwardBatch) -> ForwardBatch:
        """``batch`` with its tensors on ``stage``'s device: the batch itself on stage 0 (where it was built), a copy
        made once per batch on every other stage."""
        if stage.index == 0:
            return batch
        memo = self._batches[stage.index]
        if memo is not None and memo[0] is batch:
            return memo[1]
        moved, size = {}, 0
        for field in attrs.fields(ForwardBatch):
            value = getattr(batch, field.name)
            if isinstance(value, torch.Tensor):
                moved[field.name] = value.to(stage.device)
                size += value.numel() * value.element_size()
        local = attrs.evolve(batch, **moved)
        self._batches[stage.index] = (batch, local)
        self.counts.batch_copies += 1
        self.counts.batch_bytes += size
        return local

    def bring(self, value: Any, stage: Stage, entry: bool) -> Any:
        """``value`` (a batch, a tensor, a hidden state; anything else as it is) on ``stage``'s device."""
        if isinstance(value, ForwardBatch):
            return self.batch_on(stage, value)
        if isinstance(value, Hidden):
            moved = Hidden(*(None if t is None else t.to(stage.device) for t in (value.x, value.residual, value.ssq)))
            if entry:
                self._count_hidden_bytes(value.x, value.residual)
            return moved
        if isinstance(value, torch.Tensor):
            if entry:
                self._count_hidden_bytes(value)
            return value.to(stage.device)
        return value

    def _count_hidden_bytes(self, *tensors: torch.Tensor | None) -> None:
        self.counts.hidden_bytes += sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _OnStage:
    """A placed module's forward: its inputs brought to its stage first (``entry``: the stage's first layer,
    where the hidden state crosses), run with its GPU current (the kernels launch on the current device's
    stream and keep per-device state)."""

    def __init__(self, split: LayerSplit, stage: Stage, forward: Any, entry: bool):
        self.split, self.stage, self.forward, self.entry = split, stage, forward, entry
        self.cuda = stage.device.type == "cuda"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        split, stage, entry = self.split, self.stage, self.entry
        if entry:
            split.counts.hidden_moves += 1
        args = tuple(split.bring(a, stage, entry) for a in args)
        kwargs = {k: split.bring(v, stage, entry) for k, v in kwargs.items()}
        if not self.cuda:
            return self.forward(*args, **kwargs)
        with torch.cuda.device(stage.device):
            return self.forward(*args, **kwargs)


class _Step:
    """The model's forward (or logits from hidden states) under a split: the logits rows picked on the last
    stage, the logits handed back on the first device."""

    def __init__(self, split: LayerSplit, method: Any):
        self.split, self.method = split, method

    def __call__(self, *args: Any) -> torch.Tensor:
        *rest, batch = args
        rows = batch.logits_indices
        if rows is not None and rows.device != self.split.tail.device:
            batch = attrs.evolve(batch, logits_indices=rows.to(self.split.tail.device))
        out = self.method(*rest, batch)
        return out.to(self.split.home.device)


def parse_gpu_split(value: Any) -> str | list[float] | None:
    """A ``--gpu-split`` value: "auto", GiB per device as "20,24" or a list of numbers, or None (no split)."""
    if value is None or value == "auto":
        return value
    parts = value.split(",") if isinstance(value, str) else value
    try:
        sizes = [float(p) for p in parts]
    except (TypeError, ValueError):
        sizes = []
    if not sizes or not all(s > 0 for s in sizes):  # also refuses nan
        raise UsageError(f"gpu_split must be 'auto' or GiB per device like 20,24 (each more than 0), got {value!r}")
    return sizes


def load_layer_split(model_dir: str | Path, gpu_split: str | Sequence[float], device: Any, dtype: Any, progress: bool,
                     tokenizer: bool, context: int):
    """A ``LoadedModel`` of ``model_dir`` with its layers spread as :func:`~trellm.distributed.plan.plan_layer_split`
    plans for ``context`` cache tokens (refused before anything is allocated when it does not fit)."""
    from ..model import load_local
    from .plan import device_and_dtype, plan_layer_split

    model_dir = Path(model_dir)
    dev, dt = device_and_dtype(model_dir, device, dtype)
    split = LayerSplit.from_plan(plan_layer_split(model_dir, gpu_split, context, dev, dt))
    lm = load_local(model_dir, split.home.device, dt, progress, tokenizer, placement=split.placement)
    split.install(lm.model)
    return lm
