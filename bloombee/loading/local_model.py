"""The whole model on this machine, built from the same blocks a server loads: the reference a swarm's greedy tokens
are compared with, also when the servers' weights are quantised (the reference's blocks are quantised the same way)."""

from __future__ import annotations

import torch

from bloombee.loading.weights import load_block_stack, load_client_head
from bloombee.loading.resolve import load_model_config
from bloombee.models.core.masks import causal_mask
from bloombee.weight_formats import QuantType


class LocalModel:
    """Every block of ``model`` in ``dtype`` with linear weights in ``quant_type``, and the client head in ``dtype``."""

    def __init__(self, model, dtype=torch.float32, quant_type: QuantType = "none", device="cpu"):
        num_blocks = load_model_config(model).num_hidden_layers
        self.stack = load_block_stack(model, 0, num_blocks, dtype=dtype, device=device, quant_type=quant_type)
        self.head = load_client_head(model, self.stack.dtype, device)
        self.device = torch.device(device)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [b, T, vocab] of whole sequences (no padding), in one forward without a cache."""
        batch, length = input_ids.shape
        positions = torch.arange(length, device=self.device)
        hidden = self.head.embed(input_ids.to(self.device))
        mask = causal_mask(positions, length, batch_size=batch)
        out = self.stack(hidden, positions.expand(batch, -1), None, positions, mask)
        return self.head.logits(out)

    @torch.inference_mode()
    def greedy(self, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """``input_ids`` [b, T] (no padding) followed by ``new_tokens`` greedy tokens, decoded with a KV cache."""
        batch, length = input_ids.shape
        caches = self.stack.new_caches(batch, length + new_tokens)
        ids, step = input_ids.to(self.device), input_ids.to(self.device)
        for _ in range(new_tokens):
            start = ids.shape[1] - step.shape[1]
            positions = torch.arange(start, ids.shape[1], device=self.device)
            mask = causal_mask(positions, ids.shape[1], batch_size=batch)
            hidden = self.stack(self.head.embed(step), positions.expand(batch, -1), caches, positions, mask)
            step = self.head.logits(hidden[:, -1:]).argmax(-1)
            ids = torch.cat([ids, step], dim=1)
        return ids
