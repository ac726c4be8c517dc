"""What a model, a cache layer or a draft proposer can do, named once.

Core code asks these questions through the helpers below instead of probing attributes with
``hasattr``: each capability has one name, one definition of the methods it means and one place to
read about it (vLLM's ``interfaces.py`` idea). The Protocols are runtime-checkable and structural: a
plugin's module gains a capability by implementing the methods, with no base class or registration.
"""
from __future__ import annotations

from functools import cache
from typing import Any, Generic, Protocol, Sequence, runtime_checkable

import torch


@cache
def _members(protocol: type) -> tuple[str, ...]:
    """The attribute and method names a Protocol requires."""
    names: set[str] = set()
    for base in protocol.__mro__:
        if base not in (object, Protocol, Generic):
            names |= {n for n in vars(base) if not n.startswith("_")} | set(vars(base).get("__annotations__", {}))
    return tuple(sorted(names))


def implements(obj: Any, protocol: type) -> bool:
    """``isinstance(obj, protocol)`` for a runtime-checkable Protocol, with its member names computed once.

    The same structural test (every member present on ``obj``), but Python 3.11's own check recomputes the
    members on each call: about 100 µs, measured, which the cache and generator would pay per layer.
    """
    return obj is not None and all(hasattr(obj, name) for name in _members(protocol))


# ---- models --------------------------------------------------------------------------------------


@runtime_checkable
class HasRecurrentState(Protocol):
    """A model some of whose layers keep per-sequence recurrent state (gated delta net, Mamba2, short
    conv): it builds its own cache (paged KV for the attention layers plus state slots), and its steps
    are not captured in CUDA graphs."""

    def recurrent_layers(self) -> list[Any | None]:
        """Per decoder layer, the mixer keeping state (None for attention layers)."""

    def make_cache(self, max_tokens: int = 8192, page_size: int = 256, max_slots: int | None = None, **kwargs: Any) -> Any:
        """A :class:`~trellm.cache.KVCache` with state layers for the recurrent mixers."""


@runtime_checkable
class SupportsImages(Protocol):
    """A model that takes images in its prompts (:class:`~trellm.multimodal.VisionLanguageModel`)."""

    def preprocess(self, image: Any) -> Any:
        """A decoded image -> a VisionInput (pixels, token count, digest)."""

    def encode(self, items: Sequence[Any]) -> list[torch.Tensor]:
        """VisionInputs -> one [num_tokens, hidden] embedding block each."""

    def prepare(self, prompt: Any, images: Sequence[Any], tokenizer: Any = None) -> Any:
        """A prompt with image markers and its images -> a MultimodalPrompt."""


@runtime_checkable
class HasMTPHead(Protocol):
    """A model carrying a multi-token-prediction head (``mtp``: an MTPHead, or None when the
    checkpoint has no ``mtp.*`` tensors)."""

    mtp: Any


@runtime_checkable
class HasStopTokens(Protocol):
    """A config naming its end-of-sequence token ids."""

    eos_token_ids: tuple[int, ...]


@runtime_checkable
class HasDefaultStopIds(Protocol):
    """A loaded model that knows which token ids end a generation (config and tokenizer together)."""

    def default_stop_ids(self) -> set[int]:
        """Token ids that stop generation by default."""


@runtime_checkable
class SplitsOverRanks(Protocol):
    """A module (a plugin's own, e.g. DeepSeek's latent attention) that splits itself for tensor parallel:
    ``split_over_ranks(comm)`` keeps this rank's part (``comm.rank`` of ``comm.world``), cutting its
    projections with ``trellm.sdk``'s ``split_columns`` / ``split_rows`` (the latter all-reduces)."""

    def split_over_ranks(self, comm: Any) -> None:
        """Keep only this rank's share of the module's weights and shrink its sizes to match."""


@runtime_checkable
class HoldsSomeExperts(Protocol):
    """An expert collection holding only experts [start, stop) of the ``whole_experts`` its checkpoint has (expert
    parallel: the other ranks hold the rest): ``per_expert[i]`` is expert ``start + i`` (None: held as stacked
    tensors). A LoRA adapter's factors of the other experts are another rank's to keep."""

    start: int
    stop: int
    whole_experts: int
    per_expert: list | None


@runtime_checkable
class ReadsEarlierCache(Protocol):
    """A mixer that attends over an earlier layer's cache instead of keeping its own (Gemma 4's KV-sharing
    layers): ``cache_source`` is that layer's index. A layer split keeps the two on one device."""

    cache_source: int


def cache_source(module: Any) -> int | None:
    """The earlier layer whose cache ``module`` reads (:class:`ReadsEarlierCache`), or None."""
    return module.cache_source if implements(module, ReadsEarlierCache) else None


def is_hybrid(model: Any) -> bool:
    """Whether ``model`` keeps recurrent state (:class:`HasRecurrentState`)."""
    return implements(model, HasRecurrentState)


def supports_images(model: Any) -> bool:
    """Whether ``model`` takes images (:class:`SupportsImages`)."""
    return implements(model, SupportsImages)


def mtp_head(model: Any) -> Any | None:
    """The model's multi-token-prediction head, or None (:class:`HasMTPHead`)."""
    return model.mtp if implements(model, HasMTPHead) else None


def config_stop_ids(config: Any) -> set[int]:
    """The end-of-sequence ids a config names; none for configs without them (:class:`HasStopTokens`)."""
    return set(config.eos_token_ids or ()) if implements(config, HasStopTokens) else set()


# ---- cache layers --------------------------------------------------------------------------------


@runtime_checkable
class PagedKVLayer(Protocol):
    """A cache layer holding an attention layer's K/V in pages handed out by the shared allocator
    (fp16 or quantized)."""

    num_pages: int

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write new tokens' K/V at flat ``slots`` (page * page_size + offset)."""

    def attend(self, q: torch.Tensor, batch: Any, scale: float, sliding_window: int = 0, softcap: float = 0.0,
               sinks: Any = None) -> torch.Tensor:
        """Attention of ``q`` over the cached K/V of each sequence of ``batch``."""

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page (copy-on-write of a shared prefix page)."""

    def nbytes(self) -> int:
        """Bytes held."""


@runtime_checkable
class DenseKVPages(PagedKVLayer, Protocol):
    """A paged KV layer whose pages are plain tensors [num_pages, page_size, kv_heads, head_dim] that
    code may read directly (the unquantized cache)."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor


@runtime_checkable
class MakesCacheLayer(Protocol):
    """An attention module whose cache layer keeps more per token than its K/V (a sparse-attention indexer's
    keys): :meth:`~trellm.cache.KVCache.for_model` hands it the K/V layer its factory made to wrap."""

    def cache_layer(self, kv_layer: Any) -> Any:
        """The layer this module's cache entry is, built around ``kv_layer``."""


@runtime_checkable
class StateSlots(Protocol):
    """A cache layer holding recurrent state in per-sequence slots."""

    def alloc_slot(self) -> int:
        """A free slot, zeroed."""

    def free_slot(self, slot: int) -> None:
        """Give a slot back."""

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one slot's state (prefix checkpoints, draft snapshots)."""

    def nbytes(self) -> int:
        """Bytes held."""


def is_paged_layer(layer: Any) -> bool:
    """Whether a cache layer holds paged K/V (:class:`PagedKVLayer`)."""
    return implements(layer, PagedKVLayer)


def has_dense_pages(layer: Any) -> bool:
    """Whether a cache layer's K/V pages are plain tensors (:class:`DenseKVPages`)."""
    return implements(layer, DenseKVPages)


def is_state_layer(layer: Any) -> bool:
    """Whether a cache layer holds recurrent-state slots (:class:`StateSlots`)."""
    return implements(layer, StateSlots)


# ---- draft proposers -----------------------------------------------------------------------------


@runtime_checkable
class DraftsFromHiddenStates(Protocol):
    """A proposer that drafts from the target model's hidden states (MTP): the generator hands it
    each step's final hidden rows, and runs without CUDA graphs for it."""

    def observe_hidden(self, key: Any, start: int, hidden: torch.Tensor, tokens: Sequence[int]) -> None:
        """Rows ``start..`` of sequence ``key``'s hidden states and the tokens they produced."""


def wants_hidden_states(proposer: Any) -> bool:
    """Whether a proposer drafts from hidden states (:class:`DraftsFromHiddenStates`)."""
    return implements(proposer, DraftsFromHiddenStates)
