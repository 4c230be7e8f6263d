"""Whole sequences through the swarm without a session: the forward, and the backward that training runs.

`StatelessChain.forward` sends a batch through the chain span by span, its rows in micro-batches (each its own trip,
so that servers work on one while the next server works on another), re-routing around failed servers. With
`keep`, every server keeps its span's inputs under a fresh id, and `StatelessChain.backward` sends the outputs'
gradients back through the same spans in reverse, each server answering its inputs' gradients (and its blocks'
deep prompts'). A server that fails in the backward is banned and its blocks re-routed: the client redoes their
forward from the span's inputs it holds, then the backward goes through the new spans. `RemoteBlocks` makes the
two one autograd op.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError

from bloombee.client.loop import run_sync
from bloombee.client.routing import Span
from bloombee.client.spans import RequestRejected
from bloombee.codec import LAYOUTS, CompressionPolicy
from bloombee.protocol import BackwardMessage, ErrorKind, ErrorMessage, Feature, ForwardMessage, pack, unpack
from bloombee.protocol.service import block_service_stub
from bloombee.protocol.streams import single

logger = logging.getLogger(__name__)

# a server that failed: route around it (P2PDaemonError: it cannot be dialled; P2PHandlerError: its handler broke)
FAILURES = (ConnectionError, OSError, TimeoutError, P2PDaemonError, P2PHandlerError)


class StreamClosed(ConnectionError):
    """A server's stream ended without an answer, which hivemind streams occasionally do: try again, no ban."""


async def forward_span(p2p: P2P, span: Span, hidden: torch.Tensor, token_mask: torch.Tensor | None,
                       policy: CompressionPolicy, timeout: float, prompts: torch.Tensor | None = None,
                       forward_id: str | None = None, adapter: str | None = None) -> torch.Tensor:
    """Stateless forward of whole sequences through the blocks of `span` on its server computing LoRA `adapter`,
    with the span's deep `prompts`; with `forward_id` the server keeps the inputs for a backward."""
    tensors = {"hidden": hidden}
    if token_mask is not None:
        tensors["token_mask"] = token_mask.to(torch.bool)
    if prompts is not None:
        tensors["prompts"] = prompts.contiguous()
    message = ForwardMessage(start_block=span.start, end_block=span.end, codecs=LAYOUTS, forward_id=forward_id,
                             adapter=adapter)
    stub = block_service_stub(p2p, span.peer_id)
    tensors = await _reply(await stub.rpc_forward(single(pack(message, tensors, policy))), span, "forward", timeout)
    return tensors["hidden"]


async def backward_span(p2p: P2P, span: Span, forward_id: str, grad_outputs: torch.Tensor, policy: CompressionPolicy,
                        timeout: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of the inputs (and deep prompts) of the forward `span`'s server kept as `forward_id`."""
    message = BackwardMessage(forward_id=forward_id, codecs=LAYOUTS)
    stub = block_service_stub(p2p, span.peer_id)
    request = pack(message, {"grad_outputs": grad_outputs}, policy)
    tensors = await _reply(await stub.rpc_backward(single(request)), span, "backward", timeout)
    return tensors["grad_inputs"], tensors.get("grad_prompts")


async def _reply(responses, span: Span, what: str, timeout: float) -> dict[str, torch.Tensor]:
    """The tensors of a server's one reply; RequestRejected if it refused the request as invalid, ConnectionError if
    it failed or said nothing."""
    reply = await asyncio.wait_for(anext(aiter(responses), None), timeout)
    if reply is None:
        raise StreamClosed(f"server {span.peer_id} closed the {what} stream without answering")
    message, tensors = unpack(reply)
    if isinstance(message, ErrorMessage):
        if message.error_kind == ErrorKind.INVALID:
            raise RequestRejected(f"server {span.peer_id} rejected the {what}: {message.error}")
        raise ConnectionError(f"server {span.peer_id}: {message.error}")
    return tensors


@dataclass
class KeptSpan:
    """A span one micro-batch went through, what it sent there, and the id its server keeps that under."""

    span: Span
    forward_id: str | None
    hidden: torch.Tensor


class StatelessChain:
    """One forward (and its backward) of a batch through every block of `remote` (a RemoteSequential)."""

    def __init__(self, remote, token_mask: torch.Tensor | None, keep: bool):
        self.remote, self.token_mask, self.keep = remote, token_mask, keep
        self.settings = remote.settings
        self._parts: list[tuple[slice, torch.Tensor | None, list[KeptSpan]]] = []  # rows, their prompts, their spans

    async def forward(self, hidden: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
        """The chain's output for `hidden` [batch, tokens, H] with deep `prompts` [blocks, batch, prefix, H]."""
        batch, tokens = hidden.shape[:2]
        route = await self._route(0, self.remote.manager.num_blocks)
        micro_batches = self.settings.micro_batches
        if micro_batches == "auto":
            micro_batches = self.remote.choose_micro_batches(route, batch, tokens, tokens)
        parts = [slice(int(rows[0]), int(rows[-1]) + 1)
                 for rows in torch.arange(batch).tensor_split(min(micro_batches, batch))]
        outputs = await asyncio.gather(*(self._forward_part(hidden[rows], self._rows(prompts, rows), rows, route)
                                         for rows in parts))
        return torch.cat(outputs).to(hidden.dtype)

    async def backward(self, grad_outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradients of the inputs and deep prompts of the forward, given its outputs' gradients."""
        results = await asyncio.gather(*(self._backward_part(grad_outputs[rows], prompts, rows, spans)
                                         for rows, prompts, spans in self._parts))
        grad_inputs = torch.cat([grad for grad, _ in results]).to(grad_outputs.dtype)
        if self._parts[0][1] is None:
            return grad_inputs, None
        return grad_inputs, torch.cat([grad for _, grad in results], dim=1).to(grad_outputs.dtype)

    @staticmethod
    def _rows(prompts: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
        return prompts[:, rows] if prompts is not None else None

    async def _route(self, start: int, end: int) -> list[Span]:
        features = (Feature.BACKWARD,) if self.keep else ()
        return await asyncio.get_running_loop().run_in_executor(None, self.remote.manager.make_route, start, end, 0,
                                                                features)

    async def _forward_part(self, hidden: torch.Tensor, prompts: torch.Tensor | None, rows: slice,
                            route: list[Span]) -> torch.Tensor:
        out, spans = await self._through(hidden, prompts, rows, 0, self.remote.manager.num_blocks, route)
        self._parts.append((rows, prompts, spans))
        self._parts.sort(key=lambda part: part[0].start)
        return out

    async def _through(self, hidden: torch.Tensor, prompts: torch.Tensor | None, rows: slice, start: int, end: int,
                       route: list[Span] | None = None) -> tuple[torch.Tensor, list[KeptSpan]]:
        """Rows `rows` through blocks [start, end), re-routing after failures; the output and the spans used."""
        kept: list[KeptSpan] = []
        for _ in range(self.settings.max_retries + 1):
            for span in route or await self._route(start, end):
                forward_id = uuid.uuid4().hex if self.keep else None
                try:
                    out = await forward_span(self.remote.p2p, span, hidden, self._mask(rows),
                                             self.remote.policy_for(span.peer_id, span.record), self.settings.request_timeout,
                                             prompts[span.start:span.end] if prompts is not None else None, forward_id,
                                             self.settings.active_adapter)
                except FAILURES as error:
                    logger.warning("Forward through %s failed (%r); re-routing", span.peer_id, error)
                    self._ban(span, error)
                    start, route = span.start, None
                    break
                kept.append(KeptSpan(span, forward_id, hidden))
                hidden, start = out, span.end
            else:
                return hidden, kept
        raise RuntimeError(f"forward failed after {self.settings.max_retries + 1} attempts")

    async def _backward_part(self, grad: torch.Tensor, prompts: torch.Tensor | None, rows: slice,
                             spans: list[KeptSpan]) -> tuple[torch.Tensor, torch.Tensor | None]:
        grad_prompts = torch.zeros_like(prompts) if prompts is not None else None
        for kept in reversed(spans):
            grad = await self._backward_span(kept, grad, prompts, grad_prompts, rows)
        return grad, grad_prompts

    async def _backward_span(self, kept: KeptSpan, grad: torch.Tensor, prompts: torch.Tensor | None,
                             grad_prompts: torch.Tensor | None, rows: slice, attempt: int = 0) -> torch.Tensor:
        """The gradient of a span's inputs (its prompts' into `grad_prompts`); after a failure, through a new route
        whose forward is redone from the span's inputs."""
        span = kept.span
        try:
            grad_inputs, span_prompts = await backward_span(self.remote.p2p, span, kept.forward_id, grad,
                                                            self.remote.policy_for(span.peer_id, span.record),
                                                            self.settings.request_timeout)
        except FAILURES as error:
            if attempt >= self.settings.max_retries:
                raise RuntimeError(f"backward failed after {attempt + 1} attempts") from error
            logger.warning("Backward through %s failed (%r); redoing blocks %d..%d", span.peer_id, error,
                           span.start, span.end - 1)
            self._ban(span, error)
            _, replacement = await self._through(kept.hidden, prompts, rows, span.start, span.end)
            for again in reversed(replacement):
                grad = await self._backward_span(again, grad, prompts, grad_prompts, rows, attempt + 1)
            return grad
        if grad_prompts is not None:
            grad_prompts[span.start:span.end] = span_prompts
        return grad_inputs

    def _ban(self, span: Span, error: Exception) -> None:
        if not isinstance(error, StreamClosed):
            self.remote.manager.ban(span.peer_id)

    def _mask(self, rows: slice) -> torch.Tensor | None:
        return self.token_mask[rows] if self.token_mask is not None else None


class RemoteBlocks(torch.autograd.Function):
    """The swarm's blocks as one autograd op of the hidden states and deep prompts."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, prompts: torch.Tensor | None, chain: StatelessChain) -> torch.Tensor:
        ctx.chain = chain
        return run_sync(chain.forward(hidden.detach(), prompts.detach() if prompts is not None else None))

    @staticmethod
    def backward(ctx, grad_outputs: torch.Tensor):
        grad_hidden, grad_prompts = run_sync(ctx.chain.backward(grad_outputs.contiguous()))
        return grad_hidden, grad_prompts, None
