"""Network-emulated swarm benchmark: BloomBee's own processes in network namespaces over shaped links.

One command (as root) builds a namespace per server and one for the client, joined by veth pairs
to a bridge in a hub namespace, shapes every node's uplink with `tc` (tbf for one rate, htb classes
with u32 filters for per-destination rates), starts `bloombee-dht`, `bloombee-server` and a client
workload inside them, measures, and tears everything down.

    sudo .venv/bin/python -m benchmarks.netbench sweep --help

Modules: `presets` (environments), `knobs` (optimisation switches and configurations), `plan`
(server block ranges), `netns` (namespaces, veths, qdiscs, counters), `swarm` (processes),
`worker` (the client workload, run inside the client namespace), `metrics` (pure result
processing: throughput, latency, bytes per hop, transport breakdown, floor), `report` (tables,
plots), `cli` (argument parsing and the sweep).
"""
