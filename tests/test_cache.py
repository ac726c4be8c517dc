"""Page accounting, prefix hashing and eviction order, and the quantized KV cache numbers."""
from __future__ import annotations

import math

import pytest
import torch

from trellm import ops
from trellm.batch import ForwardBatch
from trellm.cache import CacheFullError, KVCacheLayer, PageAllocator
from trellm.cache.prefix import PrefixCache, page_hashes
from trellm.cache.quantized import QuantizedKVCacheLayer
from trellm.ops.kv_quant import _hadamard32, _pack, _unpack, bit_planes


def test_page_hashes_are_chained():
    a = page_hashes(list(range(10)), 4)
    b = page_hashes(list(range(8)) + [99, 98], 4)
    c = page_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)
    assert len(a) == 2  # the partial third page has no name
    assert a == b  # same full pages, same names
    assert c[0] == a[0] and c[1] != a[1]
    assert page_hashes([4, 5, 6, 7], 4) != a[1:]  # a page's name depends on everything before it


def test_prefix_cache_lookup_evicts_lru_deepest_first():
    alloc = PageAllocator(6)
    cache = PrefixCache(alloc, page_size=4)
    seq_a = alloc.alloc(3)
    names_a = page_hashes(list(range(12)), 4)
    for depth, (name, page) in enumerate(zip(names_a, seq_a)):
        cache.insert(name, page, depth)
    cache.verify([seq_a])
    assert cache.lookup(page_hashes(list(range(8)) + [50] * 4, 4)) == seq_a[:2]
    alloc.decref(seq_a)  # job A finishes: its pages stay cached
    cache.verify([])
    assert alloc.free_pages == 3 and cache.available() == 6
    seq_b = cache.alloc(4)  # needs one eviction: the deepest page of the chain goes first
    assert seq_a[2] in seq_b and cache.lookup(names_a) == seq_a[:2]
    cache.verify([seq_b])
    with pytest.raises(CacheFullError):
        cache.alloc(3)
    alloc.decref(seq_b)
    cache.clear()
    cache.verify([])
    assert alloc.free_pages == 6


def test_verify_catches_a_leak():
    alloc = PageAllocator(4)
    cache = PrefixCache(alloc, 4)
    pages = alloc.alloc(2)
    with pytest.raises(AssertionError, match="refcount"):
        cache.verify([pages[:1]])


# ---- quantized cache ------------------------------------------------------------------------------


def test_bit_planes_and_packing_round_trip():
    assert bit_planes(7) == [4, 2, 1] and bit_planes(8) == [8] and bit_planes(3) == [2, 1]
    for bits in range(2, 9):
        codes = torch.randint(0, 2**bits, (9, 32))
        packed = _pack(codes, bits)
        assert packed.dtype == torch.int32 and packed.shape == (9, bits)
        assert torch.equal(_unpack(packed, bits), codes)
    # layout: 4-bit value j sits at bit offset 4*j of the plane's words (little-endian)
    codes = torch.arange(32).remainder(16)[None]
    words = _pack(codes, 4).long() & 0xFFFFFFFF
    assert int(words[0, 0]) == sum(j << (4 * j) for j in range(8))
    with pytest.raises(ValueError, match="2..8"):
        bit_planes(9)


def test_hadamard_is_orthogonal():
    h = _hadamard32("cpu")
    assert torch.equal(h @ h.T, 32 * torch.eye(32))


def test_kv_quantize_error_halves_per_bit():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    x[:, 5] *= 20  # an outlier channel: the rotation spreads it over its group
    errors = []
    for bits in range(2, 9):
        packed, scales = ops.kv_quantize(x, bits)
        assert packed.shape == (64, 4 * bits) and scales.shape == (64, 4) and scales.dtype == torch.float16
        y = ops.kv_dequantize(packed, scales, bits, torch.float32)
        errors.append(((y - x).norm() / x.norm()).item())
    for lo, hi in zip(errors[1:], errors[:-1]):
        assert 0.4 < lo / hi < 0.6
    assert errors[-1] < 0.01
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.kv_quantize(torch.randn(2, 40), 4)


def test_quantized_layer_attends_like_fp_layer():
    torch.manual_seed(0)
    pages, page_size, heads, dim = 6, 8, 2, 32
    fp = KVCacheLayer(pages, page_size, heads, dim, dim, torch.float32, "cpu")
    q8 = QuantizedKVCacheLayer(pages, page_size, heads, dim, dim, torch.float32, "cpu", k_bits=8, v_bits=8)
    q3 = QuantizedKVCacheLayer(pages, page_size, heads, dim, dim, torch.float32, "cpu", k_bits=3, v_bits=5)

    class Cache:
        device, page_size = torch.device("cpu"), 8

    # two sequences using non-contiguous pages, mixed prefill/decode
    batch = ForwardBatch.with_cache([list(range(11)), [1]], [0, 4], [[5, 1], [3]], Cache(), all_logits=True)
    k = torch.randn(batch.num_tokens, heads, dim)
    v = torch.randn(batch.num_tokens, heads, dim)
    q = torch.randn(batch.num_tokens, 4, dim)
    outs = []
    for layer in (fp, q8, q3):
        layer.store(k, v, batch.slots)
        outs.append(layer.attend(q, batch, 1 / math.sqrt(dim)))
    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(outs[1], outs[0]) < 0.01
    assert rel(outs[1], outs[0]) < rel(outs[2], outs[0]) < 0.3
    assert q3.nbytes() < q8.nbytes() < fp.nbytes()
    with pytest.raises(ValueError, match="k_bits"):
        QuantizedKVCacheLayer(2, 8, 2, 32, 32, torch.float32, "cpu", k_bits=1)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedKVCacheLayer(2, 8, 1, 24, 24, torch.float32, "cpu")
