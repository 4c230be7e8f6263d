#!/usr/bin/env bash
# The main job: start a real local swarm on the embedded model (a bootstrap peer and two server
# processes on 127.0.0.1, each with half of the blocks), stream one generation through it, shut down.
# Extra arguments go to `bloombee-client demo` (e.g. --prompt "import os" --servers 3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/bloombee-client" demo "$@"
