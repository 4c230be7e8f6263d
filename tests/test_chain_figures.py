"""The client's one view of the chain's measured figures: learnt once, read by its policies, chooser and switch."""

import pytest
import torch

from bloombee.client.figures import ChainFigures, chain_bandwidths
from bloombee.client.micro_batching import MicroBatchChooser
from bloombee.client.steps import StepStats
from bloombee.codec import LAYOUTS, CompressionPolicy, call_costs
from bloombee.protocol import HopReport
from test_micro_batching import CONFIG, chain

MBIT = 1e6 / 8  # bytes/s in one Mbit/s


def test_one_step_teaches_the_policy_and_the_chooser_the_same_figure():
    """A server's decode, timed once in a step's hop report, is the figure the client's policy for the link to it
    decides with and the one the chooser models that server with: one estimate, which either then sees move."""
    figures = ChainFigures(20 * MBIT)
    choose = MicroBatchChooser(CONFIG, link_mbps=20.0, compression="auto", figures=figures)
    spans = chain(20.0)
    peers = [span.peer_id for span in spans]
    policy = CompressionPolicy("auto", link_bandwidth=20 * MBIT, figures=figures.link(peers[0]))
    raw_bytes = 32 * CONFIG.hidden_size * 4  # a micro-batch of 32 rows in float32
    assert policy.measured_decompress_speed(raw_bytes) is None
    reports = [HopReport(raw_bytes=raw_bytes, wire_bytes=raw_bytes,
                         decode_cpu_s=call_costs().decode_s + raw_bytes / 50e6)] + \
        [HopReport(raw_bytes=raw_bytes, wire_bytes=raw_bytes) for _ in spans[1:]]
    figures.observe_step(peers, StepStats(reports=reports, micro_batch_reports=[reports],
                                          sent={0: ("bytesplit", raw_bytes)}, received_decode_cpu_s=[0.0]))
    assert policy.measured_decompress_speed(raw_bytes) == pytest.approx(50e6)
    assert policy.figures(raw_bytes)[2] == pytest.approx(50e6)
    assert choose.chain_inputs(spans, 32, 32, 32).nodes[0].compression.decompress_mb_per_s == pytest.approx(50.0)
    policy.adopt_decompress_speed(80e6, raw_bytes)  # the same estimate: what the policy takes, the chooser reads
    assert choose.chain_inputs(spans, 32, 32, 32).nodes[0].compression.decompress_mb_per_s == pytest.approx(80.0)


def test_the_clients_encodes_are_one_figure_for_all_its_links():
    """What the policy for the link to one server learns of the client's encodes, the policy for another server and
    the chooser's client decide with: the client's codec, not a link's."""
    figures = ChainFigures(20 * MBIT)
    spans = chain(20.0)
    first, second = (CompressionPolicy("on", accepted=LAYOUTS, figures=figures.link(span.peer_id))
                     for span in spans[:2])
    x = torch.randn(32, CONFIG.hidden_size)
    first.encode(x)
    assert second.figures(x.nbytes)[:2] == first.figures(x.nbytes)[:2] != CompressionPolicy().figures(x.nbytes)[:2]
    assert second.report()["estimates"]["< 512 KiB"]["observations"] == {"encode": 1, "decode": 0}
    client = MicroBatchChooser(CONFIG, link_mbps=20.0, compression="on", figures=figures).chain_inputs(
        spans, 32, 32, 32).client.compression
    assert client.ratio == pytest.approx(first.figures(x.nbytes)[0])
    assert client.compress_mb_per_s == pytest.approx(first.figures(x.nbytes)[1] / 1e6)


def test_the_switch_reads_the_hop_bandwidths_of_the_view():
    figures = ChainFigures(100 * MBIT)
    spans = chain(20.0)
    assert figures.hop_bandwidths(spans) == chain_bandwidths(100 * MBIT, [20 * MBIT] * 3) == [20 * MBIT] * 4
