"""The planner's predicted step time for each measured step, beside the measurement.

For every step of a run the chain's servers' announced profiles (per-block cost tables, codec
figures) with their compute speeds and codec figures measured in the run's earlier steps, the hops'
true shaped rates and the step's own micro-batch count go through the same code the client's
`micro_batches="auto"` uses (`bloombee.planner.chain.chain_inputs`, `ComputeSpeeds`,
`CodecFigures` and the planner's `evaluate` / `schedule.simulate`). Both of the planner's estimates are kept: its
closed form and its event simulation.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from benchmarks.netbench.metrics import median

UNSHAPED_MBPS = 10000.0  # an unshaped veth hop, as the harness advertises it


@lru_cache(maxsize=8)
def _model_section(model_path: str) -> dict:
    from bloombee.loading import load_model_config
    from bloombee.planner.model_config import model_section_from_config

    return model_section_from_config(load_model_config(model_path))


def step_prediction(record: dict, step: dict, context: int, speeds, codecs) -> dict[str, float] | None:
    """Closed-form and simulated seconds of one step's chain as the planner predicts it, at the servers' speeds and
    codec figures measured in the record's earlier steps (None without profiles); then the step's own reports update
    `speeds` (`ComputeSpeeds`) and `codecs` (`CodecFigures`), as the client's own steps update its model."""
    from bloombee.client.micro_batching import measured_compute
    from bloombee.planner.chain import modelled_compute, predicted_times
    from bloombee.client.steps import StepStats
    from bloombee.planner.costs import micro_batch_size
    from bloombee.protocol import HopReport

    if any(span.get("profile") is None for span in record["chain"]):
        return None
    assignment = [span["end"] - span["start"] for span in record["chain"]]
    rows, micro_batches = step["batch"] * step["tokens"], step.get("micro_batches", 1)
    size = micro_batch_size(rows, micro_batches)
    figures = predicted_times(_inputs(record, step, context, speeds, codecs, size), assignment, rows, micro_batches)
    reports = step.get("reports") or []
    if len(reports) == len(assignment):
        inputs = _inputs(record, step, context)
        codecs.observe([node.name for node in inputs.nodes], size, StepStats(
            client_encode_s=step["client_encode_s"], client_layout=step["client_layout"],
            sent_raw_bytes=step["sent_raw_bytes"], sent_wire_bytes=step["sent_wire_bytes"], micro_batches=micro_batches,
            micro_batch_reports=[[HopReport.model_validate(report) for report in micro_batch]
                                 for micro_batch in step["micro_batch_reports"]]))
        speeds.observe(modelled_compute(inputs, assignment, rows, micro_batches), [node.name for node in inputs.nodes],
                       measured_compute(inputs, [HopReport.model_validate(report) for report in reports]), size)
    return figures


def _inputs(record: dict, step: dict, context: int, speeds=None, codecs=None, micro_batch_rows: int = 0):
    """The planner's inputs of the record's chain for `step`; with `speeds` and `codecs`, its cost tables scaled by
    the one and its codecs' figures replaced by the other's at micro-batches of `micro_batch_rows` rows."""
    from bloombee.client.micro_batching import with_measurements
    from bloombee.planner.chain import chain_inputs

    chain = record["chain"]
    nodes = [{**span["profile"], "name": f"{span['name']}:{span['start']}", "offload": span.get("offload")}
             for span in chain]
    hops = [rate or UNSHAPED_MBPS for rate in record["hop_rates_mbps"]]
    tokens = step["tokens"]
    nodes, client_codec = with_measurements(nodes, speeds, codecs, None if speeds is None else micro_batch_rows)
    return chain_inputs(_model_section(record["model_path"]), nodes, hops,
                        [span["end"] - span["start"] for span in chain], step["batch"] * tokens,
                        -(-context // tokens), chain[0]["dtype"], record["client_settings"].get("compression", "auto"),
                        hop_mbps=hops, client_cpu=record["client_cpu"], client_codec=client_codec)


def predictions(record: dict) -> dict[str, Any]:
    """Median predicted (closed form, simulated) and measured chain seconds of the decode and prefill steps, each
    step predicted from the record's earlier ones (the servers' measured compute speeds)."""
    from bloombee.client.micro_batching import CodecFigures, ComputeSpeeds

    predicted: dict[str, list] = {"prefill": [], "decode": []}
    measured: dict[str, list] = {"prefill": [], "decode": []}
    speeds, codecs = ComputeSpeeds(), CodecFigures()
    for rep in record["repeats"]:
        context = 0
        for step in rep["steps"]:
            context += step["tokens"]
            figures = step_prediction(record, step, context, speeds, codecs)
            if figures is None:
                return {}
            predicted[step["kind"]].append(figures)
            measured[step["kind"]].append(step["chain_s"])
    return {kind: {"closed_form_s": median(p["closed_form_s"] for p in predicted[kind]),
                   "simulated_s": median(p["simulated_s"] for p in predicted[kind]),
                   "measured_s": median(measured[kind])}
            for kind in ("prefill", "decode") if measured[kind]}
