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
