"""Model resolution (folder, hub id, alias), block-range and client-head loading, DHT prefixes."""

from bloombee.loading.aliases import ALIASES
from bloombee.loading.prefix import dht_prefix
from bloombee.loading.resolve import ModelNotFoundError, load_model_config, resolve_model
from bloombee.loading.weights import CheckpointReader, load_block_stack, load_client_head

__all__ = ["ALIASES", "ModelNotFoundError", "CheckpointReader", "dht_prefix", "load_block_stack",
           "load_client_head", "load_model_config", "resolve_model"]
