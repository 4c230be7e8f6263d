"""The draft model of tree speculative decoding, run locally with the package's own blocks and KV caches.

Its caches follow the session's KV layout: the prompt at slots [0, T) (left padding masked), then
each round's tree at slots [P, P + N) in node order, attending the row's committed slots and the
node's ancestors, rope position = committed tokens of the row + depth. ``commit`` keeps each row's
accepted path at [P, P + len_r), leaves holes (masked slots) up to P + advance and moves P there.
Trees are built breadth-first, one depth level for all rows per forward pass, as many nodes per
depth as `widths` give (widths[d] children per depth-d node): greedily, a level holds the most
probable paths (by the draft's probability of the whole path) among the children of the level
above, however they fall on its nodes; sampled, each node's children are i.i.d. draws from the
warped distribution (the rejection rule needs them so).
The deepest level is chosen but not run: no child of a leaf is ever proposed, and a leaf that is
accepted is run together with the next round's roots (one pass fewer per round).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bloombee.loading import load_block_stack, load_client_head, load_model_config, resolve_model
from bloombee.models.core.masks import causal_mask, rope_positions_from_padding
from bloombee.speculative.dtypes import faster_dtype
from bloombee.speculative.tree import TokenTree
from bloombee.speculative.verify import warp_probs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftTree:
    """One row's proposed tree and the draft's (warped) distribution [N, V] at each node that has children (the
    leaves' rows are zeros: nothing is drawn from them)."""

    tree: TokenTree
    probs: torch.Tensor


def tree_size(widths: tuple[int, ...]) -> int:
    """Nodes of a tree whose depth-d nodes have widths[d] children each: 1 + w0 + w0 * w1 + ..."""
    size = level = 1
    for width in widths:
        level *= width
        size += level
    return size


class DraftModel:
    """A small model proposing token trees; its KV caches mirror the target session's slot layout."""

    def __init__(self, model: str = "bloombee-tiny-draft", dtype: torch.dtype | str = torch.float32,
                 device: torch.device | str = "cpu"):
        """`dtype` "auto": the blocks and the head (embeddings, LM head) each in the faster of float32 and bfloat16 on
        `device`, measured for a level of 4 nodes (`faster_dtype`)."""
        path = resolve_model(model)
        config = load_model_config(path)
        auto = dtype == "auto"
        self.head = load_client_head(path, torch.float32 if auto else dtype, device)
        block_dtype = head_dtype = dtype
        if auto:  # the blocks timed on a matrix of their MLP's shape, the head on its own weights
            block_dtype = faster_dtype(torch.zeros(config.intermediate_size, config.hidden_size, device=device), rows=4)
            head_dtype = faster_dtype(self.head.lm_head.weight, rows=4)
            self.head.to(head_dtype)
            logger.info("draft %s: blocks in %s, head in %s", model, block_dtype, head_dtype)
        self.stack = load_block_stack(path, 0, config.num_hidden_layers, block_dtype, device)
        self.block_dtype, self.head_dtype = block_dtype, head_dtype
        self.device = self.head.device
        self.caches, self.token_mask = [], None
        self.max_length = self.max_tree_nodes = self.position = self.proposed_size = 0
        self.leaf_level = 0  # the offset of the last tree's deepest level, whose nodes were not run
        self.leaf_tokens: torch.Tensor | None = None  # [b, n] those nodes' tokens
        self.unrun: torch.Tensor | None = None  # [b] token of each row's committed leaf at slot P - 1, or -1

    @property
    def batch_size(self) -> int:
        return 0 if self.token_mask is None else self.token_mask.shape[0]

    @torch.inference_mode()
    def start(self, batch_size: int, max_length: int, max_tree_nodes: int) -> None:
        """Empty caches of max_length + max_tree_nodes slots per row; position 0."""
        capacity = max_length + max_tree_nodes
        self.caches = self.stack.new_caches(batch_size, capacity)
        self.token_mask = torch.zeros(batch_size, capacity, dtype=torch.bool, device=self.device)
        self.max_length, self.max_tree_nodes = max_length, max_tree_nodes
        self.position = self.proposed_size = 0
        self.unrun = None

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        """Write `input_ids` [b, T] (left padding False in `token_mask`) at slots [P, P + T) (P = 0 after start)."""
        batch, length = input_ids.shape
        self._check_rows(batch)
        start, end = self.position, self.position + length
        if end > self.max_length:
            raise ValueError(f"prefill of {length} tokens at position {start} exceeds max_length {self.max_length}")
        self.token_mask[:, start:end] = True if token_mask is None else token_mask.to(self.device, torch.bool)
        key_padding = self.token_mask[:, :end]
        cache_positions = torch.arange(start, end, device=self.device)
        rope = rope_positions_from_padding(key_padding)[:, start:end]
        mask = causal_mask(cache_positions, end, key_padding)
        self.stack(self._embed(input_ids.to(self.device)), rope, self.caches, cache_positions, mask)
        self.position, self.proposed_size = end, 0

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor, widths: tuple[int, ...], sample: bool = False,
                warp: Callable[[torch.Tensor], torch.Tensor] | None = None,
                generator: torch.Generator | None = None) -> list[DraftTree]:
        """Each row's tree rooted at roots[r], written at slots [P, P + N) (N = tree_size(widths)): greedily the most
        probable paths, or (`sample`) widths[d] i.i.d. draws from warp(logits) per depth-d node (default softmax;
        `generator` on the model's device)."""
        warp = warp or warp_probs
        size = tree_size(widths)
        self._check_rows(roots.shape[0])
        self._check_tree_fits(size)
        parents = torch.full((roots.shape[0], size), -1, dtype=torch.long, device=self.device)
        mask = self._prefix_mask(size)
        prefix_count = self.token_mask[:, :self.position].sum(-1)
        level_tokens = roots.to(self.device, torch.long)[:, None]
        path_logp = torch.zeros(level_tokens.shape, device=self.device)
        tokens, probs, first = [], [], 0
        for depth, width in enumerate(widths):
            end = first + level_tokens.shape[1]
            if depth == 0:
                logits = self._forward_roots(level_tokens, mask, prefix_count)
            else:
                logits = self._forward_level(level_tokens, depth, first, end, mask, prefix_count)
            tokens.append(level_tokens)
            probs.append(warp(logits))
            if sample:
                level_tokens, level_parents = self._drawn_children(probs[-1], width, generator)
            else:
                level_tokens, level_parents, path_logp = self._likeliest_children(logits, path_logp, width)
            self._attach(parents, mask, first + level_parents, end)
            first = end
        tokens.append(level_tokens)
        if widths:
            probs.append(torch.zeros(*level_tokens.shape, self.head.config.vocab_size, device=self.device))
        else:  # a lone root is run: it is not a leaf of a level that was chosen without a pass
            probs.append(warp(self._forward_roots(level_tokens, mask, prefix_count)))
            first = size
        self.proposed_size, self.leaf_level, self.leaf_tokens = size, first, level_tokens
        return self._rows(torch.cat(tokens, 1), torch.cat(probs, 1), parents)

    @torch.inference_mode()
    def commit(self, keep: list[torch.Tensor], advance: int) -> None:
        """Keep each row's accepted nodes (offsets keep[r], ascending, into the last tree) at [P, P + len_r), mask the
        slots after them up to P + advance, and move P there."""
        self._check_keep(keep, advance)
        for cache in self.caches:
            cache.compact(self.position, keep)
        start = self.position
        self.token_mask[:, start:start + self.proposed_size] = False
        unrun = torch.full((len(keep),), -1, dtype=torch.long, device=self.device)
        for row, offsets in enumerate(keep):
            self.token_mask[row, start:start + offsets.numel()] = True
            if offsets.numel() and int(offsets[-1]) >= self.leaf_level:  # its path ends at a leaf: at slot P - 1
                unrun[row] = self.leaf_tokens[row, int(offsets[-1]) - self.leaf_level]
        self.unrun = unrun if bool((unrun >= 0).any()) else None
        self.position, self.proposed_size = start + advance, 0

    def _forward_roots(self, roots, mask, prefix_count) -> torch.Tensor:
        """Logits [b, 1, V] of the roots, written at slot P; with them, in the same pass, the leaves the last commit
        kept at slot P - 1 (a row without one writes its root there too, attending only itself: that slot is one
        of its holes)."""
        if self.unrun is None:
            return self._forward_level(roots, 0, 0, 1, mask, prefix_count)
        start, pending = self.position, self.unrun >= 0
        leaf_keys = torch.zeros(roots.shape[0], start + 1, dtype=torch.bool, device=self.device)
        leaf_keys[:, :start] = self.token_mask[:, :start] & pending[:, None]
        leaf_keys[:, start - 1] = True
        tokens = torch.cat([torch.where(pending, self.unrun, roots[:, 0])[:, None], roots], 1)
        rope = torch.stack([prefix_count - 1, prefix_count], 1)
        keys = torch.stack([leaf_keys, mask[:, 0, :start + 1]], 1)
        hidden = self.stack(self._embed(tokens), rope, self.caches, torch.arange(start - 1, start + 1,
                                                                                device=self.device), keys)
        self.unrun = None
        return self._logits(hidden[:, 1:])

    def _forward_level(self, level_tokens, depth, first, end, mask, prefix_count) -> torch.Tensor:
        """Logits [b, n, V] of the depth-`depth` nodes [first, end), their KV written at slots P + [first, end)."""
        start = self.position
        cache_positions = torch.arange(start + first, start + end, device=self.device)
        rope = (prefix_count + depth)[:, None].expand(-1, end - first)
        hidden = self.stack(self._embed(level_tokens), rope, self.caches, cache_positions,
                            mask[:, first:end, :start + end])
        return self._logits(hidden)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head.embed(tokens).to(self.block_dtype)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden.to(self.head_dtype))

    @staticmethod
    def _drawn_children(probs, width, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [b, n * width] of the next level, each node's `width` i.i.d. draws consecutive, and their parents
        (indices into this level)."""
        batch, nodes, vocab = probs.shape
        drawn = torch.multinomial(probs.reshape(-1, vocab), width, replacement=True, generator=generator)
        parents = torch.arange(nodes, device=probs.device).repeat_interleave(width).expand(batch, -1)
        return drawn.reshape(batch, nodes * width), parents

    @staticmethod
    def _likeliest_children(logits, path_logp, width) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The n * width children of this level's n nodes whose paths are the most probable: their tokens [b, n * w],
        parents (indices into this level) and paths' log-probabilities, most probable first."""
        vocab = logits.shape[-1]
        paths = path_logp[:, :, None] + logits.float().log_softmax(-1)
        best = paths.flatten(1).topk(logits.shape[1] * width, dim=-1)
        return best.indices % vocab, best.indices // vocab, best.values

    def _prefix_mask(self, size: int) -> torch.Tensor:
        """[b, N, P + N]: every node attends its row's committed slots and itself (its ancestors come with _attach)."""
        mask = torch.zeros(self.batch_size, size, self.position + size, dtype=torch.bool, device=self.device)
        mask[:, :, :self.position] = self.token_mask[:, None, :self.position]
        mask[:, :, self.position:] = torch.eye(size, dtype=torch.bool, device=self.device)
        return mask

    def _attach(self, parents: torch.Tensor, mask: torch.Tensor, level_parents: torch.Tensor, start: int) -> None:
        """Record the parents [b, n] of the next level's nodes [start, start + n): in `parents`, and in `mask` their
        parents' ancestors as theirs."""
        end, tree = start + level_parents.shape[1], slice(self.position, None)
        parents[:, start:end] = level_parents
        rows = torch.arange(parents.shape[0], device=self.device)[:, None]
        mask[:, start:end, tree] |= mask[rows, level_parents, tree]

    @staticmethod
    def _rows(tokens: torch.Tensor, probs: torch.Tensor, parents: torch.Tensor) -> list[DraftTree]:
        tokens, parents = tokens.cpu(), parents.cpu()
        return [DraftTree(TokenTree(tokens[row], parents[row]), probs[row]) for row in range(tokens.shape[0])]

    def _check_rows(self, batch: int) -> None:
        if self.token_mask is None:
            raise ValueError("call start(batch_size, max_length, max_tree_nodes) first")
        if batch != self.batch_size:
            raise ValueError(f"expected {self.batch_size} rows (the started batch), got {batch}")

    def _check_tree_fits(self, size: int) -> None:
        if size > self.max_tree_nodes:
            raise ValueError(f"a tree of {size} nodes exceeds max_tree_nodes {self.max_tree_nodes}")
        if self.position > self.max_length:
            raise ValueError(f"position {self.position} is past max_length {self.max_length}")

    def _check_keep(self, keep: list[torch.Tensor], advance: int) -> None:
        if self.proposed_size == 0:
            raise ValueError("commit needs a proposed tree: call propose first")
        if len(keep) != self.batch_size:
            raise ValueError(f"keep must hold one tensor per row ({self.batch_size}), got {len(keep)}")
        for row, offsets in enumerate(keep):
            bad_range = offsets.numel() and (int(offsets.min()) < 0 or int(offsets.max()) >= self.proposed_size)
            if offsets.ndim != 1 or bad_range or bool((offsets[1:] <= offsets[:-1]).any()):
                raise ValueError(f"keep[{row}] must be ascending node offsets in [0, {self.proposed_size}), "
                                 f"got {offsets.tolist()}")
        longest = max(offsets.numel() for offsets in keep)
        if not longest <= advance <= self.proposed_size:
            raise ValueError(f"advance must be between the longest kept path ({longest}) and the tree size "
                             f"({self.proposed_size}), got {advance}")
