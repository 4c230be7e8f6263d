"""The swarm's status against a live 2-server swarm: `bloombee-client status`/`info` and the API's /status page,
loaded in headless Chromium (installed from Debian's packages when missing), before and after a server stops.

The tests share one swarm and run in file order: the page test stops server b, the last test checks the gap it left."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from api_support import MODEL, ApiProcess, start_tiny_swarm

from bloombee.api.status_page import coverage_svg
from bloombee.client.swarm_status import ModelStatus, ServerStatus

CLIENT = str(Path(sys.executable).parent / "bloombee-client")


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def chromium() -> str:
    """The chromium binary; installed with apt-get when missing, skipped (with the reason) when that fails."""
    if find_chromium() is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=300, env=env)
        install = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, text=True,
                                 timeout=900, env=env)
        if find_chromium() is None:
            pytest.skip(f"chromium is not installed and `apt-get install chromium` failed: {install.stderr[-300:]}")
    if find_chromium() is None:
        pytest.skip("chromium is not installed and this user cannot install it (needs root and apt-get)")
    return find_chromium()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = start_tiny_swarm(tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"), {"a": "0:4", "b": "4:8"},
                             "--announce-period", "1")
    yield swarm
    swarm.stop()


@pytest.fixture(scope="module")
def api(swarm, tmp_path_factory):
    process = ApiProcess(swarm, tmp_path_factory.mktemp("api") / "api.log", "--status-refresh-seconds", "2")
    yield process
    process.stop()


def browse(chromium: str, url: str, screenshot: Path) -> str:
    """The page's DOM after Chromium rendered it; also saves a screenshot."""
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1000,700"]
    subprocess.run([*flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True)
    return subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True).stdout


def server_bars(dom: str) -> dict[str, str]:
    """Server name -> state, read from the SVG bars."""
    return dict(re.findall(r'<rect class="server" data-name="([^"]+)" data-state="([^"]+)"', dom))


def client(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLIENT, *args], capture_output=True, text=True, timeout=120)


def test_status_command_shows_both_servers_and_a_full_chain(swarm):
    result = client("status", "--model", MODEL, "--initial-peers", *swarm.initial_peers, "--json")
    assert result.returncode == 0, result.stderr
    [status] = json.loads(result.stdout)["models"]
    assert status["full_chain"] and status["uncovered"] == []
    servers = {server["public_name"]: server for server in status["servers"]}
    assert (servers["a"]["start_block"], servers["a"]["end_block"], servers["b"]["start_block"]) == (0, 4, 4)
    assert servers["a"]["state"] == "online" and servers["a"]["version"] and servers["a"]["features"]
    table = client("status", "--model", MODEL, "--initial-peers", *swarm.initial_peers)
    assert table.returncode == 0 and "full chain: a[0:4] -> b[4:8]" in table.stdout
    assert "servers per block: 1 1 1 1 1 1 1 1" in table.stdout
    listed = client("status", "--initial-peers", *swarm.initial_peers, "--json")  # no --model: what the swarm serves
    assert listed.returncode == 0, listed.stderr
    assert [(model["prefix"], model["num_blocks"], model["full_chain"]) for model in json.loads(listed.stdout)["models"]] == [
        (status["prefix"], 8, True)]


def test_status_page_draws_the_blocks_and_shows_a_stopped_server(swarm, api, chromium, tmp_path):
    dom = browse(chromium, api.base_url + "/status", tmp_path / "status-before.png")
    assert server_bars(dom) == {"a": "online", "b": "online"}
    assert re.findall(r'data-block="(\d+)" data-servers="(\d+)"', dom) == [(str(b), "1") for b in range(8)]
    assert re.findall(r"<text class=\"count\"[^>]*>(\d+)</text>", dom) == ["1"] * 8
    assert "http-equiv=\"refresh\" content=\"2\"" in dom and "a[0:4]" in dom
    assert (tmp_path / "status-before.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    swarm.kill("b", signal.SIGTERM)
    deadline = time.monotonic() + 60
    while server_bars(dom).get("b") == "online" and time.monotonic() < deadline:
        time.sleep(1)
        dom = browse(chromium, api.base_url + "/status", tmp_path / "status-after.png")
    assert server_bars(dom).get("b", "offline") == "offline" and server_bars(dom)["a"] == "online"
    assert "Blocks served by nobody: 4..7" in dom and "no full chain" in dom
    assert (tmp_path / "status-after.png").stat().st_size > 1000


def test_status_and_info_flag_the_gap_after_the_stop(swarm, api):
    status = client("status", "--model", MODEL, "--initial-peers", *swarm.initial_peers)
    assert status.returncode == 1 and "blocks served by nobody: 4..7" in status.stdout
    info = client("info", "--model", MODEL, "--initial-peers", *swarm.initial_peers)
    assert info.returncode == 1 and "coverage gap: blocks 4..7 are served by nobody" in info.stdout
    assert api.status()["models"][0]["full_chain"] is False


def _server(name: str, start: int, end: int, state: str = "online") -> ServerStatus:
    return ServerStatus(peer_id=f"peer-{name}", public_name=name, state=state, start_block=start, end_block=end,
                        throughput=1.0, cache_tokens_left=100, offload=0.0, link_mbps=100.0, version="x", features=[],
                        dtype="float32", device="cpu")


def test_counts_per_block_are_written_under_an_axis_of_block_numbers():
    """The counts are visible text (not only tooltips); block numbers are the axis above them."""
    servers = [_server("a", 0, 6), _server("b", 4, 10), _server("c", 8, 12, "offline")]
    status = ModelStatus(model="m", prefix="m", num_blocks=12, servers=servers, uncovered=[10, 11], full_chain=False, chain=[])
    svg = coverage_svg(status)
    counts = [int(count) for count in re.findall(r'<text class="count"[^>]*>(\d+)</text>', svg)]
    assert counts == [1, 1, 1, 1, 2, 2, 1, 1, 1, 1, 0, 0]
    assert re.findall(r'<text class="axis"[^>]*>(\d+)</text>', svg) == [str(block) for block in range(12)]
    wide = coverage_svg(ModelStatus(model="m", prefix="m", num_blocks=80, servers=[_server("a", 0, 80)], uncovered=[],
                                    full_chain=True, chain=["a[0:80]"]))
    assert re.findall(r'<text class="axis"[^>]*>(\d+)</text>', wide)[:3] == ["0", "2", "4"]
    assert len(re.findall(r'<text class="count"', wide)) == 80
