"""The network benchmark harness's pure parts: presets, shaping commands, knobs, plans, parsing, metrics, reports.

The end-to-end run (namespaces, processes, shaped links) is in test_netbench_smoke.py.
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.netbench import cli, knobs, metrics, netns, plan, presets, report
from benchmarks.netbench.worker import Channel, Workload, speculates

NODES = ["client", "s0", "s1", "s2"]


# ---------------------------------------------------------------------------------- presets


def test_presets_match_the_paper():
    assert [presets.PRESETS[name].uplink_mbps for name in ("E2", "E3", "E4", "E5")] == [500.0, 250.0, 125.0, 20.0]
    assert presets.PRESETS["E1"].kind == "unshaped" and presets.PRESETS["E1"].rate_mbps("client", "s0", NODES) is None
    for name in ("E2", "E3", "E4", "E5"):
        env = presets.PRESETS[name]
        assert env.kind == "uniform"
        assert all(rate == env.uplink_mbps for rate in env.pair_rates(NODES).values())
    e6 = presets.PRESETS["E6"]
    assert e6.kind == "matrix"
    # Table 3, sender -> receiver
    assert e6.site_rates_mbps["California"] == {"New Jersey": 347.0, "Canada": 305.0}
    assert e6.site_rates_mbps["New Jersey"] == {"California": 312.0, "Canada": 577.0}
    assert e6.site_rates_mbps["Canada"] == {"California": 280.0, "New Jersey": 643.0}


def test_e6_places_nodes_on_sites_and_looks_up_pairs():
    e6 = presets.PRESETS["E6"]
    assert e6.sites(NODES) == {"client": "California", "s0": "California", "s1": "New Jersey", "s2": "Canada"}
    chain = [("client", "s0"), ("s0", "s1"), ("s1", "s2"), ("s2", "client")]
    assert [e6.rate_mbps(src, dst, NODES) for src, dst in chain] == [None, 347.0, 577.0, 280.0]
    assert e6.rate_mbps("s1", "client", NODES) == 312.0
    # more servers than sites: they cycle over the servers' sites
    assert e6.sites(NODES + ["s3"])["s3"] == "California"
    assert e6.advertised_mbps("s0", NODES, 10000.0) == 305.0  # its slowest shaped uplink
    assert presets.PRESETS["E1"].advertised_mbps("s0", NODES, 10000.0) == 10000.0


@pytest.mark.parametrize("text, mbps", [("20", 20.0), ("20mbit", 20.0), ("20Mbps", 20.0), ("1gbit", 1000.0),
                                        ("500kbit", 0.5), ("2.5", 2.5)])
def test_parse_rate(text, mbps):
    assert presets.parse_rate_mbps(text) == pytest.approx(mbps)


def test_parse_environment_variants(tmp_path):
    assert presets.parse_environment("e3") is presets.PRESETS["E3"]
    assert presets.parse_environment("unshaped") is presets.PRESETS["E1"]
    custom = presets.parse_environment("custom:50mbit")
    assert (custom.name, custom.kind, custom.uplink_mbps) == ("50Mbps", "uniform", 50.0)
    assert presets.parse_environment("75").uplink_mbps == 75.0
    matrix = tmp_path / "m.json"
    matrix.write_text(json.dumps({"name": "two-sites", "rates_mbps": {"A": {"B": 10}, "B": {"A": 40}},
                                  "placement": ["A", "A", "B"]}))
    env = presets.parse_environment(f"matrix:{matrix}")
    assert env.name == "two-sites" and env.kind == "matrix"
    nodes = ["client", "s0", "s1"]
    assert [env.rate_mbps(a, b, nodes) for a, b in [("client", "s0"), ("s0", "s1"), ("s1", "client")]] == [None, 10.0, 40.0]
    yaml_matrix = tmp_path / "m.yaml"
    yaml_matrix.write_text("rates_mbps: {A: {B: 5}, B: {A: 6}}\nplacement: [A, B]\n")
    assert presets.parse_environment(f"matrix:{yaml_matrix}").rate_mbps("s0", "client", ["client", "s0"]) == 6.0


def test_parse_environment_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown environment"):
        presets.parse_environment("E9")
    with pytest.raises(ValueError, match="unknown environment"):
        presets.parse_environment("fast")
    with pytest.raises(ValueError, match="positive"):
        presets.parse_environment("custom:0")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rates_mbps": {}}))
    with pytest.raises(ValueError, match="placement"):
        presets.parse_environment(f"matrix:{bad}")
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"rates_mbps": {"A": {}}, "placement": ["A", "B"]}))
    with pytest.raises(ValueError, match="no rate from site"):
        presets.parse_environment(f"matrix:{missing}").rate_mbps("client", "s0", ["client", "s0"])


def test_parse_environments_lists():
    assert [env.name for env in presets.parse_environments("uniform")] == ["E1", "E2", "E3", "E4", "E5"]
    assert [env.name for env in presets.parse_environments("all")] == ["E1", "E2", "E3", "E4", "E5", "E6"]
    assert [env.name for env in presets.parse_environments("E1, custom:10")] == ["E1", "10Mbps"]
    with pytest.raises(ValueError, match="twice"):
        presets.parse_environments("E1,E1")


# ---------------------------------------------------------------------------------- shaping commands


IPS = {node: f"10.77.0.{10 + i}" for i, node in enumerate(NODES)}


def test_unshaped_only_removes_qdiscs():
    commands = netns.shaping_commands(presets.PRESETS["E1"], NODES, IPS)
    assert set(commands) == set(NODES)
    assert all(cmds == [["tc", "qdisc", "del", "dev", "eth0", "root"]] for cmds in commands.values())


def test_uniform_is_one_tbf_per_uplink():
    commands = netns.shaping_commands(presets.PRESETS["E5"], NODES, IPS)
    for cmds in commands.values():
        assert len(cmds) == 2
        tbf = cmds[1]
        assert tbf[:7] == ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf"]
        assert tbf[tbf.index("rate") + 1] == "20000kbit"
        assert int(tbf[tbf.index("burst") + 1]) == 4096
        assert int(tbf[tbf.index("limit") + 1]) >= 4 << 20


def test_burst_and_queue_scale_with_rate():
    assert netns.tbf_burst_bytes(20) == 4096
    assert netns.tbf_burst_bytes(500) == 12500  # 0.2 ms at 500 Mbit/s
    assert netns.queue_limit_bytes(20) == 4 << 20
    assert netns.queue_limit_bytes(1000) == 62_500_000


def test_matrix_is_htb_with_a_class_and_filter_per_shaped_destination():
    commands = netns.shaping_commands(presets.PRESETS["E6"], NODES, IPS)
    s1 = commands["s1"]
    assert s1[1][5:] == ["root", "handle", "1:", "htb", "default", "999"]
    classes = {cmd[cmd.index("classid") + 1]: cmd[cmd.index("rate") + 1] for cmd in s1 if cmd[1] == "class"}
    filters = {cmd[cmd.index("dst") + 1]: cmd[cmd.index("flowid") + 1] for cmd in s1 if cmd[1] == "filter"}
    # s1 (New Jersey) -> client and s0 (California) 312, -> s2 (Canada) 577; the default class is unshaped
    assert {ip: classes[flow] for ip, flow in filters.items()} == {
        "10.77.0.10/32": "312000kbit", "10.77.0.11/32": "312000kbit", "10.77.0.13/32": "577000kbit"}
    assert classes["1:999"] == netns.DEFAULT_CLASS_RATE
    # client and s0 share a site: no class between them
    client_filters = [cmd[cmd.index("dst") + 1] for cmd in commands["client"] if cmd[1] == "filter"]
    assert "10.77.0.11/32" not in client_filters and "10.77.0.12/32" in client_filters


def test_topology_names_and_addresses():
    topology = netns.Topology(NODES, owner=4242)
    assert topology.ns("s0") == "bbnb4242-s0" and topology.hub == "bbnb4242-hub"
    assert netns.NAME.match(topology.ns("client")).groups() == ("4242", "client")
    assert topology.ips["client"] == "10.77.0.10" and topology.ips["hub"] == netns.HUB_IP
    assert topology.exec_argv("s1", ["python", "-V"]) == ["ip", "netns", "exec", "bbnb4242-s1", "python", "-V"]
    assert len(netns.Topology.hub_port("a-very-long-node-name")) <= 15
    with pytest.raises(ValueError):
        netns.Topology(["client", "hub"])


# ---------------------------------------------------------------------------------- knobs and plans


def test_configurations():
    baseline = knobs.parse_configuration("baseline")
    assert baseline.server_args() == []  # every switch is the client's: one server set serves every configuration
    off = {"compression": "off", "micro_batches": 1, "speculation": "off"}
    assert baseline.client_settings() == off
    on = knobs.parse_configuration("compression")
    assert on.server_args() == [] and on.client_settings() == {**off, "compression": "on"}
    eight = knobs.parse_configuration("compression+micro_batching:8")
    assert eight.client_settings() == {**off, "compression": "on", "micro_batches": 8} and not eight.bandwidth_sensitive
    chosen = knobs.parse_configuration("micro_batching:auto")
    assert chosen.client_settings() == {**off, "micro_batches": "auto"} and chosen.bandwidth_sensitive
    assert knobs.parse_configuration("speculative").client_settings() == {**off, "speculation": "on"}
    switch = knobs.parse_configuration("speculative:auto")
    assert switch.client_settings() == {**off, "speculation": "auto"} and switch.bandwidth_sensitive
    with pytest.raises(ValueError, match="takes no value"):
        knobs.parse_configuration("compression:3")
    with pytest.raises(ValueError, match="whole number"):
        knobs.parse_configuration("micro_batching:many")
    assert knobs.parse_configuration("all").enabled == frozenset(knobs.OPTIMISATIONS)
    auto = knobs.parse_configuration("auto")
    assert auto.server_args() == [] and auto.client_settings() == {} and auto.bandwidth_sensitive
    assert not on.bandwidth_sensitive
    with pytest.raises(ValueError, match="unknown configuration"):
        knobs.parse_configuration("speculation")
    with pytest.raises(ValueError, match="twice"):
        knobs.parse_configurations("baseline,baseline")


def test_server_groups_run_every_configuration_side_by_side():
    envs = presets.parse_environments("E1,E5")
    static = knobs.parse_configurations("baseline,compression")
    assert [([c.name for c in cs], [e.name for e in es]) for cs, es in cli.server_groups(static, envs)] == [
        (["baseline", "compression"], ["E1", "E5"])]
    mixed = knobs.parse_configurations("baseline,compression,auto")
    assert [([c.name for c in cs], [e.name for e in es]) for cs, es in cli.server_groups(mixed, envs)] == [
        (["baseline", "compression", "auto"], ["E1"]), (["baseline", "compression", "auto"], ["E5"])]


def test_plans(tmp_path):
    assert plan.even_split(8, 3) == [(0, 3), (3, 5), (5, 8)]
    assert plan.parse_blocks("0:3,3:8") == [(0, 3), (3, 8)]
    assert plan.resolve_plan(8) == [(0, 3), (3, 5), (5, 8)]
    assert plan.resolve_plan(8, blocks="0:4,4:8") == [(0, 4), (4, 8)]
    files = {
        "servers.json": {"servers": [{"blocks": "0:2"}, {"blocks": [2, 8]}]},
        "blocks.json": {"blocks": ["0:2", "2:8"]},
        "list.json": ["0:2", "2:8"],
        "planner.json": {"plan": {"assignment": [2, 0, 6]}},
    }
    for name, content in files.items():
        path = tmp_path / name
        path.write_text(json.dumps(content))
        assert plan.resolve_plan(8, plan_file=str(path)) == [(0, 2), (2, 8)], name
    with pytest.raises(ValueError, match="gap or overlap"):
        plan.resolve_plan(8, blocks="0:3,4:8")
    with pytest.raises(ValueError, match="end at block"):
        plan.resolve_plan(8, blocks="0:3,3:6")
    with pytest.raises(ValueError, match="START:END"):
        plan.parse_blocks("0-3")
    with pytest.raises(ValueError):
        plan.even_split(2, 3)


# ---------------------------------------------------------------------------------- argument parsing


def test_sweep_arguments():
    args = cli.build_parser().parse_args(["sweep"])
    assert (args.model, args.servers, args.batch, args.envs, args.configs, args.dtype) == (
        "bloombee-tiny", None, 32, "E1,E2,E3,E4,E5", "baseline,compression", "auto")
    args = cli.build_parser().parse_args(["sweep", "--model", "wide", "--blocks", "0:1,1:3", "--batch", "8",
                                          "--envs", "E5,custom:5", "--configs", "all", "--repeats", "3"])
    assert (args.blocks, args.batch, args.repeats) == ("0:1,1:3", 8, 3)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["sweep", "--servers", "2", "--blocks", "0:1,1:2"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["sweep", "--batch", "0"])


def test_privilege_check_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(cli.os, "geteuid", lambda: 1000)
    assert "root" in cli.check_privileges()
    monkeypatch.setattr(cli.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cli.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    assert cli.check_privileges() == "needs tc on PATH"


def test_worker_channel_marks_wait_for_continue():
    out = io.StringIO()
    channel = Channel(io.StringIO('{"cmd": "continue"}\n'), out)
    channel.mark("start")
    assert json.loads(out.getvalue()) == {"event": "mark", "name": "start"}
    with pytest.raises(RuntimeError, match="continue"):
        Channel(io.StringIO('{"cmd": "run"}\n'), io.StringIO()).mark("decode")


# ---------------------------------------------------------------------------------- metrics


def test_percentile_and_median():
    assert metrics.percentile([1, 2, 3, 4, 5], 50) == 3
    assert metrics.percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert metrics.percentile([7], 90) == 7
    assert math.isnan(metrics.percentile([], 50))


def test_floor_is_compute_plus_bytes_at_rate():
    # 3 servers of 10 ms; 4 hops of 25 000 bytes at 20 Mbit/s = 10 ms each; an unshaped hop costs nothing
    assert metrics.floor_seconds([0.01] * 3, [25_000] * 4, [20.0] * 4) == pytest.approx(0.07)
    assert metrics.floor_seconds([0.01] * 3, [25_000] * 4, [None, 20.0, 20.0, None]) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        metrics.floor_seconds([0.01], [1, 2], [None])


def _step(kind="decode", wire=1000, raw=2000, compute=0.01, chain=0.05, wall=0.06, batch=4, servers=2):
    return {"kind": kind, "tokens": 1, "batch": batch, "wall_s": wall, "head_s": 0.001, "chain_s": chain,
            "client_encode_s": 0.001, "client_decode_s": 0.002, "client_layout": "bytesplit",
            "sent_raw_bytes": raw, "sent_wire_bytes": wire, "received_wire_bytes": wire,
            "reports": [{"peer_id": f"p{i}", "layout": "bytesplit", "raw_bytes": raw, "wire_bytes": wire,
                         "decode_s": 0.002, "compute_s": compute, "encode_s": 0.001} for i in range(servers)]}


def test_step_parts_leave_the_wire_as_the_remainder():
    parts = metrics.step_parts(_step())
    assert parts["encode_s"] == [0.001, 0.001, 0.001] and parts["decode_s"] == [0.002, 0.002, 0.002]
    assert parts["wire_total_s"] == pytest.approx(0.05 - 0.003 - 0.006 - 0.02)
    assert metrics.hop_app_bytes(_step()) == [1000, 1000, 1000]
    assert metrics.hop_app_bytes(_step(), "raw_bytes") == [2000, 2000, 2000]
    assert metrics.hops_of([{"name": "s0.g0c1"}, {"name": "s1.g0c1"}]) == [("client", "s0"), ("s0", "s1"), ("s1", "client")]


def _counters(tx: dict[str, tuple[int, int]]) -> dict:
    return {node: {"tx_bytes": b, "tx_packets": p, "rx_bytes": 0, "rx_packets": 0} for node, (b, p) in tx.items()}


def test_iface_stats_remove_background_and_headers():
    before = _counters({"client": (0, 0), "s0": (0, 0), "s1": (0, 0)})
    after = _counters({"client": (10_660, 10), "s0": (11_660, 10), "s1": (10_660, 10)})
    hops = [("client", "s0"), ("s0", "s1"), ("s1", "client")]
    background = {"seconds": 5, "per_s": {"s0": {"tx_bytes": 1000.0, "tx_packets": 0.0}}}
    stats = metrics.iface_hop_stats(before, after, hops, steps=10, window_s=1.0, background=background)
    assert stats["bytes"] == [1066, 1166, 1066]
    assert stats["net_bytes"] == [1066, 1066, 1066]
    assert stats["payload_bytes"] == pytest.approx([1000, 1000, 1000])
    assert stats["packets"] == [1, 1, 1]


def _record(rate, wire=1000, n_decode=4, servers=2, window=1.0):
    hops = [("client", "s0")] + [(f"s{i}", f"s{i + 1}") for i in range(servers - 1)] + [(f"s{servers - 1}", "client")]
    steps = [_step("prefill", wire=8 * wire, chain=0.2, wall=0.2, servers=servers)]
    steps += [_step(wire=wire, servers=servers) for _ in range(n_decode)]
    senders = [src for src, _ in hops]
    per_step = wire + metrics.HEADER_BYTES  # one packet per hop and step
    counters = {"start": _counters({n: (0, 0) for n in senders}),
                "decode": _counters({n: (8 * wire + metrics.HEADER_BYTES, 1) for n in senders}),
                "end": _counters({n: (8 * wire + metrics.HEADER_BYTES + n_decode * per_step, 1 + n_decode) for n in senders})}
    return {"env": {"name": "X"}, "config": {"name": "baseline"}, "model_name": "m",
            "workload": {"prompt_len": 8, "new_tokens": n_decode + 1}, "hops": hops, "hop_rates_mbps": [rate] * len(hops),
            "background": None, "repeats": [{"steps": steps, "counters": counters, "mark_times": {"start": 0.0, "decode": 1.0, "end": 1.0 + window},
                                             "generation_s": 0.2 + 0.06 * n_decode, "loadavg": [1.0, 1.0, 1.0]}]}


def test_summarize_a_run():
    s = metrics.summarize(_record(rate=8.0))
    assert s["decode_tokens_per_s"] == pytest.approx(4 / 0.06)
    assert s["e2e_tokens_per_s"] == pytest.approx(4 * 5 / (0.2 + 0.24))
    assert s["step_median_s"] == pytest.approx(0.06) and s["step_p90_s"] == pytest.approx(0.06)
    assert s["hop_wire_bytes"] == [1000, 1000, 1000] and s["step_wire_bytes"] == 3000
    assert s["compression_ratio"] == pytest.approx(2.0)
    assert s["iface_over_app"] == pytest.approx([1.0, 1.0, 1.0]) and s["counters_agree"]
    assert s["prefill_iface_over_app"] == pytest.approx([1.0, 1.0, 1.0])
    # floor: 2 x 10 ms compute + 3 hops x 1066 bytes at 8 Mbit/s
    assert s["floor_s"] == pytest.approx(0.02 + 3 * 1066 * 8 / 8e6)
    assert s["measured_over_floor"] == pytest.approx(0.05 / s["floor_s"])
    rows = s["breakdown"]["hops"]
    assert [row["hop"] for row in rows] == ["client->s0", "s0->s1", "s1->client"]
    assert rows[0]["d2h_s"] == rows[0]["h2d_s"] == 0.0 and rows[-1]["compute_s"] is None
    wire_total = 0.05 - 0.003 - 0.006 - 0.02
    assert sum(row["wire_s"] for row in rows) == pytest.approx(wire_total)
    assert s["breakdown"]["stack_overhead_s"] == pytest.approx(wire_total - 3 * 1066 * 8 / 8e6)


def test_summarize_pools_repeats_and_flags_disagreeing_counters():
    record = _record(rate=None)
    second = json.loads(json.dumps(record["repeats"][0]))
    for step in second["steps"]:
        step["wall_s"] *= 2
    record["repeats"].append(second)
    s = metrics.summarize(record)
    assert s["repeats"] == 2 and s["decode_steps"] == 8
    assert s["decode_tokens_per_s"] == pytest.approx(4 * 8 / (4 * 0.06 + 4 * 0.12))
    assert s["floor_s"] == pytest.approx(0.02)  # unshaped: compute only
    bad = _record(rate=None, wire=100_000)
    bad["repeats"][0]["counters"]["end"]["s0"]["tx_bytes"] += 4 * 10_000  # 10 % more on one hop than the process sent
    assert not metrics.summarize(bad)["counters_agree"]
    headers = _record(rate=None, wire=1000)
    headers["repeats"][0]["counters"]["end"]["client"]["tx_bytes"] += 4 * 800  # a step header of 800 bytes: fine
    assert metrics.summarize(headers)["counters_agree"]
    with pytest.raises(ValueError, match="decode step"):
        metrics.summarize(_record(rate=None, n_decode=0))


def test_steps_missing_a_report_stay_out_of_the_breakdown():
    record = _record(rate=None)
    late = record["repeats"][0]["steps"][1]
    late["reports"][1], late["chain_s"] = None, 9.0  # its ack (with the report) came after the output
    s = metrics.summarize(record)
    assert s["steps_without_all_reports"] == 1 and s["decode_steps"] == 4
    assert s["chain_median_s"] == pytest.approx(0.05) and s["compute_s"] == pytest.approx(0.02)
    assert s["breakdown"]["complete_reports"]


# ---------------------------------------------------------------------------------- reports


def test_tables_plots_and_strict_json(tmp_path):
    summaries = []
    for env, rate in (("E1", None), ("E5", 20.0)):
        for config in ("baseline", "compression"):
            record = _record(rate=rate)
            record["env"]["name"], record["config"]["name"] = env, config
            summaries.append(metrics.summarize(record))
    summaries[0]["measured_over_floor"] = float("nan")
    meta = {"model_name": "m", "model_note": "test", "command": "sudo ...", "hidden_size": 64, "num_blocks": 2,
            "dtype": "float32", "server_nodes": ["s0", "s1"], "ranges": [[0, 1], [1, 2]], "batch": 4, "prompt_len": 8,
            "new_tokens": 5, "warmup_steps": 2, "started": "now",
            "machine": {"cpus": 2, "loadavg_start": "1.0", "kernel": "k", "git": "g"}}
    table = report.summary_table(summaries)
    assert table.count("\n") == 1 + len(summaries) and "| E5 | compression |" in table
    assert "client->s0" in report.breakdown_table(summaries)
    comparison = report.comparison_table(summaries)
    assert comparison.count("\n") == 3 and "| E5 | compression |" in comparison and "1.00x" in comparison
    assert report.comparison_table(summaries[:1]) == ""
    pytest.importorskip("matplotlib")
    paths = report.write_sweep_outputs(tmp_path, meta, summaries)
    for name in ("throughput_png", "transport_png", "breakdown_png"):
        assert Path(paths[name]).stat().st_size > 1000
    data = json.loads((tmp_path / "summary.json").read_text())  # strict: no NaN
    assert data["runs"][0]["measured_over_floor"] is None
    assert "sudo ..." in (tmp_path / "summary.md").read_text()


def test_timeline_places_every_part_of_every_micro_batch():
    def report(offset, at):
        return {"batch_offset": offset, "decode_at": at, "decode_s": 0.001, "compute_at": at + 0.002, "compute_s": 0.010,
                "encode_at": at + 0.013, "encode_s": 0.001}

    step = {"sent_at": [100.0, 100.005], "received_at": [100.060, 100.050],
            "micro_batch_reports": [[report(4, 100.020), report(4, 100.040)], [report(0, 100.010), report(0, 100.030)]]}
    intervals = metrics.timeline(step, ["s0", "s1"])
    assert len(intervals) == 2 * 9  # per micro-batch: 3 transfers, 3 parts on each of 2 servers
    first = [i for i in intervals if i["mb"] == 0]
    assert {i["row"] for i in first} == {"client -> s0", "s0 decode", "s0 compute", "s0 encode", "s0 -> s1",
                                         "s1 decode", "s1 compute", "s1 encode", "s1 -> client"}
    send = next(i for i in first if i["row"] == "client -> s0")
    assert send["start"] == 0.0 and send["end"] == pytest.approx(10.0)
    back = next(i for i in intervals if i["mb"] == 1 and i["row"] == "s1 -> client")
    assert back["start"] == pytest.approx(54.0) and back["end"] == pytest.approx(60.0)
    assert metrics.timeline({"sent_at": [], "micro_batch_reports": []}, ["s0"]) == []


# ---------------------------------------------------------------------------------- speculation through generate()


def test_every_optimisation_changes_what_a_sweep_runs():
    """Named alone, each optimisation differs from the baseline in the servers' flags, the client's settings or the
    client's path (speculation runs through generate())."""
    baseline = knobs.parse_configuration("baseline")

    def runs(config: knobs.Configuration) -> tuple:
        return config.server_args(), config.client_settings(), speculates(config.client_settings())

    for name in knobs.OPTIMISATIONS:
        assert runs(knobs.parse_configuration(name)) != runs(baseline), name
    assert speculates(knobs.parse_configuration("speculative").client_settings())
    assert speculates(knobs.parse_configuration("speculative:auto").client_settings())
    assert not speculates(baseline.client_settings()) and not speculates(knobs.parse_configuration("compression").client_settings())
    assert knobs.parse_configuration("offload").server_args() == ["--offload", "0.5"]
    assert knobs.parse_configuration("quant").server_args() == ["--quant-type", "nf4"]


def test_quant_fixes_the_servers_precision_or_leaves_the_products_default():
    assert "--quant-type" not in knobs.parse_configuration("baseline").server_args()  # not named: the product's auto
    assert knobs.parse_configuration("compression+quant:int8").server_args() == ["--quant-type", "int8"]
    assert knobs.parse_configuration("quant:none").server_args() == ["--quant-type", "none"]
    assert "--quant-type" not in knobs.parse_configuration("auto").server_args()
    with pytest.raises(ValueError, match="one of none, int8, nf4"):
        knobs.parse_configuration("quant:fp8")
    # the device and the memory budget decide these autos, not the link: their servers serve every environment
    assert not knobs.parse_configuration("quant:auto").bandwidth_sensitive
    assert not knobs.parse_configuration("offload:auto").bandwidth_sensitive
    assert knobs.parse_configuration("quant:auto+micro_batching:auto").bandwidth_sensitive


class _FakeSpeculatingModel:
    """generate() as the client's model runs it with a draft: streams the prompt, then tokens; keeps round stats."""

    def __init__(self, draft: object | None = "draft"):
        self.draft, self.calls, self.last_speculation = draft, [], None

    def settings_draft(self):
        return self.draft

    def generate(self, ids, max_new_tokens: int, streamer=None, **kwargs):
        import torch

        from bloombee.speculative.generation import RoundStats

        self.calls.append({"prompt": ids.shape[1], "max_new_tokens": max_new_tokens, **kwargs})
        if streamer is not None:
            streamer.put(ids[:1])
            streamer.put(torch.zeros(1, 1, dtype=torch.long))
            streamer.end()
        self.last_speculation = RoundStats(tree_rounds=2, plain_rounds=1, accepted=[3, 2], nodes_proposed=[15, 15],
                                           chain=[("s0.g0c0", 0, 4), ("s1.g0c0", 4, 8)])
        return torch.zeros(ids.shape[0], ids.shape[1] + max_new_tokens, dtype=torch.long)


def _workload(monkeypatch, model) -> tuple[Workload, list[str]]:
    import torch

    out = io.StringIO()
    workload = Workload(Channel(io.StringIO('{"cmd": "continue"}\n' * 3), out))
    workload.model_path = "m"
    monkeypatch.setattr(workload, "_model", lambda allowed, settings: model)
    monkeypatch.setattr(workload, "prompt_ids", lambda batch, prompt_len, seed: (torch.ones(batch, prompt_len, dtype=torch.long), "random"))
    loops: list[int] = []

    def step_loop(model, ids, new_tokens, max_length, mark):
        loops.append(new_tokens)
        return [], [], 0.1

    monkeypatch.setattr(workload, "_generate", step_loop)
    return workload, loops


def test_worker_runs_speculative_configurations_through_generate(monkeypatch):
    model = _FakeSpeculatingModel()
    workload, loops = _workload(monkeypatch, model)
    speculative = knobs.parse_configuration("speculative").client_settings()
    result = workload.run(["s0.g0c0", "s1.g0c0"], speculative, batch=2, prompt_len=5, new_tokens=6, warmup_steps=1)
    assert loops == [] and [call["max_new_tokens"] for call in model.calls] == [2, 6]
    assert model.calls[1]["prompt"] == 5 and model.calls[1]["do_sample"] is False and model.calls[1]["eos_token_id"] is None
    assert result["mode"] == "generate" and result["new_tokens"] == 6 and result["batch"] == 2
    assert 0 <= result["first_token_s"] <= result["generation_s"]
    assert result["chain"] == [{"name": "s0.g0c0", "start": 0, "end": 4}, {"name": "s1.g0c0", "start": 4, "end": 8}]
    assert result["speculation"]["tree_rounds"] == 2 and result["speculation"]["accepted"] == [3, 2]
    assert [json.loads(line)["name"] for line in workload.channel.out.getvalue().splitlines()] == ["start", "end"]


def test_worker_runs_other_configurations_through_the_step_loop(monkeypatch):
    model = _FakeSpeculatingModel()
    workload, loops = _workload(monkeypatch, model)
    for name in ("baseline", "compression", "auto"):
        result = workload.run(["s0"], knobs.parse_configuration(name).client_settings(), batch=2, prompt_len=5,
                              new_tokens=6, warmup_steps=1, marks=False)
        assert result["mode"] == "steps"
    assert model.calls == [] and loops == [2, 6] * 3
    without_draft, _ = _workload(monkeypatch, _FakeSpeculatingModel(draft=None))
    with pytest.raises(ValueError, match="the configuration speculates but m names no draft model"):
        without_draft.run(["s0"], {"speculation": "on"}, batch=1, prompt_len=5, new_tokens=6, marks=False)


def _generate_record(config: str, walls: tuple[float, ...] = (1.0, 1.2)) -> dict:
    repeats = [{"mode": "generate", "steps": [], "generation_s": wall, "first_token_s": 0.2, "batch": 2, "new_tokens": 9,
                "speculation": {"tree_rounds": 3, "plain_rounds": 1, "accepted": [3, 2, 3], "nodes_proposed": [15] * 3},
                "loadavg": [1.0, 1.0, 1.0]} for wall in walls]
    return {"env": {"name": "E1"}, "config": {"name": config}, "model_name": "m", "workload": {"prompt_len": 8, "new_tokens": 9},
            "hops": [("client", "s0"), ("s0", "s1"), ("s1", "client")], "hop_rates_mbps": [None] * 3, "repeats": repeats}


def test_a_generate_run_is_summarised_beside_the_step_loop(tmp_path):
    s = metrics.summarize(_generate_record("speculative"))
    assert s["mode"] == "generate" and s["repeats"] == 2 and s["decode_steps"] == 8
    assert s["decode_tokens_per_s"] == pytest.approx(2 * 8 * 2 / (0.8 + 1.0))
    assert s["e2e_tokens_per_s"] == pytest.approx(2 * 9 * 2 / 2.2)
    assert s["e2e_tokens_per_s_repeats"] == pytest.approx([18 / 1.0, 18 / 1.2])
    assert s["step_median_s"] == pytest.approx((0.8 / 4 + 1.0 / 4) / 2) and s["prefill_s"] == pytest.approx(0.2)
    assert s["tokens_per_step"] == pytest.approx(2.0) and s["tokens_per_tree_round"] == pytest.approx(8 / 3)
    baseline = _record(rate=None)
    baseline["env"]["name"] = "E1"
    summaries = [metrics.summarize(baseline), s]
    comparison = report.comparison_table(summaries)
    assert "| E1 | speculative |" in comparison and f"{s['decode_tokens_per_s'] / summaries[0]['decode_tokens_per_s']:.2f}x" in comparison
    assert "| E1 | speculative | 17.8 | 16.4 | 8 | 6 | 2 | 2.00 | 2.67 |" in report.speculation_table(summaries)
    assert "| E1 | speculative |" in report.summary_table(summaries) and "speculative" not in report.breakdown_table(summaries)
    meta = {"model_name": "m", "model_note": "test", "command": "sudo ...", "hidden_size": 64, "num_blocks": 2,
            "dtype": "float32", "server_nodes": ["s0", "s1"], "ranges": [[0, 1], [1, 2]], "batch": 2, "prompt_len": 8,
            "new_tokens": 9, "warmup_steps": 2, "started": "now",
            "machine": {"cpus": 2, "loadavg_start": "1.0", "kernel": "k", "git": "g"}}
    pytest.importorskip("matplotlib")
    report.write_sweep_outputs(tmp_path, meta, summaries)
    assert "## Speculative decoding" in (tmp_path / "summary.md").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["runs"][1]["compression_ratio"] is None


# ---------------------------------------------------------------------------------- chains under one budget (benches)

TINY = Path(__file__).resolve().parents[1] / "bloombee" / "assets" / "bloombee-tiny"


def _quant_record(quant: str, gpu_gib: float) -> dict:
    """A one-server chain of bloombee-tiny's 8 blocks whose profile announces `quant` and a `gpu_gib` budget."""
    cost = {"table": {"micro_batch": [1.0, 32.0], "mlp_ms": [1.0, 4.0], "attn_gpu_ms": [0.1, 0.4],
                      "attn_cpu_ms": [0.1, 0.4]}, "reference_seq_len": 32}
    profile = {"name": "s0.c", "gpu": "cpu (float32)", "gpu_memory_gib": gpu_gib, "host_memory_gib": 1.0,
               "reserved_gib": 0.0, "quant_type": quant, "cost": cost,
               "link": {"uplink_mbps": 1000.0, "downlink_mbps": 1000.0}}
    span = {"name": "s0.c", "start": 0, "end": 8, "profile": profile, "dtype": "float32", "offload": 0.0,
            "quant_type": quant}
    return {"chain": [span], "hop_rates_mbps": [20.0, 20.0], "model_path": str(TINY), "client_cpu": None,
            "client_settings": {"compression": "off"}, "workload": {"batch": 4}}


def test_predictions_plan_the_precision_the_servers_announce():
    from benchmarks.netbench import chains, predict
    from bloombee.planner.inputs import ModelSpec

    spec = ModelSpec.model_validate(predict._model_section(str(TINY)))
    budget = 8 * spec.weight_bytes("float32", "nf4") * 2 / 2**30  # 8 nf4 blocks fit twice, 8 float32 ones do not
    inputs = predict._inputs(_quant_record("nf4", budget), {"tokens": 1, "batch": 4}, 64)
    assert inputs.nodes[0].quant_type == "nf4" and inputs.model.linear_params_per_block
    view = chains.planner_view(_quant_record("nf4", budget), 64)
    assert view["feasible"] and view["quant_types"] == ["nf4"]
    assert view["weight_bytes"] == [pytest.approx(8 * spec.weight_bytes("float32", "nf4"))]
    full = chains.planner_view(_quant_record("none", budget), 64)
    assert not full["feasible"] and full["quant_types"] == ["none"]


def test_quant_chains_follow_the_blocks_that_fit():
    from benchmarks import quant_netbench
    from benchmarks.netbench import chains

    figures = [{"quant": "none", "blocks_per_server": 1, "servers": 3},
               {"quant": "int8", "blocks_per_server": 2, "servers": 2},
               {"quant": "nf4", "blocks_per_server": 3, "servers": 1}]
    quant_netbench.check_premise(figures)
    layout = quant_netbench.chain_list(3, figures)
    assert [chain.ranges for chain in layout] == [((0, 1), (1, 2), (2, 3)), ((0, 2), (2, 3)), ((0, 3),)]
    assert [chain.label for chain in layout] == ["3 servers, --quant-type none", "2 servers, --quant-type int8",
                                                 "1 server, --quant-type nf4"]
    configs = chains.configurations("compression", layout, "quant")
    assert [configs[key].server_args() for key in "abc"] == [["--quant-type", q] for q in ("none", "int8", "nf4")]
    with pytest.raises(SystemExit, match="without quant"):
        chains.configurations("quant:nf4", layout, "quant")
    with pytest.raises(SystemExit, match="does not force"):
        quant_netbench.check_premise([{**figures[0], "blocks_per_server": 2, "servers": 2}, *figures[1:]])
    with pytest.raises(SystemExit, match="does not force"):
        quant_netbench.check_premise([figures[0], {**figures[1], "blocks_per_server": 1, "servers": 3}, figures[2]])


def test_chain_speedups_and_table():
    from benchmarks.netbench import chains

    rows = [{"env": env, "chain": key, "label": key, "hops": 2,
             "summary": {"decode_tokens_per_s": tps, "e2e_tokens_per_s": tps / 2}}
            for env, key, tps in (("E1", "a", 10.0), ("E1", "b", 12.0), ("E5", "a", 4.0), ("E5", "b", 5.0),
                                  ("E5", "c", 3.0))]
    assert chains.speedups(rows) == {"E1": {"b": pytest.approx(0.2)}, "E5": {"b": pytest.approx(0.25),
                                                                           "c": pytest.approx(-0.25)}}
    lines = chains.table(rows[:1], chains.LEAD_COLUMNS + [("e2e", lambda row: f"{row['summary']['e2e_tokens_per_s']:g}")])
    assert lines == ["| env | chain | hops | e2e |", "|---|---|---|---|", "| E1 | a | 2 | 5 |"]
