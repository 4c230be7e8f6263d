#!/usr/bin/env bash
# The test command: installs what it needs, builds the docs site strictly (a broken link or a page missing
# from mkdocs.yml's nav fails the run), then runs the whole suite.
# As root with `ip` available, the suite runs inside a private network namespace that has only
# loopback, so no test can reach another address.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
cd "$root"
site_dir="$(mktemp -d)"
trap 'rm -rf "$site_dir"' EXIT
NO_MKDOCS_2_WARNING=1 "$root/.venv/bin/mkdocs" build --strict --config-file "$root/mkdocs.yml" --site-dir "$site_dir"
rm -rf "$site_dir"
trap - EXIT
pytest_cmd=("$root/.venv/bin/python" -m pytest "$@")
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null && command -v unshare >/dev/null; then
    exec unshare --net -- bash -c 'ip link set lo up && exec "$@"' bash "${pytest_cmd[@]}"
fi
exec "${pytest_cmd[@]}"
