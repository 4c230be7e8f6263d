"""The client's view of the swarm: who serves which blocks, which servers are banned, the best chain."""

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import hivemind

from bloombee.codec import CODEC_VERSION
from bloombee.dht.records import ServerRecord, ServerState, fetch_records
from bloombee.planner.chain import SpanFigures, activation_bytes
from bloombee.protocol import REQUIRED_FEATURES, Feature
from bloombee.settings import ClientSettings

logger = logging.getLogger(__name__)

NO_ROOM_SECONDS = 1000.0  # a server without room for the session is taken only where no other serves its blocks


class MissingBlocksError(RuntimeError):
    """Some blocks of the model are served by no usable server."""


@dataclass(frozen=True)
class Span:
    """One server of a chain and the blocks [start, end) the chain uses it for."""

    peer_id: str
    start: int
    end: int
    record: ServerRecord


def format_ranges(blocks: list[int]) -> str:
    """[1, 2, 3, 7] -> '1..3, 7'."""
    ranges, first = [], None
    for index, block in enumerate(blocks):
        if first is None:
            first = block
        if index + 1 == len(blocks) or blocks[index + 1] != block + 1:
            ranges.append(f"{first}..{block}" if block != first else str(block))
            first = None
    return ", ".join(ranges)


class SequenceManager:
    """Reads server records from the DHT, keeps bans with growing back-off, and picks chains of servers."""

    def __init__(self, dht: hivemind.DHT, prefix: str, num_blocks: int, hidden_size: int, settings: ClientSettings,
                 model_name: str = "", allowed_servers: list[str] | None = None, blocked_servers: list[str] | None = None):
        self.dht, self.prefix, self.num_blocks, self.hidden_size = dht, prefix, num_blocks, hidden_size
        self.settings, self.model_name = settings, model_name or prefix
        self.allowed_servers = set(allowed_servers) if allowed_servers else None
        self.blocked_servers = set(blocked_servers or ())
        self._records: list[dict[str, ServerRecord]] = [{} for _ in range(num_blocks)]
        self._updated_at = float("-inf")
        self._bans: dict[str, tuple[float, int]] = {}
        self._banned_records: dict[str, ServerRecord] = {}  # each banned server's record when it was banned
        self._incompatible: set[str] = set()  # servers skipped as incompatible, logged once
        self._held: dict[str, tuple[int, int]] = {}  # bytes this client's sessions took or gave back since the last read
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()  # one DHT read at a time; concurrent callers wait for it and reuse it
        self._route_lock = threading.Lock()  # one route chosen (and held) at a time

    def update(self, force: bool = False) -> None:
        """Refresh the records when they are older than update_period (or always when forced)."""
        requested = time.monotonic()
        with self._update_lock:
            fresh = self._updated_at >= requested if force else time.monotonic() - self._updated_at < self.settings.update_period
            if fresh:
                return
            try:
                records = fetch_records(self.dht, self.prefix, self.num_blocks)
            except OSError as error:  # the pipe to the DHT peer's process, closed once it shut down
                raise ConnectionError(f"cannot read the swarm: this client's DHT peer has stopped (closing a model "
                                      f"stops it): {error}") from error
            with self._lock:
                self._records, self._updated_at, self._held = records, time.monotonic(), {}

    def ban(self, peer_id: str) -> None:
        """Exclude a failing server for ban_base_seconds, doubling on each new failure."""
        with self._lock:
            _, failures = self._bans.get(peer_id, (0.0, 0))
            seconds = min(self.settings.ban_base_seconds * 2**failures, self.settings.ban_max_seconds)
            self._bans[peer_id] = (time.monotonic() + seconds, failures + 1)
            record = next((records[peer_id] for records in self._records if peer_id in records), None)
            if record is not None:
                self._banned_records[peer_id] = record
        logger.warning("Banned server %s for %.0f s", peer_id, seconds)

    def is_usable(self, peer_id: str, record: ServerRecord, at: float | None = None) -> bool:
        """Whether this client routes through the server, its ban judged as of `at` (monotonic; default now)."""
        return self.could_use(peer_id, record) and self.ban_left(peer_id, at) == 0

    def ban_left(self, peer_id: str, at: float | None = None) -> float:
        """Seconds from `at` (monotonic; default now) until this client's ban of `peer_id` ends (0: not banned)."""
        banned_until, _ = self._bans.get(peer_id, (0.0, 0))
        return max(banned_until - (time.monotonic() if at is None else at), 0.0)

    def could_use(self, peer_id: str, record: ServerRecord) -> bool:
        """Whether this client would route through the server were it not banned."""
        if record.state != ServerState.ONLINE or {peer_id, record.public_name} & self.blocked_servers:
            return False
        if record.quant_type not in self.settings.accepted_quant_types:
            return False
        if self.settings.active_adapter is not None and self.settings.active_adapter not in record.adapters:
            return False
        problem = incompatibility(record)
        if problem is not None:
            if peer_id not in self._incompatible:
                self._incompatible.add(peer_id)
                logger.warning("Skipping server %s: %s (run the same bloombee version on both sides)", peer_id, problem)
            return False
        return self.allowed_servers is None or peer_id in self.allowed_servers or record.public_name in self.allowed_servers

    def banned_servers(self) -> dict[str, tuple[ServerRecord, float]]:
        """Servers this client would use but banned: peer id -> (record, seconds of ban left). A frozen server's record
        can be missing from a read (its own DHT node held it): its record from when it was banned stands in."""
        with self._lock:
            current = {peer_id: record for records in self._records for peer_id, record in records.items()}
            records = {**self._banned_records, **current}
            return {peer_id: (record, self.ban_left(peer_id)) for peer_id, record in records.items()
                    if self.ban_left(peer_id) > 0 and self.could_use(peer_id, record)}

    def usable_servers(self, at: float | None = None) -> dict[str, ServerRecord]:
        """Usable servers' records, their free bytes net of what this client's sessions took since they were read."""
        with self._lock:
            return {peer_id: self._net_of_held(peer_id, record) for records in self._records
                    for peer_id, record in records.items() if self.is_usable(peer_id, record, at)}

    def hold(self, spans: list[Span], tokens: int, sign: int = 1) -> None:
        """Count a session of `tokens` tokens opened (sign 1) or closed (-1) on these spans' servers, so that
        sessions this client opens before the next read of the records spread over replicas."""
        with self._lock:
            for span in spans:
                need = session_need(span.record, tokens)
                if need is not None:
                    device, host = self._held.get(span.peer_id, (0, 0))
                    self._held[span.peer_id] = (device + sign * need[0], host + sign * need[1])

    def _net_of_held(self, peer_id: str, record: ServerRecord) -> ServerRecord:
        device, host = self._held.get(peer_id, (0, 0))
        if not device and not host:
            return record
        return record.model_copy(update={
            "device_free_bytes": min(max(record.device_free_bytes - device, 0), record.device_memory_bytes),
            "host_free_bytes": min(max(record.host_free_bytes - host, 0), record.host_memory_bytes)})

    def make_route(self, start: int = 0, end: int | None = None, tokens: int = 0,
                   features: tuple[Feature, ...] = ()) -> list[Span]:
        """The chain covering blocks [start, end) with the least estimated step time for a session of `tokens`
        (batch x max_length) tokens, through servers announcing `features`, held for it until
        `hold(chain, tokens, -1)`; refreshes once if needed. Bans are judged as of the call: a DHT read slowed by a
        frozen peer does not outlast the ban of that peer."""
        end = self.num_blocks if end is None else end
        asked = time.monotonic()
        self.update()
        try:
            return self._route_and_hold(start, end, tokens, asked, features)
        except MissingBlocksError:
            self.update(force=True)
        try:
            return self._route_and_hold(start, end, tokens, asked, features)
        except MissingBlocksError as error:
            raise MissingBlocksError(self._explain_missing(start, end) or str(error)) from None

    def _explain_missing(self, start: int, end: int) -> str | None:
        """Why blocks of [start, end) have no usable server when servers this client banned, or servers in a precision
        it does not accept, hold them."""
        usable = self.usable_servers().values()
        missing = [block for block in range(start, end) if not any(r.start_block <= block < r.end_block for r in usable)]
        return (banned_blocks_message(missing, self.banned_servers(), self.model_name)
                or self._unaccepted_message(missing))

    def _unaccepted_message(self, missing: list[int]) -> str | None:
        """The explanation when only servers in a precision this client does not accept hold `missing` blocks."""
        with self._lock:
            precisions = sorted({record.quant_type for block in missing for record in self._records[block].values()
                                 if record.state == ServerState.ONLINE
                                 and record.quant_type not in self.settings.accepted_quant_types})
        if not precisions:
            return None
        return (f"blocks {format_ranges(missing)} of model {self.model_name!r} are served only by servers whose weights "
                f"are {' or '.join(precisions)}, and this client accepts {self.settings.quant_types} (quant_types); "
                f"accept {', '.join(precisions)} too, or start a server with --quant-type "
                f"{self.settings.accepted_quant_types[0]} for them")

    def _route_and_hold(self, start: int, end: int, tokens: int, asked: float,
                        features: tuple[Feature, ...]) -> list[Span]:
        """The best chain, counted as held at once: concurrent sessions of this client see each other's choice."""
        with self._route_lock:
            servers = {peer_id: record for peer_id, record in self.usable_servers(asked).items()
                       if set(features) <= set(record.features)}
            chain = best_chain(servers, start, end, self.span_cost(tokens), self.model_name)
            self.hold(chain, tokens)
            return chain

    def span_cost(self, tokens: int) -> Callable[[ServerRecord, int], float]:
        """The cost of a span for a session of `tokens` tokens: its step time and how full it would leave the server."""
        return lambda record, num_blocks: self.hop_cost(record, num_blocks) + self.memory_cost(record, tokens)

    def hop_cost(self, record: ServerRecord, num_blocks: int) -> float:
        """Estimated seconds of one decode step through `num_blocks` blocks of this server, hop included."""
        return span_figures(record, num_blocks, self.hidden_size).seconds(1, self.settings.hop_penalty_seconds)

    def memory_cost(self, record: ServerRecord, tokens: int) -> float:
        """Seconds added to a server by how full a session of `tokens` tokens would leave it: up to one hop penalty
        as its memory fills (sessions spread over replicas), NO_ROOM_SECONDS where the session would wait."""
        need = session_need(record, tokens)
        if need is None:
            return 0.0
        free_device, free_host = record.device_free_bytes - need[0], record.host_free_bytes - need[1]
        if free_device < 0 or free_host < 0:
            return NO_ROOM_SECONDS
        filled = 1.0 - free_device / record.device_memory_bytes if record.device_memory_bytes else 0.0
        return self.settings.hop_penalty_seconds * filled


def span_figures(record: ServerRecord, blocks: int, hidden_size: int) -> SpanFigures:
    """What the model of the chain takes from a server's record for a span of `blocks` of its blocks."""
    return SpanFigures(blocks, record.throughput, record.link_bandwidth, activation_bytes(hidden_size, record.dtype),
                       record.row_seconds, record.busy_vectors)


def session_need(record: ServerRecord, tokens: int) -> tuple[int, int] | None:
    """(device, host) bytes a session of `tokens` tokens over all of the server's blocks would take, from its
    announced bytes per token (a span over fewer blocks takes less: counting them all keeps a chain from splitting
    one server into several spans to squeeze in); None where it announces none."""
    if not record.device_bytes_per_token and not record.host_bytes_per_token:
        return None
    return tokens * record.device_bytes_per_token, tokens * record.host_bytes_per_token


def incompatibility(record: ServerRecord) -> str | None:
    """Why this client cannot use a server (codec version, protocol features it lacks), or None."""
    if record.codec_version != CODEC_VERSION:
        return f"it speaks codec frame version {record.codec_version}, this client {CODEC_VERSION}"
    missing = [feature for feature in REQUIRED_FEATURES if feature not in record.features]
    if missing:
        return f"it does not announce the protocol features {', '.join(missing)}"
    return None


def best_chain(servers: dict[str, ServerRecord], start: int, end: int,
               hop_cost: Callable[[ServerRecord, int], float], model_name: str = "the model") -> list[Span]:
    """Cheapest chain of spans covering [start, end): a shortest path over block boundaries."""
    best: dict[int, tuple[float, Span | None]] = {start: (0.0, None)}
    for position in range(start, end):
        if position not in best:
            continue
        cost_here = best[position][0]
        for peer_id, record in servers.items():
            if not record.start_block <= position < record.end_block:
                continue
            for stop in range(position + 1, min(record.end_block, end) + 1):
                cost = cost_here + hop_cost(record, stop - position)
                if stop not in best or cost < best[stop][0]:
                    best[stop] = (cost, Span(peer_id, position, stop, record))
    if end not in best:
        raise MissingBlocksError(missing_blocks_message(servers, start, end, model_name))
    chain, position = [], end
    while position != start:
        span = best[position][1]
        chain.append(span)
        position = span.start
    return chain[::-1]


def missing_blocks_message(servers: dict[str, ServerRecord], start: int, end: int, model_name: str) -> str:
    missing = [block for block in range(start, end)
               if not any(record.start_block <= block < record.end_block for record in servers.values())]
    missing = missing or list(range(start, end))
    first, last = missing[0], missing[-1]
    return (f"blocks {format_ranges(missing)} of model {model_name!r} are not served by any usable online server; "
            f"start a server for them, e.g. `bloombee-server --model {model_name} --blocks {first}:{last + 1} "
            f"--initial-peers ...`")


def banned_blocks_message(missing: list[int], banned: dict[str, tuple[ServerRecord, float]], model_name: str) -> str | None:
    """The explanation when servers this client banned (failed or stopped answering: `banned` maps peer id to its
    record and the seconds of ban left) hold some of the `missing` blocks, or None when none of them does."""
    holders = {peer_id: (record, left) for peer_id, (record, left) in banned.items()
               if any(record.start_block <= block < record.end_block for block in missing)}
    if not holders:
        return None
    names = ", ".join(f"{record.public_name or peer_id} (blocks {record.start_block}:{record.end_block})"
                      for peer_id, (record, _) in sorted(holders.items()))
    held = [block for block in missing if any(r.start_block <= block < r.end_block for r, _ in holders.values())]
    nobody = [block for block in missing if block not in held]
    longest = max(left for _, left in holders.values())
    message = (f"blocks {format_ranges(held)} of model {model_name!r} are served only by {names}, which stopped "
               f"answering (failed or timed out) and {'is' if len(holders) == 1 else 'are'} banned by this client for "
               f"up to {longest:.0f} s more; wait for {'it' if len(holders) == 1 else 'them'} to recover and retry, "
               f"or start another server for those blocks: `bloombee-server --model {model_name} --blocks "
               f"{held[0]}:{held[-1] + 1} --initial-peers ...`")
    if nobody:
        message += f" (blocks {format_ranges(nobody)} are not served by any online server at all)"
    return message
