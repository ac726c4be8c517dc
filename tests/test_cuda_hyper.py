"""Hyper-connections (mHC: DeepSeek V4, GLM 5.3) on CUDA, held against their torch references.

``hyper_connection_weights`` (the RMS-normed streams through fn, pre / post, the Sinkhorn-normalised comb, the
block input) runs in two launches, ``hyper_connection_merge`` in one (kernels_cuda/hyper.cu), where
``TRELLM_HYPER_CONNECTIONS=kernel``; the default stays on the references until these tests pass on a GPU.

CPU tests: the route knob and both ops reaching their entry points through a stub library. CUDA tests (skipped
without a GPU): each kernel against its reference (bf16/fp16/fp32, 1..8 streams, Sinkhorn iterations 0/1/20,
widths 64 and 4096), replayed from a CUDA graph, and a tiny GLM 5.3's decode logits against the torch route.
"""
from __future__ import annotations

import pytest
import torch

from test_cuda_kda import declared_arguments, tiny_glm5_decode
from test_cuda_moe import cuda_impl, kernels, on_cuda, rel_err  # noqa: F401  (kernels: a fixture)
from test_projection_routes import stub_kernels  # noqa: F401  (a fixture)
from trellm.ops.hyper import (
    HYPER_CONNECTIONS_ENV, hyper_connection_merge, hyper_connection_weights, hyper_connections_route,
)


def hc_inputs(device, dtype, tokens=3, n=4, d=64, seed=0):
    """Streams [T, N, D] and a hyper-connection's float32 fn, base, scale; a block output [T, D]."""
    g = torch.Generator().manual_seed(seed)
    mixes = (2 + n) * n
    t = dict(
        streams=torch.randn(tokens, n, d, generator=g).to(dtype),
        fn=torch.randn(mixes, n * d, generator=g) * 2 / (n * d) ** 0.5,  # mixes of order 1: sigmoids not saturated
        base=torch.randn(mixes, generator=g), scale=torch.rand(3, generator=g) + 0.5,
        out=torch.randn(tokens, d, generator=g).to(dtype),
    )
    return {k: v.to(device) for k, v in t.items()}


def test_hyper_connections_route(monkeypatch):
    monkeypatch.delenv(HYPER_CONNECTIONS_ENV, raising=False)
    assert hyper_connections_route() == "kernel"  # measured faster on the H200 (bench_hyper.py)
    monkeypatch.setenv(HYPER_CONNECTIONS_ENV, "reference")
    assert hyper_connections_route() == "reference"
    monkeypatch.setenv(HYPER_CONNECTIONS_ENV, "fused")
    with pytest.raises(ValueError, match="TRELLM_HYPER_CONNECTIONS='fused'"):
        hyper_connections_route()


def test_hyper_connection_routes_reach_their_kernels(stub_kernels, monkeypatch):
    """On CPU tensors against a stub kernel library: nothing launches on the reference route; on "kernel" both
    ops reach their entry points with the header's argument count, the sizes and the Sinkhorn settings."""
    t = hc_inputs("cpu", torch.bfloat16, tokens=3, n=4, d=64)
    monkeypatch.setenv(HYPER_CONNECTIONS_ENV, "reference")
    x, post, comb = hyper_connection_weights(t["streams"], t["fn"], t["base"], t["scale"], 20, 1e-6, 1e-5)
    hyper_connection_merge(t["streams"], t["out"], post, comb)
    assert stub_kernels == []
    monkeypatch.setenv(HYPER_CONNECTIONS_ENV, "kernel")
    hyper_connection_weights(t["streams"], t["fn"], t["base"], t["scale"], 20, 1e-6, 1e-5)
    hyper_connection_merge(t["streams"], t["out"], post, comb)
    assert [name for name, _ in stub_kernels] == ["hyper_connection_weights", "hyper_connection_merge"]
    for name, args in stub_kernels:
        assert len(args) == declared_arguments(name), name
    (_, weights), (_, merge) = stub_kernels
    assert weights[1] == 1 and weights[9:15] == [3, 4, 64, 20, pytest.approx(1e-6), pytest.approx(1e-5)]
    assert merge[5:9] == [1, 3, 4, 64]  # dtype, tokens, streams, dim
    stub_kernels.clear()
    prefill = hc_inputs("cpu", torch.bfloat16, tokens=65, n=4, d=64)  # past the kernels' 64 tokens: torch's matmul
    hyper_connection_weights(prefill["streams"], prefill["fn"], prefill["base"], prefill["scale"], 20, 1e-6, 1e-5)
    assert stub_kernels == []


# ---- CUDA ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,n,d", [(1, 4, 4096), (5, 4, 64), (2, 1, 128), (3, 8, 96)])
@pytest.mark.parametrize("iters", [0, 1, 20])
@on_cuda
def test_hyper_connection_weights_cuda(monkeypatch, dtype, tokens, n, d, iters):
    monkeypatch.setenv(HYPER_CONNECTIONS_ENV, "kernel")
    t = hc_inputs("cuda", dtype, tokens, n, d)
    args = (t["fn"], t["base"], t["scale"], iters, 1e-6, 1e-5)
    x, post, comb = cuda_impl(hyper_connection_weights)(t["streams"], *args)
    ref_x, ref_post, ref_comb = hyper_connection_weights.reference(t["streams"], *args)
    assert x.dtype == dtype and x.shape == (tokens, d) and post.shape == (tokens, n) and comb.shape == (tokens, n, n)
    assert rel_err(post, ref_post) < 1e-4 and rel_err(comb, ref_comb) < 1e-4  # float32: only the sums' order
    assert rel_err(x, ref_x) < (1e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,n,d", [(1, 4, 4096), (7, 4, 100), (2, 8, 32)])
@on_cuda
def test_hyper_connection_merge_cuda(monkeypatch, dtype, tokens, n, d):
    monkeypatch.setenv(HYPER_CONNECTIONS_ENV, "kernel")
    t = hc_inputs("cuda", dtype, tokens, n, d)
    _, post, comb = hyper_connection_weights.reference(t["streams"], t["fn"], t["base"], t["scale"], 20, 1e-6, 1e-5)
    out = cuda_impl(hyper_connection_merge)(t["streams"], t["out"], post, comb)
    ref = hyper_connection_merge.reference(t["streams"], t["out"], post, comb)
    assert out.dtype == dtype and out.shape == t["streams"].shape
    assert rel_err(out, ref) < (1e-2 if dtype != torch.float32 else 1e-5)


@on_cuda
def test_hyper_connection_replays_from_a_cuda_graph(monkeypatch):
    """A block's weights and merge captured once, replayed over new streams copied into the captured buffer."""
    monkeypatch.setenv(HYPER_CONNECTIONS_ENV, "kernel")
    t = hc_inputs("cuda", torch.bfloat16, tokens=2, n=4, d=256)
    streams = t["streams"].clone()
    run = lambda: hyper_connection_merge(streams, t["out"], *cuda_impl(hyper_connection_weights)(  # noqa: E731
        streams, t["fn"], t["base"], t["scale"], 20, 1e-6, 1e-5)[1:])
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new = run()
    for seed in (1, 2):
        streams.copy_(hc_inputs("cuda", torch.bfloat16, tokens=2, n=4, d=256, seed=seed)["streams"])
        graph.replay()
        _, post, comb = hyper_connection_weights.reference(streams, t["fn"], t["base"], t["scale"], 20, 1e-6, 1e-5)
        assert rel_err(new, hyper_connection_merge.reference(streams, t["out"], post, comb)) < 1e-2


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@on_cuda
def test_tiny_glm5_decode_with_hyper_connection_kernels_cuda(monkeypatch, dtype, tolerance):
    """The tiny GLM 5.3's decode logits (tests/test_cuda_kda.py) with the hyper-connection kernels against the
    torch route, every other op on its default CUDA route."""
    monkeypatch.setenv(HYPER_CONNECTIONS_ENV, "reference")
    ref = tiny_glm5_decode("cuda", dtype, monkeypatch, "reference")
    monkeypatch.setenv(HYPER_CONNECTIONS_ENV, "kernel")
    out = tiny_glm5_decode("cuda", dtype, monkeypatch, "reference")
    assert rel_err(out, ref) < tolerance
