"""Wall time of calls that run on a device, its queued work included."""

import time
from collections.abc import Callable

import torch


def call_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `run`, each until `device` has finished its work (work queued before the
    first call is not counted)."""
    _synchronize(device)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - began)
    return times


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
