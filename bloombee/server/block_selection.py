"""Where a server without --blocks should serve: the window of blocks the swarm covers worst."""

from bloombee.dht.records import ServerRecord, ServerState


def block_coverage(records_per_block: list[dict[str, ServerRecord]], exclude_peer: str | None = None) -> list[float]:
    """Announced throughput serving each block, summed over online (and joining) servers."""
    coverage = []
    for records in records_per_block:
        coverage.append(sum(
            record.throughput for peer_id, record in records.items()
            if peer_id != exclude_peer and record.state != ServerState.OFFLINE
        ))
    return coverage


def choose_start_block(coverage: list[float], num_blocks: int) -> int:
    """Start of the window of `num_blocks` blocks whose weakest block is weakest (ties: least total, then lowest)."""
    num_blocks = min(num_blocks, len(coverage))
    windows = range(len(coverage) - num_blocks + 1)
    return min(windows, key=lambda start: (min(coverage[start:start + num_blocks]), sum(coverage[start:start + num_blocks]), start))


def should_move(coverage_without_me: list[float], my_start: int, my_end: int, my_throughput: float, balance_quality: float) -> int | None:
    """The start to move to when that raises the swarm's weakest block by `balance_quality`x, else None."""
    num_blocks = my_end - my_start
    current = list(coverage_without_me)
    for block in range(my_start, my_end):
        current[block] += my_throughput
    best_start = choose_start_block(coverage_without_me, num_blocks)
    if best_start == my_start:
        return None
    moved = list(coverage_without_me)
    for block in range(best_start, best_start + num_blocks):
        moved[block] += my_throughput
    if min(moved) > balance_quality * min(current):
        return best_start
    return None
