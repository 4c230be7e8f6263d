"""This process's machine as the planner sees it: a fingerprint shared by every process on the host, its cores and
what messages cost it (measured: `bloombee.host_costs`)."""

import hashlib
import os
import socket
from pathlib import Path

from bloombee.host_costs import host_costs


def host_fingerprint() -> str:
    """The same for every process on this machine (across network namespaces), different between machines."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            parts.append(socket.gethostname())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cpu_share(threads: int) -> dict:
    """The planner's `CpuShare` of this process computing with `threads` threads, with what messages cost its host."""
    host = host_fingerprint()
    return {"host": host, "threads": threads, "cores": len(os.sched_getaffinity(0)), **host_costs(host).cpu_fields()}


def latency_ms() -> float:
    """This host's end of a hop's latency beyond a message's bytes and CPU (half the one-way figure it measured)."""
    return host_costs(host_fingerprint()).latency_ms / 2
