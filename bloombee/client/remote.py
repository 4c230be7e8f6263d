"""The model's transformer blocks as served by the swarm: stateless forward and inference sessions."""

import logging
import threading

import hivemind
import torch

from bloombee.client.figures import ChainFigures
from bloombee.client.loop import run_sync
from bloombee.client.micro_batching import MicroBatchChooser
from bloombee.client.routing import SequenceManager
from bloombee.client.session import InferenceSession
from bloombee.client.stateless import RemoteBlocks, StatelessChain
from bloombee.codec import CompressionPolicy
from bloombee.protocol import InfoMessage, pack, parse_message
from bloombee.protocol.service import block_service_stub
from bloombee.settings import ClientSettings

logger = logging.getLogger(__name__)


class RemoteSequential:
    """Blocks 0..L-1 of a model, reached through the DHT-announced servers of the swarm."""

    def __init__(self, dht: hivemind.DHT, prefix: str, config, settings: ClientSettings, model_name: str = "",
                 allowed_servers: list[str] | None = None, blocked_servers: list[str] | None = None):
        self.dht, self.settings, self.hidden_size = dht, settings, config.hidden_size
        self.manager = SequenceManager(dht, prefix, config.num_hidden_layers, config.hidden_size, settings, model_name,
                                       allowed_servers, blocked_servers)
        self.figures = ChainFigures(self.link_bandwidth)  # what the chain's machines measured, read by every controller
        self.choose_micro_batches = MicroBatchChooser(config, settings.link_bandwidth_mbps, settings.compression,
                                                      self.figures)
        self.p2p = run_sync(dht.replicate_p2p())
        self._policies: dict[str, CompressionPolicy] = {}
        self._policies_lock = threading.Lock()

    @property
    def link_bandwidth(self) -> float:
        return self.settings.link_bandwidth_mbps * 1e6 / 8

    def policy_for(self, peer_id: str, record) -> CompressionPolicy:
        """The compression policy of the link to one server (shared by the sessions of this client), deciding with the
        client's view of the chain's figures."""
        with self._policies_lock:
            if peer_id not in self._policies:
                bandwidth = min(self.link_bandwidth, record.link_bandwidth)
                self._policies[peer_id] = CompressionPolicy(self.settings.compression, link_bandwidth=bandwidth,
                                                            accepted=record.codecs or ("raw",),
                                                            figures=self.figures.link(peer_id))
            return self._policies[peer_id]

    def inference_session(self, max_length: int, batch_size: int = 1,
                          prompts: torch.Tensor | None = None) -> InferenceSession:
        """Open a session along the best chain, with deep `prompts` [blocks, prefix, hidden] added at its first
        prefix slots if given; close it (or use it as a context manager) when done."""
        session = InferenceSession(self.manager, self.p2p, max_length, batch_size, self.hidden_size, self.settings,
                                   self.policy_for, self.figures, self.choose_micro_batches, prompts)
        return session.open()

    def session_length_limit(self) -> int | None:
        """The longest session every usable server announces it opens (None: none announces a limit)."""
        self.manager.update()
        limits = [record.max_length for record in self.manager.usable_servers().values() if record.max_length]
        return min(limits, default=None)

    def server_info(self, peer_id: str) -> dict | None:
        """What a server says about itself (its record, open sessions, cache left); None if it answers an error."""
        stub = block_service_stub(self.p2p, peer_id)
        reply = run_sync(stub.rpc_info(pack(InfoMessage()), timeout=self.settings.request_timeout))
        message = parse_message(reply.metadata)
        return message.info if isinstance(message, InfoMessage) else None

    def forward(self, hidden: torch.Tensor, token_mask: torch.Tensor | None = None,
                prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Stateless forward of whole sequences through every block, span by span, re-routing around failures, with
        deep `prompts` [blocks, batch, prefix, H] added before each block if given; differentiable (the servers keep
        their spans' inputs for the backward) when grad is enabled and `hidden` or `prompts` require it."""
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, prompts))
        chain = StatelessChain(self, token_mask, keep=needs_grad)
        if needs_grad:
            return RemoteBlocks.apply(hidden, prompts, chain)
        return run_sync(chain.forward(hidden, prompts))
