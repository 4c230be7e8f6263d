"""The swarm's processes inside a `Topology`: the bootstrap peer, the servers and the client worker.

Each process is `ip netns exec NAMESPACE python -m ...` with the project's own CLIs
(`bloombee.cli.dht`, `bloombee.cli.server`) and the harness's client worker, in its own process
group. `stop()` ends them (SIGTERM, then SIGKILL to the group); `Topology.destroy()` then kills
anything still inside a namespace before deleting it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from benchmarks.netbench.netns import HUB_IP, Topology

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
MADDR = re.compile(r"/ip4/\S+/p2p/\w+")
DHT_PORT = 31337


@dataclass
class Process:
    name: str
    node: str
    popen: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.popen.poll() is None


class WorkerError(RuntimeError):
    pass


class Worker:
    """The client workload process; `call()` sends one command and answers marks until its result."""

    def __init__(self, process: Process):
        self.process = process
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.popen.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise WorkerError(f"client worker silent for {timeout:g} s; its log:\n{self.process.log_tail()}") from None
        if line is None:
            raise WorkerError(f"client worker exited ({self.process.popen.poll()}); its log:\n{self.process.log_tail()}")
        return json.loads(line)

    def _send(self, obj: dict) -> None:
        self.process.popen.stdin.write(json.dumps(obj) + "\n")
        self.process.popen.stdin.flush()

    def wait_ready(self, timeout: float) -> None:
        event = self._next(timeout)
        if event.get("event") != "ready":
            raise WorkerError(f"client worker sent {event!r} before 'ready'")

    def call(self, cmd: str, timeout: float = 600.0, on_mark: Callable[[str], None] | None = None, **kwargs) -> dict:
        self._send({"cmd": cmd, **kwargs})
        while True:
            event = self._next(timeout)
            if event.get("event") == "mark":
                if on_mark is not None:
                    on_mark(event["name"])
                self._send({"cmd": "continue"})
            elif event.get("event") == "result":
                return event["result"]
            elif event.get("event") == "error":
                raise WorkerError(f"client worker: {cmd} failed: {event['error']}\n{self.process.log_tail()}")

    def quit(self) -> None:
        try:
            self._send({"cmd": "quit"})
        except (BrokenPipeError, OSError, ValueError):
            pass


class NetSwarm:
    """Processes of one swarm in `topology`; a context manager that always stops them all."""

    def __init__(self, topology: Topology, model: str, log_dir: Path, python: str = sys.executable,
                 env: dict[str, str] | None = None, startup_timeout: float = 300.0):
        self.topology, self.model, self.log_dir = topology, model, Path(log_dir)
        self.python, self.startup_timeout = python, startup_timeout
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.dht: Process | None = None
        self.servers: list[Process] = []
        self.worker: Worker | None = None
        self.initial_peers: list[str] = []
        self._started = 0

    # -- processes ---------------------------------------------------------------------------

    def _spawn(self, name: str, node: str, argv: list[str], env: dict[str, str] | None = None, pipes: bool = False) -> Process:
        self._started += 1
        log_path = self.log_dir / f"{self._started:02d}-{name}.log"
        full = self.topology.exec_argv(node, [self.python, *argv])
        with open(log_path, "w") as log:  # the child keeps its own descriptor
            popen = subprocess.Popen(full, stdout=subprocess.PIPE if pipes else log, stderr=log,
                                     stdin=subprocess.PIPE if pipes else subprocess.DEVNULL, text=True,
                                     env={**self.env, **(env or {})}, cwd=ROOT, start_new_session=True)
        logger.debug("started %s (pid %d): %s", name, popen.pid, " ".join(full))
        return Process(name, node, popen, log_path, full)

    def start_dht(self) -> Process:
        self.dht = self._spawn("dht", "hub", ["-m", "bloombee.cli.dht", "--host-maddrs", f"/ip4/{HUB_IP}/tcp/{DHT_PORT}",
                                              "--no-nat-traversal"])
        return self.dht

    def wait_dht(self) -> list[str]:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            found = MADDR.findall(self.dht.log_path.read_text(errors="replace"))
            if found:
                self.initial_peers = found
                return found
            if not self.dht.alive():
                break
            time.sleep(0.2)
        raise RuntimeError(f"the bootstrap peer did not start; its log:\n{self.dht.log_tail()}")

    def start_worker(self, threads: int = 0) -> Worker:
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        process = self._spawn("client", "client", ["-m", "benchmarks.netbench.worker"], env=env, pipes=True)
        self.worker = Worker(process)
        return self.worker

    def start_server(self, name: str, node: str, blocks: tuple[int, int], args: list[str], dtype: str,
                     link_mbps: float, threads: int = 0) -> Process:
        argv = ["-m", "bloombee.cli.server", "--model", self.model, "--blocks", f"{blocks[0]}:{blocks[1]}",
                "--initial-peers", *self.initial_peers, "--host-maddrs", f"/ip4/{self.topology.ips[node]}/tcp/0",
                "--no-nat-traversal", "--public-name", name, "--dtype", dtype, "--link-bandwidth-mbps", f"{link_mbps:g}",
                "--num-threads", str(threads), *args]
        process = self._spawn(name, node, argv)
        self.servers.append(process)
        return process

    def check_servers(self) -> None:
        for server in self.servers:
            if not server.alive():
                raise RuntimeError(f"server {server.name} exited with {server.popen.returncode}; its log:\n{server.log_tail()}")

    @staticmethod
    def _terminate(processes: list[Process], grace: float = 20.0) -> None:
        for process in processes:  # the main process only: it still needs its DHT child to announce itself offline
            if process.alive():
                try:
                    process.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for process in processes:
            try:
                process.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop on SIGTERM; killing its process group", process.name)
            try:
                os.killpg(process.popen.pid, signal.SIGKILL)  # the p2p daemons of the group too
            except (ProcessLookupError, PermissionError):
                pass
            try:
                process.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def stop_servers(self) -> None:
        self._terminate(self.servers)
        self.servers = []

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.quit()
            try:
                self.worker.process.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._terminate([self.worker.process], grace=5)
            self.worker = None
        self.stop_servers()
        if self.dht is not None:
            self._terminate([self.dht], grace=5)
            self.dht = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def client_rows(topology: Topology, argv: list[str]) -> list[dict]:
    """Run a benchmark's client part (`argv`) in the namespace `client`; the JSON rows it printed."""
    out = subprocess.run(topology.exec_argv("client", argv), capture_output=True, text=True, check=True, cwd=ROOT)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def wait_for_servers(model, count: int, timeout_s: float = 600.0) -> None:
    """Until the client `model` sees `count` usable servers; SystemExit after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while len(model.remote.manager.usable_servers()) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"the servers did not come online within {timeout_s:g} s")
        time.sleep(1.0)
        model.remote.manager.update(force=True)
