"""Feed-forward layers: gated (SwiGLU; its gate and up fused in phi3), plain GELU (falcon, bloom) and mixture of
experts (mixtral, qwen3_moe)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from bloombee.models.core.config import BlockConfig


class BloomGELU(nn.Module):
    """GELU's tanh approximation written out as bloom computes it (its constants rounded as there, so its bits)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def activation(name: str) -> nn.Module:
    """The activation a config's ``hidden_act`` names: transformers' (ACT2FN), or ``bloom_gelu``."""
    return BloomGELU() if name == "bloom_gelu" else ACT2FN[name]


class GatedMLP(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """GatedMLP whose gate and up projections are one matrix, gate rows first (phi3's gate_up_proj)."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GeluMLP(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class MoEMLP(nn.Module):
    """Top-k routed experts: softmax over router logits, keep the top k, renormalise them (with norm_topk_prob), sum
    the weighted experts."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(cfg) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tokens, slot = torch.where(chosen == e)
            if tokens.numel():
                out.index_add_(0, tokens, expert(x[tokens]) * weights[tokens, slot, None])
        return out.reshape(shape)


MLPS = {"GatedMLP": GatedMLP, "FusedGatedMLP": FusedGatedMLP, "GeluMLP": GeluMLP, "MoEMLP": MoEMLP}
