"""Decoder blocks composed from core parts: sequential (pre-norm) or parallel attention + MLP (falcon)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from bloombee.models.core.config import BlockConfig
from bloombee.models.core.mlp import layer_mlp
from bloombee.models.core.packing import Cache, Packing


class DecoderBlock(nn.Module):
    """Pre-norm block: h = x + attn(attn_norm(x)); out = h + mlp(mlp_norm(h)).

    A generated ``<family>/block.py`` subclass names its parts: ``norm_class`` (called with
    ``(hidden_size, norm_eps)``), ``attention_class`` and ``mlp_class`` (called with the BlockConfig).
    """

    norm_class: type[nn.Module]
    attention_class: type[nn.Module]
    mlp_class: type[nn.Module]

    def __init__(self, cfg: BlockConfig, layer_index: int):
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index
        self.attn_norm = self.norm_class(cfg.hidden_size, cfg.norm_eps)
        self.attn = self.attention_class(cfg)
        self.mlp_norm = self.norm_class(cfg.hidden_size, cfg.norm_eps) if cfg.separate_mlp_norm else None
        self.mlp = layer_mlp(self.mlp_class, cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                packing: Packing, caches: Sequence[Cache | None]) -> torch.Tensor:
        """Packed x [N, H] of `packing`'s segments, each with its cache of this block (or None) -> [N, H]."""
        h = x + self.attn(self.attn_norm(x), cos, sin, packing, caches)
        return h + self.mlp(self.mlp_norm(h))


class SandwichDecoderBlock(DecoderBlock):
    """Pre- and post-norms around attention and MLP (gemma2): h = x + post_attn_norm(attn(attn_norm(x)));
    out = h + post_mlp_norm(mlp(mlp_norm(h)))."""

    def __init__(self, cfg: BlockConfig, layer_index: int):
        super().__init__(cfg, layer_index)
        self.post_attn_norm = self.norm_class(cfg.hidden_size, cfg.norm_eps)
        self.post_mlp_norm = self.norm_class(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x, cos, sin, packing, caches):
        h = x + self.post_attn_norm(self.attn(self.attn_norm(x), cos, sin, packing, caches))
        return h + self.post_mlp_norm(self.mlp(self.mlp_norm(h)))


class ParallelDecoderBlock(DecoderBlock):
    """``features.parallel_attention``: out = x + (mlp(mlp_norm(x) or attn_norm(x)) + attn(attn_norm(x)))."""

    def forward(self, x, cos, sin, packing, caches):
        if not self.cfg.parallel_attention:  # e.g. falcon with parallel_attn=False
            return super().forward(x, cos, sin, packing, caches)
        attn_in = self.attn_norm(x)
        attn_out = self.attn(attn_in, cos, sin, packing, caches)
        mlp_in = self.mlp_norm(x) if self.mlp_norm is not None else attn_in
        return x + (self.mlp(mlp_in) + attn_out)
