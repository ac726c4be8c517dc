"""Hyper-connection ops (manifold-constrained hyper-connections, mHC): the residual stream widened to N
parallel streams that each block reads through a learned collapse and writes back through a learned
expansion and a doubly-stochastic stream mix. Torch references, float32 math (DeepSeek V4, GLM 5.3)."""
from __future__ import annotations

import torch

from . import op, route_from_env

HYPER_CONNECTIONS_ENV = "TRELLM_HYPER_CONNECTIONS"
HYPER_CONNECTIONS_ROUTES = ("reference", "kernel")


def hyper_connections_route() -> str:
    """``TRELLM_HYPER_CONNECTIONS``, how :func:`hyper_connection_weights` and :func:`hyper_connection_merge` run on
    CUDA: "kernel" (default), two launches (up to 64 tokens) and one (kernels_cuda/hyper.cu); "reference" the
    torch ops (~140 small kernels per block's weights, the Sinkhorn loop 6 per iteration). On the H200
    (2026-12-05, ``bench_hyper.py``, 4 streams of 4096) the kernels take 39 / 41 us per block at 1 / 16 tokens,
    the reference 194 / 271."""
    return route_from_env(HYPER_CONNECTIONS_ENV, HYPER_CONNECTIONS_ROUTES, "kernel")


@op
def hyper_connection_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block_input [T, D], post [T, N], comb [T, N, N])`` from ``streams`` [T, N, D].

    One linear map of the RMS-normalised flattened streams (``fn`` [(2 + N) * N, N * D], ``base``, and three
    ``scale`` factors for the pre / post / comb parts) gives: ``pre = sigmoid(.) + eps`` (how the streams
    collapse into the block's input), ``post = 2 sigmoid(.)`` (how the block's output spreads over the
    streams) and ``comb``, a row softmax made doubly stochastic by ``sinkhorn_iters`` Sinkhorn-Knopp
    normalisations (how the old streams mix into the new ones). The block input is in ``streams``' dtype.
    """
    t, n, _ = streams.shape
    flat = streams.reshape(t, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    block_input = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return block_input, post, comb


@op
def hyper_connection_merge(streams: torch.Tensor, block_output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The new streams [T, N, D]: ``post[t, i] * block_output[t] + sum_j comb[t, j, i] * streams[t, j]``
    (the block's output spread over the streams plus the old streams mixed), in ``streams``' dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@op
def hyper_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, norm_eps: float) -> torch.Tensor:
    """The final collapse of ``streams`` [T, N, D] into one hidden state [T, D]: weights
    ``sigmoid(scale * fn(rmsnorm(flat streams)) + base) + eps`` per stream (DeepSeek V4's ``hc_head``)."""
    t = streams.shape[0]
    flat = streams.reshape(t, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(torch.nn.functional.linear(flat, fn.float()) * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
