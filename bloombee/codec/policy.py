"""When to compress a hop: the break-even rule, fed by speeds measured on recent traffic.

The rule is the model of the chain's (`bloombee.planner.rules.codec_break_even`): compressing a
message of ``N`` raw bytes pays on links slower than ``B*(N) = (1 - 1/r) / (1/C + 1/D + (E + F) / N)``
(``r`` the ratio, ``C`` and ``D`` the encode and decode speeds in raw bytes per second, ``E + F`` the
CPU time of the two calls beyond their bytes, which each process measures: `bloombee.codec.calls`).

The calls' own time matters for small messages (a 16 KiB decode step's frame), and a codec's speed
per byte differs between message sizes, so ``CompressionPolicy`` keeps its figures per size class of
message (powers of two): for each, the medians of recent ``r``, ``1/C`` and ``1/D`` (`ByteCost`) from
the encodes it makes and the decodes its receiver reports (the receiver's own speed of that class
travels back in each step's route). They are kept in `LinkFigures`: the policy's own on a server; on
a client the view of the chain's figures (`bloombee.client.figures.ChainFigures`), which learns them
once, from the client's encodes and its steps' hop reports, for every controller of the client. It
takes ``B`` from the caller (the link speed the DHT records announce, the figure the planner models
the hop with) and applies the rule per message. Use one policy per link. While it keeps choosing raw
for a class it still compresses one message of it in ``probe_every`` so that its estimates follow the
traffic.

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
from bloombee.planner.rules import message_break_even

from .calls import call_costs
from .core import MIN_COMPRESS_BYTES, encode

logger = logging.getLogger(__name__)

MODES = ("auto", "on", "off")

SPEED_WINDOW = 9  # codec ratios and speeds are the median of this many recent calls


@dataclass
class Decision:
    """What the policy chose for one message, by which rule (`RULES`), and the figures it had."""

    layout: str
    compress: bool
    rule: str
    num_bytes: int
    min_bytes: int
    bandwidth: float | None
    ratio: float
    compress_speed: float
    decompress_speed: float
    break_even_bandwidth: float

    @property
    def probe(self) -> bool:
        """A message compressed only to refresh the estimates."""
        return self.rule == "probe"

    @property
    def reason(self) -> str:
        """The rule in words, with the figures it weighed (built only when read: the policy decides every message)."""
        figures = (f"ratio {self.ratio:.3f}, encode {_rate(self.compress_speed)}, decode "
                   f"{_rate(self.decompress_speed)}, break-even {_rate(self.break_even_bandwidth)}")
        return RULES[self.rule].format(self=self, link=_rate(self.bandwidth or 0.0), figures=figures)


RULES = {
    "off": "raw: compression is off for this link",
    "small": "raw: {self.num_bytes} B is under the {self.min_bytes} B minimum worth compressing",
    "forced": "compress: compression is forced on for this link",
    "unknown": "compress: link bandwidth unknown, assuming a slow link ({figures})",
    "slow": "compress: link {link} < break-even ({figures})",
    "probe": "compress (probe to refresh estimates): link {link} >= break-even ({figures})",
    "fast": "raw: link {link} >= break-even ({figures})",
}


class ByteCost:
    """Seconds per raw byte that one side of the codec takes beyond each call's own time (`call_s`): the median of
    its last SPEED_WINDOW observations, so that one cold first call (10x a warm one here) or one descheduled
    mid-way does not move it."""

    def __init__(self, call_s: float):
        self.call_s = call_s
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
        """Raw bytes per second of the bytes alone (None before any observation)."""
        per_byte = self._per_byte.value
        return None if per_byte is None else 1.0 / per_byte


class SizeEstimates:
    """What one machine's codec (or one link's) did with the messages of one size class: the ratio its encodes
    reached, their speed, and the speed of its decodes."""

    def __init__(self):
        self.ratio = Recent(SPEED_WINDOW)
        calls = call_costs()
        self.encode = ByteCost(calls.encode_s)
        self.decode = ByteCost(calls.decode_s)

    def observe_encode(self, raw_bytes: int, encoded_bytes: float, seconds: float) -> None:
        self.ratio.update(raw_bytes / encoded_bytes)
        self.encode.observe(raw_bytes, seconds)


def kept(classes: dict[int, SizeEstimates], num_bytes: int) -> SizeEstimates:
    """The estimates of the size class of `num_bytes` in `classes`, added if new."""
    key = size_class(num_bytes)
    if key not in classes:
        classes[key] = SizeEstimates()
    return classes[key]


class LinkFigures:
    """The figures a link's policy decides with, per size class of message: the sending machine's ratio and encode
    speed, the receiving machine's decode speed. A policy's own by default; on a client, the view of the chain's
    figures that its other controllers read too (`bloombee.client.figures`)."""

    def __init__(self, sender: dict[int, SizeEstimates] | None = None,
                 receiver: dict[int, SizeEstimates] | None = None, lock: threading.Lock | None = None):
        self.sender = {} if sender is None else sender
        self.receiver = self.sender if receiver is None else receiver
        self.lock = lock or threading.Lock()

    def figures(self, num_bytes: int) -> tuple[float | None, float | None, float | None]:
        """(ratio, encode speed, decode speed) measured for messages of `num_bytes` raw bytes, None where not yet."""
        key = size_class(num_bytes)
        with self.lock:
            sent, received = self.sender.get(key), self.receiver.get(key)
            ratio, encode_speed = (None, None) if sent is None else (sent.ratio.value, sent.encode.speed)
            return ratio, encode_speed, None if received is None else received.decode.speed

    def observe_encode(self, raw_bytes: int, encoded_bytes: int, seconds: float) -> None:
        with self.lock:
            kept(self.sender, raw_bytes).observe_encode(raw_bytes, encoded_bytes, seconds)

    def observe_decode(self, raw_bytes: int, seconds: float) -> None:
        with self.lock:
            kept(self.receiver, raw_bytes).decode.observe(raw_bytes, seconds)

    def adopt_decode(self, speed: float, num_bytes: int) -> None:
        with self.lock:
            kept(self.receiver, num_bytes).decode.adopt(speed)

    def counts(self) -> dict[int, dict[str, int]]:
        """Observations so far per size class: of the sender's encodes and of the receiver's decodes."""
        with self.lock:
            return {key: {"encode": self.sender[key].ratio.count if key in self.sender else 0,
                          "decode": self.receiver[key].decode.count if key in self.receiver else 0}
                    for key in set(self.sender) | set(self.receiver)}


class CompressionPolicy:
    """Per-link compress/raw decision.

    ``mode``: "auto" applies the break-even rule, "on" always compresses (tiny messages aside),
    "off" never does. ``layout`` is what a compressing decision returns (passed to ``encode``);
    ``accepted`` is the set of layouts the peer on this link decodes; ``figures`` where its estimates come from and
    go (its own by default).
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
        figures: LinkFigures | None = None,
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
        self._figures = figures or LinkFigures()
        self._raw_streaks: dict[int, int] = {}  # size class -> messages of it sent raw in a row
        self._bandwidth = link_bandwidth
        self._counts = {"raw": 0, "compressed": 0, "probes": 0}
        self._last: Decision | None = None

    # ------------------------------------------------------------------ estimates
    def figures(self, num_bytes: int) -> tuple[float, float, float]:
        """(ratio, encode speed, decode speed) the policy has for messages of `num_bytes` raw bytes (the priors where
        nothing is measured yet)."""
        measured = self._figures.figures(num_bytes)
        return tuple(prior if value is None else value for value, prior in zip(measured, self._priors))

    def measured_decompress_speed(self, num_bytes: int) -> float | None:
        """The receiver's decode speed of messages of `num_bytes` once one has been observed or adopted, else None."""
        return self._figures.figures(num_bytes)[2]

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
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("codec policy: %s", d.reason)
        return d.layout

    def _decide(self, num_bytes: int) -> Decision:
        bw = self.bandwidth
        key = size_class(num_bytes)
        self._raw_streaks.setdefault(key, 0)
        r, c, dspeed = self.figures(num_bytes)
        b_star = message_break_even(r, c, dspeed, call_costs().both_s, num_bytes)

        def decision(compress: bool, rule: str) -> Decision:
            return Decision(layout=self.layout if compress else "raw", compress=compress, rule=rule,
                            num_bytes=num_bytes, min_bytes=self.min_bytes, bandwidth=bw, ratio=r, compress_speed=c,
                            decompress_speed=dspeed, break_even_bandwidth=b_star)

        if self.mode == "off":
            return decision(False, "off")
        if num_bytes < self.min_bytes:
            return decision(False, "small")
        if self.mode == "on":
            return decision(True, "forced")
        if bw is None:
            return decision(True, "unknown")
        if bw < b_star:
            self._raw_streaks[key] = 0
            return decision(True, "slow")
        self._raw_streaks[key] += 1
        if self.probe_every and self._raw_streaks[key] >= self.probe_every:
            self._raw_streaks[key] = 0
            return decision(True, "probe")
        return decision(False, "fast")

    # ------------------------------------------------------------------ observations
    def observe_encode(self, raw_bytes: int, encoded_bytes: int, seconds: float) -> None:
        """Record one encode the policy asked to compress: sizes and CPU seconds (the call's own time is taken off)."""
        if raw_bytes <= 0 or encoded_bytes <= 0 or seconds < 0:
            return
        self._figures.observe_encode(raw_bytes, encoded_bytes, seconds)

    def observe_decode(self, raw_bytes: int, seconds: float) -> None:
        """Record one decode of a compressed frame: decoded size and CPU seconds (the call's own time is taken off)."""
        if raw_bytes <= 0 or seconds < 0:
            return
        self._figures.observe_decode(raw_bytes, seconds)

    def adopt_decompress_speed(self, speed: float, num_bytes: int) -> None:
        """Take the receiver's own measured decode speed (raw bytes/s) of messages of `num_bytes` in place of this
        policy's estimate."""
        if speed <= 0:
            raise ValueError("decompress speed must be a positive number of bytes per second.")
        self._figures.adopt_decode(speed, num_bytes)

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
        """What the policy chose last and why, with its current estimates (of each size class it has met) and counts."""
        observations = self._figures.counts()
        with self._lock:
            met = set(self._raw_streaks) | set(observations)
            return {
                "mode": self.mode,
                "layout": self.layout,
                "last": ({**asdict(self._last), "probe": self._last.probe, "reason": self._last.reason}
                         if self._last else None),
                "bandwidth": self.bandwidth,
                "estimates": {f"< {_size(1 << key)}": self._report(key, observations) for key in sorted(met)},
                "counts": dict(self._counts),
            }

    def _report(self, key: int, observations: dict[int, dict[str, int]]) -> dict:
        ratio, compress_speed, decompress_speed = self.figures(1 << (key - 1))
        return {"ratio": ratio, "compress_speed": compress_speed, "decompress_speed": decompress_speed,
                "observations": observations.get(key, {"encode": 0, "decode": 0})}


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
