"""The planner's predicted step time for each measured step, beside the measurement.

For every step of a run the chain's servers' announced profiles (per-block cost tables, codec
figures) with their compute speeds and codec figures measured in the run's earlier steps, the hops'
true shaped rates and the step's own micro-batch count go through the same code the client's
`micro_batches="auto"` uses (`bloombee.planner.chain.chain_inputs`, the client's view of the chain's
figures `ChainFigures` and the planner's `evaluate` / `schedule.simulate`). Both of the planner's
estimates are kept: its closed form and its event simulation.
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


def step_prediction(record: dict, step: dict, context: int, figures) -> dict[str, float] | None:
    """Closed-form and simulated seconds of one step's chain as the planner predicts it, at the servers' speeds and
    codec figures measured in the record's earlier steps (None without profiles); then the step's own reports update
    `figures` (`ChainFigures`), as the client's own steps and encodes update its view."""
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
    used = figures.messages.factor
    times = predicted_times(_inputs(record, step, context, figures, size), assignment, rows, micro_batches)
    reports = step.get("reports") or []
    if len(reports) == len(assignment):
        raised = predicted_times(_inputs(record, step, context, figures, size, used + 1), assignment, rows,
                                 micro_batches)
        figures.messages.observe(used, times["simulated_s"], raised["simulated_s"], step["chain_s"])
        inputs = _inputs(record, step, context)
        peers = [span["name"] for span in record["chain"]]
        sent = (step["client_layout"], step["sent_raw_bytes"] / micro_batches)  # each micro-batch's, on average
        if sent[0] != "raw" and step["sent_wire_bytes"]:  # the client's encodes, as its policies learn them
            figures.link(peers[0]).observe_encode(sent[1], step["sent_wire_bytes"] / micro_batches,
                                                  step["client_encode_s"] / micro_batches)
        micro_batch_reports = [[HopReport.model_validate(report) for report in micro_batch]
                               for micro_batch in step["micro_batch_reports"]]
        figures.observe_step(peers, StepStats(
            micro_batch_reports=micro_batch_reports, sent={hops[0].batch_offset: sent for hops in micro_batch_reports},
            received_decode_cpu_s=[0.0] * len(micro_batch_reports)))  # the client's decodes are not recorded
        figures.speeds.observe(modelled_compute(inputs, assignment, rows, micro_batches),
                               [node.name for node in inputs.nodes],
                               measured_compute(inputs, [HopReport.model_validate(report) for report in reports]), size)
    return times


def _inputs(record: dict, step: dict, context: int, figures=None, micro_batch_rows: int = 0,
            message_factor: float | None = None):
    """The planner's inputs of the record's chain for `step`; with `figures` (`ChainFigures`), its cost tables scaled
    by the measured compute speeds, its codecs' figures replaced by the measured ones at micro-batches of
    `micro_batch_rows` rows and its messages' CPU by the measured factor (or `message_factor`)."""
    from bloombee.planner.chain import activation_bytes, chain_inputs

    chain = record["chain"]
    nodes = [{**span["profile"], "name": f"{span['name']}:{span['start']}", "offload": span.get("offload")}
             for span in chain]
    hops = [rate or UNSHAPED_MBPS for rate in record["hop_rates_mbps"]]
    tokens = step["tokens"]
    model = _model_section(record["model_path"])
    client_codec, factor = nodes[0].get("compression"), 1.0
    if figures is not None:
        factor = figures.messages.factor if message_factor is None else message_factor
        nodes, client_codec = figures.measured_nodes(nodes, [span["name"] for span in chain], micro_batch_rows,
                                                     activation_bytes(model["hidden_size"], chain[0]["dtype"]))
    return chain_inputs(model, nodes, hops,
                        [span["end"] - span["start"] for span in chain], step["batch"] * tokens,
                        -(-context // tokens), chain[0]["dtype"], record["client_settings"].get("compression", "auto"),
                        hop_mbps=hops, client_cpu=record["client_cpu"], client_codec=client_codec,
                        message_factor=factor)


def predictions(record: dict) -> dict[str, Any]:
    """Median predicted (closed form, simulated) and measured chain seconds of the decode and prefill steps, each
    step predicted from the record's earlier ones (the servers' measured compute speeds)."""
    from bloombee.client.figures import ChainFigures

    predicted: dict[str, list] = {"prefill": [], "decode": []}
    measured: dict[str, list] = {"prefill": [], "decode": []}
    figures = ChainFigures(UNSHAPED_MBPS * 1e6 / 8)  # its hop bandwidths are not read here
    for rep in record["repeats"]:
        context = 0
        for step in rep["steps"]:
            context += step["tokens"]
            times = step_prediction(record, step, context, figures)
            if times is None:
                return {}
            predicted[step["kind"]].append(times)
            measured[step["kind"]].append(step["chain_s"])
    return {kind: {"closed_form_s": median(p["closed_form_s"] for p in predicted[kind]),
                   "simulated_s": median(p["simulated_s"] for p in predicted[kind]),
                   "measured_s": median(measured[kind])}
            for kind in ("prefill", "decode") if measured[kind]}
