"""Feed-forward layers: gated (SwiGLU; its gate and up fused in phi3), plain GELU (falcon, bloom) and mixtures of
experts (mixtral and qwen3_moe; gpt_oss's experts packed in 3-D tensors)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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


def weighted_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, num_experts: int,
                     expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Rows x [N, H] through their chosen experts [N, k], each expert's output times its weight [N, k] (cast to x's
    dtype), summed per row; `expert(e, rows)` computes expert e on the rows routed to it."""
    out = torch.zeros_like(x)
    for e in range(num_experts):
        tokens, slot = torch.where(chosen == e)
        if tokens.numel():
            out.index_add_(0, tokens, (expert(e, x[tokens]) * weights[tokens, slot, None]).to(x.dtype))
    return out


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
        out = weighted_experts(x, weights.to(x.dtype), chosen, len(self.experts), lambda e, rows: self.experts[e](rows))
        return out.reshape(shape)


class PackedExperts(nn.Module):
    """All experts in 3-D tensors as gpt_oss stores them ([experts, in, out], the gate and up columns interleaved),
    with biases, and its clamped SwiGLU: (up + 1) * g * sigmoid(alpha * g), g the gate clamped to <= limit and up to
    [-limit, limit]."""

    row_wise = True  # batch-invariant mode chunks its rows (core.invariance)

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        experts, hidden, width = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * width))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * width))
        self.down_proj = nn.Parameter(torch.zeros(experts, width, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert `expert` on the rows x [n, hidden] routed to it."""
        gate_up = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[expert] + \
            self.down_proj_bias[expert]


class PackedMoEMLP(nn.Module):
    """gpt_oss's mixture: a router with a bias, a softmax over the k largest router logits, PackedExperts."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = PackedExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, chosen = torch.topk(self.router(x), self.top_k, dim=-1)  # [N, k]
        weights = F.softmax(logits, dim=-1, dtype=logits.dtype)
        out = weighted_experts(x, weights, chosen, self.experts.gate_up_proj.shape[0],
                               lambda e, rows: self.experts(rows, e))
        return out.reshape(shape)


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's routing, in float32: sigmoid scores; experts chosen by score plus a correction bias, among the
    experts of the topk_groups groups whose two best biased scores sum highest; weighted by their unbiased scores,
    renormalised (with norm_topk_prob) and scaled by routed_scaling."""

    row_wise = True  # its forward, the scores; batch-invariant mode chunks its rows (core.invariance)
    keeps_float32 = True  # its weight and bias load in float32 whatever the server's dtype (as transformers keeps them)

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.top_k, self.groups, self.topk_groups = cfg.num_experts_per_tok, cfg.num_expert_groups, cfg.topk_groups
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> each expert's score [N, E], float32."""
        return F.linear(x.float(), self.weight.float()).sigmoid()

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores [N, E] -> (weights [N, k] float32, chosen experts [N, k])."""
        biased = scores + self.e_score_correction_bias.float()
        by_group = biased.unflatten(-1, (self.groups, -1))
        best_groups = by_group.topk(2, dim=-1)[0].sum(-1).topk(self.topk_groups, dim=-1, sorted=False)[1]
        in_best = torch.zeros_like(by_group[..., 0]).scatter_(1, best_groups, 1).bool()
        biased = by_group.masked_fill(~in_best[..., None], float("-inf")).flatten(1)
        chosen = biased.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class GroupLimitedMoEMLP(nn.Module):
    """DeepSeek-V3's mixture: GatedMLP experts chosen by a GroupLimitedRouter, plus shared experts (one GatedMLP
    num_shared_experts times an expert's width) that every token passes through."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.router = GroupLimitedRouter(cfg)
        self.experts = nn.ModuleList(GatedMLP(cfg) for _ in range(cfg.num_experts))
        shared = cfg.intermediate_size * cfg.num_shared_experts
        self.shared_experts = GatedMLP(dataclasses.replace(cfg, intermediate_size=shared))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.router.choose(self.router(x))
        out = weighted_experts(x, weights, chosen, len(self.experts), lambda e, rows: self.experts[e](rows))
        return (out + self.shared_experts(x)).reshape(shape)


MLPS = {"GatedMLP": GatedMLP, "FusedGatedMLP": FusedGatedMLP, "GeluMLP": GeluMLP, "MoEMLP": MoEMLP,
        "PackedMoEMLP": PackedMoEMLP, "GroupLimitedMoEMLP": GroupLimitedMoEMLP}
MIXTURES = ("MoEMLP", "PackedMoEMLP", "GroupLimitedMoEMLP")


def layer_mlp(mlp_class: type[nn.Module], cfg: BlockConfig) -> nn.Module:
    """The family's MLP for a layer; a GatedMLP where a mixture family's config gives the layer no experts
    (DeepSeek-V3's first layers)."""
    if mlp_class.__name__ in MIXTURES and not cfg.num_experts:
        return GatedMLP(cfg)
    return mlp_class(cfg)
