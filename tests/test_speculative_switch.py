"""The speculation switch: equation 8's break-even bandwidth, and the decisions it drives from measured rounds."""

import math
from types import SimpleNamespace

import pytest

from bloombee.client.figures import chain_bandwidths
from bloombee.planner.rules import speculation_break_even as break_even_bandwidth
from bloombee.speculative.switch import (
    HOPELESS_WAIT,
    PLAIN_PROBES,
    TREE_PROBES,
    WINDOW,
    SpeculationSwitch,
    hop_weighted_bytes,
    shrunk,
)

MBIT = 1e6 / 8  # bytes/s in one Mbit/s


def step(client_bytes: int, *server_bytes: int):
    """A step's statistics as the switch reads them: bytes the client sent and each server sent on."""
    return SimpleNamespace(sent_wire_bytes=client_bytes, reports=[SimpleNamespace(wire_bytes=size) for size in server_bytes])


def test_break_even_is_equation_8():
    # B (N - a) D over (a - 1) t_rtt + (a - m) t_comp - c / n, here with the per-round terms already summed
    assert break_even_bandwidth(extra_bytes=30_000, saved_s=0.010) == pytest.approx(3e6)
    assert break_even_bandwidth(extra_bytes=-5, saved_s=0.010) == 0.0  # the tree moves fewer bytes per token
    assert break_even_bandwidth(extra_bytes=30_000, saved_s=-0.001) == math.inf  # it costs time even with free links


def test_hops_and_their_weights():
    assert chain_bandwidths(100.0, [50.0, 200.0]) == [50.0, 50.0, 100.0]
    # 1000 bytes over a hop twice as fast as the slowest weigh as 500 on the slowest
    assert hop_weighted_bytes(step(1000, 1000, 1000), [50.0, 100.0, 50.0]) == pytest.approx(2500)


def test_widths_shrink_then_become_a_chain():
    assert shrunk((4, 2, 2, 1), 0) == (4, 2, 2, 1)
    assert shrunk((4, 2, 2, 1), 1) == (2, 1, 1, 1)
    assert shrunk((4, 2, 2, 1), 2) == (1, 1, 1, 1)


def run_rounds(switch: SpeculationSwitch, plain_s: float, tree_s: float, accepted: float, rounds: int,
               plain_step=step(1000, 1000, 1000), tree_step=step(15000, 5000, 5000), rows: int = 1) -> list[bool]:
    """Feed `rounds` rounds of fixed measured costs; which of them speculated."""
    decisions = []
    for _ in range(rounds):
        if switch.speculate():
            switch.observe_tree(tree_s, 0.002, accepted, tree_step, rows)
            decisions.append(True)
        else:
            switch.observe_plain(plain_s, plain_step)
            decisions.append(False)
    return decisions


def test_fast_links_keep_speculating():
    switch = SpeculationSwitch("auto", bandwidths=[1000 * MBIT] * 3)
    decisions = run_rounds(switch, plain_s=0.007, tree_s=0.012, accepted=2.8, rounds=40)
    assert decisions[:PLAIN_PROBES] == [False] * PLAIN_PROBES and all(decisions[PLAIN_PROBES:])
    assert switch.level == 0 and switch.last_break_even < switch.slowest


def test_slow_links_shrink_the_tree_then_stop_and_recheck_ever_more_rarely():
    # 20 Mbit/s: the tree's 25 kB per round cost 10 ms more than plain's 3 kB, the fixed saving is smaller; it
    # would lose even accepting its whole depth, so rechecks start HOPELESS_WAIT times later
    switch = SpeculationSwitch("auto", bandwidths=[20 * MBIT] * 3, recheck_rounds=8)
    decisions = run_rounds(switch, plain_s=0.007 + 3000 / (20 * MBIT), tree_s=0.012 + 25000 / (20 * MBIT),
                           accepted=1.6, rounds=8 * HOPELESS_WAIT * 8)
    tried = decisions[PLAIN_PROBES:PLAIN_PROBES + TREE_PROBES]
    assert all(tried) and switch.off and switch.last_break_even > switch.slowest
    rechecks = [index for index, tree in enumerate(decisions) if tree][TREE_PROBES:]
    gaps = [later - earlier for earlier, later in zip(rechecks, rechecks[1:])]
    assert len(rechecks) == 3 and rechecks[0] >= 8 * HOPELESS_WAIT and gaps == sorted(gaps)  # one round each
    assert gaps[-1] >= 2 * gaps[0]  # ever rarer


def test_a_short_dip_in_acceptance_does_not_stop_a_tree_that_pays():
    # fast links: 2.8 tokens per round pay, 1.0 does not; 8 rounds of 1.0 after 40 of 2.8 still average 2.5
    switch = SpeculationSwitch("auto", bandwidths=[1000 * MBIT] * 3)
    assert all(run_rounds(switch, plain_s=0.007, tree_s=0.012, accepted=2.8, rounds=40)[PLAIN_PROBES:])
    assert all(run_rounds(switch, plain_s=0.007, tree_s=0.012, accepted=1.0, rounds=8))
    assert not all(run_rounds(switch, plain_s=0.007, tree_s=0.012, accepted=1.0, rounds=120))  # a lasting one does


def test_a_batch_is_judged_after_one_tree_round_and_a_hopeless_tree_rechecked_rarely():
    # batch 8: a tree round costs 8 plain rounds (more than its 4 tokens of depth + 1 could repay) and its slowest
    # row commits 1.5 tokens; one round shows 8 rows; the recheck waits HOPELESS_WAIT times the interval
    switch = SpeculationSwitch("auto", bandwidths=[1000 * MBIT] * 3, recheck_rounds=8)
    decisions = run_rounds(switch, plain_s=0.010, tree_s=0.080, accepted=1.5, rounds=8 * HOPELESS_WAIT, rows=8)
    assert decisions[PLAIN_PROBES] and not any(decisions[PLAIN_PROBES + 1:]) and switch.off
    assert any(run_rounds(switch, plain_s=0.010, tree_s=0.080, accepted=1.5, rounds=8, rows=8))


def test_a_smaller_tree_is_measured_in_full_after_a_recheck():
    switch = SpeculationSwitch("auto", bandwidths=[20 * MBIT] * 3)
    switch.off, switch.rounds_since_check, switch.recheck_in = True, 0, 0
    switch.plain.rounds = PLAIN_PROBES
    for _ in range(WINDOW):
        switch.observe_plain(0.007 + 3000 / (20 * MBIT), step(1000, 1000, 1000))
    switch.widths((2, 2, 1, 1))
    assert switch.speculate() and switch.probes == 1  # a recheck: one round of the configured tree
    switch.observe_tree(0.012 + 25000 / (20 * MBIT), 0.002, 2.0, step(15000, 5000, 5000))
    assert switch.level == 1 and switch.probes == TREE_PROBES  # shrunk: its first round alone does not decide


def test_the_planner_prior_skips_a_tree_that_could_never_pay():
    switch = SpeculationSwitch("auto", bandwidths=[1000 * MBIT] * 3)
    assert switch.untried()
    assert switch.consider(plain_s=0.01, tree_s=0.02, depth=4)  # 5 tokens at best for twice the time: try it
    assert not switch.consider(plain_s=0.01, tree_s=0.08, depth=4) and switch.off
    assert switch.consider(None, 0.08, 4)  # no profiles: measure instead


def test_fixed_modes_ignore_measurements():
    on, off = SpeculationSwitch("on"), SpeculationSwitch("off")
    assert all(run_rounds(on, 0.001, 1.0, 1.0, 10)) and not any(run_rounds(off, 1.0, 0.001, 5.0, 10))
    with pytest.raises(ValueError, match="auto, on or off"):
        SpeculationSwitch("sometimes")
