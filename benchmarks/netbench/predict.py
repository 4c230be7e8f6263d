"""The planner's predicted step time for each measured step, beside the measurement.

For every step of a run the chain's servers' announced profiles (per-block cost tables, codec
figures), the hops' true shaped rates and the step's own micro-batch count go through the same
code the client's `micro_batches="auto"` uses (`bloombee.client.micro_batching.chain_inputs` and
the planner's `evaluate` / `schedule.simulate`). Both of the planner's estimates are kept: its
closed form (eq. 4) and its event simulation.
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


def step_prediction(record: dict, step: dict, context: int) -> dict[str, float] | None:
    """Closed-form and simulated seconds of one step's chain as the planner predicts it (None without profiles)."""
    from bloombee.client.micro_batching import chain_inputs, predicted_times

    chain = record["chain"]
    if any(span.get("profile") is None for span in chain):
        return None
    nodes = [{**span["profile"], "name": f"{span['name']}:{span['start']}", "offload": span.get("offload")}
             for span in chain]
    hops = [rate or UNSHAPED_MBPS for rate in record["hop_rates_mbps"]]
    compression = record["client_settings"].get("compression", "auto")
    tokens = step["tokens"]
    assignment = [span["end"] - span["start"] for span in chain]
    inputs = chain_inputs(_model_section(record["model_path"]), nodes, hops, assignment,
                          step["batch"] * tokens, -(-context // tokens), chain[0]["dtype"], compression, hop_mbps=hops,
                          client_cpu=record["client_cpu"])
    return predicted_times(inputs, assignment, step["batch"] * tokens, step.get("micro_batches", 1))


def predictions(record: dict) -> dict[str, Any]:
    """Median predicted (closed form, simulated) and measured chain seconds of the decode and prefill steps."""
    out: dict[str, Any] = {}
    for kind in ("prefill", "decode"):
        predicted, measured = [], []
        for rep in record["repeats"]:
            context = 0
            for step in rep["steps"]:
                context += step["tokens"]
                if step["kind"] != kind:
                    continue
                figures = step_prediction(record, step, context)
                if figures is None:
                    return {}
                predicted.append(figures)
                measured.append(step["chain_s"])
        if measured:
            out[kind] = {"closed_form_s": median(p["closed_form_s"] for p in predicted),
                         "simulated_s": median(p["simulated_s"] for p in predicted),
                         "measured_s": median(measured)}
    return out
