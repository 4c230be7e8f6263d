"""Network namespaces, veth pairs, qdiscs and interface counters for one benchmark swarm.

Layout (every name carries the owner's pid, so runs never collide and leftovers can be found):

    bbnb<pid>-hub      bridge br0 10.77.0.1/24 (the bootstrap DHT peer listens here)
      h-client <-veth-> eth0 in bbnb<pid>-client   10.77.0.10
      h-s0     <-veth-> eth0 in bbnb<pid>-s0       10.77.0.11
      ...

Every veth is created inside the hub namespace and its peer moved straight into its node's
namespace, so nothing is ever added to, or read from, the namespace the harness runs in. Only
each node's uplink (its eth0 egress) is shaped. Counters are read on the hub side (one call):
the hub port's rx is its node's tx.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Self

from benchmarks.netbench.presets import Environment

logger = logging.getLogger(__name__)

PREFIX = "bbnb"
NAME = re.compile(rf"^{PREFIX}(\d+)-([A-Za-z0-9_.]+)$")
SUBNET = "10.77.0"
HUB_IP = f"{SUBNET}.1"
MTU_FRAME = 1514  # bytes a full-size TCP segment occupies on a veth (Ethernet + IP + TCP headers + 1448 payload)
DEFAULT_CLASS_RATE = "10gbit"  # htb class for unshaped destinations (same site, the hub): far above anything measured


class NetnsError(RuntimeError):
    pass


def run(argv: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}")
    return result


def list_namespaces() -> list[str]:
    result = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def harness_namespaces(owner: int | None = None) -> list[str]:
    """Namespaces this harness created (all owners, or one owner's)."""
    names = []
    for name in list_namespaces():
        match = NAME.match(name)
        if match and (owner is None or int(match.group(1)) == owner):
            names.append(name)
    return names


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(namespace: str) -> list[int]:
    result = run(["ip", "netns", "pids", namespace], check=False)
    return [int(line) for line in result.stdout.split() if line.strip().isdigit()]


def kill_namespace_processes(namespace: str, grace: float = 5.0) -> list[int]:
    """SIGTERM every process inside `namespace` (all of them were started by this harness), then SIGKILL."""
    pids = namespace_pids(namespace)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and namespace_pids(namespace):
        time.sleep(0.1)
    for pid in namespace_pids(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and namespace_pids(namespace):
        time.sleep(0.1)
    return pids


def delete_namespace(namespace: str) -> None:
    kill_namespace_processes(namespace)
    run(["ip", "netns", "delete", namespace], check=False)


def cleanup_stale(include_live: bool = False) -> list[str]:
    """Delete namespaces left by harness runs whose owner process is gone (or all of them)."""
    removed = []
    for name in harness_namespaces():
        owner = int(NAME.match(name).group(1))
        if include_live or not pid_alive(owner):
            delete_namespace(name)
            removed.append(name)
    return removed


# ---------------------------------------------------------------------------------- shaping (pure)


def tbf_burst_bytes(rate_mbps: float) -> int:
    """Bucket size: 0.2 ms at the rate, at least 4 KiB (a few frames). Small, so that even a 32 KB
    activation is paced at the rate instead of leaving in one burst (measured: 4 KiB reaches the
    same throughput as 64 KiB at 20-500 Mbit/s here)."""
    return max(4096, int(rate_mbps * 1e6 / 8 * 200e-6))


def queue_limit_bytes(rate_mbps: float) -> int:
    """A queue long enough that TCP never loses a packet at the shaper (4 MiB, or 0.5 s at the rate)."""
    return max(4 << 20, int(rate_mbps * 1e6 / 8 * 0.5))


def rate_arg(rate_mbps: float) -> str:
    return f"{rate_mbps * 1000:.0f}kbit"


def shaping_commands(env: Environment, nodes: list[str], ips: dict[str, str], dev: str = "eth0") -> dict[str, list[list[str]]]:
    """The `tc` argv (without `-n NAMESPACE`) that shape each node's uplink for `env`.

    unshaped: remove the root qdisc; uniform: one tbf; matrix: htb, one class per shaped
    destination with a u32 filter on the destination address, everything else in a fast default class.
    """
    commands: dict[str, list[list[str]]] = {}
    for node in nodes:
        reset = ["tc", "qdisc", "del", "dev", dev, "root"]
        if env.kind == "unshaped":
            commands[node] = [reset]
        elif env.kind == "uniform":
            rate = env.uplink_mbps
            commands[node] = [reset, ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate_arg(rate),
                                      "burst", str(tbf_burst_bytes(rate)), "limit", str(queue_limit_bytes(rate))]]
        else:
            cmds = [reset, ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "999"],
                    ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:999", "htb", "rate", DEFAULT_CLASS_RATE,
                     "burst", "1000000", "cburst", "1000000", "quantum", "200000"]]
            for index, dst in enumerate(other for other in nodes if other != node):
                rate = env.rate_mbps(node, dst, nodes)
                if rate is None:
                    continue
                classid = f"1:{10 + index}"
                burst = str(tbf_burst_bytes(rate))
                cmds.append(["tc", "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb", "rate", rate_arg(rate),
                             "ceil", rate_arg(rate), "burst", burst, "cburst", burst, "quantum", str(MTU_FRAME)])
                cmds.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                             "match", "ip", "dst", f"{ips[dst]}/32", "flowid", classid])
            commands[node] = cmds
    return commands


# ---------------------------------------------------------------------------------- the topology


@dataclass
class Topology:
    """The namespaces of one swarm; `create()` builds them, `destroy()` removes them and their processes."""

    nodes: list[str]
    owner: int = field(default_factory=os.getpid)
    created: bool = False
    shaping_log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if "hub" in self.nodes or len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"node names must be unique and not 'hub': {self.nodes}")
        if len(self.nodes) > 200:
            raise ValueError("at most 200 nodes fit the /24")
        self.ips = {node: f"{SUBNET}.{10 + index}" for index, node in enumerate(self.nodes)}
        self.ips["hub"] = HUB_IP

    def ns(self, node: str) -> str:
        return f"{PREFIX}{self.owner}-{node}"

    @property
    def hub(self) -> str:
        return self.ns("hub")

    @staticmethod
    def hub_port(node: str) -> str:
        return f"h-{node}"[:15]

    def _ip(self, namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run(["ip", "-n", namespace, *args], check=check)

    def create(self) -> None:
        self.created = True  # from here on, destroy() has something to do even if a step below fails
        run(["ip", "netns", "add", self.hub])
        self._ip(self.hub, "link", "set", "lo", "up")
        self._ip(self.hub, "link", "add", "br0", "type", "bridge")
        self._ip(self.hub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
        self._ip(self.hub, "link", "set", "br0", "up")
        self._quiet_ipv6(self.hub)
        for node in self.nodes:
            namespace = self.ns(node)
            run(["ip", "netns", "add", namespace])
            self._quiet_ipv6(namespace)
            self._ip(namespace, "link", "set", "lo", "up")
            port = self.hub_port(node)
            self._ip(self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            self._ip(self.hub, "link", "set", port, "master", "br0")
            self._ip(self.hub, "link", "set", port, "up")
            self._ip(namespace, "addr", "add", f"{self.ips[node]}/24", "dev", "eth0")
            self._ip(namespace, "link", "set", "eth0", "up")

    @staticmethod
    def _quiet_ipv6(namespace: str) -> None:
        """No IPv6 (no router solicitations or DAD packets on the counters); sysctls are per namespace."""
        run(["ip", "netns", "exec", namespace, "sh", "-c",
             "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"],
            check=False)

    def apply(self, env: Environment) -> list[str]:
        """Shape every uplink for `env`; returns the commands run (as text, for the run's JSON)."""
        applied = []
        for node, commands in shaping_commands(env, self.nodes, self.ips).items():
            for argv in commands:
                full = [argv[0], "-n", self.ns(node), *argv[1:]]
                is_reset = argv[1:3] == ["qdisc", "del"]
                result = run(full, check=not is_reset)
                if not is_reset:
                    applied.append(" ".join(full))
                if result.stderr.strip() and not is_reset:
                    logger.debug("%s: %s", " ".join(full), result.stderr.strip())
        self.shaping_log = applied
        return applied

    def counters(self) -> dict[str, dict[str, int]]:
        """Per node: bytes and packets it sent (tx) and received (rx), read on the hub side of its veth."""
        links = json.loads(self._ip(self.hub, "-s", "-j", "link", "show").stdout or "[]")
        by_port = {link["ifname"]: link["stats64"] for link in links if "stats64" in link}
        result = {}
        for node in self.nodes:
            stats = by_port[self.hub_port(node)]
            result[node] = {"tx_bytes": stats["rx"]["bytes"], "tx_packets": stats["rx"]["packets"],
                            "rx_bytes": stats["tx"]["bytes"], "rx_packets": stats["tx"]["packets"],
                            "tx_dropped": stats["rx"].get("dropped", 0)}
        return result

    def qdisc_stats(self) -> dict[str, list[dict]]:
        """`tc -s qdisc` of each uplink (sent bytes, drops, overlimits)."""
        result = {}
        for node in self.nodes:
            out = run(["tc", "-n", self.ns(node), "-s", "-j", "qdisc", "show", "dev", "eth0"], check=False).stdout
            try:
                result[node] = [{key: q.get(key) for key in ("kind", "bytes", "packets", "drops", "overlimits", "requeues")}
                                for q in json.loads(out or "[]")]
            except json.JSONDecodeError:
                result[node] = []
        return result

    def exec_argv(self, node: str, argv: list[str]) -> list[str]:
        namespace = self.hub if node == "hub" else self.ns(node)
        return ["ip", "netns", "exec", namespace, *argv]

    def namespaces(self) -> list[str]:
        return [self.hub] + [self.ns(node) for node in self.nodes]

    def destroy(self) -> list[str]:
        """Kill whatever still runs inside, delete every namespace (their veths go with them); returns leftovers."""
        for namespace in reversed(self.namespaces()):
            if namespace in list_namespaces():
                delete_namespace(namespace)
        leftovers = harness_namespaces(self.owner)
        leftovers = [name for name in leftovers if name in self.namespaces()]
        if leftovers:
            logger.error("namespaces left behind: %s", leftovers)
        self.created = False
        return leftovers

    def __enter__(self) -> Self:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()
