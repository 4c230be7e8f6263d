"""Start a real swarm on this machine: a bootstrap peer and block servers as separate processes.

Used by the demo, the tests and the benchmarks. Every process binds to 127.0.0.1 only, unless given --host-maddrs.
"""

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import hivemind

from bloombee.dht.lifecycle import descendants
from bloombee.dht.peers import start_dht
from bloombee.dht.records import ServerState, fetch_records

logger = logging.getLogger(__name__)

MADDR = re.compile(r"/ip4/\S+/p2p/\w+")


@dataclass
class ServerProcess:
    name: str
    process: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)
    prefix: list[str] = field(default_factory=list)  # what the command runs under, e.g. `ip netns exec NAMESPACE`

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class LocalSwarm:
    """A bootstrap peer plus servers for one model; use as a context manager so everything is torn down.

    Every server gets `--num-threads server_threads` (default 1) unless its arguments name a count: several
    servers on one machine, each with a torch thread per core, spin against each other (measured: 4 sessions
    through 2 servers took 98 s each with a thread per core, 6.5 s with one thread per server)."""

    def __init__(self, model: str, num_blocks: int, prefix: str, log_dir: str | None = None, env: dict[str, str] | None = None,
                 startup_timeout: float = 180.0, server_threads: int = 1):
        self.model, self.num_blocks, self.prefix = model, num_blocks, prefix
        self.server_threads = server_threads
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="bloombee-swarm-"))
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.servers: list[ServerProcess] = []
        self.bootstrap: subprocess.Popen | None = None
        self.initial_peers: list[str] = []
        self._dht: hivemind.DHT | None = None

    def __enter__(self) -> "LocalSwarm":
        self.start_bootstrap()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, module: str, args: list[str], log_path: Path, prefix: Sequence[str] = (),
               mode: str = "w") -> subprocess.Popen:
        log = open(log_path, mode)
        return subprocess.Popen([*prefix, sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, start_new_session=True)

    def start_bootstrap(self, *args: str) -> None:
        """Start `bloombee-dht ARGS` and wait for the addresses it prints."""
        log_path = self.log_dir / "bootstrap.log"
        self.bootstrap = self._spawn("bloombee.cli.dht", list(args), log_path)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            found = MADDR.findall(log_path.read_text())
            if found:
                self.initial_peers = found
                return
            if self.bootstrap.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"bootstrap peer did not start; its log:\n{log_path.read_text()}")

    @property
    def dht(self) -> hivemind.DHT:
        """A client-mode DHT peer of this process, for watching the swarm's records."""
        if self._dht is None:
            self._dht = start_dht(self.initial_peers, client_mode=True)
        return self._dht

    def add_server(self, *args: str, name: str | None = None, wait: bool = True,
                   prefix: Sequence[str] = ()) -> ServerProcess:
        """Start `bloombee-server --model MODEL --initial-peers ... ARGS` (under `prefix`, e.g. `ip netns exec NS`);
        wait until it announces itself online."""
        name = name or f"server{len(self.servers)}"
        threads = [] if "--num-threads" in args else ["--num-threads", str(self.server_threads)]
        full_args = ["--model", self.model, "--initial-peers", *self.initial_peers, "--public-name", name, *threads, *args]
        log_path = self.log_dir / f"{name}.log"
        process = self._spawn("bloombee.cli.server", full_args, log_path, prefix)
        server = ServerProcess(name, process, log_path, full_args, list(prefix))
        self.servers.append(server)
        if wait:
            self.wait_online([name])
        return server

    def online_names(self) -> dict[str, tuple[int, int]]:
        """Public names of online servers and their block ranges, as the DHT shows them now."""
        online = {}
        for records in fetch_records(self.dht, self.prefix, self.num_blocks):
            for record in records.values():
                if record.state == ServerState.ONLINE:
                    online[record.public_name] = (record.start_block, record.end_block)
        return online

    def wait_online(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if set(names) <= set(self.online_names()):
                return
            for server in self.servers:
                if server.name in names and server.process.poll() is not None:
                    raise RuntimeError(f"server {server.name} exited with {server.process.returncode}:\n{server.log_tail()}")
            time.sleep(0.5)
        tails = "\n".join(f"--- {s.name}\n{s.log_tail()}" for s in self.servers if s.name in names)
        raise TimeoutError(f"servers {names} did not come online within {self.startup_timeout:g} s\n{tails}")

    def server(self, name: str) -> ServerProcess:
        return next(server for server in self.servers if server.name == name)

    def restart(self, name: str) -> ServerProcess:
        """Start a server that has ended again with the same arguments (its peer id too, given --identity-path); its
        log goes on in the same file. Returns at once: its old records may still read ONLINE."""
        old = self.server(name)
        if old.process.poll() is None:
            raise RuntimeError(f"server {name} is still running")
        process = self._spawn("bloombee.cli.server", old.args, old.log_path, old.prefix, mode="a")
        new = ServerProcess(name, process, old.log_path, old.args, old.prefix)
        self.servers[self.servers.index(old)] = new
        return new

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a server and wait for it to end; SIGKILL takes its DHT child and p2p daemon too, like a machine dying."""
        server = self.server(name)
        if sig == signal.SIGKILL:
            self.signal_all(name, sig)
        else:
            server.process.send_signal(sig)
        server.process.wait(timeout=60)

    def signal_all(self, name: str, sig: int) -> None:
        """Send `sig` to a server and every process below it (its DHT child and p2p daemon): SIGSTOP freezes the
        whole machine's share, SIGCONT thaws it."""
        process = self.server(name).process
        below = descendants(process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL to whatever is left of its group) and the watcher DHT."""
        processes = [server.process for server in self.servers] + ([self.bootstrap] if self.bootstrap else [])
        below = [pid for process in processes if process.poll() is None for pid in descendants(process.pid)]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # the process stops its own DHT peer and p2p daemon
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                logger.warning("Process %d did not stop within 20 s of SIGTERM; killing its group", process.pid)
            with contextlib.suppress(ProcessLookupError):  # the group is gone already after a clean stop
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for pid in below:  # normally gone with their parents already
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None
