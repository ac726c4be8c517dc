"""Dense elementwise / normalisation ops: torch references."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import op


@op
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm in float32, cast back to ``x.dtype``. ``unit_offset`` scales by (1 + w) (Gemma style)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        w = weight.float()
        y = y * (1.0 + w if unit_offset else w)
    return y.to(x.dtype)


@op
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``; returns ``(rms_norm(h), h)`` (the fused pre-norm residual step)."""
    h = x + residual
    return rms_norm.reference(h, weight, eps, unit_offset), h


def group_sum_squares(y: torch.Tensor) -> torch.Tensor:
    """Per row and 128-column group, the float32 sum of squares of y [rows, n] (n % 128 == 0): [rows, n / 128]."""
    return y.float().square().reshape(y.shape[0], -1, 128).sum(-1)


@op
def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim in float32."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": lambda t: F.gelu(t),
    "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "gelu_new": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda t: F.relu(t).square(),
    "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t),
}


def activation_fn(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}") from None


def xielu(x: torch.Tensor, alpha_p: float, alpha_n: float, beta: float = 0.5, eps: float = -1e-6) -> torch.Tensor:
    """xIELU (Apertus): quadratic for x > 0, a shifted ELU-like curve below; ``alpha_*`` are pre-softplus values."""
    ap = F.softplus(torch.tensor(alpha_p)).item()
    an = beta + F.softplus(torch.tensor(alpha_n)).item()
    xf = x.float()
    neg = (torch.expm1(torch.clamp(xf, max=eps)) - xf) * an + beta * xf
    return torch.where(xf > 0, ap * xf * xf + beta * xf, neg).to(x.dtype)


@op
def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` (SwiGLU / GeGLU)."""
    return activation_fn(activation)(gate) * up


@op
def rotary_embedding(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x`` [tokens, heads, head_dim].

    ``cos``/``sin`` are [tokens, rotary_dim/2] for each token's position. NeoX layout (the HF default)
    pairs dim i with i + rotary_dim/2; ``interleaved`` (GPT-J) pairs 2i with 2i+1.
    """
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half].float(), x[..., 2 * half :]
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1) if rest.shape[-1] else out.to(x.dtype)
