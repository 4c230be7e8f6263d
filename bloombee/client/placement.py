"""The live swarm as planner input: online servers' DHT records as planner nodes, with their current ranges."""

from collections import Counter
from typing import Any

from bloombee.dht.records import ServerRecord, ServerState


def _profiled(servers: dict[str, ServerRecord]) -> dict[str, ServerRecord]:
    return {peer_id: record for peer_id, record in servers.items()
            if record.state == ServerState.ONLINE and record.profile is not None}


def swarm_dtype(servers: dict[str, ServerRecord]) -> str:
    """The dtype most of the online servers with a profile announce (what the planner sizes weights, KV and hops by)."""
    return Counter(record.dtype for record in _profiled(servers).values()).most_common(1)[0][0]


def swarm_nodes(servers: dict[str, ServerRecord]) -> tuple[list[dict[str, Any]], list[tuple[str, int, int]]]:
    """Planner nodes of the online servers with a profile, in pipeline order, and their current ranges."""
    online = [(record.start_block, peer_id, record) for peer_id, record in _profiled(servers).items()]
    online.sort()
    nodes, ranges = [], []
    for _, peer_id, record in online:
        name = record.public_name or peer_id
        nodes.append(record.profile.node(name=name))
        ranges.append((name, record.start_block, record.end_block))
    return nodes, ranges
