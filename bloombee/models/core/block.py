"""The decoder block: norms, attention and MLP, sequential (pre-norm) or parallel (falcon)."""

from __future__ import annotations

import torch
from torch import nn

from bloombee.models.core.config import BlockConfig
from bloombee.models.core.kv_cache import KVCache


class DecoderBlock(nn.Module):
    """Subclasses (generated per family) create ``attn_norm``, ``attn``, ``mlp_norm`` (or None) and ``mlp``.

    Sequential:  h = x + attn(attn_norm(x));  out = h + mlp(mlp_norm(h))
    Parallel:    out = x + (mlp(mlp_norm(x) or attn_norm(x)) + attn(attn_norm(x)))
    """

    attn_norm: nn.Module
    attn: nn.Module
    mlp_norm: nn.Module | None
    mlp: nn.Module

    def __init__(self, cfg: BlockConfig, layer_index: int):
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index
        self.parallel = cfg.parallel_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                cache: KVCache | None, cache_positions: torch.Tensor, mask: torch.Tensor | None,
                batch_offset: int = 0) -> torch.Tensor:
        attn_in = self.attn_norm(x)
        attn_out = self.attn(attn_in, cos, sin, cache, cache_positions, mask, batch_offset)
        if self.parallel:
            mlp_in = self.mlp_norm(x) if self.mlp_norm is not None else attn_in
            return x + (self.mlp(mlp_in) + attn_out)
        h = x + attn_out
        return h + self.mlp(self.mlp_norm(h))
