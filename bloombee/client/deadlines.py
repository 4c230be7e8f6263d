"""How long a step through a chain may take before the chain counts as failed.

A step's expected time comes from the session's own recent steps of the same size when there are
some, else from the servers' announced figures (hop penalty, link bandwidth, block throughput). A
step fails after max(`step_timeout_min`, `step_timeout_factor` x expected) seconds, and never waits
longer than `request_timeout`: a dead or frozen server costs a bounded time that does not depend on
the generic request timeout.
"""

from collections import defaultdict, deque
from collections.abc import Sequence

from bloombee.client.routing import Span, span_figures
from bloombee.planner.chain import announced_step_seconds
from bloombee.settings import ClientSettings

RECENT_STEPS = 8  # step times remembered per step size


class StepClock:
    """One session's expected step times and the deadlines derived from them."""

    def __init__(self, settings: ClientSettings, hidden_size: int):
        self.settings, self.hidden_size = settings, hidden_size
        self._recent: dict[tuple[int, int], deque[float]] = defaultdict(lambda: deque(maxlen=RECENT_STEPS))

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A step of `rows` x `tokens` went through the whole chain in `seconds`."""
        self._recent[rows, tokens].append(seconds)

    def expected(self, spans: Sequence[Span], rows: int, tokens: int) -> float:
        """Seconds a step of `rows` x `tokens` should take through `spans`: the slowest recent one, else announced."""
        recent = self._recent.get((rows, tokens))
        return max(recent) if recent else self.announced(spans, rows * tokens)

    def announced(self, spans: Sequence[Span], vectors: int) -> float:
        """Seconds for `vectors` hidden vectors through `spans` by the servers' DHT records."""
        figures = [span_figures(span.record, span.end - span.start, self.hidden_size) for span in spans]
        return announced_step_seconds(figures, vectors, self.settings.hop_penalty_seconds)

    def deadline(self, expected: float) -> float:
        """Seconds to wait for something expected to take `expected` seconds."""
        bounded = max(self.settings.step_timeout_min, self.settings.step_timeout_factor * expected)
        return min(bounded, self.settings.request_timeout)
