"""Rotary position embeddings, including the rope scaling types found in transformers configs.

Inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` for scaled types (llama3, linear,
dynamic, yarn, longrope), so they match the reference exactly; the default type is computed here. Dynamic and
longrope frequencies depend, as in transformers, on the longest position of the call: here of one session's step.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's rope parameters (those of `layer_type`, where the config keeps them per layer type) as a dict with
    at least rope_type and rope_theta."""
    params = getattr(config, "rope_parameters", None)
    if layer_type is not None:
        params = params[layer_type]
    elif params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_layer_types(config) -> list[str] | None:
    """Each layer's key into the config's rope parameters where it keeps them per layer type (gemma3), else None."""
    params, layer_types = getattr(config, "rope_parameters", None), getattr(config, "layer_types", None)
    if isinstance(params, dict) and layer_types and set(layer_types) <= set(params):
        return list(layer_types)
    return None


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) [b, T, head_dim] for rotary positions [b, T], with the rope parameters of `layer_type`
    where the config keeps them per layer type."""

    def __init__(self, config, head_dim: int, layer_type: str | None = None):
        super().__init__()
        self.config, self.head_dim, self.layer_type = config, head_dim, layer_type
        params = rope_parameters(config, layer_type)
        self.rope_type = params["rope_type"]
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}.")
        self.original_max_length = getattr(config, "max_position_embeddings", None)
        if self.rope_type == "default":
            base = params["rope_theta"]
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config, None, **self._of_type())
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if self.rope_type == "longrope":  # short factors up to the original context, long ones past it
            self.original_max_length = params.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None) or self.original_max_length
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=self.original_max_length + 1,
                                                               **self._of_type())
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)

    def _of_type(self) -> dict:
        """The layer type transformers' rope functions take, where the config keeps parameters per layer type."""
        return {} if self.layer_type is None else {"layer_type": self.layer_type}

    @property
    def fixed_frequencies(self) -> bool:
        """Whether the frequencies are the same whatever the positions (not a dynamic or long rope's)."""
        return self.rope_type not in ("dynamic", "longrope")

    def _inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        if self.rope_type == "longrope":
            return self.long_inv_freq if int(positions.max()) + 1 > self.original_max_length else self.inv_freq
        if self.rope_type != "dynamic":
            return self.inv_freq
        # dynamic NTK: frequencies depend on the longest position seen in this call
        seq_len = int(positions.max()) + 1
        if self.original_max_length is None or seq_len <= self.original_max_length:
            return self.inv_freq
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](self.config, self.inv_freq.device, seq_len=seq_len,
                                                     **self._of_type())
        return inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq(positions).to(device=positions.device, dtype=torch.float)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [b, h, T, d] and k [b, kv, T, d] by cos/sin [b, T, d_rot] (d_rot <= d rotates the first part)."""
    cos, sin = cos[:, None], sin[:, None]
    rot = cos.shape[-1]
    if rot == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_rot, q_pass = q[..., :rot], q[..., rot:]
    k_rot, k_pass = k[..., :rot], k[..., rot:]
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    k_rot = k_rot * cos + rotate_half(k_rot) * sin
    return torch.cat((q_rot, q_pass), -1), torch.cat((k_rot, k_pass), -1)
