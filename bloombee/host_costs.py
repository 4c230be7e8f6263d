"""What moving messages costs this host, measured on it: the figures the model of the chain takes per process.

Two p2p daemons on loopback pass steps through a stream as a session's hops do (a step message with
its hidden states, packed and unpacked by `bloombee.protocol`, answered by an acknowledgement):
small steps give the CPU one message costs a process and its daemon at each end, and the latency of
a message beyond its bytes; large ones the rate at which the stack (the packing and the daemons)
moves bytes and the process's share of that work. Before them, the machine's idle time gives the cores
its other processes keep busy. Measured once per host (cached in
`BLOOMBEE_CACHE`), announced by each server in its profile and taken by the client for itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from bloombee.measure_cache import CACHE_DIR, cached
from bloombee.protocol import AckMessage, Hop, HopReport, StepHeader, StepMessage, pack, unpack

logger = logging.getLogger(__name__)

SMALL_BYTES, SMALL_ROUND_TRIPS = 16384, 30  # a decode step's hidden states
LARGE_BYTES, LARGE_ROUND_TRIPS = 1 << 20, 4  # a prompt's
ROUNDS = 5
WARMUP_ROUND_TRIPS = 20
IDLE_WINDOWS, IDLE_WINDOW_S = 5, 0.1
VERSION = 1  # part of the cache key: figures measured by an older method are measured again


@dataclass(frozen=True)
class HostCosts:
    """Per message at one end of a hop: the CPU it costs the process and its p2p daemon together (`message_ms`) and
    the daemon's share of that; the one-way latency beyond its bytes and CPU; the rate at which the stack moves
    bytes and the process's share of that work; the cores other processes kept busy."""

    message_ms: float
    daemon_share: float
    latency_ms: float
    stack_mbps: float
    interpreter_share: float
    busy_cores: float

    def cpu_fields(self) -> dict:
        """The planner `CpuShare` fields these figures fill."""
        return {key: value for key, value in asdict(self).items() if key != "latency_ms"}


@functools.cache
def host_costs(host: str) -> HostCosts:
    """This host's figures (measured the first time, then cached under its fingerprint `host`; read once per process,
    as the model of the chain asks for them at every step it scores)."""
    figures = cached(CACHE_DIR / "host_costs.json", f"{host}|v{VERSION}", lambda: asdict(measure_host_costs()))
    return HostCosts(**figures)


def measure_host_costs() -> HostCosts:
    """Measure (a few seconds, in a thread of its own so that it runs beside any event loop of the caller)."""
    busy = busy_cores(IDLE_WINDOWS, IDLE_WINDOW_S)
    result: list[HostCosts] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(_step_figures(busy)))
        except BaseException as error:  # re-raised in the caller's thread below
            failure.append(error)

    thread = threading.Thread(target=run, name="host-costs")
    thread.start()
    thread.join()
    if failure:
        raise RuntimeError("could not measure this host's messaging costs") from failure[0]
    logger.info("Host messaging costs: %s", result[0])
    return result[0]


def busy_cores(windows: int, seconds: float) -> float:
    """Cores of this machine (of those this process may use) that stay busy: the least busy of `windows` windows of
    `seconds` each, from /proc/stat (a steady load shows in every window, another process's burst not in all)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            values = [int(value) for value in stat.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # all jiffies, idle + iowait

    busiest_share = 1.0
    total, idle = sample()
    for _ in range(windows):
        time.sleep(seconds)
        total_after, idle_after = sample()
        busiest_share = min(busiest_share, 1.0 - (idle_after - idle) / max(total_after - total, 1))
        total, idle = total_after, idle_after
    return len(os.sched_getaffinity(0)) * max(busiest_share, 0.0)


async def _step_figures(busy: float) -> HostCosts:
    options = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "nat_port_map": False, "auto_nat": False, "use_relay": False}
    server = await P2P.create(**options)
    client = await P2P.create(initial_peers=await server.get_visible_maddrs(), **options)
    try:
        await server.add_protobuf_handler("steps", _answer, runtime_pb2.ExpertRequest, stream_input=True,
                                          stream_output=True)
        daemons = [server._child.pid, client._child.pid]  # noqa: SLF001: hivemind names no public handle for them
        await _round_trips(client, server, SMALL_BYTES, WARMUP_ROUND_TRIPS)
        smalls, larges = [], []
        for _ in range(ROUNDS):
            smalls.append(await _timed(client, server, daemons, SMALL_BYTES, SMALL_ROUND_TRIPS))
            larges.append(await _timed(client, server, daemons, LARGE_BYTES, LARGE_ROUND_TRIPS))
    finally:
        await client.shutdown()
        await server.shutdown()
    return _figures(smalls, larges, busy)


def _figures(smalls: list[tuple[float, ...]], larges: list[tuple[float, ...]], busy: float) -> HostCosts:
    """The figures from rounds of (wall, process CPU, daemons' CPU) seconds per small and per large message: wall
    times the median of the rounds (a busy moment spoils one round), CPU times the mean of all (the daemons' CPU
    is counted in clock ticks, too coarse for one round)."""
    wall_s = statistics.median(small[0] for small in smalls)
    moved_s = statistics.median(large[0] - small[0] for small, large in zip(smalls, larges))  # beyond a small one's
    process_s, daemon_s = (statistics.fmean(small[part] for small in smalls) for part in (1, 2))
    large_process_s, large_daemon_s = (statistics.fmean(large[part] for large in larges) for part in (1, 2))
    work_s = (large_process_s - process_s) + (large_daemon_s - daemon_s)
    return HostCosts(message_ms=(process_s + daemon_s) / 2 * 1e3, daemon_share=daemon_s / max(process_s + daemon_s, 1e-9),
                     latency_ms=max(wall_s - process_s - daemon_s, 0.0) * 1e3,
                     stack_mbps=(LARGE_BYTES - SMALL_BYTES) * 8 / max(moved_s, 1e-9) / 1e6,
                     interpreter_share=min(max((large_process_s - process_s) / max(work_s, 1e-9), 0.0), 1.0),
                     busy_cores=busy)


def _step(server_id: str, step_id: int) -> StepMessage:
    """A step as a client sends one into a chain of two servers: a route, and a report of the hop before."""
    route = (Hop(peer_id=server_id, session_id="probe", codecs=("raw",), link_bandwidth=1e6),)
    header = StepHeader(session_id="probe", step_id=step_id, start_position=step_id, route=route,
                        reports=(HopReport(peer_id=server_id, raw_bytes=SMALL_BYTES, compute_s=1e-3),))
    return StepMessage(step=header)


async def _answer(requests, context):
    """The server's end: unpack each step, acknowledge it, and send its hidden states on (as a step of its own)."""
    async for request in requests:
        message, tensors = unpack(request)
        if isinstance(message, StepMessage):
            yield pack(AckMessage(step_id=message.step.step_id))
            yield pack(message, tensors)


async def _timed(client: P2P, server: P2P, daemons: list[int], size: int, round_trips: int) -> tuple[float, ...]:
    """Per message of `size` bytes (two per round trip, each with its acknowledgement, through both ends): wall
    seconds, this process's CPU seconds, the two daemons' CPU seconds."""
    daemon_before, cpu_before, began = processes_cpu_s(daemons), time.process_time(), time.perf_counter()
    await _round_trips(client, server, size, round_trips)
    messages = 2 * round_trips
    return ((time.perf_counter() - began) / messages, (time.process_time() - cpu_before) / messages,
            (processes_cpu_s(daemons) - daemon_before) / messages)


async def _round_trips(client: P2P, server: P2P, size: int, count: int) -> None:
    """`count` steps of `size` bytes of hidden states sent and answered one after the other through one stream, each
    answer acknowledged."""
    answered: asyncio.Queue[StepMessage] = asyncio.Queue()
    hidden = torch.zeros(size // 2, dtype=torch.bfloat16)
    server_id = server.peer_id.to_base58()

    async def requests():
        for step_id in range(count):
            yield pack(_step(server_id, step_id), {"hidden_states": hidden})
            reply = await answered.get()
            yield pack(AckMessage(step_id=reply.step.step_id))

    async for response in await client.iterate_protobuf_handler(server.peer_id, "steps", requests(),
                                                                 runtime_pb2.ExpertRequest):
        message, _ = unpack(response)
        if isinstance(message, StepMessage):
            answered.put_nowait(message)


def processes_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes `pids` have used."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total
