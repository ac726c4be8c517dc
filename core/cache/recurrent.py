"""Recurrent-state cache layers for hybrid models (gated delta net, Mamba-style layers).

An attention-free layer keeps a fixed-size state per sequence instead of pages: the last K-1 conv
inputs and the recurrent matrix state. States live in ``max_slots`` slots; a sequence holds one slot
(the same index in every recurrent layer, handed out in step by identical free lists) and its
ForwardBatch row names it in ``batch.state_slots``. A slot is zeroed when allocated, so a new
sequence starts from the zero state; :meth:`RecurrentStateLayer.copy_slot` checkpoints and restores
state (prefix reuse, speculative rollback).
"""
from __future__ import annotations

import torch

from . import CacheFullError, KVCache, KVCacheLayer, layer_placement

DEFAULT_STATE_SLOTS = 16


class RecurrentStateLayer:
    """Per-slot conv state [slots, conv_dim, conv_width-1] (model dtype) and recurrent state (float32).

    ``extra``: more per-slot state a layer keeps beside its mixer's, by name -> (shape, dtype) (Qwen 3.8-Flash-Next's
    n-gram token history and dilated-conv inputs); zeroed, copied and counted with the rest, in ``self.extra``.
    """

    def __init__(
        self,
        max_slots: int,
        conv_dim: int,
        conv_width: int,
        state_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
        state_dtype: torch.dtype = torch.float32,
        extra: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    ):
        if max_slots <= 0:
            raise ValueError(f"a recurrent cache layer needs at least one state slot, got {max_slots}")
        self.max_slots = max_slots
        self.conv_states = torch.zeros(max_slots, conv_dim, max(conv_width - 1, 0), dtype=dtype, device=device)
        self.states = torch.zeros(max_slots, *state_shape, dtype=state_dtype, device=device)
        self.extra = {name: torch.zeros(max_slots, *shape, dtype=dt, device=device) for name, (shape, dt) in (extra or {}).items()}
        self._free = list(range(max_slots - 1, -1, -1))

    def _per_slot(self) -> list[torch.Tensor]:
        return [self.conv_states, self.states, *self.extra.values()]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc_slot(self) -> int:
        """A zeroed slot (raises CacheFullError when all are taken)."""
        if not self._free:
            raise CacheFullError(f"all {self.max_slots} recurrent-state slots are in use")
        slot = self._free.pop()
        for t in self._per_slot():
            t[slot].zero_()
        return slot

    def free_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots or slot in self._free:
            raise ValueError(f"recurrent-state slot {slot} is not allocated")
        self._free.append(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        for t in self._per_slot():
            t[dst].copy_(t[src])

    def read(self, slots: torch.Tensor, fresh: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv states, recurrent states) of ``slots`` [B]; rows where ``fresh`` [B] is True read as zeros.
        No host sync (a decode graph captures it): the mask applies whether or not a row is fresh."""
        conv, state = self.conv_states[slots], self.states[slots]
        if fresh is not None:
            zero = conv.new_zeros(())
            conv = torch.where(fresh.view(-1, 1, 1), zero, conv)
            state = torch.where(fresh.view(-1, *([1] * (state.dim() - 1))), state.new_zeros(()), state)
        return conv, state

    def write(self, slots: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.conv_states[slots] = conv.to(self.conv_states.dtype)
        self.states[slots] = state.to(self.states.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._per_slot())


def build_hybrid_cache(
    model,
    max_tokens: int = 8192,
    page_size: int = 256,
    max_slots: int = DEFAULT_STATE_SLOTS,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    layer_factory=None,
) -> KVCache:
    """A KVCache for a hybrid model: paged KV for attention layers, a :class:`RecurrentStateLayer` for
    each layer whose mixer offers ``state_layer(max_slots, dtype, device)`` (see ``model.recurrent_layers()``)."""
    place = layer_placement(model, device)
    dtype = dtype or model.embed.weight.dtype
    cache = KVCache.for_model(model, max_tokens, page_size, dtype, device, layer_factory)
    for i, mixer in enumerate(model.recurrent_layers()):
        if mixer is not None:
            cache.layers[i] = mixer.state_layer(max_slots, dtype, place(i))
    cache.made_with["max_slots"] = max_slots  # a tensor-parallel rank makes its own part with make_cache(**made_with)
    return cache


def state_layers(cache: KVCache) -> list[RecurrentStateLayer]:
    """The layers keeping per-slot state (the same test as :meth:`KVCache.state_layers`, so both agree)."""
    return cache.state_layers()


def alloc_state_slot(cache: KVCache) -> int | None:
    """One slot index valid in every recurrent layer of ``cache`` (None when it has none)."""
    layers = state_layers(cache)
    if not layers:
        return None
    if min(l.free_slots for l in layers) == 0:  # check first, so a full layer never strands a slot of another
        raise CacheFullError(f"all {layers[0].max_slots} recurrent-state slots are in use")
    taken = [l.alloc_slot() for l in layers]
    if len(set(taken)) != 1:
        for l, s in zip(layers, taken):
            l.free_slot(s)
        raise RuntimeError(f"recurrent cache layers handed out different slots {taken}; allocate through alloc_state_slot")
    return taken[0]


def slots_in_use(cache: KVCache) -> set[int]:
    """Slots allocated in the recurrent layers (they allocate in step, so the first layer speaks for all)."""
    layers = state_layers(cache)
    if not layers:
        return set()
    used = [set(range(l.max_slots)) - set(l._free) for l in layers]
    if any(u != used[0] for u in used):
        raise AssertionError(f"recurrent cache layers disagree on allocated slots: {used}")
    return used[0]


def free_state_slot(cache: KVCache, slot: int | None) -> None:
    if slot is not None:
        for l in state_layers(cache):
            l.free_slot(slot)


def copy_state_slot(cache: KVCache, src: int, dst: int) -> None:
    for l in state_layers(cache):
        l.copy_slot(src, dst)
    if cache.state_copies is not None:  # the other tensor-parallel ranks copy their part before the next step
        cache.state_copies.append((src, dst))


__all__ = [
    "DEFAULT_STATE_SLOTS",
    "KVCacheLayer",
    "RecurrentStateLayer",
    "alloc_state_slot",
    "build_hybrid_cache",
    "copy_state_slot",
    "free_state_slot",
    "slots_in_use",
    "state_layers",
]
