"""Failover's pure parts: the step shapes a replay repeats, and the deadlines that bound a stalled step."""

import pytest
from test_swarm_units import record

from bloombee.client.deadlines import StepClock
from bloombee.client.routing import Span
from bloombee.client.steps import StepShape, record_shape, shapes_before
from bloombee.settings import ClientSettings


def test_shapes_keep_each_step_and_its_micro_batches():
    shapes: list[StepShape] = []
    for shape in (StepShape(0, 5, ((0, 2), (2, 2))), StepShape(5, 1, ((0, 4),)), StepShape(6, 1, ((0, 4),))):
        shapes = record_shape(shapes, shape)
    assert shapes == [StepShape(0, 5, ((0, 2), (2, 2))), StepShape(5, 1, ((0, 4),)), StepShape(6, 1, ((0, 4),))]


def test_a_step_written_over_earlier_positions_drops_later_shapes_and_cuts_the_one_it_splits():
    shapes = [StepShape(0, 5, ((0, 1),)), StepShape(5, 3, ((0, 1),)), StepShape(8, 1, ((0, 1),))]
    shapes = record_shape(shapes, StepShape(6, 2, ((0, 1),)))
    assert shapes == [StepShape(0, 5, ((0, 1),)), StepShape(5, 1, ((0, 1),)), StepShape(6, 2, ((0, 1),))]


def test_shapes_before_clip_to_the_replayed_positions():
    shapes = [StepShape(0, 5, ((0, 1),)), StepShape(5, 3, ((0, 1),)), StepShape(8, 1, ((0, 1),))]
    assert shapes_before(shapes, 7) == [StepShape(0, 5, ((0, 1),)), StepShape(5, 2, ((0, 1),))]
    assert shapes_before(shapes, 9) == shapes


def chain(throughput: float = 100.0) -> list[Span]:
    return [Span("a", 0, 4, record(0, 4, throughput)), Span("b", 4, 8, record(4, 8, throughput))]


def test_the_deadline_comes_from_recent_steps_of_the_same_size_with_a_floor():
    clock = StepClock(ClientSettings(step_timeout_min=5.0, step_timeout_factor=3.0), hidden_size=64)
    for seconds in (0.01, 0.03, 0.02):
        clock.observe(1, 1, seconds)
    assert clock.expected(chain(), 1, 1) == pytest.approx(0.03)
    assert clock.deadline(clock.expected(chain(), 1, 1)) == 5.0
    clock.observe(1, 100, 4.0)
    assert clock.deadline(clock.expected(chain(), 1, 100)) == pytest.approx(12.0)


def test_without_recent_steps_the_announced_figures_give_the_expected_time():
    clock = StepClock(ClientSettings(hop_penalty_seconds=0.0), hidden_size=64)
    vectors = 1000
    transfer = vectors * 64 * 4 / 12.5e6  # the records announce float32: 4 bytes a value
    assert clock.expected(chain(throughput=100.0), 1, vectors) == pytest.approx(2 * (transfer + 4 * vectors / 100.0))


def test_no_deadline_is_longer_than_the_request_timeout():
    clock = StepClock(ClientSettings(request_timeout=20.0), hidden_size=64)
    assert clock.deadline(3600.0) == 20.0
