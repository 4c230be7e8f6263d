"""bloombee.codec.policy: the break-even rule (bloombee.planner.rules), both ways, and how observations move it."""

import threading
import time

import pytest
import torch

from bloombee import codec
from bloombee.codec import CompressionPolicy
from bloombee.planner.rules import codec_break_even, compression_pays

MB = 1e6


def break_even_bandwidth(ratio, compress_speed, decompress_speed, num_bytes=float("inf")):
    """The rule with this machine's measured call costs, as the policy applies it."""
    return codec_break_even(ratio, compress_speed, decompress_speed, codec.call_costs().both_s, num_bytes)


def worth_compressing(ratio, bandwidth, compress_speed, decompress_speed, num_bytes=float("inf")):
    return compression_pays(bandwidth, ratio, compress_speed, decompress_speed, codec.call_costs().both_s, num_bytes)


def test_rule_compresses_on_slow_links_and_not_on_fast_ones():
    # r = 1.5 saves a third of the bytes; C = D = 500 MB/s costs 4 ns per byte.
    # Break-even: (1 - 1/1.5) / (2 / 500e6) = 83.3 MB/s.
    assert break_even_bandwidth(1.5, 500 * MB, 500 * MB) == pytest.approx(83.333 * MB, rel=1e-3)
    assert worth_compressing(1.5, 2.5 * MB, 500 * MB, 500 * MB)  # 20 Mbit/s home uplink
    assert worth_compressing(1.5, 83 * MB, 500 * MB, 500 * MB)
    assert not worth_compressing(1.5, 84 * MB, 500 * MB, 500 * MB)
    assert not worth_compressing(1.5, 4000 * MB, 500 * MB, 500 * MB)  # loopback
    assert not worth_compressing(1.0, 1.0, 500 * MB, 500 * MB)  # nothing saved: never
    assert not worth_compressing(0.9, 1.0, 500 * MB, 500 * MB)
    assert break_even_bandwidth(1.0, 500 * MB, 500 * MB) == 0.0


def policy(**kw):
    kw.setdefault("prior_ratio", 1.5)
    kw.setdefault("prior_compress_speed", 500 * MB)
    kw.setdefault("prior_decompress_speed", 500 * MB)
    return CompressionPolicy("auto", **kw)


def test_choose_follows_the_rule_both_ways():
    p = policy(link_bandwidth=2.5 * MB)
    assert p.choose(1 << 20) == "auto"
    last = p.report()["last"]
    assert last["compress"] and last["reason"].startswith("compress: link 2.5 MB/s < break-even")
    assert p.choose(1 << 20, link_bandwidth=1000 * MB) == "raw"
    last = p.report()["last"]
    assert not last["compress"] and last["reason"].startswith("raw: link 1 GB/s >= break-even")
    assert last["break_even_bandwidth"] == pytest.approx(break_even_bandwidth(1.5, 500 * MB, 500 * MB, 1 << 20))
    assert last["break_even_bandwidth"] < 83.333 * MB


def test_the_calls_own_time_keeps_small_messages_raw_where_large_ones_compress():
    # at 1.5x and 500 MB/s both ways a byte costs 4 ns to code and saves a third of its wire time; the calls' own
    # time (measured: tens of us) is worth KBs of coding, so a 16 KiB message breaks even well below a large one
    calls = codec.call_costs().both_s
    small = break_even_bandwidth(1.5, 500 * MB, 500 * MB, 16384)
    assert small == pytest.approx((1 / 3) / (4e-9 + calls / 16384))
    assert small < break_even_bandwidth(1.5, 500 * MB, 500 * MB, 1 << 20) < break_even_bandwidth(1.5, 500 * MB, 500 * MB)
    between = (small + break_even_bandwidth(1.5, 500 * MB, 500 * MB, 1 << 20)) / 2
    p = policy(link_bandwidth=between)
    assert p.choose(16384) == "raw" and p.choose(1 << 20) == "auto"
    assert worth_compressing(1.5, between, 500 * MB, 500 * MB, 1 << 20)
    assert not worth_compressing(1.5, between, 500 * MB, 500 * MB, 16384)


def test_observed_times_are_taken_as_the_call_plus_its_bytes():
    p = policy()
    p.observe_encode(1_000_000, 500_000, codec.call_costs().encode_s + 0.001)  # 1 ms for the bytes: 1 GB/s
    p.observe_decode(1_000_000, codec.call_costs().decode_s + 0.0005)  # 2 GB/s
    assert p.figures(1_000_000) == pytest.approx((2.0, 1e9, 2e9))


def test_tiny_messages_and_modes():
    p = policy(link_bandwidth=1 * MB)
    assert p.choose(100) == "raw" and "minimum" in p.report()["last"]["reason"]
    on = CompressionPolicy("on", link_bandwidth=1e12)
    assert on.choose(1 << 20) == "auto" and on.choose(10) == "raw"
    off = CompressionPolicy("off", link_bandwidth=1)
    assert off.choose(1 << 20) == "raw" and "off" in off.report()["last"]["reason"]
    with pytest.raises(ValueError, match="mode"):
        CompressionPolicy("sometimes")
    with pytest.raises(ValueError, match="positive"):
        policy().choose(1 << 20, link_bandwidth=0)


def test_unknown_bandwidth_assumes_a_slow_link():
    p = policy()
    assert p.choose(1 << 20) == "auto" and "unknown" in p.report()["last"]["reason"]


def test_observed_ratio_moves_the_decision():
    p = policy(link_bandwidth=10 * MB)
    assert p.choose(1 << 20) == "auto"
    for _ in range(20):  # the traffic turns out incompressible: ratio ~1.01
        p.observe_encode(1 << 20, int((1 << 20) / 1.01), 0.002)
    assert p.figures(1 << 20)[0] == pytest.approx(1.01, rel=1e-3)
    assert p.choose(1 << 20) == "raw"


def test_observed_speeds_move_the_decision():
    p = policy(link_bandwidth=30 * MB)
    assert p.choose(1 << 20) == "auto"  # 30 MB/s < 83.3 MB/s
    n = 1 << 20
    p.observe_encode(n, n // 1.5, n / 100e6 + codec.call_costs().encode_s)  # 100 MB/s encode: break-even drops to 27.8 MB/s
    assert p.figures(n)[1] == pytest.approx(100 * MB)
    assert p.choose(n) == "raw"
    p.observe_decode(n, n / 10e9 + codec.call_costs().decode_s)  # 10 GB/s decode
    p.observe_encode(n, n // 1.5, n / 10e9 + codec.call_costs().encode_s)  # 10 GB/s: the median of the two, 198 MB/s
    assert p.figures(n)[1] == pytest.approx(1 / 5.05e-9)
    assert p.choose(n) == "auto"
    assert p.figures(n // 2) == (1.5, 500 * MB, 500 * MB)  # messages of another size class: still the priors


def test_one_slow_call_does_not_move_the_speeds():
    """A process's first encode (a cold codec) takes 10x a warm one: among warm ones it is outvoted at once."""
    p = policy()
    p.observe_encode(16384, 10_000, 10 * (codec.call_costs().encode_s + 16384 / 500e6))
    assert p.figures(16384)[1] < 50 * MB
    for _ in range(2):
        p.observe_encode(16384, 10_000, codec.call_costs().encode_s + 16384 / 500e6)
    assert p.figures(16384)[1] == pytest.approx(500 * MB)
    p.adopt_decompress_speed(2e9, 16384)
    assert p.measured_decompress_speed(16384) == pytest.approx(2e9)
    p.observe_decode(16384, 10 * (codec.call_costs().decode_s + 16384 / 2e9))
    assert p.figures(16384)[2] < 2e8  # the median of two is their mean
    for _ in range(2):
        p.observe_decode(16384, codec.call_costs().decode_s + 16384 / 2e9)
    assert p.figures(16384)[2] == pytest.approx(2e9)
    assert p.measured_decompress_speed(1 << 20) is None


def test_each_size_class_learns_its_own_figures():
    """A decode step's 16 KiB frames code at a lower speed per byte than a prompt's 256 KiB ones (the calls and cold
    caches weigh more): what the small ones teach leaves the large ones compressed on a link where they pay."""
    p = policy(link_bandwidth=30 * MB, probe_every=0)
    for _ in range(5):
        p.observe_encode(16384, 11_000, 16384 / 50e6)
        p.observe_decode(16384, 16384 / 100e6)
    assert p.choose(16384) == "raw" and p.choose(30_000) == "raw"  # 16-32 KiB: one class
    assert p.choose(1 << 18) == "auto"  # its own class: the priors until it learns
    p.observe_encode(1 << 18, (1 << 18) // 2, (1 << 18) / 600e6)
    p.observe_decode(1 << 18, (1 << 18) / 1e9)
    assert p.choose(1 << 18) == "auto"
    assert set(p.report()["estimates"]) == {"< 32 KiB", "< 512 KiB"}


def test_encode_speed_is_cpu_time_not_the_wait_for_the_interpreter_lock():
    """A thread spinning in Python holds the lock in 5 ms slices: each encode waits for it far longer than it works.
    The policy learns the encode's CPU time (wall time here: 1-2 MB/s for 16 KiB frames, 20-100x too slow)."""
    spinning, running = threading.Event(), threading.Event()
    spinning.set()

    def spin():
        running.set()
        while spinning.is_set():
            pass

    p = CompressionPolicy("on", accepted=codec.LAYOUTS)
    x = (torch.randn(32, 1, 256) * 3).to(torch.bfloat16)  # a bloombee-tiny decode step's 16 KiB
    spinner = threading.Thread(target=spin)
    spinner.start()
    running.wait()  # else five quick encodes can finish before the spinner first runs
    try:
        began = time.perf_counter()
        for _ in range(5):
            p.encode(x)
        wall_speed = 5 * x.nbytes / (time.perf_counter() - began)
    finally:
        spinning.clear()
        spinner.join()
    assert p.report()["estimates"]["< 32 KiB"]["observations"]["encode"] == 5
    assert p.figures(x.nbytes)[1] > 5 * MB and p.figures(x.nbytes)[1] > 3 * wall_speed


def test_probes_keep_estimates_fresh_on_fast_links():
    p = policy(link_bandwidth=1000 * MB, probe_every=4)
    choices = [p.choose(1 << 20) for _ in range(8)]
    assert choices == ["raw", "raw", "raw", "auto", "raw", "raw", "raw", "auto"]
    assert p.report()["counts"] == {"raw": 6, "compressed": 2, "probes": 2}
    assert p.report()["last"]["probe"]
    never = policy(link_bandwidth=1000 * MB, probe_every=0)
    assert all(never.choose(1 << 20) == "raw" for _ in range(100))


def test_policy_encode_decode_round_trip_and_learn():
    x = torch.randn(32, 2048).half()
    p = CompressionPolicy("auto", link_bandwidth=1 * MB, accepted=codec.LAYOUTS)
    data = p.encode(x)
    assert codec.inspect(data).layout != "raw"
    y = codec.decode(data)
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))
    obs = p.report()["estimates"]["< 256 KiB"]["observations"]
    assert obs["encode"] == 1 and obs["decode"] == 0
    p.adopt_decompress_speed(5e9, x.nbytes)
    assert p.figures(x.nbytes)[2] == pytest.approx(5e9)
    assert p.report()["estimates"]["< 256 KiB"]["observations"]["decode"] == 1
    assert p.figures(x.nbytes)[0] == pytest.approx(codec.inspect(data).ratio)
    fast = CompressionPolicy("auto", link_bandwidth=1e12, probe_every=0)
    assert codec.inspect(fast.encode(x)).layout == "raw"
    assert fast.report()["estimates"]["< 256 KiB"]["observations"]["encode"] == 0
    restricted = CompressionPolicy("on", accepted=["raw"])
    assert codec.inspect(restricted.encode(x)).layout == "raw"
