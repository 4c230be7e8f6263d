"""When to compress a hop: the break-even rule, fed by speeds measured on recent traffic.

The rule is the model of the chain's (`bloombee.planner.rules.codec_break_even`): compressing a
message of ``N`` raw bytes pays on links slower than ``B*(N) = (1 - 1/r) / (1/C + 1/D + (E + F) / N)``
(``r`` the ratio, ``C`` and ``D`` the encode and decode speeds in raw bytes per second, ``E + F`` the
CPU time of the two calls beyond their bytes, which each process measures: `bloombee.codec.calls`).

The calls' own time matters for small messages (a 16 KiB decode step's frame), and a codec's speed
per byte differs between message sizes, so ``CompressionPolicy`` keeps its figures per size class of
message (powers of two): for each, the medians of recent ``r``, ``1/C`` and ``1/D`` (`ByteCost`) from
the encodes it makes and the decodes its receiver reports (the receiver's own speed of that class
travels back in each step's route). It takes ``B`` from the caller (the link speed the DHT records
announce, the figure the planner models the hop with) and applies the rule per message. Use one
policy per link. While it keeps choosing raw for a class it still compresses one message of it in
``probe_every`` so that its estimates follow the traffic.

Speeds are CPU time of the thread that encodes or decodes: wall time on a busy machine also counts
the waits for the interpreter lock and for a core, which would make compression look many times
dearer than it is. Transfers are not timed either: the time from a push to
its acknowledgement is mostly the receiver's turnaround, not bytes over the link.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from bloombee.planner.learning import Recent, size_class
from bloombee.planner.rules import codec_break_even

from .calls import call_costs
from .core import MIN_COMPRESS_BYTES, encode

logger = logging.getLogger(__name__)

MODES = ("auto", "on", "off")

SPEED_WINDOW = 9  # codec ratios and speeds are the median of this many recent calls


@dataclass
class Decision:
    layout: str
    compress: bool
    reason: str
    num_bytes: int
    bandwidth: float | None
    ratio: float
    compress_speed: float
    decompress_speed: float
    break_even_bandwidth: float
    probe: bool = False


class ByteCost:
    """Seconds per raw byte that one side of the codec takes beyond each call's own time (`call_s`): the median of
    its last SPEED_WINDOW observations, so that one cold first call (10x a warm one here) or one descheduled
    mid-way does not move it; the prior (a speed, or None) until the first."""

    def __init__(self, call_s: float, prior_speed: float | None):
        self.call_s, self.prior_speed = call_s, prior_speed
        self._per_byte = Recent(SPEED_WINDOW)

    @property
    def count(self) -> int:
        return self._per_byte.count

    def observe(self, raw_bytes: int, seconds: float) -> None:
        self._per_byte.update(max(seconds - self.call_s, 1e-9) / raw_bytes)

    def adopt(self, speed: float) -> None:
        """Take `speed` (raw bytes/s, measured elsewhere) in place of the observations so far."""
        self._per_byte.adopt(1.0 / speed)

    @property
    def speed(self) -> float | None:
        """Raw bytes per second of the bytes alone (the prior before any observation)."""
        per_byte = self._per_byte.value
        return self.prior_speed if per_byte is None else 1.0 / per_byte


class SizeEstimates:
    """What a policy has learnt about the messages of one size class: ratio, encode and decode speeds, and how many
    of them in a row it has sent raw."""

    def __init__(self, prior_ratio: float | None, prior_compress_speed: float | None,
                 prior_decompress_speed: float | None):
        self.ratio = Recent(SPEED_WINDOW, prior_ratio)
        calls = call_costs()
        self.encode = ByteCost(calls.encode_s, prior_compress_speed)
        self.decode = ByteCost(calls.decode_s, prior_decompress_speed)
        self.raw_streak = 0

    def report(self) -> dict:
        return {"ratio": self.ratio.value, "compress_speed": self.encode.speed, "decompress_speed": self.decode.speed,
                "observations": {"encode": self.ratio.count, "decode": self.decode.count}}


class CompressionPolicy:
    """Per-link compress/raw decision.

    ``mode``: "auto" applies the break-even rule, "on" always compresses (tiny messages aside),
    "off" never does. ``layout`` is what a compressing decision returns (passed to ``encode``);
    ``accepted`` is the set of layouts the peer on this link decodes.
    """

    def __init__(
        self,
        mode: str = "auto",
        *,
        link_bandwidth: float | None = None,
        layout: str = "auto",
        accepted: Iterable[str] | None = None,
        level: int | None = None,
        prior_ratio: float | None = None,
        prior_compress_speed: float | None = None,
        prior_decompress_speed: float | None = None,
        min_bytes: int = MIN_COMPRESS_BYTES,
        probe_every: int = 32,
    ):
        if mode not in MODES:
            raise ValueError(f"CompressionPolicy mode must be one of {', '.join(MODES)}, not {mode!r}.")
        if link_bandwidth is not None and link_bandwidth <= 0:
            raise ValueError("link_bandwidth must be a positive number of bytes per second.")
        self.mode = mode
        self.layout = layout
        self.accepted = None if accepted is None else tuple(accepted)
        self.level = level
        self.min_bytes = min_bytes
        self.probe_every = probe_every
        self._lock = threading.Lock()
        calls = call_costs()  # this machine's figures on a sample stand until messages measure their own
        self._priors = (prior_ratio or calls.ratio, prior_compress_speed or calls.compress_speed,
                        prior_decompress_speed or calls.decompress_speed)
        self._sizes: dict[int, SizeEstimates] = {}
        self._bandwidth = link_bandwidth
        self._counts = {"raw": 0, "compressed": 0, "probes": 0}
        self._last: Decision | None = None

    # ------------------------------------------------------------------ estimates
    def _estimates(self, num_bytes: int) -> SizeEstimates:
        """The size class of `num_bytes`, kept from now on (for reads: `_known`)."""
        key = size_class(num_bytes)
        if key not in self._sizes:
            self._sizes[key] = SizeEstimates(*self._priors)
        return self._sizes[key]

    def _known(self, num_bytes: int) -> SizeEstimates:
        """The size class of `num_bytes` as learnt so far (the priors for one not yet met), without keeping it."""
        return self._sizes.get(size_class(num_bytes)) or SizeEstimates(*self._priors)

    def figures(self, num_bytes: int) -> tuple[float, float, float]:
        """(ratio, encode speed, decode speed) the policy has for messages of `num_bytes` raw bytes."""
        with self._lock:
            estimates = self._known(num_bytes)
            return estimates.ratio.value, estimates.encode.speed, estimates.decode.speed

    def measured_decompress_speed(self, num_bytes: int) -> float | None:
        """The receiver's decode speed of messages of `num_bytes` once one has been observed or adopted, else None."""
        with self._lock:
            decode = self._known(num_bytes).decode
            return decode.speed if decode.count else None

    @property
    def bandwidth(self) -> float | None:
        """The link bandwidth the caller gave (bytes/s), or None."""
        return self._bandwidth

    # ------------------------------------------------------------------ decision
    def choose(self, num_bytes: int, link_bandwidth: float | None = None) -> str:
        """The layout to encode a message of ``num_bytes`` raw bytes with: "raw" or ``self.layout``."""
        with self._lock:
            if link_bandwidth is not None:
                if link_bandwidth <= 0:
                    raise ValueError("link_bandwidth must be a positive number of bytes per second.")
                self._bandwidth = link_bandwidth
            d = self._decide(num_bytes)
            self._last = d
            self._counts["compressed" if d.compress else "raw"] += 1
            self._counts["probes"] += d.probe
        logger.debug("codec policy: %s", d.reason)
        return d.layout

    def _decide(self, num_bytes: int) -> Decision:
        bw = self.bandwidth
        estimates = self._estimates(num_bytes)
        r, c, dspeed = estimates.ratio.value, estimates.encode.speed, estimates.decode.speed
        b_star = codec_break_even(r, c, dspeed, call_costs().both_s, num_bytes)

        def decision(compress: bool, reason: str, probe: bool = False) -> Decision:
            return Decision(
                layout=self.layout if compress else "raw",
                compress=compress,
                reason=reason,
                num_bytes=num_bytes,
                bandwidth=bw,
                ratio=r,
                compress_speed=c,
                decompress_speed=dspeed,
                break_even_bandwidth=b_star,
                probe=probe,
            )

        if self.mode == "off":
            return decision(False, "raw: compression is off for this link")
        if num_bytes < self.min_bytes:
            return decision(False, f"raw: {num_bytes} B is under the {self.min_bytes} B minimum worth compressing")
        if self.mode == "on":
            return decision(True, "compress: compression is forced on for this link")
        figures = f"ratio {r:.3f}, encode {_rate(c)}, decode {_rate(dspeed)}, break-even {_rate(b_star)}"
        if bw is None:
            return decision(True, f"compress: link bandwidth unknown, assuming a slow link ({figures})")
        if bw < b_star:
            estimates.raw_streak = 0
            return decision(True, f"compress: link {_rate(bw)} < break-even ({figures})")
        estimates.raw_streak += 1
        if self.probe_every and estimates.raw_streak >= self.probe_every:
            estimates.raw_streak = 0
            return decision(True, f"compress (probe to refresh estimates): link {_rate(bw)} >= break-even ({figures})", True)
        return decision(False, f"raw: link {_rate(bw)} >= break-even ({figures})")

    # ------------------------------------------------------------------ observations
    def observe_encode(self, raw_bytes: int, encoded_bytes: int, seconds: float) -> None:
        """Record one encode the policy asked to compress: sizes and CPU seconds (the call's own time is taken off)."""
        if raw_bytes <= 0 or encoded_bytes <= 0 or seconds < 0:
            return
        with self._lock:
            estimates = self._estimates(raw_bytes)
            estimates.ratio.update(raw_bytes / encoded_bytes)
            estimates.encode.observe(raw_bytes, seconds)

    def observe_decode(self, raw_bytes: int, seconds: float) -> None:
        """Record one decode of a compressed frame: decoded size and CPU seconds (the call's own time is taken off)."""
        if raw_bytes <= 0 or seconds < 0:
            return
        with self._lock:
            self._estimates(raw_bytes).decode.observe(raw_bytes, seconds)

    def adopt_decompress_speed(self, speed: float, num_bytes: int) -> None:
        """Take the receiver's own measured decode speed (raw bytes/s) of messages of `num_bytes` in place of this
        policy's estimate."""
        if speed <= 0:
            raise ValueError("decompress speed must be a positive number of bytes per second.")
        with self._lock:
            self._estimates(num_bytes).decode.adopt(speed)

    # ------------------------------------------------------------------ conveniences
    def encode(self, tensor: torch.Tensor, link_bandwidth: float | None = None) -> bytes:
        """choose + encode + observe_encode in one call."""
        raw_bytes = tensor.numel() * tensor.element_size()
        layout = self.choose(raw_bytes, link_bandwidth)
        start = time.thread_time()
        data = encode(tensor, layout, level=self.level, accepted=self.accepted)
        if layout != "raw":
            self.observe_encode(raw_bytes, len(data), time.thread_time() - start)
        return data

    def report(self) -> dict:
        """What the policy chose last and why, with its current estimates and counts."""
        with self._lock:
            return {
                "mode": self.mode,
                "layout": self.layout,
                "last": asdict(self._last) if self._last else None,
                "bandwidth": self.bandwidth,
                "estimates": {f"< {_size(1 << key)}": self._sizes[key].report() for key in sorted(self._sizes)},
                "counts": dict(self._counts),
            }


def _size(num_bytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes} B"


def _rate(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"
