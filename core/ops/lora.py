"""The per-row low-rank update of LoRA adapters: rows of one batch may each use a different adapter.

The adapters of one projection are stacked into two matrices: ``a`` [slots * rank, in] holds adapter
slot s's A in rows ``[s * rank, (s + 1) * rank)`` and ``b`` [out, slots * rank] its scaled B in the
same columns (an adapter of a smaller rank, or one that does not target this projection, leaves its
rows zero). ``slots`` [rows] names each row's adapter slot, -1 for none, as a tensor: the choice is
data, so one captured CUDA graph serves every mix of adapters (the BGMV idea of Punica / S-LoRA).
"""
from __future__ import annotations

import torch

from . import op, route_from_env

LORA_KERNEL_ENV = "TRELLM_LORA_KERNEL"
LORA_KERNEL_ROUTES = ("fused", "split")


def lora_kernel_route() -> str:
    """``TRELLM_LORA_KERNEL``, the CUDA route of the update: "split" (default) is two programmatic dependent
    launches, the shrink spread over k across many blocks, then the expand; "fused" is one launch per projection
    group, each column block computing its row's h = A x alone (one SM reads all of A). On the H200 (2026-12-05,
    ``bench_lora.py``, rank 16, 8 layers of the Llama-8B shape at 4 bpw) split takes 3.0-3.3 us per update at
    batch 1 against 6.5-12.9 fused, and rank-16 adapters on every projection cost +20% of the step at batch 1 and
    +15% at batch 8 with two adapters, against +44% / +35% fused."""
    return route_from_env(LORA_KERNEL_ENV, LORA_KERNEL_ROUTES, "split")


@op
def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
             rank: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y[i] + b[:, s*rank:(s+1)*rank] @ a[s*rank:(s+1)*rank] @ x[i]`` with ``s = slots[i]`` (rows with
    s = -1 unchanged), written into ``out`` (into y itself when None) and returned. x [rows, in], y and out
    [rows, out_features]; float32 accumulation.

    The reference runs every slot's A on every row and masks the other slots' columns out: two matmuls,
    no host sync, exact (masked columns contribute exact zeros).
    """
    h = x.float() @ a.float().t()  # [rows, slots * rank]
    column_slot = torch.arange(a.shape[0], device=x.device) // rank
    h = h * (slots.long()[:, None] == column_slot[None, :])
    delta = (h @ b.float().t()).to(y.dtype)
    if out is None:
        return y.add_(delta)
    return torch.add(y, delta, out=out)


@op
def lora_add_parts(ys: list[torch.Tensor], x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
                   slots: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """:func:`lora_add` in place for several projections of one x (q/k/v, gate/up): ``ys[p]`` gets the
    update by ``a[p]``, ``b[p]``. A backend may do all parts in one launch (the CUDA kernel does, up to 4)."""
    return [lora_add.reference(y, x, ap, bp, slots, rank) for y, ap, bp in zip(ys, a, b)]
