"""What the swarm looks like for one model: each block's servers, the blocks nobody serves, whether a chain exists."""

from pydantic import BaseModel

from bloombee.client.routing import MissingBlocksError, best_chain, format_ranges, incompatibility, span_figures
from bloombee.dht.records import ServerRecord, ServerState, fetch_records
from bloombee.planner.report import size_text
from bloombee.settings import ClientSettings


class ServerStatus(BaseModel):
    """One server as the DHT shows it, with why this client could not use it (if it could not)."""

    peer_id: str
    public_name: str
    state: str
    start_block: int
    end_block: int
    throughput: float
    cache_tokens_left: int
    offload: float
    link_mbps: float
    version: str
    features: list[str]
    dtype: str
    quant_type: str = "none"
    weight_bytes: int = 0
    device: str
    problem: str | None = None

    @classmethod
    def of(cls, peer_id: str, record: ServerRecord) -> "ServerStatus":
        return cls(peer_id=peer_id, public_name=record.public_name, state=record.state.value, start_block=record.start_block,
                   end_block=record.end_block, throughput=record.throughput, cache_tokens_left=record.cache_tokens_left,
                   offload=record.offload, link_mbps=record.link_bandwidth * 8 / 1e6, version=record.version, features=list(record.features),
                   dtype=record.dtype, quant_type=record.quant_type, weight_bytes=record.weight_bytes,
                   device=record.device, problem=incompatibility(record))

    @property
    def label(self) -> str:
        return self.public_name or self.peer_id[-8:]

    @property
    def weights_text(self) -> str:
        """E.g. 'nf4 1.20 GiB': the precision of the weights and their bytes on the device."""
        return f"{self.quant_type} {size_text(self.weight_bytes)}"


class ModelStatus(BaseModel):
    """The swarm's view of one model."""

    model: str
    prefix: str
    num_blocks: int
    servers: list[ServerStatus]
    uncovered: list[int]  # blocks no usable online server holds
    full_chain: bool
    chain: list[str]  # the labels of the chain a client would route through now, in block order

    @property
    def uncovered_text(self) -> str:
        return format_ranges(self.uncovered)

    def servers_per_block(self) -> list[int]:
        """How many usable online servers hold each block."""
        return [sum(1 for server in self.servers if usable(server) and server.start_block <= block < server.end_block)
                for block in range(self.num_blocks)]


def usable(server: ServerStatus) -> bool:
    return server.state == ServerState.ONLINE.value and server.problem is None


def announced_cost(record: ServerRecord, blocks: int) -> float:
    """A span's announced step time at a client's default hop penalty (the status view knows no hidden size, so
    only hops and compute count)."""
    return span_figures(record, blocks, 0).seconds(1, ClientSettings().hop_penalty_seconds)


def model_status(dht, model: str, prefix: str, num_blocks: int) -> ModelStatus:
    """Read every block's records of `prefix` from the DHT and summarise them."""
    records: dict[str, ServerRecord] = {}
    for block_records in fetch_records(dht, prefix, num_blocks):
        records.update(block_records)
    servers = sorted((ServerStatus.of(peer_id, record) for peer_id, record in records.items()),
                     key=lambda server: (server.start_block, server.end_block, server.label))
    online = {server.peer_id: records[server.peer_id] for server in servers if usable(server)}
    uncovered = [block for block in range(num_blocks)
                 if not any(record.start_block <= block < record.end_block for record in online.values())]
    try:
        spans = best_chain(online, 0, num_blocks, announced_cost, model)
    except MissingBlocksError:
        spans = []
    chain = [f"{span.record.public_name or span.peer_id[-8:]}[{span.start}:{span.end}]" for span in spans]
    return ModelStatus(model=model, prefix=prefix, num_blocks=num_blocks, servers=servers, uncovered=uncovered,
                       full_chain=bool(spans), chain=chain)


def status_lines(status: ModelStatus) -> list[str]:
    """The status as text for a terminal, one line per server."""
    lines = [f"{status.model} ({status.prefix}): {status.num_blocks} blocks, {len(status.servers)} servers, "
             + (f"full chain: {' -> '.join(status.chain)}" if status.full_chain else "NO full chain")]
    lines.append(f"  {'server':14} {'blocks':>7}  {'state':8} {'block-steps/s':>13} {'weights':>15} {'free cache tokens':>17} "
                 f"{'offload':>7} {'link':>10}  {'version':8} features")
    for server in status.servers:
        note = f"  [skipped: {server.problem}]" if server.problem else ""
        lines.append(f"  {server.label:14} {server.start_block:>3}:{server.end_block:<3}  {server.state:8} "
                     f"{server.throughput:13.1f} {server.weights_text:>15} {server.cache_tokens_left:17d} {server.offload:7.2f} {server.link_mbps:6.0f} Mb/s  "
                     f"{server.version:8} {','.join(server.features)}{note}")
    lines.append("  servers per block: " + " ".join(map(str, status.servers_per_block())))
    if status.uncovered:
        lines.append(f"  blocks served by nobody: {status.uncovered_text} -- start a server for them "
                     f"(bloombee-server --model {status.model} --blocks {status.uncovered[0]}:{status.uncovered[-1] + 1} ...)")
    return lines
