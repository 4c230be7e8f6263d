"""BloomBee: run a large language model across a peer-to-peer swarm of block servers."""

__version__ = "0.1.0"
