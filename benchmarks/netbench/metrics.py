"""Turning one run's raw records into its figures (pure functions, no processes, no namespaces).

A run's chain is ``client -> s_a -> s_b -> ... -> client``: hop 0 is the client's send, hop i
(1 <= i < n) is server i-1's push to server i, hop n is the last server's reply. Per decode step:

- bytes per hop from the process's own counters: the client's ``sent_wire_bytes`` for hop 0 and
  each server's ``HopReport.wire_bytes`` (what it sent on) for the others (encoded tensor frames);
  from the interfaces: the tx bytes of each hop's sender over the decode window, divided by the
  decode steps, less the idle swarm's background (DHT upkeep, measured before the runs). These
  include Ethernet/IP/TCP headers (``HEADER_BYTES`` per packet), the message headers, libp2p
  framing, TCP acks of the reverse direction and the servers' small per-step acks to the client;
  the agreement check compares the interfaces' TCP payload (bytes less headers per packet) with
  the processes' bytes;
- the transport breakdown per hop (the paper's Tables 6-8): device->host copy and host->device
  copy (0 on this CPU-only machine: the tensors never leave host memory), encode + hand to the
  socket (the sender's encode time), wire, receive + decode (the receiver's decode time), and
  compute per server. Wire time is what the chain's step time leaves after every other part:
  ``wire_total = chain_s - client encode - client decode - sum(server decode + compute + encode)``.
  Per hop it is estimated as that hop's serialization time at its shaped rate
  (interface bytes / rate) plus an equal share of the rest (the stack overhead every hop pays:
  protobuf, the two p2p daemons, TCP, asyncio wake-ups); the rest is reported as ``stack_overhead_s``;
- the floor: ``sum(compute of the blocks) + sum over hops(interface bytes / shaped rate)`` — the
  step time if the shaped links were the only cost besides computing; unshaped hops add nothing.
  With no micro-batching every hop waits for the previous one, so this is a lower bound;
  ``measured / floor`` (median chain time over it) says how far the stack is from it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

CPU_COPY_NOTE = "device<->host copies are 0: CPU-only machine, tensors stay in host memory"
HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12, per packet on the veth
# The interfaces' TCP payload per hop and step must lie within [-3 %, +5 % + 1.5 KB] of the process's
# count: the processes count encoded tensor frames only, the wire also carries each message's header
# (the step header names the rest of the route: ~0.3-0.9 KB), libp2p framing and the per-step acks.
AGREEMENT_LOW, AGREEMENT_HIGH, AGREEMENT_SLACK_BYTES = 0.97, 1.05, 1536


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


def median(values: Iterable[float]) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else math.nan


def node_of(public_name: str) -> str:
    """Servers are named '<node>.<group>' (e.g. s0.1): the node is the part before the dot."""
    return public_name.split(".", 1)[0]


def hops_of(chain: list[dict]) -> list[tuple[str, str]]:
    nodes = ["client"] + [node_of(span["name"]) for span in chain] + ["client"]
    return list(itertools.pairwise(nodes))


def hop_app_bytes(step: dict, key: str = "wire_bytes") -> list[int]:
    """Bytes each hop carried in one step, from the processes' counters (wire or raw)."""
    first = step["sent_wire_bytes"] if key == "wire_bytes" else step["sent_raw_bytes"]
    return [first] + [(report or {}).get(key, 0) for report in step["reports"]]


def step_parts(step: dict) -> dict[str, Any]:
    """Encode per hop (sender), decode per hop (receiver), compute per server, and the wire remainder."""
    reports = [report or {} for report in step["reports"]]
    encode = [step["client_encode_s"]] + [report.get("encode_s", 0.0) for report in reports]
    decode = [report.get("decode_s", 0.0) for report in reports] + [step["client_decode_s"]]
    compute = [report.get("compute_s", 0.0) for report in reports]
    wire = step["chain_s"] - sum(encode) - sum(decode) - sum(compute)
    return {"encode_s": encode, "decode_s": decode, "compute_s": compute, "wire_total_s": wire,
            "complete": all(report for report in step["reports"])}


def counter_delta(before: dict[str, dict], after: dict[str, dict], node: str, key: str = "tx_bytes") -> int:
    return after[node][key] - before[node][key]


def iface_hop_bytes(before: dict[str, dict], after: dict[str, dict], hops: list[tuple[str, str]]) -> list[int]:
    """Bytes each hop's sender put on its uplink between two snapshots."""
    return [counter_delta(before, after, src) for src, _ in hops]


def iface_hop_stats(before: dict[str, dict], after: dict[str, dict], hops: list[tuple[str, str]], steps: int,
                    window_s: float | None = None, background: dict | None = None) -> dict[str, list[float]]:
    """Per hop and per step, from the sender's uplink counters: all bytes; bytes less the idle swarm's
    background traffic over the window; and the TCP payload (that, less HEADER_BYTES per packet)."""
    total, net, payload, packets = [], [], [], []
    for src, _ in hops:
        sent = counter_delta(before, after, src)
        pkts = counter_delta(before, after, src, "tx_packets")
        bg_bytes = bg_pkts = 0.0
        if background and window_s:
            rates = background["per_s"].get(src, {})
            bg_bytes, bg_pkts = rates.get("tx_bytes", 0.0) * window_s, rates.get("tx_packets", 0.0) * window_s
        total.append(sent / steps)
        net.append(max(sent - bg_bytes, 0.0) / steps)
        payload.append(max(sent - bg_bytes - HEADER_BYTES * max(pkts - bg_pkts, 0.0), 0.0) / steps)
        packets.append(pkts / steps)
    return {"bytes": total, "net_bytes": net, "payload_bytes": payload, "packets": packets}


def transfer_seconds(num_bytes: float, rate_mbps: float | None) -> float:
    return 0.0 if rate_mbps is None else num_bytes * 8.0 / (rate_mbps * 1e6)


def floor_seconds(compute_s: Sequence[float], hop_bytes: Sequence[float], hop_rates_mbps: Sequence[float | None]) -> float:
    """Lower bound of one step: all block compute plus every hop's bytes at its shaped rate."""
    if len(hop_bytes) != len(hop_rates_mbps):
        raise ValueError(f"{len(hop_bytes)} hop byte counts for {len(hop_rates_mbps)} hop rates")
    return float(sum(compute_s) + sum(transfer_seconds(b, r) for b, r in zip(hop_bytes, hop_rates_mbps)))


def breakdown(steps: list[dict], hops: list[tuple[str, str]], hop_rates_mbps: list[float | None],
              hop_bytes: list[float]) -> dict[str, Any]:
    """Median transport breakdown of `steps` (decode steps), per hop and per server."""
    parts = [step_parts(step) for step in steps]
    n_hops = len(hops)
    encode = [median(p["encode_s"][h] for p in parts) for h in range(n_hops)]
    decode = [median(p["decode_s"][h] for p in parts) for h in range(n_hops)]
    compute = [median(p["compute_s"][i] for p in parts) for i in range(n_hops - 1)]
    wire_total = median(p["wire_total_s"] for p in parts)
    serialization = [transfer_seconds(b, r) for b, r in zip(hop_bytes, hop_rates_mbps)]
    overhead = wire_total - sum(serialization)
    rows = []
    for h, (src, dst) in enumerate(hops):
        rows.append({"hop": f"{src}->{dst}", "rate_mbps": hop_rates_mbps[h], "bytes": hop_bytes[h],
                     "d2h_s": 0.0, "encode_s": encode[h], "wire_s": serialization[h] + overhead / n_hops,
                     "serialization_s": serialization[h], "decode_s": decode[h], "h2d_s": 0.0,
                     "compute_s": compute[h] if h < n_hops - 1 else None, "computed_by": dst if h < n_hops - 1 else None})
    return {"hops": rows, "wire_total_s": wire_total, "stack_overhead_s": overhead, "compute_total_s": sum(compute),
            "encode_total_s": sum(encode), "decode_total_s": sum(decode), "note": CPU_COPY_NOTE,
            "complete_reports": all(p["complete"] for p in parts)}


def _weighted(rows: list[list[float]], weights: list[int]) -> list[float]:
    total = sum(weights)
    return [sum(row[h] * w for row, w in zip(rows, weights)) / total for h in range(len(rows[0]))]


def iface_summary(repeats: list[dict], hops: list[tuple[str, str]], background: dict | None,
                  first: str, last: str, kind: str) -> tuple[dict[str, list[float]], list[float]]:
    """Interface figures per hop and step of the `kind` steps between marks `first` and `last`, averaged
    over the repeats (weighted by their steps), and their agreement with the processes' own counts."""
    stats, weights, app = [], [], []
    for rep in repeats:
        counters, marks = rep.get("counters") or {}, rep.get("mark_times") or {}
        steps = [step for step in rep["steps"] if step["kind"] == kind]
        if first not in counters or last not in counters or not steps:
            continue
        window = marks[last] - marks[first] if first in marks and last in marks else None
        stats.append(iface_hop_stats(counters[first], counters[last], hops, len(steps), window, background))
        app.append([sum(hop_app_bytes(step)[h] for step in steps) / len(steps) for h in range(len(hops))])
        weights.append(len(steps))
    if not stats:
        return {}, []
    merged = {key: _weighted([st[key] for st in stats], weights) for key in stats[0]}
    app_mean = _weighted(app, weights)
    merged["process_bytes"] = app_mean
    merged["excess_bytes"] = [i - a for i, a in zip(merged["payload_bytes"], app_mean)]
    agreement = [i / a if a else math.nan for i, a in zip(merged["payload_bytes"], app_mean)]
    return merged, agreement


def counters_agree(iface: dict[str, list[float]]) -> bool:
    """Whether every hop's interface payload is the process's bytes plus at most headers and framing."""
    if not iface:
        return False
    return all(AGREEMENT_LOW * a <= i <= AGREEMENT_HIGH * a + AGREEMENT_SLACK_BYTES
               for i, a in zip(iface["payload_bytes"], iface["process_bytes"]))


def summarize(run: dict) -> dict[str, Any]:
    """The figures of one (environment, configuration): decode steps pooled over its repeats (`summarize_generate`
    for a configuration that ran through `model.generate`)."""
    repeats = run["repeats"]
    if repeats[0].get("mode") == "generate":
        return summarize_generate(run)
    steps = [step for rep in repeats for step in rep["steps"]]
    decode_steps = [step for step in steps if step["kind"] == "decode"]
    prefill = [step for step in steps if step["kind"] == "prefill"]
    if not decode_steps:
        raise ValueError("a run needs at least one decode step (new_tokens >= 2)")
    hops = [tuple(hop) for hop in run["hops"]]
    rates = run["hop_rates_mbps"]
    batch = decode_steps[0]["batch"]
    n_decode = len(decode_steps)

    app_wire = [median(hop_app_bytes(step)[h] for step in decode_steps) for h in range(len(hops))]
    app_raw = [median(hop_app_bytes(step, "raw_bytes")[h] for step in decode_steps) for h in range(len(hops))]
    iface, agreement = iface_summary(repeats, hops, run.get("background"), "decode", "end", "decode")
    _, prefill_agreement = iface_summary(repeats, hops, run.get("background"), "start", "decode", "prefill")

    floor_bytes = iface["net_bytes"] if iface else [b * 1514 / 1448 for b in app_wire]
    # a server's report rides on its ack to the client, which can (rarely) arrive after the step's output:
    # the breakdown and the floor use the steps whose every report arrived
    complete = [step for step in decode_steps if all(step["reports"])] or decode_steps
    parts = breakdown(complete, hops, rates, floor_bytes)
    compute = [row["compute_s"] for row in parts["hops"] if row["compute_s"] is not None]
    floor = floor_seconds(compute, floor_bytes, rates)
    chain_median = median(step["chain_s"] for step in complete)
    walls = [step["wall_s"] for step in decode_steps]
    typical = min(complete, key=lambda step: abs(step["chain_s"] - chain_median))
    return {
        "env": run["env"]["name"], "config": run["config"]["name"], "model": run["model_name"],
        "batch": batch, "prompt_len": run["workload"]["prompt_len"], "new_tokens": run["workload"]["new_tokens"],
        "servers": len(hops) - 1, "repeats": len(repeats), "decode_steps": n_decode,
        "decode_tokens_per_s": batch * n_decode / sum(walls),
        "e2e_tokens_per_s": batch * len(steps) / sum(rep["generation_s"] for rep in repeats),
        "e2e_tokens_per_s_repeats": [batch * len(rep["steps"]) / rep["generation_s"] for rep in repeats],
        "step_median_s": median(walls), "step_p90_s": percentile(walls, 90),
        "chain_median_s": chain_median, "chain_p90_s": percentile([s["chain_s"] for s in decode_steps], 90),
        "head_median_s": median(step["head_s"] for step in decode_steps),
        "prefill_s": median(step["wall_s"] for step in prefill) if prefill else None,
        "hop_wire_bytes": app_wire, "hop_raw_bytes": app_raw, "hop_iface": iface,
        "hop_iface_bytes": iface.get("net_bytes", []),
        "step_wire_bytes": sum(app_wire), "step_raw_bytes": sum(app_raw),
        "step_iface_bytes": sum(iface["net_bytes"]) if iface else None,
        "compression_ratio": sum(app_raw) / sum(app_wire) if sum(app_wire) else math.nan,
        "iface_over_app": agreement, "prefill_iface_over_app": prefill_agreement,
        "counters_agree": counters_agree(iface),
        "layouts": sorted({step["client_layout"] for step in decode_steps} |
                          {r["layout"] for step in decode_steps for r in step["reports"] if r}),
        "breakdown": parts, "compute_s": sum(compute), "wire_s": parts["wire_total_s"],
        "transport_s": median(step["chain_s"] - sum(step_parts(step)["compute_s"]) for step in complete),
        "steps_without_all_reports": len(decode_steps) - len(complete),
        "floor_s": floor, "measured_over_floor": chain_median / floor if floor > 0 else math.nan,
        "loadavg": [rep.get("loadavg") for rep in repeats], "failed_attempts": len(run.get("failed_attempts", [])),
        "micro_batches": sorted({step.get("micro_batches", 1) for step in steps}),
        "timeline": timeline(typical, [dst for _, dst in hops[:-1]]),
        "timeline_chain_s": typical["chain_s"],
    }


# what the step loop's summary holds per hop and step and a `model.generate` run cannot see: absent (None, NaN, empty)
STEP_FIGURES_ABSENT = {
    "chain_median_s": None, "chain_p90_s": None, "head_median_s": None, "hop_wire_bytes": [], "hop_raw_bytes": [],
    "hop_iface": {}, "hop_iface_bytes": [], "step_wire_bytes": None, "step_raw_bytes": None, "step_iface_bytes": None,
    "compression_ratio": math.nan, "iface_over_app": [], "prefill_iface_over_app": [], "counters_agree": None,
    "layouts": [], "breakdown": None, "compute_s": None, "wire_s": None, "transport_s": None,
    "steps_without_all_reports": 0, "floor_s": None, "measured_over_floor": math.nan, "micro_batches": [],
    "timeline": [], "timeline_chain_s": None,
}


def summarize_generate(run: dict) -> dict[str, Any]:
    """The figures of a configuration that ran through `model.generate` (speculative decoding): tokens/s after the
    first token (`decode`) and end to end, defined as for the step loop; a step is one trip through the chain (a
    token tree or a plain step), its time the mean over a generation; and the speculation's rounds."""
    repeats = run["repeats"]
    batch = repeats[0]["batch"]
    rounds = [rep["speculation"]["tree_rounds"] + rep["speculation"]["plain_rounds"] for rep in repeats]
    decode_s = [rep["generation_s"] - rep["first_token_s"] for rep in repeats]
    per_step = [seconds / count for seconds, count in zip(decode_s, rounds) if count]
    accepted = [count for rep in repeats for count in rep["speculation"]["accepted"]]
    return {
        **STEP_FIGURES_ABSENT,
        "env": run["env"]["name"], "config": run["config"]["name"], "model": run["model_name"], "mode": "generate",
        "batch": batch, "prompt_len": run["workload"]["prompt_len"], "new_tokens": run["workload"]["new_tokens"],
        "servers": len(run["hops"]) - 1, "repeats": len(repeats), "decode_steps": sum(rounds),
        "decode_tokens_per_s": batch * sum(rep["new_tokens"] - 1 for rep in repeats) / sum(decode_s),
        "e2e_tokens_per_s": batch * sum(rep["new_tokens"] for rep in repeats) / sum(rep["generation_s"] for rep in repeats),
        "e2e_tokens_per_s_repeats": [batch * rep["new_tokens"] / rep["generation_s"] for rep in repeats],
        "step_median_s": median(per_step), "step_p90_s": percentile(per_step, 90),
        "prefill_s": median(rep["first_token_s"] for rep in repeats),
        "tree_rounds": sum(rep["speculation"]["tree_rounds"] for rep in repeats),
        "plain_rounds": sum(rep["speculation"]["plain_rounds"] for rep in repeats),
        "tokens_per_tree_round": statistics.fmean(accepted) if accepted else None,
        "tokens_per_step": sum(rep["new_tokens"] - 1 for rep in repeats) / sum(rounds) if sum(rounds) else None,
        "loadavg": [rep.get("loadavg") for rep in repeats], "failed_attempts": len(run.get("failed_attempts", [])),
    }


def timeline(step: dict, names: list[str]) -> list[dict]:
    """Who did what when in one step: per micro-batch, each server's decode, compute and encode, and each hop's
    transfer (from the sender's encode end, or the client's send, to the receiver's decode start), in ms from
    the client's first send. `names` are the chain's nodes (s0, s1, ...)."""
    if not step.get("micro_batch_reports") or not step.get("sent_at"):
        return []
    origin = min(step["sent_at"])
    ms = lambda t: (t - origin) * 1e3  # noqa: E731
    offsets = sorted({reports[0]["batch_offset"] for reports in step["micro_batch_reports"]})
    sent = dict(zip(offsets, step["sent_at"]))
    intervals = []
    for reports, received in zip(step["micro_batch_reports"], step["received_at"]):
        mb = offsets.index(reports[0]["batch_offset"])
        ready, sender = sent[reports[0]["batch_offset"]], "client"
        for name, report in zip(names, reports):
            intervals.append({"row": f"{sender} -> {name}", "kind": "transfer", "mb": mb, "start": ms(ready), "end": ms(report["decode_at"])})
            for part in ("decode", "compute", "encode"):
                began = report[f"{part}_at"]
                intervals.append({"row": f"{name} {part}", "kind": part, "mb": mb, "start": ms(began),
                                  "end": ms(began + report[f"{part}_s"])})
            ready, sender = report["encode_at"] + report["encode_s"], name
        intervals.append({"row": f"{sender} -> client", "kind": "transfer", "mb": mb, "start": ms(ready), "end": ms(received)})
    return intervals
