"""The announced throughput: the start-up figure until batch-1 decode steps are served, then theirs, kept for the
next start."""

import json
import time

from bloombee.server.throughput import SERVED_BEFORE_TRUSTED, ThroughputMeter


def test_served_batch_one_decode_steps_replace_the_start_up_figure_and_are_kept(tmp_path):
    cache = tmp_path / "throughput.json"
    meter = ThroughputMeter(20.0, "key", cache)
    meter.observe(vectors=4, blocks=4, seconds=0.01)  # a batch of 4: not what the figure means
    meter.observe(vectors=16, blocks=4, seconds=0.01)  # a prompt step
    for _ in range(SERVED_BEFORE_TRUSTED - 1):
        meter.observe(vectors=1, blocks=4, seconds=0.05)  # 80 block-steps/s
    assert meter.value == 20.0
    meter.save()
    assert not cache.exists()
    meter.observe(vectors=1, blocks=4, seconds=0.05)
    assert meter.value == 80.0
    meter.save()
    assert json.loads(cache.read_text()) == {"key": 80.0}
    meter.observe(vectors=1, blocks=4, seconds=0.1)  # slower steps pull the figure down gradually
    assert 40.0 < meter.value < 80.0


def test_served_forwards_of_several_decode_steps_replace_the_start_up_row_figure(tmp_path):
    meter = ThroughputMeter(20.0, "key", tmp_path / "throughput.json", row_seconds=0.001)
    for _ in range(SERVED_BEFORE_TRUSTED):
        meter.observe(vectors=1, blocks=4, seconds=0.2)  # 0.05 s a block alone
        meter.observe(vectors=12, blocks=4, seconds=0.3, steps=2)  # a prompt beside a decode step: not a row figure
    assert meter.value == 20.0 and meter.row_seconds == 0.001
    for _ in range(SERVED_BEFORE_TRUSTED):
        meter.observe(vectors=5, blocks=4, seconds=0.36, steps=5)  # 0.09 s a block: 0.01 s for each further step
    assert abs(meter.row_seconds - 0.01) < 1e-9


def test_the_load_is_the_mean_size_of_recent_forwards(tmp_path):
    meter = ThroughputMeter(20.0, "key", tmp_path / "throughput.json", row_seconds=0.001, load_window_s=0.5)
    assert meter.busy_vectors == 0.0
    for vectors in (4, 8, 12):
        meter.observe(vectors=vectors, blocks=4, seconds=0.01)
    assert meter.busy_vectors == 8.0
    time.sleep(0.6)  # forwards older than the window no longer count
    assert meter.busy_vectors == 0.0
