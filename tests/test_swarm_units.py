"""The swarm's pure parts: routing, ban back-off, block choice, records, NAT rule, settings."""

import hivemind
import pytest
from pydantic import ValidationError

from bloombee.client.routing import MissingBlocksError, SequenceManager, best_chain, format_ranges
from bloombee.codec import CODEC_VERSION
from bloombee.dht.peers import binds_only_loopback, nat_traversal_enabled, start_dht
from bloombee.dht.records import ServerRecord, ServerState, announce, block_key, fetch_records
from bloombee.protocol import PROTOCOL_FEATURES, REQUIRED_FEATURES
from bloombee.server.announcing import REFRESH_PERIODS, why_announce
from bloombee.server.block_selection import block_coverage, choose_start_block, should_move
from bloombee.settings import ClientSettings, ServerSettings, load_settings


def record(start: int, end: int, throughput: float = 100.0, state: ServerState = ServerState.ONLINE, name: str = "",
           codec_version: int = CODEC_VERSION, features: tuple[str, ...] = PROTOCOL_FEATURES) -> ServerRecord:
    return ServerRecord(state=state, start_block=start, end_block=end, throughput=throughput, link_bandwidth=12.5e6,
                        cache_tokens_left=1000, dtype="float32", device="cpu", version="0.1.0", public_name=name,
                        codec_version=codec_version, features=features)


def cost(per_hop: float = 0.01):
    return lambda rec, num_blocks: per_hop + num_blocks / rec.throughput


def test_best_chain_prefers_fewer_hops_when_equally_fast():
    servers = {"a": record(0, 4), "b": record(4, 8), "whole": record(0, 8), "c": record(2, 6)}
    chain = best_chain(servers, 0, 8, cost())
    assert [(span.peer_id, span.start, span.end) for span in chain] == [("whole", 0, 8)]


def test_best_chain_routes_around_a_slow_server_and_uses_partial_spans():
    servers = {"slow": record(0, 8, throughput=1.0), "a": record(0, 5), "b": record(3, 8)}
    chain = best_chain(servers, 0, 8, cost())
    assert [span.peer_id for span in chain] == ["a", "b"]
    assert chain[0].start == 0 and chain[0].end == chain[1].start and chain[1].end == 8 and 3 <= chain[0].end <= 5


def test_missing_blocks_error_names_them_and_suggests_a_server():
    with pytest.raises(MissingBlocksError, match=r"blocks 3\.\.4, 7 of model 'm' .*--blocks 3:8"):
        best_chain({"a": record(0, 3), "b": record(5, 7)}, 0, 8, cost(), "m")


def test_routing_prefers_replicas_with_room_for_the_session():
    manager = SequenceManager(None, "p", 8, 64, ClientSettings())

    def replica(free: int) -> ServerRecord:
        return record(0, 8).model_copy(update={"device_memory_bytes": 1 << 20, "device_free_bytes": free,
                                               "host_memory_bytes": 1 << 20, "host_free_bytes": 1 << 20,
                                               "device_bytes_per_token": 64, "host_bytes_per_token": 8})

    servers = {"full": replica(1000), "roomy": replica(1 << 20), "half": replica(1 << 19)}

    def route(tokens: int) -> str:
        return best_chain(servers, 0, 8, manager.span_cost(tokens))[0].peer_id

    assert route(100) == "roomy"  # 6.4 KB: every replica has room, the emptiest is cheapest
    del servers["roomy"]
    assert route(100) == "half"
    assert route(5_000) == "half"  # 320 KB fit only there
    del servers["half"]
    assert route(5_000) == "full"  # no room anywhere: the one that serves the blocks, where the session will wait


def test_routing_counts_what_a_step_adds_to_a_loaded_server_that_batches():
    manager = SequenceManager(None, "p", 8, 64, ClientSettings(hop_penalty_seconds=0.0))
    # 100 batch-1 steps/s a block; one more row adds 1 ms a block to a forward of a server that batches
    batching = record(0, 8).model_copy(update={"row_seconds": 0.001, "busy_vectors": 8.0})
    one_at_a_time = record(0, 8).model_copy(update={"busy_vectors": 8.0})  # announces no per-row figure
    assert manager.hop_cost(batching, 8) == pytest.approx(8 * (0.01 + 0.001 * 8), rel=1e-3)
    assert manager.hop_cost(one_at_a_time, 8) == pytest.approx(8 * 0.01, rel=1e-3)
    servers = {"loaded": batching, "idle": batching.model_copy(update={"busy_vectors": 0.0})}
    assert best_chain(servers, 0, 8, manager.span_cost(10))[0].peer_id == "idle"
    servers = {"loaded": batching, "slower but idle": record(0, 8, throughput=50.0)}
    assert best_chain(servers, 0, 8, manager.span_cost(10))[0].peer_id == "loaded"  # 18 ms a block batched < 20 alone


def test_blocks_held_only_by_banned_servers_are_explained_as_such():
    """A frozen server is banned, not gone: the error names it, says it stopped answering, and what to do."""
    manager = SequenceManager(None, "p", 8, 64, ClientSettings(ban_base_seconds=30), model_name="m")
    servers = {"peer-a": record(0, 3, name="a"), "peer-b": record(3, 6, name="b"), "peer-c": record(6, 8, name="c")}
    manager._records = [{peer: rec for peer, rec in servers.items() if rec.start_block <= block < rec.end_block}
                        for block in range(8)]
    manager._updated_at = float("inf")  # the records above are current: no DHT read
    assert [span.peer_id for span in manager.make_route(0, 8)] == ["peer-a", "peer-b", "peer-c"]
    manager.ban("peer-b")
    with pytest.raises(MissingBlocksError) as error:
        manager.make_route(0, 8)
    message = str(error.value)
    assert message.startswith("blocks 3..5 of model 'm' are served only by b (blocks 3:6), which stopped answering")
    assert "banned by this client for up to 30 s more; wait for it to recover and retry, or start another server" in message
    assert "--blocks 3:6" in message and "not served by any usable online server" not in message
    records = [dict(records) for records in manager._records]
    for block in range(3, 6):  # b's record is missing from a read (its own DHT node, frozen with it, held it)
        manager._records[block] = {}
    assert str(pytest.raises(MissingBlocksError, manager.make_route, 0, 8).value) == message
    manager._records = records
    manager._records[6:] = [{}, {}]  # server c left: blocks 6..7 have no server at all
    message = str(pytest.raises(MissingBlocksError, manager.make_route, 0, 8).value)
    assert message.endswith("(blocks 6..7 are not served by any online server at all)")
    manager._bans.clear()
    with pytest.raises(MissingBlocksError, match="blocks 6..7 of model 'm' are not served by any usable online server"):
        manager.make_route(0, 8)


def test_format_ranges():
    assert format_ranges([1, 2, 3, 7, 9, 10]) == "1..3, 7, 9..10"


def test_ban_grows_and_filters_servers():
    manager = SequenceManager(None, "p", 8, 64, ClientSettings(ban_base_seconds=10, ban_max_seconds=25))
    rec = record(0, 8)
    assert manager.is_usable("x", rec)
    manager.ban("x")
    assert not manager.is_usable("x", rec)
    manager.ban("x")
    manager.ban("x")
    assert manager._bans["x"][1] == 3
    assert not manager.is_usable("x", record(0, 8, state=ServerState.JOINING))


def test_servers_of_another_codec_version_are_not_used():
    manager = SequenceManager(None, "p", 8, 64, ClientSettings())
    assert manager.is_usable("x", record(0, 8))
    assert not manager.is_usable("old", record(0, 8, codec_version=CODEC_VERSION - 1))
    assert not manager.is_usable("unknown", record(0, 8, codec_version=0))


def test_servers_lacking_a_required_protocol_feature_are_not_used(caplog):
    manager = SequenceManager(None, "p", 8, 64, ClientSettings())
    without_history = tuple(feature for feature in PROTOCOL_FEATURES if feature != "history")
    with caplog.at_level("WARNING"):
        assert not manager.is_usable("old", record(0, 8, features=without_history))
        assert not manager.is_usable("old", record(0, 8, features=without_history))
    assert [r.getMessage() for r in caplog.records if "history" in r.getMessage()] == [
        "Skipping server old: it does not announce the protocol features history (run the same bloombee version on both sides)"]
    assert not manager.is_usable("bare", record(0, 8, features=()))
    assert manager.is_usable("new", record(0, 8, features=REQUIRED_FEATURES))


def test_allowed_and_blocked_servers():
    manager = SequenceManager(None, "p", 8, 64, ClientSettings(), allowed_servers=["good"], blocked_servers=["bad"])
    assert manager.is_usable("peer1", record(0, 8, name="good"))
    assert not manager.is_usable("peer2", record(0, 8, name="other"))
    assert not manager.is_usable("bad", record(0, 8, name="good"))


def test_block_choice_takes_the_weakest_window():
    assert choose_start_block([5, 5, 5, 5, 0, 0, 0, 0], 4) == 4
    assert choose_start_block([0, 0, 0, 0, 0, 0, 0, 0], 4) == 0
    assert choose_start_block([9, 1, 9, 9, 9, 9], 2) in (0, 1)
    records = [{"a": record(0, 2, 3.0), "b": record(0, 2, 5.0, ServerState.OFFLINE)}, {"a": record(0, 2, 3.0)}]
    assert block_coverage(records) == [3.0, 3.0]
    assert block_coverage(records, exclude_peer="a") == [0.0, 0.0]


def test_rebalance_moves_only_when_it_helps_enough():
    assert should_move([10, 10, 0, 0], 0, 2, 10, 1.25) == 2
    assert should_move([10, 10, 10, 10], 0, 2, 10, 1.25) is None


def test_record_validation():
    with pytest.raises(ValidationError, match="end_block 2 must exceed start_block 4"):
        record(4, 2)
    with pytest.raises(ValidationError):
        ServerRecord.model_validate({"state": "online"})


def test_dht_records_round_trip_and_malformed_ones_are_ignored():
    dht = start_dht()
    other = start_dht(initial_peers=[str(maddr) for maddr in dht.get_visible_maddrs()])
    try:
        announce(dht, "model", record(0, 2, name="srv"), hivemind.utils.get_dht_time() + 30)
        other.store(block_key("model", 1), {"state": "online", "garbage": True}, hivemind.utils.get_dht_time() + 30, subkey="evil")
        per_block = fetch_records(other, "model", 3)
        assert [sorted(records) for records in per_block] == [[dht.peer_id.to_base58()], [dht.peer_id.to_base58()], []]
        assert per_block[0][dht.peer_id.to_base58()].public_name == "srv"
    finally:
        other.shutdown()
        dht.shutdown()


def test_a_record_is_announced_when_clients_would_route_differently_or_its_refresh_is_due():
    announced = record(0, 4).model_copy(update={"row_seconds": 1e-3, "busy_vectors": 4.0})
    assert why_announce(None, announced, 0.0) == "first announcement"
    assert why_announce(announced, announced, REFRESH_PERIODS - 0.1) is None
    assert why_announce(announced, announced, REFRESH_PERIODS) == "refresh"
    # measured figures wobble from forward to forward: announced again only when the predicted step time moves 10 %
    assert why_announce(announced, announced.model_copy(update={"busy_vectors": 4.5, "throughput": 99.0}), 1) is None
    assert why_announce(announced, announced.model_copy(update={"busy_vectors": 0.0}), 1).startswith("step time")
    assert why_announce(announced, announced.model_copy(update={"throughput": 80.0}), 1).startswith("step time")
    # the room clients route on, by more than 5 %; the free bytes move with it and are not compared themselves
    assert why_announce(announced, announced.model_copy(update={"cache_tokens_left": 960, "device_free_bytes": 7}), 1) is None
    assert why_announce(announced, announced.model_copy(update={"cache_tokens_left": 940}), 1) == (
        "cache room 1000 -> 940 tokens")
    assert why_announce(announced, announced.model_copy(update={"state": ServerState.OFFLINE}), 1) == "changed: state"
    assert why_announce(announced, announced.model_copy(update={"maddrs": ("/ip4/127.0.0.1/tcp/1",)}), 1) == (
        "changed: maddrs")


def test_nat_traversal_is_never_on_for_loopback():
    assert binds_only_loopback(["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"])
    assert not binds_only_loopback(["/ip4/0.0.0.0/tcp/0"])
    assert nat_traversal_enabled(["/ip4/127.0.0.1/tcp/0"], True) is False
    assert nat_traversal_enabled(["/ip4/0.0.0.0/tcp/0"], None) is True
    assert nat_traversal_enabled(["/ip4/0.0.0.0/tcp/0"], False) is False


def test_settings_from_env_then_flags(monkeypatch):
    monkeypatch.setenv("BLOOMBEE_MAX_LENGTH", "128")
    monkeypatch.setenv("BLOOMBEE_MAX_BATCH_SIZE", "3")
    settings = load_settings(ServerSettings, {"max_batch_size": 7, "cache_tokens": None})
    assert (settings.max_length, settings.max_batch_size, settings.cache_tokens) == (128, 7, ServerSettings().cache_tokens)
    monkeypatch.setenv("BLOOMBEE_MAX_LENGTH", "-1")
    with pytest.raises(ValidationError, match="max_length"):
        load_settings(ServerSettings)
