"""Quantized KV cache layers: K and V stored at 2..8 bits each (see :mod:`trellm.ops.kv_quant`).

The layer keeps the same ``store()`` / ``attend()`` interface as :class:`KVCacheLayer`. The torch
reference attends by staging: it dequantizes the pages the batch touches into a compact fp buffer
and runs the ordinary paged attention over it (a CUDA kernel may fuse the dequantization instead).
"""
from __future__ import annotations

import functools

import torch

from .. import ops
from ..ops.kv_quant import GROUP, kv_dequantize_pages, kv_quantize_store
from . import DEFAULT_PAGE_SIZE, KVCache


class QuantizedKVCacheLayer:
    """Pages of packed codes (int32) and fp16 group scales for K and for V."""

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 dtype: torch.dtype, device, k_bits: int = 4, v_bits: int = 4):
        for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
            if not 2 <= bits <= 8:
                raise ValueError(f"quantized KV cache: {name} must be in 2..8, got {bits}")
        k_dim, v_dim = num_kv_heads * head_dim, num_kv_heads * v_head_dim
        for what, dim in (("K", k_dim), ("V", v_dim)):
            if dim % GROUP:
                raise ValueError(f"quantized KV cache: {what} width per token (kv_heads*head_dim = {dim}) must be a multiple of {GROUP}")
        self.num_pages, self.page_size = num_pages, page_size
        self.num_kv_heads, self.head_dim, self.v_head_dim = num_kv_heads, head_dim, v_head_dim
        self.k_bits, self.v_bits, self.dtype = k_bits, v_bits, dtype
        self.qk = torch.zeros(num_pages, page_size, k_dim // GROUP * k_bits, dtype=torch.int32, device=device)
        self.qv = torch.zeros(num_pages, page_size, v_dim // GROUP * v_bits, dtype=torch.int32, device=device)
        self.sk = torch.zeros(num_pages, page_size, k_dim // GROUP, dtype=torch.float16, device=device)
        self.sv = torch.zeros(num_pages, page_size, v_dim // GROUP, dtype=torch.float16, device=device)

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        kv_quantize_store(k.reshape(k.shape[0], -1), self.k_bits, self.qk, self.sk, slots)
        kv_quantize_store(v.reshape(v.shape[0], -1), self.v_bits, self.qv, self.sv, slots)

    def _staged(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K/V of ``pages`` as [n, page_size, heads, dim] in the model dtype."""
        n = pages.shape[0]
        k = kv_dequantize_pages(self.qk, self.sk, pages, self.k_bits, self.dtype)
        v = kv_dequantize_pages(self.qv, self.sv, pages, self.v_bits, self.dtype)
        return (k.view(n, self.page_size, self.num_kv_heads, self.head_dim),
                v.view(n, self.page_size, self.num_kv_heads, self.v_head_dim))

    def attend(self, q: torch.Tensor, batch, scale: float, sliding_window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        ps = self.page_size
        used = [(-(-int(c) // ps)) for c in batch.context_lens.tolist()]
        table = batch.block_table
        needed = torch.cat([table[b, :n] for b, n in enumerate(used)]).long() if any(used) else table.new_zeros(1).long()
        pages, inverse = torch.unique(needed, return_inverse=True)
        compact = torch.zeros_like(table)
        start = 0
        for b, n in enumerate(used):
            compact[b, :n] = inverse[start:start + n].to(table.dtype)
            start += n
        k_pages, v_pages = self._staged(pages)
        return ops.paged_attention(q, k_pages, v_pages, compact, batch.cu_seqlens, batch.context_lens,
                                   scale, sliding_window, softcap, sinks)

    def copy_page(self, src: int, dst: int) -> None:
        for t in (self.qk, self.qv, self.sk, self.sv):
            t[dst].copy_(t[src])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qk, self.qv, self.sk, self.sv))


def quantized_layer_factory(k_bits: int = 4, v_bits: int = 4):
    """A ``layer_factory`` for :meth:`KVCache.for_model` making quantized layers."""
    return functools.partial(_make, k_bits=k_bits, v_bits=v_bits)


def _make(num_pages, page_size, heads, dim, vdim, dtype, device, *, k_bits, v_bits):
    return QuantizedKVCacheLayer(num_pages, page_size, heads, dim, vdim, dtype, device, k_bits, v_bits)


def quantized_cache(model, k_bits: int = 4, v_bits: int = 4, max_tokens: int = 8192,
                    page_size: int = DEFAULT_PAGE_SIZE, **kwargs) -> KVCache:
    """A paged cache for ``model`` (a LoadedModel or its module tree) storing K at ``k_bits`` and V at ``v_bits``."""
    model = getattr(model, "model", model)
    return KVCache.for_model(model, max_tokens=max_tokens, page_size=page_size,
                             layer_factory=quantized_layer_factory(k_bits, v_bits), **kwargs)
