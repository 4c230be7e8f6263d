"""Choosing the micro-batch count: which servers allow it, and what `auto` picks from the planner's model."""

import asyncio

import pytest

from transformers import LlamaConfig

from bloombee.client.micro_batching import MicroBatchChooser
from bloombee.planner.chain import predicted_step_s
from bloombee.planner.inputs import CpuShare
from bloombee.client.routing import Span
from bloombee.client.session import InferenceSession
from bloombee.client.steps import StepStats, split_rows
from bloombee.client.spans import SpanStream
from bloombee.codec import CODEC_VERSION
from bloombee.dht.records import ServerRecord, ServerState
from bloombee.protocol import PROTOCOL_FEATURES, REQUIRED_FEATURES, HopReport
from bloombee.settings import ClientSettings

CONFIG = LlamaConfig(hidden_size=2048, intermediate_size=5504, num_attention_heads=16, num_key_value_heads=16,
                     num_hidden_layers=6, vocab_size=1000)


def profile(mlp_ms: tuple[float, float, float]) -> dict:
    """A planner node as a server announces it: per-block decode ms at micro-batches 1, 4, 16."""
    return {"name": "server", "link": {"uplink_mbps": 20.0, "downlink_mbps": 20.0},
            "gpu": "cpu (float32)", "gpu_memory_gib": 24.0, "host_memory_gib": 24.0,
            "cost": {"table": {"micro_batch": [1, 4, 16], "mlp_ms": list(mlp_ms), "attn_gpu_ms": [0.1, 0.2, 0.5],
                               "attn_cpu_ms": [0.1, 0.2, 0.5]}, "reference_seq_len": 32},
            "compression": {"ratio": 1.1, "compress_mb_per_s": 400.0, "decompress_mb_per_s": 1000.0}}


def span(start: int, end: int, mbps: float, node: dict | None, features=PROTOCOL_FEATURES, planned=(None, None)) -> Span:
    record = ServerRecord(state=ServerState.ONLINE, start_block=start, end_block=end, throughput=10.0,
                          link_bandwidth=mbps * 1e6 / 8, cache_tokens_left=1 << 20, dtype="float32", device="cpu",
                          version="test", codec_version=CODEC_VERSION, features=features, profile=node,
                          planned_batch_size=planned[0], planned_micro_batches=planned[1])
    return Span(f"peer{start}", start, end, record)


def on_cpus(spans: list[Span], hosts: tuple[str, ...]) -> list[Span]:
    """The same spans, each server computing on one thread of a 2-core CPU of the given host."""
    return [Span(s.peer_id, s.start, s.end, s.record.model_copy(update={"profile": s.record.profile.model_copy(
        update={"cpu": CpuShare(host=host, threads=1, cores=2)})})) for s, host in zip(spans, hosts)]


def reports(compute_s: list[float]) -> list[HopReport]:
    """Hop reports of servers that computed for these seconds (wall and CPU time alike)."""
    return [HopReport(compute_s=seconds, compute_cpu_s=seconds) for seconds in compute_s]


def step_of(compute_s: list[float]) -> StepStats:
    """A whole step whose servers computed for these seconds."""
    return StepStats(reports=reports(compute_s))


def chain(mbps: float, mlp_ms: tuple[float, float, float] | None = (10.0, 30.0, 110.0)) -> list[Span]:
    """Three servers of two blocks each, every one with its own copy of the profile (None: no profile)."""
    return [span(start, start + 2, mbps, None if mlp_ms is None else profile(mlp_ms)) for start in (0, 2, 4)]


def test_rows_split_as_evenly_as_possible():
    assert split_rows(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert split_rows(8, 8) == [(i, 1) for i in range(8)]
    assert split_rows(5, 1) == [(0, 5)]


def test_auto_splits_on_a_slow_link_and_not_on_a_fast_one():
    choose = MicroBatchChooser(CONFIG, link_mbps=20.0, compression="off")
    slow = choose(chain(20.0), 32, 1, 32)
    assert slow > 1
    inputs = choose.chain_inputs(chain(20.0), 32, 32)
    assert predicted_step_s(inputs, [2, 2, 2], 32, slow) < predicted_step_s(inputs, [2, 2, 2], 32, 1)
    fast = MicroBatchChooser(CONFIG, link_mbps=1e5, compression="off")
    # compute that does not shrink with the micro-batch (a fixed cost per call) never pays for the extra messages
    assert fast(chain(1e5, (40.0, 40.0, 40.0)), 32, 1, 32) == 1
    assert choose(chain(20.0), 1, 1, 32) == 1


def test_servers_sharing_a_cpu_slow_each_other_only_while_they_compute_at_once():
    choose = MicroBatchChooser(CONFIG, link_mbps=1e5, compression="off")

    def step_s(host_of, micro_batches: int) -> float:
        spans = on_cpus(chain(1e5), host_of)
        return predicted_step_s(choose.chain_inputs(spans, 32, 32), [2, 2, 2], 32, micro_batches)

    apart, together = ("h0", "h1", "h2"), ("one", "one", "one")
    assert step_s(together, 1) == pytest.approx(step_s(apart, 1))  # one micro-batch: one stage computes at a time
    assert step_s(together, 8) > 1.2 * step_s(apart, 8)  # three single-thread stages at once on two cores


def test_auto_does_not_split_through_servers_without_a_profile(caplog):
    choose = MicroBatchChooser(CONFIG, link_mbps=20.0, compression="off")
    with caplog.at_level("WARNING"):
        assert choose(chain(20.0, None), 32, 1, 32) == 1
        assert choose(chain(20.0, None), 32, 1, 32) == 1
    assert len([r for r in caplog.records if "announce no planner profile" in r.getMessage()]) == 1


def test_micro_batches_only_through_servers_that_announce_them():
    def session(settings: ClientSettings, spans: list[Span]) -> tuple[InferenceSession, list[SpanStream]]:
        session = InferenceSession(None, None, 64, 8, 2048, settings, None, None, lambda *args: 4)
        return session, [SpanStream(s, asyncio.Queue()) for s in spans]

    fixed, streams = session(ClientSettings(micro_batches=3), chain(20.0))
    assert fixed.micro_batches_for(streams, 1, 8) == 3
    auto, streams = session(ClientSettings(), chain(20.0))
    assert auto.micro_batches_for(streams, 1, 8) == 4
    old = [span(0, 3, 20.0, None), span(3, 6, 20.0, None, features=REQUIRED_FEATURES)]
    fixed, streams = session(ClientSettings(micro_batches=3), old)
    assert fixed.micro_batches_for(streams, 1, 8) == 1


def test_auto_takes_the_plans_micro_batches_for_the_batch_it_planned():
    planned = [span(0, 3, 20.0, profile((10.0, 30.0, 110.0)), planned=(8, 2)),
               span(3, 6, 20.0, profile((10.0, 30.0, 110.0)), planned=(8, 2))]
    session = InferenceSession(None, None, 64, 8, 2048, ClientSettings(), None, None, lambda *args: 4)
    streams = [SpanStream(s, asyncio.Queue()) for s in planned]
    assert session.micro_batches_for(streams, 1, 9) == 2  # a decode step of the planned batch: the plan's M
    assert session.micro_batches_for(streams, 16, 16) == 4  # a prompt step: the live model
    other = InferenceSession(None, None, 64, 4, 2048, ClientSettings(), None, None, lambda *args: 3)
    assert other.micro_batches_for(streams, 1, 9) == 3  # another batch size: the live model


def test_each_message_costs_cpu_at_both_ends_of_its_hop_taken_in_turns_with_compute():
    """Each process is charged the CPU its own host measured a message costs (here 0.8 ms on the servers' hosts and
    0.4 ms on the client's)."""
    from bloombee.planner.chain import chain_inputs
    from bloombee.planner import evaluate
    from bloombee.planner.schedule import cpu_shares, simulate

    server_ms, client_ms = 0.8, 0.4
    # the stack's share of each transfer (`stack_mbps`, tested below) is left out here
    nodes = [{**profile((10.0, 30.0, 110.0)), "name": f"s{i}",
              "cpu": {"host": f"h{i}", "threads": 1, "cores": 2, "message_ms": server_ms}} for i in range(3)]
    model = MicroBatchChooser(CONFIG, link_mbps=1e5, compression="off").model

    def schedule(micro_batches: int, client_cpu: dict | None, with_cpu: bool = True):
        chain_nodes = nodes if with_cpu else [{k: v for k, v in node.items() if k != "cpu"} for node in nodes]
        inputs = chain_inputs(model, chain_nodes, [700.0] * 4, [2, 2, 2], 32, 32, "float32", "off", client_cpu=client_cpu)
        return simulate(evaluate(inputs, [2, 2, 2], 32, micro_batches), cpu_shares(inputs))

    client = {"host": "c", "threads": 1, "cores": 2, "message_ms": client_ms}
    _, without = schedule(1, None, with_cpu=False)
    _, charged = schedule(1, client)
    # 4 hops, a sender and a receiver each: the servers' 6 messages and the client's 2
    assert charged - without == pytest.approx((6 * server_ms + 2 * client_ms) * 1e-3)
    intervals, _ = schedule(2, client)
    first = next(i for i in intervals if i.row == "s0 compute" and i.micro_batch == 0)
    second_arrives = next(i for i in intervals if i.row == "s0 receive" and i.micro_batch == 1)
    assert first.start_s < second_arrives.start_s < first.end_s  # micro-batch 2 arrives while 1 computes
    nominal = next(i for i in schedule(2, None, with_cpu=False)[0] if i.row == "s0 compute" and i.micro_batch == 0)
    slowed = (first.end_s - first.start_s) - (nominal.end_s - nominal.start_s)
    assert slowed == pytest.approx(server_ms * 1e-3, rel=0.05)  # they took turns on one interpreter


STACK_MBPS = 700.0  # a host's measured stack rate, as these tests announce it


def test_a_servers_compute_takes_turns_with_the_messages_streaming_through_it():
    """On unshaped links a transfer is all p2p stack: while micro-batch 2 streams into s0, s0's compute of micro-batch
    1 takes turns with the interpreter's share of the stack (its host measured half), so gets 1/1.5 of its
    interpreter; where the stack is a tenth of the transfer (a slower link), 1/1.05 of it."""
    from bloombee.planner.chain import chain_inputs, through_stack
    from bloombee.planner import evaluate
    from bloombee.planner.schedule import cpu_shares, simulate, streaming

    model = MicroBatchChooser(CONFIG, link_mbps=1e5, compression="off").model
    client = {"host": "c", "threads": 1, "cores": 2, "stack_mbps": STACK_MBPS}
    for link_mbps, expected in ((1e6, 1 / 1.5), (STACK_MBPS / 9, 1 / 1.05)):
        nodes = [{**profile((10.0, 30.0, 110.0)), "name": f"s{i}",
                  "cpu": {"host": f"h{i}", "threads": 1, "cores": 2, "stack_mbps": STACK_MBPS,
                          "interpreter_share": 0.5}} for i in range(2)]
        inputs = chain_inputs(model, nodes, [link_mbps] * 3, [3, 3], 32, 32, "float32", "off", client_cpu=client)
        evaluation = evaluate(inputs, [3, 3], 32, 2)
        into_s0 = evaluation.client_hop
        assert into_s0.bandwidth_mbps == pytest.approx(through_stack(link_mbps, STACK_MBPS, STACK_MBPS))
        stack_share = min(1.0, into_s0.bandwidth_mbps / STACK_MBPS)
        assert streaming([into_s0], cpu_shares(inputs))["s0"] == pytest.approx(0.5 * stack_share)
        intervals, _ = simulate(evaluation, {"s0": cpu_shares(inputs)["s0"]})
        compute = next(i for i in intervals if i.row == "s0 compute" and i.micro_batch == 0)
        arriving = next(i for i in intervals if i.row == "client -> s0" and i.micro_batch == 1)
        overlap = min(arriving.end_s, compute.end_s) - max(arriving.start_s, compute.start_s)
        assert overlap > 0.5 * (arriving.end_s - arriving.start_s)
        # no other CPU work in this process meanwhile (messages cost no CPU here): only the stream slows the compute
        work = evaluation.active_stages[0].t_comp_s
        assert compute.end_s - compute.start_s == pytest.approx(work + overlap * (1 - expected), rel=1e-6)


def test_a_transfer_into_a_server_slows_while_that_servers_uplink_sends():
    """Prompt micro-batches over 20 Mbit/s links: the client's second one reaches s0 while s0 pushes the first on, so it
    moves at `ack_slowdown` of its rate for that while and at full rate otherwise; a step is slower than without."""
    from bloombee.planner.chain import chain_inputs
    from bloombee.planner import evaluate, schedule
    from bloombee.planner.schedule import ack_slowdown, chain_hops, simulate

    nodes = [{**profile((0.01, 0.02, 0.05)), "name": f"s{i}"} for i in range(2)]
    model = MicroBatchChooser(CONFIG, link_mbps=20.0, compression="off").model
    evaluation = evaluate(chain_inputs(model, nodes, [20.0] * 3, [3, 3], 512, 1, "float32", "off"), [3, 3], 512, 2)
    hops = {f"{hop.src} -> {hop.dst}": hop for hop in chain_hops(evaluation)}
    intervals, makespan = simulate(evaluation)
    second = next(i for i in intervals if i.row == "client -> s0" and i.micro_batch == 1)
    pushes = [i for i in intervals if i.row == "s0 -> s1"]
    overlap = sum(max(0.0, min(second.end_s, p.end_s) - max(second.start_s, p.start_s)) for p in pushes)
    assert overlap > 0.1 * hops["client -> s0"].time_s
    slowdown = ack_slowdown(hops["client -> s0"], hops["s0 -> s1"])
    assert 0.0 < slowdown < 1.0
    moved = (second.end_s - second.start_s - overlap) + overlap * slowdown  # nominal seconds of transfer done
    assert moved == pytest.approx(hops["client -> s0"].time_s, rel=1e-6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schedule, "ACK_WINDOW_BYTES", 1e15)  # acknowledgements never wait: no slowdown
        assert simulate(evaluation)[1] < makespan


def test_measured_compute_speeds_scale_each_servers_cost_table():
    """A server whose reports show it computing 2x slower than its table: the model charges it 2x from then on,
    and the others as before; later steps move the factor to the mean of the recent steps' ratios."""
    from bloombee.planner import evaluate

    choose = MicroBatchChooser(CONFIG, link_mbps=1e5, compression="off")
    spans = chain(1e5)

    def computes(inputs) -> list[float]:
        return [stage.t_comp_s for stage in evaluate(inputs, [2, 2, 2], 32, 1).active_stages]

    table = computes(choose.chain_inputs(spans, 32, 32))
    before = choose.step_seconds(spans, 32, 1, 32, 1)
    choose.observe(spans, 32, 1, 32, step_of([table[0], 2 * table[1], table[2]]))
    assert computes(choose.chain_inputs(spans, 32, 32, 32)) == pytest.approx([table[0], 2 * table[1], table[2]])
    assert choose.step_seconds(spans, 32, 1, 32, 1) == pytest.approx(before + table[1])
    assert computes(choose.chain_inputs(spans, 32, 32)) == pytest.approx(table)  # the tables as announced
    choose.observe(spans, 32, 1, 32, step_of(table))
    assert computes(choose.chain_inputs(spans, 32, 32, 32))[1] == pytest.approx(1.5 * table[1])  # mean of 2 and 1


def test_compute_speeds_are_measured_per_micro_batch_size():
    """A server 2x slower than its table at whole steps of 32 rows and as fast as it at micro-batches of 4 rows: each
    size is charged what was measured at the nearest size."""
    from bloombee.client.figures import ComputeSpeeds

    speeds = ComputeSpeeds()
    assert speeds.factor("s", 32) == 1.0  # nothing measured yet: the table stands
    speeds.observe({"s": 1.0}, ["s"], [2.0], 32)
    assert speeds.factor("s", 4) == speeds.factor("s", 32) == 2.0  # one size measured: it stands for all
    speeds.observe({"s": 1.0}, ["s"], [1.0], 4)
    assert (speeds.factor("s", 4), speeds.factor("s", 5), speeds.factor("s", 32), speeds.factor("s", 20)) == \
        (1.0, 1.0, 2.0, 2.0)
    assert speeds.factor("other", 4) == 1.0


def test_a_single_threaded_cpu_server_is_judged_by_its_compute_threads_cpu_time():
    """Three servers on one machine's CPU wait for its cores: their reports' wall time is 3x their CPU time. The
    simulation models that waiting itself, so the speed is judged on CPU time against the table (here, as
    announced); a server whose compute thread really works 2x longer is charged 2x."""
    from bloombee.planner import evaluate

    choose = MicroBatchChooser(CONFIG, link_mbps=1e5, compression="off")
    spans = on_cpus(chain(1e5), ("h", "h", "h"))

    def computes(inputs) -> list[float]:
        return [stage.t_comp_s for stage in evaluate(inputs, [2, 2, 2], 32, 1).active_stages]

    table = computes(choose.chain_inputs(spans, 32, 32))
    cpu = [table[0], 2 * table[1], table[2]]
    choose.observe(spans, 32, 1, 32, StepStats(reports=[HopReport(compute_s=3 * t, compute_cpu_s=t) for t in cpu]))
    assert computes(choose.chain_inputs(spans, 32, 32, 32)) == pytest.approx(cpu)


def test_auto_chooses_again_once_a_chain_proves_slower_than_announced(monkeypatch):
    """Small announced computes on a fast link: messages dominate and auto takes 4 micro-batches. Once the servers'
    reports show them 10x slower than their tables, the choice is made again at that speed (2)."""
    import bloombee.client.micro_batching as micro_batching
    from bloombee.planner import evaluate

    client = {"host": "c", "threads": 1, "cores": 2, "message_ms": 0.4, "stack_mbps": STACK_MBPS}
    monkeypatch.setattr(micro_batching, "client_cpu_share", lambda: client)
    choose = MicroBatchChooser(CONFIG, link_mbps=1e5, compression="off")
    spans = chain(1e5, (0.5, 0.6, 1.0))

    def best() -> int:
        times = {m: choose.step_seconds(spans, 32, 1, 32, m) for m in (1, 2, 4, 8, 16, 32)}
        return min(times, key=times.get)

    assert choose(spans, 32, 1, 32) == best() == 4
    table = [stage.t_comp_s for stage in evaluate(choose.chain_inputs(spans, 32, 32), [2, 2, 2], 32, 1).active_stages]
    choose.observe(spans, 32, 1, 32, step_of([10 * t for t in table]))
    assert choose(spans, 32, 1, 32) == best() == 2


def test_a_message_crosses_the_p2p_stack_and_then_its_link():
    """A hop's time is the stack's (the rate its hosts measured) plus the link's: no link makes a hop faster than the
    stack, and a slow link pays the stack's copies on top of its own transmission."""
    from bloombee.planner.chain import chain_inputs
    from bloombee.planner import evaluate

    model = MicroBatchChooser(CONFIG, link_mbps=1e5, compression="off").model
    nodes = [{**profile((10.0, 30.0, 110.0)), "name": f"s{i}",
              "cpu": {"host": "h", "threads": 1, "cores": 2, "stack_mbps": STACK_MBPS}} for i in range(3)]

    def first_hop_s(link_mbps: float) -> float:
        inputs = chain_inputs(model, nodes, [link_mbps] * 4, [2, 2, 2], 32, 32, "float32", "off",
                              client_cpu={"host": "h", "threads": 1, "cores": 2, "stack_mbps": STACK_MBPS})
        return evaluate(inputs, [2, 2, 2], 32, 1).client_hop.time_s

    megabits = 40.0 * (first_hop_s(20.0) - first_hop_s(40.0))  # the stack's share and the latency cancel out
    assert first_hop_s(20.0) - first_hop_s(1e9) == pytest.approx(megabits / 20.0, rel=0.01)
    assert first_hop_s(1e9) > megabits / STACK_MBPS


def test_more_micro_batches_only_where_the_model_has_them_clearly_faster():
    """Once steps have measured the model's error, a split within its spread of the fewer micro-batches' time is not
    worth its messages; before, the model's fastest is taken."""
    from bloombee.client.steps import StepStats

    def chooser(times: dict[int, float], measured: list[float]) -> MicroBatchChooser:
        choose = MicroBatchChooser(CONFIG, link_mbps=20.0, compression="off")
        choose.step_seconds = lambda spans, batch, tokens, context, micro_batches, factor=None: times[micro_batches]
        choose.chain_inputs = lambda *args, **kwargs: None  # no compute speeds to learn here
        for seconds in measured:  # steps of one micro-batch predicted at times[1]
            choose(spans, 32, 16, 32)
            choose.observe(spans, 32, 16, 32, StepStats(micro_batches=choose(spans, 32, 16, 32), total_s=seconds))
            choose._chosen.clear()
        return choose

    spans = chain(20.0)
    assert chooser({1: 1.0, 2: 0.97, 4: 1.2}, [])(spans, 32, 16, 16) == 2  # nothing measured: no margin
    noisy = [0.9, 1.1, 1.0, 0.9, 1.1]  # 10 % off either way
    assert chooser({1: 1.0, 2: 0.97, 4: 1.2}, noisy).split_margin == pytest.approx(0.1)
    assert chooser({1: 1.0, 2: 0.97, 4: 1.2}, noisy)(spans, 32, 16, 16) == 1
    assert chooser({1: 1.0, 2: 0.85, 4: 0.83, 8: 1.0}, noisy)(spans, 32, 16, 16) == 2
    assert chooser({1: 1.0, 2: 0.97, 4: 0.8, 8: 0.9}, noisy)(spans, 32, 16, 16) == 4
    steady = [1.2] * 5  # always 20 % slower than predicted: no spread, no margin
    assert chooser({1: 1.0, 2: 0.97, 4: 1.2}, steady)(spans, 32, 16, 16) == 2


def test_codec_figures_are_what_the_sessions_messages_measured():
    """The client's embeddings compress 2x where the profile says 1.1x, and a server's encodes and decodes run at
    their own speeds: the chain's inputs carry those figures at the size measured (the nearest size standing in for
    others), the profile's before any compressed message, and raw messages teach nothing."""
    from bloombee.client.figures import ChainFigures
    from bloombee.codec import CompressionPolicy, call_costs
    ENCODE_CALL_S, DECODE_CALL_S = call_costs().encode_s, call_costs().decode_s
    from bloombee.planner.inputs import CLIENT

    choose = MicroBatchChooser(CONFIG, link_mbps=20.0, compression="on")
    spans = chain(20.0)
    peers = [s.peer_id for s in spans]
    announced = choose.chain_inputs(spans, 32, 32, 32)
    assert announced.client.compression.ratio == announced.nodes[0].compression.ratio == 1.1
    raw_bytes = 32 * CONFIG.hidden_size * 4
    compressed = [HopReport(layout="bytesplit", raw_bytes=raw_bytes, wire_bytes=raw_bytes // 1.25,
                            encode_s=ENCODE_CALL_S + raw_bytes / 100e6, decode_cpu_s=DECODE_CALL_S + raw_bytes / 50e6)
                  for _ in spans]
    raw = [HopReport(raw_bytes=raw_bytes, wire_bytes=raw_bytes) for _ in spans]
    choose.figures.observe_step(peers, StepStats(
        client_layout="raw", sent_raw_bytes=raw_bytes, sent_wire_bytes=raw_bytes, reports=raw,
        micro_batch_reports=[raw], sent={0: ("raw", raw_bytes)}, received_decode_cpu_s=[0.0]))
    assert choose.chain_inputs(spans, 32, 32, 32) == announced
    # the client's encode, learnt as its policy for the link to the first server makes it
    CompressionPolicy("on", figures=choose.figures.link(peers[0])).observe_encode(
        raw_bytes, raw_bytes // 2, ENCODE_CALL_S + raw_bytes / 200e6)
    choose.figures.observe_step(peers, StepStats(
        client_layout="bytesplit", sent_raw_bytes=raw_bytes, sent_wire_bytes=raw_bytes // 2, reports=compressed,
        micro_batch_reports=[compressed], sent={0: ("bytesplit", raw_bytes)}, received_decode_cpu_s=[0.0]))
    for rows in (32, 8):  # measured at 32 rows; 8 rows have no figures of their own yet
        inputs = choose.chain_inputs(spans, 32, 32, rows)
        assert (inputs.client.compression.ratio, inputs.client.compression.compress_mb_per_s) == \
            pytest.approx((2.0, 200.0))
        assert inputs.client.compression.decompress_mb_per_s == 1000.0  # the client's decodes are not reported
        first, second = inputs.nodes[0].compression, inputs.nodes[1].compression
        assert (first.ratio, first.compress_mb_per_s) == pytest.approx((1.25, 100.0), rel=1e-3)
        assert second.decompress_mb_per_s == pytest.approx(50.0)  # it decoded the first server's messages
        assert first.decompress_mb_per_s == pytest.approx(50.0)  # ... and the first decoded the client's
    assert ChainFigures(1.0).codec(CLIENT, None, 32) is None


def test_the_chains_steps_teach_what_its_messages_cost(monkeypatch):
    """Steps measured as slow as the model has them with 3x the hosts' message CPU, and no server computing slower:
    the chain's message factor becomes 3 and the model then predicts those steps."""
    import bloombee.client.micro_batching as micro_batching

    monkeypatch.setattr(micro_batching, "client_cpu_share",
                        lambda: {"host": "c", "threads": 1, "cores": 2, "message_ms": 1.0})
    spans = [Span(s.peer_id, s.start, s.end, s.record.model_copy(update={"profile": s.record.profile.model_copy(
        update={"cpu": CpuShare(host=f"h{s.start}", threads=1, cores=2, message_ms=1.0)})})) for s in chain(1e5)]
    choose = MicroBatchChooser(CONFIG, link_mbps=1e5, compression="off")
    micro_batches = choose(spans, 32, 1, 32)
    measured = choose.step_seconds(spans, 32, 1, 32, micro_batches, message_factor=3.0)
    assert measured > choose.step_seconds(spans, 32, 1, 32, micro_batches)
    for _ in range(3):
        choose.observe(spans, 32, 1, 32, StepStats(micro_batches=choose(spans, 32, 1, 32), total_s=measured))
    assert choose.figures.messages.factor == pytest.approx(3.0, rel=0.05)
    assert choose.step_seconds(spans, 32, 1, 32, micro_batches) == pytest.approx(measured, rel=0.02)
