#!/usr/bin/env bash
# Reproduce every netbench result in benchmarks/README.md (as root, from anywhere; ~45 minutes here).
# Each sweep runs inside `unshare --net`, a private network namespace with only loopback, like the
# test suite: the harness creates its own namespaces from there and touches nothing else.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="$root/.venv/bin/python"
sweep() { unshare --net -- bash -c 'ip link set lo up && exec "$@"' bash "$py" -m benchmarks.netbench sweep "$@"; }

# bloombee-tiny (its checkpoint dtype, bfloat16), B=32, 3 servers, E1-E6, baseline vs compression
sweep --model bloombee-tiny --servers 3 --batch 32 --prompt-len 16 --new-tokens 64 --repeats 3 \
      --envs all --configs baseline,compression --out benchmarks/results/netbench/bloombee-tiny

# the wide random model (hidden 4096, fp32: 16 KB per token per hop), one block per server, B=32:
# E1 and E5 with 4 repeats, then E1-E5 with 2
sweep --model wide --servers 3 --batch 32 --prompt-len 4 --new-tokens 16 --repeats 4 \
      --envs E1,E5 --configs baseline,compression --out benchmarks/results/netbench/wide-e1-e5
sweep --model wide --servers 3 --batch 32 --prompt-len 4 --new-tokens 16 --repeats 2 \
      --envs uniform --configs baseline,compression --out benchmarks/results/netbench/wide
