"""The block server's RPC interface: the one place that names its methods, for servers and clients alike.

A server registers its implementation with ``BlockService().add_p2p_handlers(p2p, wrapper=impl)``;
anyone calls it through ``BlockService.get_stub(p2p, peer_id)``.
"""

from typing import AsyncIterator

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

Envelope = runtime_pb2.ExpertRequest


class BlockService(ServicerBase):
    """The RPCs of a block server; each method's body lives in the server's implementation."""

    async def rpc_info(self, request: Envelope, context: P2PContext) -> Envelope:
        """Describe the server: its record, open sessions, cache left."""
        raise NotImplementedError

    async def rpc_forward(self, requests: AsyncIterator[Envelope], context: P2PContext) -> AsyncIterator[Envelope]:
        """Stateless forward of whole sequences over a block range."""
        raise NotImplementedError

    async def rpc_backward(self, requests: AsyncIterator[Envelope], context: P2PContext) -> AsyncIterator[Envelope]:
        """Gradients through forwards the server kept for a backward."""
        raise NotImplementedError

    async def rpc_push(self, requests: AsyncIterator[Envelope], context: P2PContext) -> AsyncIterator[Envelope]:
        """Steps pushed by the previous server of a session's chain."""
        raise NotImplementedError

    async def rpc_sessions(self, requests: AsyncIterator[Envelope], context: P2PContext) -> AsyncIterator[Envelope]:
        """A shared stream: many inference sessions of one client, as lanes (bloombee.protocol.bundles)."""
        raise NotImplementedError

    async def rpc_inference(self, requests: AsyncIterator[Envelope], context: P2PContext) -> AsyncIterator[Envelope]:
        """One inference session: open, then steps, history requests, until the stream ends."""
        raise NotImplementedError


def block_service_stub(p2p: P2P, peer_id: str | PeerID):
    """A stub calling the block server at ``peer_id``."""
    peer = PeerID.from_base58(peer_id) if isinstance(peer_id, str) else peer_id
    return BlockService.get_stub(p2p, peer)


async def register_block_service(p2p: P2P, implementation) -> None:
    """Serve ``implementation``'s rpc_* methods on ``p2p`` under the BlockService names."""
    await BlockService().add_p2p_handlers(p2p, wrapper=implementation)
