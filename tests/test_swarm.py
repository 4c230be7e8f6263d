"""A 3-server swarm on 127.0.0.1 generates exactly what the local transformers model generates."""

import pytest
import torch

from bloombee.client import MissingBlocksError, RequestRejected
from bloombee.client.loop import run_sync
from swarm_support import client, reference, save_tiny_llama, serving

SERVER_LIMITS = ["--dtype", "float32", "--max-length", "96", "--max-batch-size", "4"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("model") / "swarm-llama")
    with serving(folder, tmp_path_factory, {"a": "0:3", "b": "3:6", "c": "6:8"}, *SERVER_LIMITS) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def model(swarm):
    return client(swarm)


@pytest.fixture(scope="module")
def ref(swarm):
    return reference(swarm.model)


def test_greedy_batch1_equals_local_model(model, ref):
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    out = model.generate(ids, max_new_tokens=32, do_sample=False)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=32, do_sample=False))
    assert out.shape[1] == ids.shape[1] + 32


def test_greedy_batch4_left_padded_equals_local_model(model, ref):
    ids = torch.tensor([[0, 0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6], [0, 11, 12, 13, 14, 15], [0, 0, 21, 22, 23, 24]])
    mask = (torch.arange(6)[None] >= torch.tensor([[3], [0], [1], [2]])).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


@pytest.mark.parametrize("compression", ["on", "off"])
def test_compression_setting_is_lossless_and_reported(swarm, ref, compression):
    model = client(swarm, compression=compression)
    ids = torch.arange(1, 41).reshape(4, 10)
    with model.inference_session(max_length=24, batch_size=4) as session:
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        hidden = model.head.embed(torch.arange(1, 41).reshape(4, 10))
    assert torch.equal(out, ref.generate(ids, max_new_tokens=8, do_sample=False))
    with model.remote.inference_session(max_length=16, batch_size=4) as session:
        session.step(hidden)
        stats = session.last_step
    if compression == "on":
        assert stats.client_layout != "raw" and stats.sent_wire_bytes < stats.sent_raw_bytes
    else:
        assert stats.client_layout == "raw" and stats.sent_wire_bytes > stats.sent_raw_bytes
    assert [report.peer_id for report in stats.reports] == [span.peer_id for span in session.spans]
    assert all(report.compute_s > 0 and report.raw_bytes == 4 * 10 * 64 * 4 for report in stats.reports)


def test_sampling_with_seed_is_reproducible(model):
    ids = torch.tensor([[5, 6, 7]])
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_p=0.9, top_k=50, repetition_penalty=1.1)
    torch.manual_seed(123)
    first = model.generate(ids, **kwargs)
    torch.manual_seed(123)
    second = model.generate(ids, **kwargs)
    torch.manual_seed(7)
    other = model.generate(ids, **kwargs)
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_session_spans_several_generate_calls(model, ref):
    prompt, more = torch.tensor([[9, 8, 7, 6]]), torch.tensor([[40, 41]])
    with model.inference_session(max_length=64) as session:
        first = model.generate(prompt, max_new_tokens=8, do_sample=False)
        second = model.generate(more, max_new_tokens=8, do_sample=False)
        assert session.position == first.shape[1] + more.shape[1] + 8 - 1
    whole = torch.cat([first, more], dim=1)
    expected = ref.generate(whole, max_new_tokens=8, do_sample=False)
    assert torch.equal(torch.cat([first[:, :-1], second], dim=1), expected)


def test_stateless_forward_matches_local_logits(model, ref):
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        ours, theirs = model(ids).logits, ref(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_logits_to_keep_computes_the_last_positions_alone(model, ref):
    """What transformers' generate() asks for (1 at a prompt): the LM head computes only the positions kept."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        expected = ref(ids).logits
        assert torch.allclose(model(ids, logits_to_keep=3).logits, expected[:, -3:], atol=1e-5)
        with model.inference_session(max_length=16):
            kept = model(ids, logits_to_keep=1).logits
    assert kept.shape == (1, 1, model.config.vocab_size)
    assert torch.allclose(kept, expected[:, -1:], atol=1e-5)


def test_session_longer_than_server_limit_is_refused(model):
    with pytest.raises(RequestRejected, match="max_length 200 is over this server's limit of 96"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=197, do_sample=False)


def test_batch_over_server_limit_is_refused(model):
    with pytest.raises(RequestRejected, match="batch size 5 is over this server's limit of 4"):
        model.generate(torch.ones(5, 3, dtype=torch.long), max_new_tokens=2, do_sample=False)


def test_bad_step_is_rejected_and_session_keeps_working(model, ref):
    with model.remote.inference_session(max_length=16) as session:
        with pytest.raises(ValueError, match=r"hidden states must have shape \[batch, tokens, 64\]"):
            session.step(torch.zeros(1, 2, 63))
        wrong_width = torch.zeros(1, 2, 63)
        with pytest.raises(RequestRejected, match=r"server a rejected the request: hidden states must have shape"):
            run_sync(session._run_chain(session.streams, [(0, {"hidden": wrong_width})], 0, reply=True, num_tokens=2))
        hidden = model.head.embed(torch.tensor([[1, 2, 3]]))
        out = session.step(hidden)
    with torch.no_grad():
        expected = ref.model(torch.tensor([[1, 2, 3]])).last_hidden_state
    assert torch.allclose(model.head.logits(out), ref.lm_head(expected), atol=1e-5)


def test_missing_blocks_are_named(swarm):
    blocked = client(swarm, blocked_servers=[_peer_of(swarm, "b")])
    with pytest.raises(MissingBlocksError, match=r"blocks 3\.\.5 of model .* not served.*--blocks 3:6"):
        blocked.generate(torch.tensor([[1, 2]]), max_new_tokens=2)


def test_allowed_servers_restrict_the_chain(swarm, model):
    allowed = client(swarm, allowed_servers=["a", "b"])
    with pytest.raises(MissingBlocksError, match=r"blocks 6\.\.7"):
        allowed.generate(torch.tensor([[1, 2]]), max_new_tokens=2)


def _peer_of(swarm, name: str) -> str:
    from bloombee.dht.records import fetch_records

    for records in fetch_records(swarm.dht, swarm.prefix, swarm.num_blocks):
        for peer_id, record in records.items():
            if record.public_name == name:
                return peer_id
    raise AssertionError(f"server {name} not found in the DHT")
