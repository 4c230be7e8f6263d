"""Which blocks each server hosts: an even split, an explicit list, or a plan file.

Plan files (JSON or YAML) may be
- ``{"servers": [{"blocks": "0:3"}, {"blocks": [3, 8]}]}`` or ``{"blocks": ["0:3", "3:8"]}`` or a bare list;
- the output of ``bloombee-plan --json`` (its ``plan.assignment``: blocks per node in pipeline
  order; nodes with no blocks are dropped).
The ranges must tile [0, num_blocks) in order: server i+1 starts where server i ends.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

Range = tuple[int, int]


def parse_range(text: Any) -> Range:
    if isinstance(text, (list, tuple)) and len(text) == 2:
        start, end = int(text[0]), int(text[1])
    else:
        try:
            start, end = (int(part) for part in str(text).split(":"))
        except ValueError:
            raise ValueError(f"a block range is START:END (END exclusive), e.g. 0:4; got {text!r}") from None
    if not 0 <= start < end:
        raise ValueError(f"block range {start}:{end} is empty or negative")
    return start, end


def parse_blocks(text: str) -> list[Range]:
    """'0:3,3:6,6:8' -> [(0, 3), (3, 6), (6, 8)]."""
    return [parse_range(part) for part in text.split(",") if part.strip()]


def even_split(num_blocks: int, servers: int) -> list[Range]:
    if not 1 <= servers <= num_blocks:
        raise ValueError(f"cannot split {num_blocks} blocks over {servers} servers (need 1..{num_blocks})")
    bounds = [round(index * num_blocks / servers) for index in range(servers + 1)]
    return list(itertools.pairwise(bounds))


def from_assignment(assignment: list[int]) -> list[Range]:
    ranges, start = [], 0
    for count in assignment:
        if count < 0:
            raise ValueError(f"a plan assigns a negative number of blocks: {assignment}")
        if count:
            ranges.append((start, start + count))
            start += count
    return ranges


def load_plan(path: str | Path) -> list[Range]:
    path = Path(path)
    text = path.read_text()
    data = __import__("yaml").safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    if isinstance(data, dict) and isinstance(data.get("plan"), dict) and "assignment" in data["plan"]:
        return from_assignment([int(count) for count in data["plan"]["assignment"]])
    if isinstance(data, dict) and "assignment" in data:
        return from_assignment([int(count) for count in data["assignment"]])
    if isinstance(data, dict) and "servers" in data:
        return [parse_range(server["blocks"] if isinstance(server, dict) else server) for server in data["servers"]]
    if isinstance(data, dict) and "blocks" in data:
        return [parse_range(item) for item in data["blocks"]]
    if isinstance(data, list):
        return [parse_range(item["blocks"] if isinstance(item, dict) else item) for item in data]
    raise ValueError(f"{path}: no block ranges found (expected 'servers', 'blocks', a list, or bloombee-plan --json output)")


def check_tiling(ranges: list[Range], num_blocks: int) -> list[Range]:
    """The ranges, if they cover [0, num_blocks) in order without gaps or overlaps."""
    if not ranges:
        raise ValueError("no servers")
    expected = 0
    for start, end in ranges:
        if start != expected:
            raise ValueError(f"server ranges must tile the model in order: {ranges} has a gap or overlap at block {expected}")
        expected = end
    if expected != num_blocks:
        raise ValueError(f"server ranges {ranges} end at block {expected}, the model has {num_blocks} blocks")
    return ranges


def resolve_plan(num_blocks: int, servers: int | None = None, blocks: str | None = None, plan_file: str | None = None) -> list[Range]:
    """Exactly one of blocks / plan_file / servers (default 3) decides the ranges."""
    if blocks and plan_file:
        raise ValueError("give --blocks or --plan, not both")
    if blocks:
        ranges = parse_blocks(blocks)
    elif plan_file:
        ranges = load_plan(plan_file)
    else:
        ranges = even_split(num_blocks, servers or 3)
    return check_tiling(ranges, num_blocks)
