"""`micro_batches="auto"`: the planner's model of the session's chain picks how many micro-batches a step uses.

The chain's servers announce their planner profile (per-block cost table, memory, codec figures)
and link speed in their DHT records. From them this module builds the planner's inputs for the
chain as routed (one node per span, its blocks as the assignment) and scores every candidate M
with the planner's own step model and event simulation (`bloombee.planner.evaluate` and
`schedule.simulate`), then takes the fastest. A step of T tokens per row is scored as a decode
step of B x T rows (compute and activation bytes both scale with the tokens of a micro-batch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bloombee.client.routing import Span
from bloombee.planner import PlanInputs, evaluate
from bloombee.planner.model_config import model_section_from_config
from bloombee.planner.schedule import simulate

logger = logging.getLogger(__name__)

CANDIDATES = (1, 2, 4, 8, 16, 32)
# fixed cost of one message on one hop beyond its bytes (headers, p2p daemons, event loops), measured by netbench on E1
MESSAGE_OVERHEAD_MS = 1.5


class MicroBatchChooser:
    """Picks M per step for one model; remembers which servers lacked a profile so that it says so once."""

    def __init__(self, config, link_mbps: float, compression: str):
        self.model = model_section_from_config(config)
        self.link_mbps, self.compression = link_mbps, compression
        self._unprofiled: set[str] = set()

    def __call__(self, spans: Sequence[Span], batch_size: int, num_tokens: int, context: int) -> int:
        inputs = self.chain_inputs(spans, batch_size * num_tokens, context)
        if inputs is None:
            return 1
        assignment = [span.end - span.start for span in spans]
        times = {m: predicted_step_s(inputs, assignment, batch_size * num_tokens, m)
                 for m in CANDIDATES if m <= batch_size}
        return min(times, key=times.get)

    def chain_inputs(self, spans: Sequence[Span], rows: int, context: int) -> PlanInputs | None:
        """The planner's inputs for this chain, or None when a server announces no profile."""
        missing = [span.peer_id for span in spans if span.record.profile is None]
        if missing:
            new = set(missing) - self._unprofiled
            if new:
                self._unprofiled |= new
                logger.warning("micro_batches=auto: servers %s announce no planner profile, so steps through them "
                               "are not split", ", ".join(sorted(new)))
            return None
        nodes = [node_for(span) for span in spans]
        return PlanInputs.model_validate({
            "model": self.model | {"num_blocks": spans[-1].end - spans[0].start},
            "workload": {"batch_sizes": [rows], "micro_batches": [1], "seq_len": max(context, 1),
                         "dtype": planner_dtype(spans[0].record.dtype), "compression": self.compression},
            "client": {"link": link(self.link_mbps)},
            "nodes": nodes,
        })


def node_for(span: Span) -> dict:
    """The planner node of one span's server: its announced profile, with the link it announces now."""
    node = dict(span.record.profile)
    node["name"] = f"{span.peer_id}:{span.start}"
    node["link"] = link(span.record.link_bandwidth * 8 / 1e6)
    return node


def link(mbps: float) -> dict:
    return {"uplink_mbps": mbps, "downlink_mbps": mbps, "latency_ms": MESSAGE_OVERHEAD_MS / 2}


def planner_dtype(dtype: str) -> str:
    return dtype if dtype in ("float16", "bfloat16", "float32") else "float32"


def predicted_step_s(inputs: PlanInputs, assignment: list[int], rows: int, micro_batches: int) -> float:
    """The simulated time of one step of `rows` rows in `micro_batches` micro-batches (inf if it does not fit)."""
    evaluation = evaluate(inputs, assignment, rows, micro_batches)
    if not evaluation.feasible:
        return float("inf")
    return simulate(evaluation)[1]
