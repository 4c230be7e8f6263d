"""BloomBee: run a large language model across a peer-to-peer swarm of block servers.

`from bloombee import AutoDistributedModelForCausalLM` (or `AutoDistributedModel`) loads the client's part of a
model and joins a swarm; the client package (and torch with it) is imported only when one of them is first used.
"""

__version__ = "0.1.0"

_CLIENT_NAMES = ("AutoDistributedModel", "AutoDistributedModelForCausalLM", "DistributedModelForCausalLM")

__all__ = ["AutoDistributedModel", "AutoDistributedModelForCausalLM", "DistributedModelForCausalLM", "__version__"]


def __getattr__(name: str):
    if name in _CLIENT_NAMES:
        from bloombee import client

        return getattr(client, name)
    raise AttributeError(f"module 'bloombee' has no attribute {name!r}")
