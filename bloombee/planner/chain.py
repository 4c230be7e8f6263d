"""The model of a routed chain: the planner's inputs for the servers a session uses, and what it predicts.

Every estimate of a step's time goes through here or through the planner's `evaluate` and
`schedule.simulate`, which this module calls: the client's `micro_batches="auto"`, the speculation
switch's first judgement, netbench's predictions, and, from the servers' announced figures alone
(`SpanFigures`), routing, deadlines and the status view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .evaluate import evaluate
from .inputs import DTYPE_BYTES, NodeSpec, PlanInputs
from .schedule import cpu_shares, simulate



def timed_by_cpu(node: NodeSpec) -> bool:
    """Whether a node's compute is judged by its CPU time: a CPU node computing on one thread. Its report's
    `compute_cpu_s` is then all of the compute's work, without the waits for a core that the simulation models;
    elsewhere the wall time `compute_s` is judged against the simulation's (a GPU's kernels are not CPU time)."""
    return node.cpu is not None and node.cpu.threads == 1


def modelled_compute(inputs: PlanInputs, assignment: list[int], rows: int, micro_batches: int) -> dict[str, float]:
    """Each node's compute time in one step as the planner has it (all its micro-batches; empty if the step does not
    fit): the table's time where the node is timed by its CPU time, else the time the simulation gives it."""
    evaluation = evaluate(inputs, assignment, rows, micro_batches)
    if not evaluation.feasible:
        return {}
    modelled: dict[str, float] = {}
    for interval in simulate(evaluation, cpu_shares(inputs))[0]:
        if interval.kind == "compute":
            name = interval.row.removesuffix(" compute")
            modelled[name] = modelled.get(name, 0.0) + interval.end_s - interval.start_s
    for node, stage in zip(inputs.nodes, evaluation.stages):
        if timed_by_cpu(node) and stage.active:
            modelled[node.name] = stage.t_comp_s * micro_batches
    return modelled


def scaled_cost(node: dict, factor: float) -> dict:
    """A planner node dict with its cost tables' (or polynomials') compute times multiplied by `factor`, at every
    precision it gives (`cost` and `quant_costs`)."""
    if factor == 1.0:
        return node
    quant_costs = {quant: _scaled(cost, factor) for quant, cost in node.get("quant_costs", {}).items()}
    return {**node, "cost": _scaled(node["cost"], factor), **({"quant_costs": quant_costs} if quant_costs else {})}


def _scaled(cost: dict, factor: float) -> dict:
    """A `BlockCost` dict with its compute times multiplied by `factor`."""
    part = "table" if cost.get("table") is not None else "coefficients"
    scaled = {key: values if key == "micro_batch" else [value * factor for value in values]
              for key, values in cost[part].items()}
    return {**cost, part: scaled}


def scaled_messages(cpu: dict | None, factor: float) -> dict | None:
    """A `CpuShare` dict with the CPU of a message multiplied by `factor` (None stays None)."""
    if cpu is None or factor == 1.0:
        return cpu
    return {**cpu, "message_ms": cpu.get("message_ms", 0.0) * factor}


def chain_inputs(model: dict, nodes: list[dict], links_mbps: Sequence[float], blocks: Sequence[int], rows: int, context: int,
                 dtype: str, compression: str, hop_mbps: Sequence[float] | None = None,
                 client_cpu: dict | None = None, client_codec: dict | None = None,
                 message_factor: float = 1.0) -> PlanInputs:
    """Planner inputs of a chain of `nodes` (planner node dicts, as announced) holding `blocks` blocks each.

    `links_mbps`: the client's link, then each node's, as announced; `hop_mbps` (client -> first node, ...,
    last node -> client), when known, overrides them hop by hop. A step of T tokens per row is scored as
    `rows` = B x T rows over context / T (the same KV bytes). `client_cpu`: the client's own `CpuShare`
    (with what messages cost its host) and its end of a hop's `latency_ms`, `client_codec`: its codec figures (without, it has none).
    Every link is slowed by the p2p stack of the process at its end, at the rate its host measured;
    `message_factor` scales the CPU of a message on every process (what the chain's steps measured of it
    against the hosts' figures: `bloombee.client.figures.MessageCosts`).
    """
    client_cpu = scaled_messages(client_cpu, message_factor)
    nodes = [{**node, "cpu": scaled_messages(node["cpu"], message_factor)} if node.get("cpu") else node
             for node in nodes]
    names = [node["name"] for node in nodes]
    ends = [client_cpu or {}, *[node.get("cpu") or {} for node in nodes]]
    stack = dict(zip(["client", *names], [end.get("stack_mbps", 0.0) for end in ends]))
    overrides = [] if hop_mbps is None else [
        {"src": src, "dst": dst, "bandwidth_mbps": through_stack(mbps, stack[src], stack[dst])}
        for src, dst, mbps in zip(["client", *names], [*names, "client"], hop_mbps)]
    client = {"link": link(links_mbps[0], stack["client"], client_latency_ms(client_cpu))}
    if client_codec is not None:
        client["compression"] = client_codec
    if client_cpu is not None:
        client["cpu"] = {key: value for key, value in client_cpu.items() if key != "latency_ms"}
    return PlanInputs.model_validate({
        "model": model | {"num_blocks": sum(blocks)},
        "workload": {"batch_sizes": [rows], "micro_batches": [1], "seq_len": max(context, 1),
                     "dtype": planner_dtype(dtype), "compression": compression},
        "client": client,
        "nodes": [{**node, "link": link(mbps, stack[node["name"]], node.get("link", {}).get("latency_ms", 0.0))}
                  for node, mbps in zip(nodes, links_mbps[1:])],
        "link_overrides": overrides,
    })


def client_latency_ms(client_cpu: dict | None) -> float:
    """The client's end of a hop's latency, as its host measured it (0 when it gave none)."""
    return (client_cpu or {}).get("latency_ms", 0.0)


def through_stack(mbps: float, *stacks_mbps: float) -> float:
    """The rate at which a message crosses a link of `mbps` between processes whose p2p stacks move bytes at
    `stacks_mbps` (0: not measured): the stacks' copies and the link's transmission do not overlap (a message's time is
    the sum of both), each end doing half of the copies, so a stack slows even a slow link a little."""
    return 1.0 / (1.0 / mbps + sum(0.5 / stack for stack in stacks_mbps if stack > 0))


def link(mbps: float, stack_mbps: float, latency_ms: float) -> dict:
    """A node's link of `mbps` through its own stack (counted at both ends of a hop, as its end's half), with the
    latency its end of a hop adds."""
    mbps = through_stack(mbps, stack_mbps, stack_mbps)
    return {"uplink_mbps": mbps, "downlink_mbps": mbps, "latency_ms": latency_ms}


def planner_dtype(dtype: str) -> str:
    return dtype if dtype in ("float16", "bfloat16", "float32") else "float32"


def predicted_step_s(inputs: PlanInputs, assignment: list[int], rows: int, micro_batches: int) -> float:
    """The simulated time of one step of `rows` rows in `micro_batches` micro-batches (inf if it does not fit)."""
    return predicted_times(inputs, assignment, rows, micro_batches)["simulated_s"]


def predicted_times(inputs: PlanInputs, assignment: list[int], rows: int, micro_batches: int) -> dict[str, float]:
    """The planner's closed form and its event simulation of one step (inf where it does not fit)."""
    evaluation = evaluate(inputs, assignment, rows, micro_batches)
    if not evaluation.feasible:
        return {"closed_form_s": float("inf"), "simulated_s": float("inf")}
    return {"closed_form_s": evaluation.step_time_s, "simulated_s": simulate(evaluation, cpu_shares(inputs))[1]}


@dataclass(frozen=True)
class SpanFigures:
    """What a server announces that a step through `blocks` of its blocks depends on."""

    blocks: int
    block_steps_per_s: float  # decode steps per second through one block at batch 1
    link_bandwidth: float  # bytes/s
    activation_bytes: int  # bytes of one hidden vector in the server's dtype
    row_seconds: float | None = None  # seconds one more vector adds to a forward through one block (None: unknown)
    busy_vectors: float = 0.0  # mean vectors of the server's recent forwards: the load a step is batched with

    def seconds(self, vectors: int, hop_latency_s: float) -> float:
        """A step of `vectors` hidden vectors through this span: the hop into it and its compute."""
        transfer = vectors * self.activation_bytes / self.link_bandwidth
        return hop_latency_s + transfer + self.blocks * self.forward_seconds(vectors)

    def forward_seconds(self, vectors: int) -> float:
        """One block's forward holding a step of `vectors` vectors beside the server's usual load."""
        return block_forward_seconds(self.block_steps_per_s, self.row_seconds, vectors, self.busy_vectors)


def block_forward_seconds(block_steps_per_s: float, row_seconds: float | None, vectors: float,
                          busy_vectors: float = 0.0) -> float:
    """One block's forward holding a step of `vectors` vectors: a batch-1 step plus each further vector, those of the
    `busy_vectors` other sessions' it is batched with included; without a per-vector figure, a batch-1 step per
    vector."""
    single = 1.0 / max(block_steps_per_s, 1e-9)
    if row_seconds is None:
        return vectors * single
    return single + row_seconds * (vectors - 1 + busy_vectors)


def announced_step_seconds(spans: Sequence[SpanFigures], vectors: int, hop_latency_s: float) -> float:
    """Seconds of a step of `vectors` hidden vectors through a chain, by its servers' announced figures alone."""
    return sum(span.seconds(vectors, hop_latency_s) for span in spans)


def activation_bytes(hidden_size: int, dtype: str) -> int:
    """Bytes of one hidden vector in `dtype` (a name torch or the planner uses; float32 where unknown)."""
    return hidden_size * DTYPE_BYTES[planner_dtype(dtype)]
