"""Compute for the hosted blocks: session steps with KV caches and stateless forwards, on one device."""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError

from bloombee.codec import CodecError
from bloombee.models.core.masks import causal_mask, rope_positions_from_padding, stateless_causal_mask
from bloombee.models.core.offload import host_kv_heads
from bloombee.models.core.packing import Segment, granule_slots, segment_slices
from bloombee.models.core.quantize import module_weight_bytes
from bloombee.models.core.kv_cache import compact_slots
from bloombee.protocol import ErrorKind, InvalidStep
from bloombee.server.adapters import Adapters
from bloombee.server.memory import SessionBytes, SessionRefused
from bloombee.server.sessions import Session
from bloombee.speculative.pruning import TreePruner
from bloombee.speculative.tree import (PackedTrees, TokenTree, dense_rows, depths, pack_rows, packed_rows, tree_mask,
                                       unpack_rows)

logger = logging.getLogger(__name__)


BAD_INPUT = (InvalidStep, CodecError, ValidationError)  # the caller's fault, as validated: an INVALID error


@dataclass(frozen=True)
class PreparedStep:
    """A session's step ready for a forward that may hold other sessions' steps too: its vectors packed as one
    segment, and what makes the step's result from its output [rows, tokens, hidden]."""

    block_range: tuple[int, int]
    hidden: torch.Tensor  # [rows x tokens, hidden] on the device, in the blocks' dtype
    rope_positions: torch.Tensor  # [rows x tokens]
    segment: Segment
    finish: Callable[[torch.Tensor], Any]


def error_reply(error: Exception) -> tuple[ErrorKind, str]:
    """What a failure of a request tells its sender: INVALID and the reason for validated bad input (retrying
    elsewhere will not help), REFUSED for a limit or budget of this server (another may take it), else INTERNAL
    (this server failed: the client may fail over)."""
    if isinstance(error, BAD_INPUT):
        return ErrorKind.INVALID, str(error)
    if isinstance(error, SessionRefused):
        return ErrorKind.REFUSED, str(error)
    return ErrorKind.INTERNAL, f"{type(error).__name__}: {error}"


class BlockBackend:
    """Runs a sub-range of the hosted block stack; every call is made from the server's compute thread."""

    def __init__(self, stack: torch.nn.Module, device: torch.device, dtype: torch.dtype, offload: float = 0.0,
                 pruner: TreePruner | None = None, adapters: Sequence[str] = ()):
        self.stack, self.device, self.dtype = stack, torch.device(device), dtype
        self.start, self.end = stack.start, stack.end
        self.hidden_size = stack.config.hidden_size
        self.offload = offload  # fraction of each block's KV heads that sessions keep in host memory
        self.pruner = pruner  # the proxy head and keep classifier for the hidden states after block `end`
        self.weight_bytes = module_weight_bytes(stack)  # the hosted blocks' weights on the device, scales included
        self.max_chunk_tokens: int | None = None  # most tokens (rows x positions) of one step of consecutive tokens
        self.batch_invariant = False  # whether the blocks' linear layers were made batch-invariant (models.core.invariance)
        self.exact_trees = False  # whether a tree's nodes are attended one at a time (their outputs equal plain decoding)
        self.adapters = Adapters(stack, list(adapters))  # the LoRA adapters loaded into the blocks (--adapters)

    def check_range(self, start_block: int, end_block: int) -> None:
        if not (self.start <= start_block < end_block <= self.end):
            raise InvalidStep(
                f"blocks [{start_block}, {end_block}) are not inside this server's range [{self.start}, {self.end})"
            )


    def session_bytes(self, start_block: int, end_block: int, batch_size: int, max_length: int,
                      offload: float | None = None) -> SessionBytes:
        """What a session's tensors take on the device and in host memory: each block's keys and values (their
        offloaded heads in host memory), and in host memory the token mask and the output history."""
        offload = self.offload if offload is None else offload
        item = self.dtype.itemsize
        device = host = 0
        for cfg in self.stack.block_configs[start_block - self.start:end_block - self.start]:
            heads, key_dim, value_dim = cfg.cache_layout
            head_bytes = batch_size * granule_slots(max_length) * (key_dim + value_dim) * item  # K and V of a KV head
            host_heads = host_kv_heads(offload, heads)
            device += head_bytes * (heads - host_heads)
            host += head_bytes * host_heads
        host += batch_size * max_length * (self.hidden_size * item + torch.bool.itemsize)
        return SessionBytes(device, host)

    def new_session(self, session_id: str, start_block: int, end_block: int, batch_size: int, max_length: int,
                    offload: float | None = None, prompts: torch.Tensor | None = None, **client) -> Session:
        """A session's state for blocks [start_block, end_block), with their deep `prompts` [blocks, prefix, hidden]
        if given; `client` sets the client-side fields of Session."""
        self.check_range(start_block, end_block)
        if prompts is not None:
            self._check_prompts(prompts[:, None], end_block - start_block, 1, max_length)
            prompts = prompts.to(self.device, self.dtype)
        offload = self.offload if offload is None else offload
        return Session(prompts=prompts,
            session_id=session_id, start_block=start_block, end_block=end_block, batch_size=batch_size,
            max_length=max_length,
            caches=self.stack.new_caches(batch_size, max_length, block_range=(start_block, end_block), offload=offload),
            token_mask=torch.zeros(batch_size, max_length, dtype=torch.bool),
            output_history=torch.zeros(batch_size, max_length, self.hidden_size, dtype=self.dtype),
            held=self.session_bytes(start_block, end_block, batch_size, max_length, offload), **client)

    def warm_up(self, max_rows: int) -> None:
        """Run a decode step of each batch size up to `max_rows` rows through the first block, so that what kernels
        set up per shape (oneDNN's on a CPU: ~0.5 ms a matmul shape in bfloat16) is ready before sessions come, not
        paid by their first batched steps; the other blocks of most models compute the same shapes."""
        for rows in range(1, max_rows + 1):
            session = self.new_session("warm-up", self.start, self.start + 1, rows, 1)
            self.step(session, torch.zeros(rows, 1, self.hidden_size, dtype=self.dtype), 0, 0, None, None)

    def _check_hidden(self, hidden: torch.Tensor) -> None:
        if hidden.ndim != 3 or hidden.shape[-1] != self.hidden_size:
            raise InvalidStep(f"hidden states must have shape [batch, tokens, {self.hidden_size}], got {list(hidden.shape)}")
        if not hidden.is_floating_point():
            raise InvalidStep(f"hidden states must be floating point, got {hidden.dtype}")
        if 0 in hidden.shape[:2]:
            raise InvalidStep(f"hidden states must hold at least one row and one token, got {list(hidden.shape)}")

    def check_step(self, session: Session, hidden: torch.Tensor, start_position: int, batch_offset: int,
                   token_mask: torch.Tensor | None, rope_positions: torch.Tensor | None) -> None:
        """Raise InvalidStep unless the step's tensors fit the session's rows and positions (before anything is written)."""
        self._check_hidden(hidden)
        batch, num_tokens = hidden.shape[0], hidden.shape[1]
        if batch_offset + batch > session.batch_size:
            raise InvalidStep(f"rows [{batch_offset}, {batch_offset + batch}) exceed the session's batch size {session.batch_size}")
        if start_position + num_tokens > session.max_length:
            raise InvalidStep(f"positions up to {start_position + num_tokens} exceed the session's max_length {session.max_length}")
        for name, tensor in (("token_mask", token_mask), ("rope_positions", rope_positions)):
            if tensor is not None and tuple(tensor.shape) != (batch, num_tokens):
                raise InvalidStep(f"{name} must have shape {[batch, num_tokens]}, got {list(tensor.shape)}")

    @staticmethod
    def rows_towards(session: Session, version: int, reorder: tuple[int, ...] | None) -> torch.Tensor | None:
        """The rows (row i continues row reorder[i]) that take the session's rows to `version`, None where they are
        at it already; InvalidStep unless `reorder` is the next one and names one row of the session per row."""
        have = session.rows_version
        if version == have:
            return None
        if reorder is None or version != have + 1:
            raise InvalidStep(f"rows reordered {version} times asked for; here they were {have}")
        if len(reorder) != session.batch_size or not all(0 <= row < session.batch_size for row in reorder):
            raise InvalidStep(f"a reorder names rows outside the session's {session.batch_size}, one per row")
        return torch.tensor(reorder)

    def follow_rows(self, session: Session, version: int, reorder: tuple[int, ...] | None, start_position: int) -> None:
        """Bring the session's rows to `version`: apply `reorder` when it is the next one, or take the version as it
        stands when a replay rebuilds the rows from position 0 (its history is reordered already)."""
        if reorder is None and session.rows_version == 0 and start_position == 0:
            session.rows_version = version
            return
        rows = self.rows_towards(session, version, reorder)
        if rows is None:
            return
        if session.trees:
            raise InvalidStep("a reorder came while tree steps wait for their accepted nodes")
        for cache in session.caches:
            cache.reorder(rows)
        session.token_mask.copy_(session.token_mask[rows])
        session.output_history.copy_(session.output_history[rows])
        session.rows_version = version

    def check_chunk(self, hidden: torch.Tensor) -> None:
        """Raise InvalidStep if a client's step of consecutive tokens carries more than --max-chunk-tokens."""
        self._check_hidden(hidden)
        batch, num_tokens = hidden.shape[0], hidden.shape[1]
        if self.max_chunk_tokens is not None and batch * num_tokens > self.max_chunk_tokens:
            raise InvalidStep(f"a step of {batch} rows x {num_tokens} tokens is over this server's --max-chunk-tokens "
                              f"{self.max_chunk_tokens}; send it as chunks of at most that many tokens")

    def step(self, session: Session, hidden: torch.Tensor, start_position: int, batch_offset: int,
             token_mask: torch.Tensor | None, rope_positions: torch.Tensor | None) -> torch.Tensor:
        """Write tokens at slots [start_position, start_position + T) of rows [batch_offset, +b); return outputs."""
        return self.run_one(self.prepare_step(session, hidden, start_position, batch_offset, token_mask, rope_positions))

    def prepare_step(self, session: Session, hidden: torch.Tensor, start_position: int, batch_offset: int,
                     token_mask: torch.Tensor | None, rope_positions: torch.Tensor | None) -> PreparedStep:
        """A step of consecutive tokens, checked and its tokens marked in the session, ready for `run`."""
        self.check_step(session, hidden, start_position, batch_offset, token_mask, rope_positions)
        batch, num_tokens = hidden.shape[0], hidden.shape[1]
        self.check_no_tree_pending(session, batch_offset, batch, None)
        end_position = start_position + num_tokens
        rows = slice(batch_offset, batch_offset + batch)
        session.token_mask[rows, start_position:end_position] = True if token_mask is None else token_mask.to(torch.bool)
        key_padding = session.token_mask[rows, :end_position].to(self.device)
        decode = num_tokens == 1 and token_mask is None  # its slot is real and last: it attends every real slot
        if rope_positions is None:
            rope_positions = (key_padding.sum(-1, keepdim=True) - 1 if decode
                              else rope_positions_from_padding(key_padding)[:, start_position:end_position])
        cache_positions = torch.arange(start_position, end_position, device=self.device)
        mask = key_padding[:, None] if decode else causal_mask(cache_positions, end_position, key_padding)

        def finish(out: torch.Tensor) -> torch.Tensor:
            session.output_history[rows, start_position:end_position] = out.to(session.output_history.device)
            return out

        return self._prepared(session, hidden, rope_positions, cache_positions, mask, batch_offset, finish)

    def _prepared(self, session: Session, hidden: torch.Tensor, rope_positions: torch.Tensor,
                  cache_positions: torch.Tensor, mask: torch.Tensor, batch_offset: int, finish,
                  tree_start: int | None = None) -> PreparedStep:
        rows, tokens = hidden.shape[:2]
        prompts = session.prompts[:, None].expand(-1, rows, -1, -1) if session.prompts is not None else None
        segment = Segment(rows, tokens, cache_positions, mask, session.caches, batch_offset, tree_start, prompts)
        return PreparedStep((session.start_block, session.end_block),
                            hidden.to(self.device, self.dtype).reshape(rows * tokens, self.hidden_size),
                            rope_positions.to(self.device, torch.long).reshape(-1), segment, finish)

    @torch.inference_mode()
    def run(self, steps: list[PreparedStep], adapter: str | None = None) -> list:
        """One forward of prepared steps of the same blocks and adapter (of one or several sessions); each step's
        result, or the exception its finishing raised."""
        segments = [step.segment for step in steps]
        with self.adapters.active(adapter):
            out = self.stack.forward_packed(torch.cat([step.hidden for step in steps]),
                                            torch.cat([step.rope_positions for step in steps]), segments,
                                            block_range=steps[0].block_range)
        results = []
        for step, part in zip(steps, segment_slices(segments)):
            try:
                results.append(step.finish(out[part].view(step.segment.rows, step.segment.tokens, self.hidden_size)))
            except Exception as error:  # this step's own failure, reported to its session alone
                results.append(error)
        return results

    def run_one(self, step: PreparedStep):
        """`run` of one step: its result (its error raised)."""
        result = self.run([step])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def check_tree_step(self, session: Session, hidden: torch.Tensor, start_position: int, batch_offset: int,
                        trees: PackedTrees) -> int:
        """Raise InvalidStep unless a tree step fits the session; the width (largest tree) it writes."""
        if hidden.ndim != 2 or hidden.shape != (trees.parents.numel(), self.hidden_size) or not hidden.is_floating_point():
            raise InvalidStep(f"a tree step's hidden states are packed, [nodes, {self.hidden_size}] floating point, one "
                              f"per node of its trees ({trees.parents.numel()}), got {hidden.dtype} {list(hidden.shape)}")
        width = max(trees.counts)
        if batch_offset + trees.num_rows > session.batch_size:
            raise InvalidStep(f"rows [{batch_offset}, {batch_offset + trees.num_rows}) exceed the session's batch size "
                              f"{session.batch_size}")
        if start_position + width > session.max_length:
            raise InvalidStep(f"a tree of {width} nodes at slot {start_position} exceeds the session's max_length "
                              f"{session.max_length}")
        self.check_no_tree_pending(session, batch_offset, trees.num_rows, start_position)
        return width

    @staticmethod
    def check_no_tree_pending(session: Session, batch_offset: int, batch: int, start_position: int | None) -> None:
        """Raise InvalidStep if a row still holds a tree whose accepted nodes were never sent (its rejected nodes
        would stay readable), unless it is the tree a tree step at `start_position` writes again."""
        for row in range(batch_offset, batch_offset + batch):
            if row in session.trees and session.trees[row][0] != start_position:
                raise InvalidStep(f"row {row} holds a tree at slot {session.trees[row][0]} whose accepted nodes were "
                                  f"not sent (compact_start, compact_ids, compact_offsets)")

    def tree_step(self, session: Session, hidden: torch.Tensor, start_position: int, batch_offset: int,
                  trees: PackedTrees, prune_tau: float | None) -> tuple[torch.Tensor, PackedTrees]:
        """Write each row's tree at slots [start_position, + its size), nodes attending the row's prefix and their
        ancestors at rope positions from their depths; the packed outputs and trees, pruned when `prune_tau` is set
        and this server holds a pruner for the session's last block."""
        return self.run_one(self.prepare_tree_step(session, hidden, start_position, batch_offset, trees, prune_tau))

    def prepare_tree_step(self, session: Session, hidden: torch.Tensor, start_position: int, batch_offset: int,
                          trees: PackedTrees, prune_tau: float | None) -> PreparedStep:
        """A tree step (see `tree_step`), checked and its nodes marked in the session, ready for `run`."""
        width = self.check_tree_step(session, hidden, start_position, batch_offset, trees)
        pruning = prune_tau is not None and self.pruner is not None and session.end_block == self.end
        if pruning:
            self._check_tokens(trees.tokens)
        rows, end = slice(batch_offset, batch_offset + trees.num_rows), start_position + width
        for row in range(batch_offset, rows.stop):
            if row in session.trees:  # this tree again (a retry): what the earlier one wrote is masked first
                session.token_mask[row, start_position:start_position + session.trees.pop(row)[1].numel()] = False
        parents_rows = unpack_rows(trees.parents, trees.offsets)
        valid = dense_rows(torch.ones(hidden.shape[0], dtype=torch.bool), trees.offsets, width)
        session.token_mask[rows, start_position:end] = valid
        prefix = session.token_mask[rows, :start_position]
        rope = prefix.sum(-1, keepdim=True) + dense_rows(torch.cat([depths(p) for p in parents_rows]), trees.offsets, width)
        mask = tree_mask(parents_rows, width, prefix).to(self.device)
        cache_positions = torch.arange(start_position, end, device=self.device)
        dense = dense_rows(hidden, trees.offsets, width)

        def finish(out: torch.Tensor) -> tuple[torch.Tensor, PackedTrees]:
            session.output_history[rows, start_position:end] = out.to(session.output_history.device)
            for row, (_, _, ids) in zip(range(batch_offset, rows.stop), trees.rows()):
                session.trees[row] = (start_position, ids.clone())
            packed = packed_rows(out, trees.counts)
            return self._prune(packed, trees, prune_tau) if pruning else (packed, trees)

        return self._prepared(session, dense, rope, cache_positions, mask, batch_offset, finish, start_position)

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        """Raise InvalidStep unless the tree tokens a pruner scores are ids of the model's vocabulary."""
        vocab = self.stack.config.vocab_size
        if bool(((tokens < 0) | (tokens >= vocab)).any()):
            raise InvalidStep(f"tree tokens must be ids of the model's vocabulary [0, {vocab}), got "
                              f"{int(tokens.min())} to {int(tokens.max())}")

    def _prune(self, hidden: torch.Tensor, trees: PackedTrees, tau: float) -> tuple[torch.Tensor, PackedTrees]:
        """Drop each row's candidates scoring below `tau` (and their descendants); the kept nodes, packed."""
        kept_hidden, kept_trees = [], []
        for row_hidden, (parents, tokens, ids) in zip(unpack_rows(hidden, trees.offsets), trees.rows()):
            keep = self.pruner.prune(row_hidden, tokens, parents, tau)
            subtree, kept = TokenTree(tokens, parents).subtree(keep)
            kept_hidden.append(row_hidden[kept])
            kept_trees.append((subtree, ids[kept]))
        packed, offsets = pack_rows(kept_hidden)
        return packed, PackedTrees(offsets, torch.cat([tree.parents for tree, _ in kept_trees]),
                                   torch.cat([tree.tokens for tree, _ in kept_trees]), torch.cat([ids for _, ids in kept_trees]))

    @torch.inference_mode()
    def compact(self, session: Session, start_position: int, batch_offset: int, keep_ids: list[torch.Tensor]) -> None:
        """Keep only the accepted nodes (by id, root first) of each row's tree written at `start_position`, moved to
        the tree's first slots in the KV caches, token mask and output history; the rest of the tree's slots are
        masked. Rows without such a tree (already compacted, or rebuilt by a replay) are left as they are."""
        for row, ids in zip(range(batch_offset, batch_offset + len(keep_ids)), keep_ids):
            written = session.trees.get(row)
            if written is None or written[0] != start_position:
                continue
            offsets = self._slots_of(written[1], ids)
            keep = [offsets]
            for cache in session.caches:
                cache.compact(start_position, keep, row)
            compact_slots(session.output_history, 1, start_position, keep, row)
            session.token_mask[row, start_position:start_position + written[1].numel()] = False
            session.token_mask[row, start_position:start_position + offsets.numel()] = True
            del session.trees[row]

    @staticmethod
    def _slots_of(written: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The offsets in a written tree of the nodes `ids`; InvalidStep unless they are a root-first ascending path."""
        where = {int(node): offset for offset, node in enumerate(written.tolist())}
        if ids.numel() == 0 or any(int(node) not in where for node in ids):
            raise InvalidStep(f"the accepted nodes {ids.tolist()[:16]} are not nodes of the tree this server holds")
        offsets = torch.tensor([where[int(node)] for node in ids], dtype=torch.long)
        if int(offsets[0]) != 0 or bool((offsets[1:] <= offsets[:-1]).any()):
            raise InvalidStep("the accepted nodes must begin at the root and go down the tree in order")
        return offsets

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, start_block: int, end_block: int, token_mask: torch.Tensor | None,
                prompts: torch.Tensor | None = None, adapter: str | None = None) -> torch.Tensor:
        """Stateless forward of whole sequences through blocks [start_block, end_block) with `adapter`, with deep
        `prompts` [blocks, batch, prefix, hidden] added at the prefix positions before each block if given."""
        with self.adapters.active(adapter):
            return self._stateless(hidden, start_block, end_block, token_mask, prompts)

    def backward(self, hidden: torch.Tensor, start_block: int, end_block: int, token_mask: torch.Tensor | None,
                 prompts: torch.Tensor | None, grad_outputs: torch.Tensor,
                 adapter: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of `hidden` (and of `prompts`) through the forward `forward` computes of them, given its outputs'
        gradients; the blocks' weights stay frozen."""
        if tuple(grad_outputs.shape) != tuple(hidden.shape) or not grad_outputs.is_floating_point():
            raise InvalidStep(f"the outputs' gradients must be floating point of the inputs' shape {list(hidden.shape)}, "
                              f"got {grad_outputs.dtype} {list(grad_outputs.shape)}")
        inputs = [hidden.to(self.device, self.dtype).requires_grad_()]
        if prompts is not None:
            inputs.append(prompts.to(self.device, self.dtype).requires_grad_())
        with torch.enable_grad(), self.adapters.active(adapter):
            out = self._stateless(inputs[0], start_block, end_block, token_mask, inputs[1] if prompts is not None else None)
            grads = torch.autograd.grad(out, inputs, grad_outputs.to(out.device, out.dtype))
        return grads[0], grads[1] if prompts is not None else None

    def _stateless(self, hidden: torch.Tensor, start_block: int, end_block: int, token_mask: torch.Tensor | None,
                   prompts: torch.Tensor | None) -> torch.Tensor:
        self.check_range(start_block, end_block)
        self._check_hidden(hidden)
        batch, num_tokens = hidden.shape[:2]
        if prompts is not None:
            self._check_prompts(prompts, end_block - start_block, batch, num_tokens)
        if token_mask is None:
            key_padding = torch.ones(batch, num_tokens, dtype=torch.bool, device=self.device)
        elif tuple(token_mask.shape) != (batch, num_tokens):
            raise InvalidStep(f"token_mask must have shape {[batch, num_tokens]}, got {list(token_mask.shape)}")
        else:
            key_padding = token_mask.to(self.device, torch.bool)
        rope_positions = rope_positions_from_padding(key_padding)
        cache_positions = torch.arange(num_tokens, device=self.device)
        mask = stateless_causal_mask(num_tokens, key_padding)
        return self.stack(hidden.to(self.device, self.dtype), rope_positions, None, cache_positions, mask,
                          block_range=(start_block, end_block),
                          prompts=prompts.to(self.device, self.dtype) if prompts is not None else None)

    def _check_prompts(self, prompts: torch.Tensor, blocks: int, batch: int, num_tokens: int) -> None:
        """Raise InvalidStep unless deep prompts are [blocks, batch, prefix <= num_tokens, hidden] floating point."""
        if (prompts.ndim != 4 or tuple(prompts.shape[:2]) != (blocks, batch) or prompts.shape[2] > num_tokens
                or prompts.shape[3] != self.hidden_size or not prompts.is_floating_point()):
            raise InvalidStep(f"deep prompts must be floating point [{blocks} blocks, {batch} rows, prefix of at most "
                              f"{num_tokens} tokens, {self.hidden_size}], got {prompts.dtype} {list(prompts.shape)}")
