"""Tie a DHT child process and its p2p daemon to the life of the process that started them.

hivemind runs each DHT peer in a forked child process, which starts the p2p daemon as its own child.
Nothing in hivemind ends them when the parent dies without shutting them down (SIGKILL, a crash), and
the child inherits the parent's signal handlers. `GuardedDHT` fixes both: its child leaves the
parent's process group (signals sent to the parent's group are the parent's to handle, so the parent
can still announce itself offline), watches the parent's pid, and whenever it ends (parent gone,
SIGTERM, or a normal return) it ends its own children, the p2p daemon among them, first.
"""

import logging
import os
import signal
import threading
import time
from pathlib import Path

import hivemind

logger = logging.getLogger(__name__)

WATCH_PERIOD = 0.2  # seconds between checks that the parent is still alive
TERMINATE_GRACE = 1.0  # seconds a child gets to exit on SIGTERM before SIGKILL
ORPHAN_GRACE = 0.2  # ... once the parent is gone (nobody waits for a clean exit then)


def children(pid: int) -> list[int]:
    """Pids of the live child processes of `pid` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Pids of every live process below `pid`: children, their children, ..."""
    found, frontier = [], [pid]
    while frontier:
        below = [child for parent in frontier for child in children(parent)]
        found.extend(below)
        frontier = below
    return found


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def terminate(pids: list[int], grace: float = TERMINATE_GRACE) -> None:
    """SIGTERM each process, then SIGKILL whatever is still running after `grace` seconds."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in pids:
        if is_running(pid):
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class GuardedDHT(hivemind.DHT):
    """A hivemind DHT whose child process and p2p daemon never outlive the process that started it."""

    owner_subkey: bytes = b""  # the subkey this peer signs its records under (set by bloombee.dht.peers.start_dht)

    def run(self) -> None:
        parent = self._parent_pid
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, _end_on_signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_watch_parent, args=(parent,), name="bloombee-parent-watch", daemon=True).start()
        if os.getppid() != parent:  # the parent died before the watch began
            os._exit(0)
        try:
            super().run()
        finally:
            terminate(children(os.getpid()))


def _end_on_signal(signum: int, frame) -> None:
    terminate(children(os.getpid()))
    os._exit(0)


def _watch_parent(parent: int) -> None:
    """In the DHT child: once the parent is gone, end the p2p daemon and this process."""
    while os.getppid() == parent:
        time.sleep(WATCH_PERIOD)
    terminate(children(os.getpid()), grace=ORPHAN_GRACE)
    os._exit(0)
