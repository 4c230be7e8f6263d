"""The swarm client: routing, inference sessions and the distributed causal LM."""

from bloombee.client.model import AutoDistributedModel, AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from bloombee.client.remote import RemoteSequential
from bloombee.client.routing import MissingBlocksError, SequenceManager
from bloombee.client.session import InferenceSession
from bloombee.client.spans import RequestRejected

__all__ = [
    "AutoDistributedModel",
    "AutoDistributedModelForCausalLM",
    "DistributedModelForCausalLM",
    "InferenceSession",
    "MissingBlocksError",
    "RemoteSequential",
    "RequestRejected",
    "SequenceManager",
]
