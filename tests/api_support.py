"""Helpers for tests of `bloombee-api`: a bloombee-tiny swarm on 127.0.0.1 and API server processes in front of it."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bloombee.loading import dht_prefix
from bloombee.local_swarm import LocalSwarm

MODEL = "bloombee-tiny"
NUM_BLOCKS = 8


def start_tiny_swarm(log_dir: Path, cache_dir: Path, servers: dict[str, str], *server_args: str) -> LocalSwarm:
    """A bootstrap peer and one server per name -> blocks, one torch thread each."""
    swarm = LocalSwarm(MODEL, NUM_BLOCKS, dht_prefix(MODEL), log_dir=str(log_dir),
                       env={"BLOOMBEE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"})
    swarm.start_bootstrap()
    try:
        for name, blocks in servers.items():
            swarm.add_server("--blocks", blocks, "--no-profile", *server_args, name=name, wait=False)
        swarm.wait_online(list(servers))
    except BaseException:
        swarm.stop()
        raise
    return swarm


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ApiProcess:
    """`bloombee-api` as a subprocess on a free port; `stop()` ends it."""

    def __init__(self, swarm: LocalSwarm, log_path: Path, *args: str, timeout: float = 120.0):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [str(Path(sys.executable).parent / "bloombee-api"), "--model", MODEL, "--initial-peers",
                   *swarm.initial_peers, "--port", str(self.port), *args]
        self.log = open(log_path, "w")  # noqa: SIM115 -- closed by stop()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"bloombee-api exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=2):
                    return
            except (urllib.error.URLError, ConnectionError):
                pass  # not listening yet
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"bloombee-api did not answer within {timeout:g} s:\n{self.log_path.read_text()}")

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=60) as response:
            return response.read().decode()

    def status(self) -> dict:
        return json.loads(self.get("/status.json"))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
