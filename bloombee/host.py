"""This process's machine as the planner sees it: a fingerprint shared by every process on the host, and its cores."""

import hashlib
import os
import socket
from pathlib import Path


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
    """The planner's `CpuShare` of this process computing with `threads` threads."""
    return {"host": host_fingerprint(), "threads": threads, "cores": len(os.sched_getaffinity(0))}
