"""Network environments: named presets E1-E6 (the paper's section 8 set-up) and custom ones.

An environment says how fast each node's uplink is towards each other node:

- unshaped (E1): no qdisc at all, the veth's own speed (gigabits per second here);
- uniform (E2-E5, ``custom:R``): every node's uplink is one ``tc tbf rate R``;
- matrix (E6, ``matrix:FILE``): per (sender site, receiver site) rates, shaped with htb classes
  and u32 destination filters on each sender's uplink. Nodes are placed on sites; two nodes on
  the same site talk unshaped (one LAN).

Nodes are named ``client``, ``s0``, ``s1``, ... in chain order; only uplinks are shaped (a node's
downlink is the sum of what the others may send it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# The paper's Table 3: measured bandwidths (Mbps) between its three E6 sites, sender -> receiver.
E6_SITES = ("California", "New Jersey", "Canada")
E6_RATES_MBPS = {
    "California": {"New Jersey": 347.0, "Canada": 305.0},
    "New Jersey": {"California": 312.0, "Canada": 577.0},
    "Canada": {"California": 280.0, "New Jersey": 643.0},
}


@dataclass(frozen=True)
class Environment:
    """How fast each uplink is. ``uplink_mbps`` for one rate everywhere; ``site_rates_mbps`` for a matrix."""

    name: str
    description: str
    uplink_mbps: float | None = None
    site_rates_mbps: Mapping[str, Mapping[str, float]] | None = None
    placement: tuple[str, ...] = ()  # matrix only: the client's site, then s0's, s1's, ... (cycled)
    paper: str = ""  # what the paper's environment of this name was

    def __post_init__(self) -> None:
        if self.uplink_mbps is not None and self.site_rates_mbps is not None:
            raise ValueError(f"environment {self.name}: give either one uplink rate or a site matrix, not both")
        if self.uplink_mbps is not None and not self.uplink_mbps > 0:
            raise ValueError(f"environment {self.name}: the uplink rate must be positive, got {self.uplink_mbps}")
        if self.site_rates_mbps is not None:
            if not self.placement:
                raise ValueError(f"environment {self.name}: a site matrix needs a placement (client's site, then the servers')")
            for src, row in self.site_rates_mbps.items():
                for dst, rate in row.items():
                    if not rate > 0:
                        raise ValueError(f"environment {self.name}: rate {src} -> {dst} must be positive, got {rate}")

    @property
    def kind(self) -> str:
        if self.site_rates_mbps is not None:
            return "matrix"
        return "unshaped" if self.uplink_mbps is None else "uniform"

    def sites(self, nodes: list[str]) -> dict[str, str]:
        """Node -> site: the client on placement[0], server i on placement[1 + i] (cycling over the servers' sites)."""
        if self.kind != "matrix":
            return {node: node for node in nodes}
        servers = self.placement[1:] or self.placement
        result = {}
        for node in nodes:
            result[node] = self.placement[0] if node == "client" else servers[server_index(node) % len(servers)]
        return result

    def rate_mbps(self, src: str, dst: str, nodes: list[str]) -> float | None:
        """The shaped rate from node `src` to node `dst` (Mbit/s), or None when unshaped."""
        if self.kind == "unshaped":
            return None
        if self.kind == "uniform":
            return self.uplink_mbps
        sites = self.sites(nodes)
        if sites[src] == sites[dst]:
            return None
        try:
            return float(self.site_rates_mbps[sites[src]][sites[dst]])
        except KeyError:
            raise ValueError(f"environment {self.name} has no rate from site {sites[src]!r} to {sites[dst]!r}") from None

    def pair_rates(self, nodes: list[str]) -> dict[tuple[str, str], float | None]:
        return {(src, dst): self.rate_mbps(src, dst, nodes) for src in nodes for dst in nodes if src != dst}

    def advertised_mbps(self, node: str, nodes: list[str], unshaped_mbps: float) -> float:
        """What a node tells the swarm its link is (--link-bandwidth-mbps): its slowest shaped uplink."""
        rates = [rate for (src, _), rate in self.pair_rates(nodes).items() if src == node and rate is not None]
        return min(rates) if rates else unshaped_mbps

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "description": self.description, "uplink_mbps": self.uplink_mbps,
                "site_rates_mbps": {k: dict(v) for k, v in self.site_rates_mbps.items()} if self.site_rates_mbps else None,
                "placement": list(self.placement), "paper": self.paper}


def server_index(node: str) -> int:
    match = re.fullmatch(r"s(\d+)", node)
    if not match:
        raise ValueError(f"server nodes are named s0, s1, ...; got {node!r}")
    return int(match.group(1))


def _uniform(name: str, mbps: float, paper: str) -> Environment:
    return Environment(name, f"every uplink {mbps:g} Mbit/s (tc tbf)", uplink_mbps=mbps, paper=paper)


PRESETS: dict[str, Environment] = {
    "E1": Environment("E1", "unshaped veth (no qdisc)", paper="one cluster, 45 Gbps Ethernet"),
    "E2": _uniform("E2", 500.0, "500 Mbps (+25 ms in the paper's latency figure)"),
    "E3": _uniform("E3", 250.0, "250 Mbps (+50 ms in the paper's latency figure)"),
    "E4": _uniform("E4", 125.0, "125 Mbps"),
    "E5": _uniform("E5", 20.0, "20 Mbps"),
    "E6": Environment("E6", "per-pair rates of the paper's Table 3 (htb + u32 per destination); "
                            "client and s0 in California, s1 New Jersey, s2 Canada",
                      site_rates_mbps=E6_RATES_MBPS, placement=("California",) + E6_SITES,
                      paper="A100 California + RTX 4090 New Jersey + RTX 4090 Canada, Table 3"),
}

RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(k|m|g)?(?:bit|bps)?$", re.IGNORECASE)
UNIT_MBPS = {None: 1.0, "k": 1e-3, "m": 1.0, "g": 1e3}


def parse_rate_mbps(text: str) -> float:
    """'20', '20mbit', '20Mbps', '1gbit', '500kbit' -> Mbit/s."""
    match = RATE.match(text.strip())
    if not match:
        raise ValueError(f"not a rate: {text!r} (use e.g. 20, 20mbit, 1gbit, 500kbit)")
    value = float(match.group(1)) * UNIT_MBPS[(match.group(2) or "").lower() or None]
    if value <= 0:
        raise ValueError(f"a rate must be positive, got {text!r}")
    return value


def load_matrix(path: str | Path) -> Environment:
    """A matrix environment from JSON or YAML: name, rates_mbps {sender site: {receiver site: Mbps}}, placement."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict) or "rates_mbps" not in data or "placement" not in data:
        raise ValueError(f"{path}: a matrix file needs 'rates_mbps' (sender site -> receiver site -> Mbps) and "
                         "'placement' (the client's site, then each server's)")
    rates = {str(src): {str(dst): float(rate) for dst, rate in row.items()} for src, row in data["rates_mbps"].items()}
    return Environment(str(data.get("name", path.stem)), str(data.get("description", f"per-pair rates from {path.name}")),
                       site_rates_mbps=rates, placement=tuple(str(site) for site in data["placement"]))


def parse_environment(text: str) -> Environment:
    """E1..E6, custom:RATE (or just RATE, e.g. 50mbit), unshaped, or matrix:FILE."""
    text = text.strip()
    if text.upper() in PRESETS:
        return PRESETS[text.upper()]
    if text.lower() == "unshaped":
        return PRESETS["E1"]
    if text.lower().startswith("matrix:"):
        return load_matrix(text.split(":", 1)[1])
    custom = text.lower().startswith("custom:")
    rate_text = text.split(":", 1)[1] if custom else text
    if not custom and not RATE.match(rate_text):
        raise ValueError(f"unknown environment {text!r}: use one of {', '.join(PRESETS)}, custom:RATE (e.g. custom:50mbit) "
                         "or matrix:FILE")
    mbps = parse_rate_mbps(rate_text)
    return _uniform(f"{mbps:g}Mbps", mbps, "custom")


def parse_environments(text: str) -> list[Environment]:
    """A comma-separated list; 'all' = E1..E6, 'uniform' = E1..E5."""
    result = []
    for part in (p for p in text.split(",") if p.strip()):
        if part.strip().lower() == "all":
            result.extend(PRESETS.values())
        elif part.strip().lower() == "uniform":
            result.extend(PRESETS[name] for name in ("E1", "E2", "E3", "E4", "E5"))
        else:
            result.append(parse_environment(part))
    if not result:
        raise ValueError("no environment given")
    names = [env.name for env in result]
    if len(set(names)) != len(names):
        raise ValueError(f"environment listed twice: {names}")
    return result


__all__ = [
    "E6_RATES_MBPS",
    "E6_SITES",
    "PRESETS",
    "Environment",
    "load_matrix",
    "parse_environment",
    "parse_environments",
    "parse_rate_mbps",
    "server_index",
]
