"""How the model of the chain learns a figure from what it observes: one moving estimator, one size class.

The codec policy's ratios and speeds, each server's compute speed, a server's announced throughput and
the speculation switch's round figures are all `Recent` figures, kept per `size_class` where they
depend on the size of a message or micro-batch.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Literal


class Recent:
    """A figure learnt from the last `window` observations: their median (one cold or descheduled call does not move
    it) or their mean; `prior` before the first."""

    def __init__(self, window: int, prior: float | None = None, statistic: Literal["median", "mean"] = "median"):
        self.prior, self.statistic = prior, statistic
        self.values: deque[float] = deque(maxlen=window)
        self.count = 0  # observations so far (the window keeps the last ones)

    def update(self, value: float) -> None:
        self.values.append(value)
        self.count += 1

    def adopt(self, value: float) -> None:
        """Take `value` (measured elsewhere) in place of the observations so far."""
        self.values.clear()
        self.values.append(value)
        self.count = max(self.count, 1)

    @property
    def value(self) -> float | None:
        if not self.values:
            return self.prior
        return statistics.median(self.values) if self.statistic == "median" else statistics.fmean(self.values)

    @property
    def spread(self) -> float:
        """How far the observations stray from their median, relative to it: the median of |x / median - 1| (0 before
        any)."""
        if not self.values:
            return 0.0
        middle = statistics.median(self.values)
        return statistics.median(abs(value / middle - 1) for value in self.values) if middle else 0.0


def size_class(amount: float) -> int:
    """The power-of-two range of a size (bytes of a message, rows of a micro-batch): 1, 2-3, 4-7, ... are 1, 2, 3, ..."""
    return max(int(amount), 1).bit_length()


def nearest_class(classes: Sequence[int], amount: float) -> int:
    """Of `classes` (size classes), the nearest to a size of `amount` (the smaller of two as near)."""
    wanted = size_class(amount)
    return min(classes, key=lambda size: (abs(size - wanted), size))
