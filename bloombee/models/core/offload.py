"""A KV cache split by KV heads between the device and host memory, with attention over each part where it lives.

Heads ``[0, device_heads)`` stay on the device and the rest sit in host memory (pinned when the device
is CUDA), both allocated once per session. Attention is independent per head, so each part attends
its own query heads (a KV head's group) and the outputs are concatenated along the heads: the result
is that of one attention over all heads. On CUDA the host part's queries, keys and values are copied
on a side stream while the device attends its heads, and the CPU attends the host heads meanwhile.
"""

from __future__ import annotations

import math

import torch

from bloombee.models.core.kv_cache import Attention, KVCache

_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def host_kv_heads(offload: float, num_kv_heads: int) -> int:
    """KV heads a cache keeps in host memory for an offload fraction: the fraction rounded up to whole heads."""
    if not 0.0 <= offload <= 1.0:
        raise ValueError(f"the offload fraction must be in [0, 1], got {offload}")
    return math.ceil(round(offload * num_kv_heads, 9))


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


class OffloadedKVCache:
    """One block's cache with its last ``host_heads`` KV heads in host memory; ``attend`` as ``KVCache.attend``."""

    def __init__(self, batch_size: int, num_kv_heads: int, max_length: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, host_heads: int, value_dim: int | None = None):
        if not 0 < host_heads <= num_kv_heads:
            raise ValueError(f"host_heads must be in [1, {num_kv_heads}], got {host_heads}")
        self.device = torch.device(device)
        self.num_kv_heads, self.device_heads = num_kv_heads, num_kv_heads - host_heads
        self.on_device = KVCache(batch_size, self.device_heads, max_length, head_dim, dtype, self.device,
                                 value_dim=value_dim) if self.device_heads else None
        self.in_host = KVCache(batch_size, host_heads, max_length, head_dim, dtype, "cpu",
                               pin_memory=self.device.type == "cuda", value_dim=value_dim)

    @property
    def batch_size(self) -> int:
        return self.in_host.batch_size

    @property
    def max_length(self) -> int:
        return self.in_host.max_length

    def nbytes(self) -> dict[str, int]:
        parts = [self.in_host] + ([self.on_device] if self.on_device is not None else [])
        total: dict[str, int] = {}
        for part in parts:
            for kind, size in part.nbytes().items():
                total[kind] = total.get(kind, 0) + size
        return total

    def reorder(self, rows: torch.Tensor) -> None:
        for part in (self.on_device, self.in_host):
            if part is not None:
                part.reorder(rows)

    def compact(self, start: int, keep: list[torch.Tensor], batch_offset: int = 0) -> None:
        for part in (self.on_device, self.in_host):
            if part is not None:
                part.compact(start, keep, batch_offset)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_positions: torch.Tensor,
               batch_offset: int, mask: torch.Tensor, attention: Attention) -> torch.Tensor:
        query_heads = q.shape[1] * self.device_heads // self.num_kv_heads
        host_inputs, copied = self._to_host(q[:, query_heads:], k[:, self.device_heads:], v[:, self.device_heads:],
                                            mask, cache_positions)
        outputs = []
        if self.on_device is not None:
            outputs.append(self.on_device.attend(q[:, :query_heads], k[:, :self.device_heads], v[:, :self.device_heads],
                                                 cache_positions, batch_offset, mask, attention))
        if copied is not None:
            copied.synchronize()
        host_out = self.in_host.attend(*host_inputs[:3], host_inputs[4], batch_offset, host_inputs[3], attention,
                                       query_heads)
        outputs.append(host_out.to(self.device, non_blocking=True))
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]

    def _to_host(self, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """The tensors in host memory; on CUDA copied on a side stream, with the event that marks the copies done."""
        if self.device.type != "cuda":
            return [t.cpu() for t in tensors], None
        stream = _copy_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host = [t.to("cpu", non_blocking=True) for t in tensors]
            copied = torch.cuda.Event()
            copied.record(stream)
        return host, copied
