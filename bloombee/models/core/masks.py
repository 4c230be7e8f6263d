"""Attention masks the client builds: BoolTensor [b, T, S], True where query t may attend key slot s.

A query may always attend its own slot, so a fully padded row never yields NaN. Sliding windows are
not applied here: sliding-window families apply them inside attention, from slot positions.
"""

from __future__ import annotations

import torch


def causal_mask(cache_positions: torch.Tensor, length: int, key_padding_mask: torch.Tensor | None = None,
                batch_size: int = 1) -> torch.Tensor:
    """Causal mask for new tokens written at ``cache_positions`` [T], reading slots [0, length).

    ``key_padding_mask`` [b, >=length] (True = real token, False = left padding) masks padded key slots.
    Returns [b, T, length] (b = key_padding_mask's batch, else ``batch_size``).
    """
    slots = torch.arange(length, device=cache_positions.device)
    own = slots[None, :] == cache_positions[:, None]
    allowed = slots[None, :] <= cache_positions[:, None]  # [T, S]
    if key_padding_mask is None:
        return (allowed | own).unsqueeze(0).expand(batch_size, -1, -1)
    keys = key_padding_mask[:, :length].to(torch.bool, copy=False).to(cache_positions.device)
    return (allowed[None] & keys[:, None, :]) | own[None]


def stateless_causal_mask(seq_len: int, key_padding_mask: torch.Tensor | None = None,
                          batch_size: int = 1, device: torch.device | str | None = None) -> torch.Tensor:
    """Mask [b, T, T] for the stateless forward (caches=None) over T new tokens."""
    if device is None and key_padding_mask is not None:
        device = key_padding_mask.device
    positions = torch.arange(seq_len, device=device)
    return causal_mask(positions, seq_len, key_padding_mask, batch_size)


def rope_positions_from_padding(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """Rotary positions [b, S] of left-padded rows: 0 at each row's first real token (padding gets 0)."""
    mask = key_padding_mask.to(torch.long)
    return (mask.cumsum(-1) - 1).clamp(min=0)


def sliding_window_mask(query_slots: torch.Tensor, key_slots: torch.Tensor, window: int) -> torch.Tensor:
    """[T, S] True where key slot is within ``window`` slots of the query slot (q - s < window)."""
    return (query_slots[:, None] - key_slots[None, :]) < window
