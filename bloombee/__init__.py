"""BloomBee: run a large language model across a peer-to-peer swarm of block servers.

`from bloombee import AutoDistributedModelForCausalLM` (or `AutoDistributedModel`) loads the client's part of a
model and joins a swarm; the client package (and torch with it) is imported only when one of them is first used.
"""

import os

__version__ = "0.1.0"

# torch's OpenMP workers (GNU libgomp, in its Linux wheels) spin 300,000 turns after each parallel operation before
# they sleep, several milliseconds: a client waiting for the swarm between steps, or a server waiting for the next
# step, keeps a core busy for nothing. 10,000 turns keep back-to-back operations as fast
# (benchmarks/omp_spin_bench.py). libgomp reads it once, when torch loads; a wait policy or spin count set stays.
OMP_SPIN_TURNS = "10000"
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", OMP_SPIN_TURNS)

_CLIENT_NAMES = ("AutoDistributedModel", "AutoDistributedModelForCausalLM", "DistributedModelForCausalLM")

__all__ = ["AutoDistributedModel", "AutoDistributedModelForCausalLM", "DistributedModelForCausalLM", "__version__"]


def __getattr__(name: str):
    if name in _CLIENT_NAMES:
        from bloombee import client

        return getattr(client, name)
    raise AttributeError(f"module 'bloombee' has no attribute {name!r}")
