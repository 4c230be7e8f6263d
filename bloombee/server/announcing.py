"""When a server's record needs announcing: what clients route on moved, or the record is due for its refresh.

Each announcement stores a signed record under every hosted block's key, which costs the server's DHT process and
every DHT node that stores it tens of milliseconds of CPU; on a busy host that stalls every session's step at once
(benchmarks/README.md). So a server checks its record every --announce-period and announces it only when a client
would route differently on it, or when REFRESH_PERIODS periods have passed since the last announcement. A record
still lives EXPIRY_PERIODS periods: the records of a server that died without announcing its end go that soon (a
client that routes through one loses time finding the server gone).
"""

from bloombee.dht.records import ServerRecord
from bloombee.planner.chain import block_forward_seconds

REFRESH_PERIODS = 2  # announce periods after which an unchanged record is announced again
EXPIRY_PERIODS = 3  # announce periods an announced record lives
ROOM_CHANGE = 0.05  # share of the cache room announced last by which the room must move to be announced early
STEP_TIME_CHANGE = 0.1  # share by which the predicted forward time of a step must move to be announced early
_ROOM = {"cache_tokens_left", "device_free_bytes", "host_free_bytes"}  # move as sessions open and close
_MEASURED = {"throughput", "row_seconds", "busy_vectors"}  # move with every forward served


def room_moved(announced_room: int, room: int) -> bool:
    """Whether the cache room `room` (tokens) moved by more than ROOM_CHANGE from the `announced_room`."""
    return abs(room - announced_room) > ROOM_CHANGE * announced_room


def step_seconds(record: ServerRecord) -> float:
    """The model of the chain's forward time of a one-vector step through one of the record's blocks, under its
    announced load."""
    return block_forward_seconds(record.throughput, record.row_seconds, 1, record.busy_vectors)


def why_announce(announced: ServerRecord | None, record: ServerRecord, periods_since: float) -> str | None:
    """Why `record` should be announced now, `periods_since` announce periods after `announced` (None: never
    announced); None when clients would route on it as on `announced` and its refresh is not due."""
    if announced is None:
        return "first announcement"
    if periods_since >= REFRESH_PERIODS:
        return "refresh"
    changed = [name for name in ServerRecord.model_fields
               if name not in _ROOM | _MEASURED and getattr(announced, name) != getattr(record, name)]
    if changed:
        return f"changed: {', '.join(changed)}"
    if room_moved(announced.cache_tokens_left, record.cache_tokens_left):
        return f"cache room {announced.cache_tokens_left} -> {record.cache_tokens_left} tokens"
    before, now = step_seconds(announced), step_seconds(record)
    if abs(now - before) > STEP_TIME_CHANGE * before:
        return f"step time {1e3 * before:.3f} -> {1e3 * now:.3f} ms a block"
    return None
