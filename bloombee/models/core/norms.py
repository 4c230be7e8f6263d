"""Normalisation layers; all take ``(dim, eps)``: the RMSNorms have a weight only, LayerNorm a weight and a bias."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x divided by its root mean square over the last dimension, in float32."""
    x = x.to(torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no bias, no mean subtraction), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalized(x, self.eps).to(x.dtype)


class Float32RMSNorm(RMSNorm):
    """RMSNorm whose scale multiplies in float32 before casting back (gpt_oss, whose norms transformers keeps in
    float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.to(torch.float32) * rms_normalized(x, self.eps)).to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), in float32 before casting back (gemma); its weight starts at zero."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalized(x, self.eps) * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm with a weight and a bias (falcon, starcoder2)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim, eps=eps)


NORMS = {"RMSNorm": RMSNorm, "Float32RMSNorm": Float32RMSNorm, "OffsetRMSNorm": OffsetRMSNorm,
         "LayerNorm": LayerNorm}
