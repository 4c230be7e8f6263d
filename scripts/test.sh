#!/usr/bin/env bash
# The test command: installs what it needs, then runs the whole suite.
# As root with `ip` available, the suite runs inside a private network namespace that has only
# loopback, so no test can reach another address.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
cd "$root"
pytest_cmd=("$root/.venv/bin/python" -m pytest "$@")
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null && command -v unshare >/dev/null; then
    exec unshare --net -- bash -c 'ip link set lo up && exec "$@"' bash "${pytest_cmd[@]}"
fi
exec "${pytest_cmd[@]}"
