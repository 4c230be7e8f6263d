"""A server's memory budgets in bytes, on its device and in host memory, and the fair queue of sessions
waiting for room."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections import deque
from dataclasses import dataclass

import torch

from bloombee.models.core.quantize import planned_weight_bytes
from bloombee.weight_formats import QuantType

logger = logging.getLogger(__name__)

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}
DEVICE_SHARE = 0.9  # of a GPU's memory, the default device budget
HOST_SHARE = 0.8  # of the memory available at start-up, the default host budget
CUDA_RESERVED = 1 << 30  # device memory left to the CUDA context, the allocator and activations


class WeightsDoNotFit(ValueError):
    """The blocks' weights leave no room for sessions in --device-memory."""


class SessionRefused(Exception):
    """The server cannot open this session (a limit or the memory budget); the message says which."""


def parse_bytes(text: str | int) -> int:
    """'24GiB', '512MiB', '2G' (binary), '1.5GB' (decimal) or a plain count -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 24GiB, 512MiB or 2GB")
    return int(float(match.group(1)) * UNITS[unit])


def format_bytes(size: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def available_host_bytes() -> int:
    """Memory the machine can give now (MemAvailable; all physical memory where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budgets(device: torch.device, device_memory: str, host_memory: str) -> tuple[int, int]:
    """(device, host) budgets in bytes: the settings where given, else 90 % of a GPU and 80 % of the available host
    memory (on a CPU the device budget is the host budget: one memory, counted once per use)."""
    host = parse_bytes(host_memory) if host_memory != "auto" else int(HOST_SHARE * available_host_bytes())
    if device_memory != "auto":
        return parse_bytes(device_memory), host
    if device.type == "cuda":
        return int(DEVICE_SHARE * torch.cuda.get_device_properties(device).total_memory), host
    return host, host


def blocks_that_fit(config, dtype: torch.dtype, quant: QuantType, room: int, cache_tokens: int) -> int:
    """How many of the model's blocks fit in `room` bytes with their weights in `quant` and, on the device, a KV cache
    of `cache_tokens` tokens each; WeightsDoNotFit when not even one does."""
    from bloombee.models import family_for_config

    family = family_for_config(config)
    block_config = family.block_config(config, 0)
    with torch.device("meta"):
        block = family.block_class(block_config, 0)
    weights = planned_weight_bytes(block, quant, dtype.itemsize)
    kv = cache_tokens * block_config.kv_elements_per_token * dtype.itemsize
    count = min(room // (weights + kv), config.num_hidden_layers)
    if count < 1:
        raise WeightsDoNotFit(f"one block with the KV cache of --cache-tokens {cache_tokens} takes "
                              f"{format_bytes(weights + kv)} in {quant} weights, more than the {format_bytes(room)} of "
                              f"--device-memory it may use; give more device memory, fewer --cache-tokens or a "
                              f"smaller --quant-type")
    return int(count)


@dataclass(frozen=True)
class SessionBytes:
    """What one session holds: bytes on the server's device and in host memory."""

    device: int = 0
    host: int = 0

    def __add__(self, other: SessionBytes) -> SessionBytes:
        return SessionBytes(self.device + other.device, self.host + other.host)

    def __sub__(self, other: SessionBytes) -> SessionBytes:
        return SessionBytes(self.device - other.device, self.host - other.host)

    def fits(self, room: SessionBytes) -> bool:
        return self.device <= room.device and self.host <= room.host


class MemoryBudget:
    """Bytes handed to sessions against the room the server has for them; sessions that do not fit now wait in
    arrival order. Used from the server's event loop only."""

    def __init__(self, device_bytes: int, host_bytes: int, device: str = "device"):
        self.total = SessionBytes(max(device_bytes, 0), max(host_bytes, 0))
        self.used = SessionBytes()
        self.device = device
        self._waiters: deque[tuple[SessionBytes, asyncio.Future]] = deque()

    @property
    def free(self) -> SessionBytes:
        return self.total - self.used

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def reserve(self, need: SessionBytes, timeout: float) -> None:
        """Take `need`, waiting up to `timeout` seconds behind earlier sessions; SessionRefused if it never came."""
        if not need.fits(self.total):
            raise SessionRefused(f"the session needs {self._describe(need)} but this server's budget is "
                                 f"{self._describe(self.total)} in all; ask for a shorter max_length or a smaller "
                                 f"batch, or use another server")
        if not self._waiters and need.fits(self.free):
            self.used += need
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((need, waiter))
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        except asyncio.CancelledError:
            self._withdraw(need, waiter)
            raise
        if not waiter.done():
            refusal = SessionRefused(f"the session needs {self._describe(need)} and this server had only "
                                     f"{self._describe(self.free)} free for {timeout:g} s (--alloc-timeout); try "
                                     f"again later or use another server")
            self._withdraw(need, waiter)
            raise refusal

    def release(self, amount: SessionBytes) -> None:
        self.used -= amount
        self._grant()

    def _grant(self) -> None:
        """Hand room to the waiting sessions in arrival order, as long as the first one fits."""
        while self._waiters and self._waiters[0][0].fits(self.free):
            need, waiter = self._waiters.popleft()
            self.used += need
            waiter.set_result(None)

    def _withdraw(self, need: SessionBytes, waiter: asyncio.Future) -> None:
        if waiter.done():  # granted while its session gave up: give it back
            self.release(need)
            return
        self._waiters.remove((need, waiter))
        waiter.cancel()
        self._grant()

    def _describe(self, amount: SessionBytes) -> str:
        return f"{format_bytes(amount.device)} of {self.device} memory (--device-memory) and " \
               f"{format_bytes(amount.host)} of host memory (--host-memory)"
