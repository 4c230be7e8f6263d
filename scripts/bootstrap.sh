#!/usr/bin/env bash
# Creates .venv in the checkout (once) and installs BloomBee with its dev extras into it; reinstalls
# only when pyproject.toml changes. torch is installed only when missing, as the CPU wheel torch==2.13.0.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
fi
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$venv/bin/pip" install -q torch==2.13.0
fi
stamp="$venv/.bloombee-installed"
wanted="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1) $root"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    "$venv/bin/pip" install -q -e "$root[dev]"
    echo "$wanted" > "$stamp"
fi
# Headless Chromium for the browser test of /status (tests/test_status_page.py), from Debian's packages; installed
# here, outside test.sh's network namespace. Where it cannot be had, that test skips and says why.
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >/dev/null 2>&1; then
        echo "bootstrap: could not install chromium; tests/test_status_page.py will skip its browser test" >&2
    fi
fi
