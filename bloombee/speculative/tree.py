"""Token trees of speculative decoding: each request's tree as tokens + parent indices, packed for the wire.

Node 0 of a tree is its root (parent -1); every other node's parent comes before it. A node's rope
position is the position of its row's next token plus its depth; it attends the cached prefix and
its ancestors (and itself). Several requests' trees travel as one packed tensor of nodes plus the
offsets where each request's nodes begin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_parents(parents: torch.Tensor) -> None:
    """Raise ValueError unless `parents` [N] is a tree: node 0 the root (-1), every other parent an earlier node."""
    if parents.ndim != 1 or parents.numel() == 0 or parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tree parents must be a non-empty 1-d integer tensor, got {parents.dtype} {list(parents.shape)}")
    if int(parents[0]) != -1:
        raise ValueError(f"node 0 of a tree is its root and has parent -1, got {int(parents[0])}")
    earlier = torch.arange(parents.numel())
    if bool(((parents[1:] < 0) | (parents[1:] >= earlier[1:])).any()):
        raise ValueError("every tree node but the root must have an earlier node as its parent")


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth [N] of each node (the root 0)."""
    result = [0]
    for parent in parents.tolist()[1:]:  # a list: indexing a tensor node by node costs far more than the work
        result.append(result[parent] + 1)
    return torch.tensor(result, dtype=torch.long)


def ancestry(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: True at (i, j) where node j is node i or one of its ancestors."""
    lines = [[0]]
    for node, parent in enumerate(parents.tolist()[1:], start=1):
        lines.append(lines[parent] + [node])
    result = torch.zeros(len(lines), len(lines), dtype=torch.bool)
    result[[node for node, line in enumerate(lines) for _ in line], [j for line in lines for j in line]] = True
    return result


def close_under_ancestors(parents: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`keep` [N] with every node whose parent is dropped dropped too (the root always kept)."""
    closed = [True]
    for kept, parent in zip(keep.tolist()[1:], parents.tolist()[1:]):
        closed.append(bool(kept) and closed[parent])
    return torch.tensor(closed, dtype=torch.bool)


@dataclass(frozen=True)
class TokenTree:
    """One request's candidate tree: tokens [N] and parents [N] (node 0 the root, parent -1)."""

    tokens: torch.Tensor
    parents: torch.Tensor

    def __post_init__(self):
        check_parents(self.parents)
        if self.tokens.shape != self.parents.shape:
            raise ValueError(f"a tree has one token per node: {list(self.tokens.shape)} tokens, "
                             f"{list(self.parents.shape)} parents")

    @property
    def size(self) -> int:
        return self.parents.numel()

    def subtree(self, keep: torch.Tensor) -> tuple[TokenTree, torch.Tensor]:
        """The tree of the nodes `keep` [N] marks (closed under ancestors first) and their indices in this tree."""
        kept = close_under_ancestors(self.parents, keep).nonzero().flatten()
        new_index = torch.full((self.size,), -1, dtype=torch.long)
        new_index[kept] = torch.arange(kept.numel())
        parents = self.parents[kept]
        parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
        return TokenTree(self.tokens[kept], parents), kept

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root to `node`, in order."""
        path = [node]
        while path[-1] != 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]


def pack_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor of the rows' nodes [sum N_i, ...] and the offsets [b + 1] where each row's nodes begin."""
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor([row.shape[0] for row in rows], dtype=torch.long).cumsum(0)
    return torch.cat(rows), offsets


def unpack_rows(packed: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor]:
    """The rows pack_rows packed."""
    return [packed[int(first):int(end)] for first, end in zip(offsets[:-1], offsets[1:])]


def check_offsets(offsets: torch.Tensor, total: int) -> None:
    """Raise ValueError unless `offsets` [b + 1] splits `total` nodes into b non-empty rows."""
    if offsets.ndim != 1 or offsets.numel() < 2 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tree offsets must be a 1-d integer tensor of at least 2 entries, got {list(offsets.shape)}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != total or bool((offsets[1:] <= offsets[:-1]).any()):
        raise ValueError(f"tree offsets must rise from 0 to the {total} nodes sent, each row holding a node at least")


def dense_rows(packed: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """[b, width, ...]: each row's nodes first, zeros after them."""
    rows = unpack_rows(packed, offsets)
    dense = packed.new_zeros((len(rows), width) + tuple(packed.shape[1:]))
    for index, row in enumerate(rows):
        dense[index, :row.shape[0]] = row
    return dense


def packed_rows(dense: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The first counts[i] nodes of each row of `dense` [b, width, ...], packed."""
    return torch.cat([dense[index, :count] for index, count in enumerate(counts)])


def tree_mask(parents_rows: list[torch.Tensor], width: int, prefix_keys: torch.Tensor) -> torch.Tensor:
    """Attention mask [b, width, P + width] of trees written at slots [P, P + width) after a prefix whose readable
    slots `prefix_keys` [b, P] marks: each node attends the prefix and its ancestors; a slot past a row's tree
    attends only itself."""
    batch, prefix = prefix_keys.shape
    mask = torch.zeros(batch, width, prefix + width, dtype=torch.bool)
    mask[:, :, prefix:] = torch.eye(width, dtype=torch.bool)
    for row, parents in enumerate(parents_rows):
        size = parents.numel()
        mask[row, :size, :prefix] = prefix_keys[row].to(torch.bool)
        mask[row, :size, prefix:prefix + size] = ancestry(parents)
    return mask


@dataclass(frozen=True)
class PackedTrees:
    """The trees of consecutive rows as a tree step carries them (``bloombee.protocol.steps``): offsets [b + 1] into
    the packed nodes, and per node its parent (an index within its row's tree), token and id (its index in the tree
    the client built: pruning keeps ids)."""

    offsets: torch.Tensor
    parents: torch.Tensor
    tokens: torch.Tensor
    ids: torch.Tensor

    @classmethod
    def of(cls, trees: list[TokenTree]) -> PackedTrees:
        """The packed form of whole trees, their nodes' ids their indices."""
        parents, offsets = pack_rows([tree.parents for tree in trees])
        ids = torch.cat([torch.arange(tree.size) for tree in trees])
        return cls(offsets, parents, torch.cat([tree.tokens for tree in trees]), ids)

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    @property
    def counts(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def check(self) -> None:
        """Raise ValueError unless the offsets split the nodes into rows, each a tree, with a token and an id a node."""
        total = self.parents.numel()
        if self.parents.ndim != 1:
            raise ValueError(f"tree parents must be a 1-d tensor, one per node, got {list(self.parents.shape)}")
        check_offsets(self.offsets, total)
        for name in ("tokens", "ids"):
            tensor = getattr(self, name)
            if tensor.shape != self.parents.shape or tensor.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"tree {name} must be integers, one per node: {list(tensor.shape)} for {total} nodes")
        for parents in unpack_rows(self.parents, self.offsets):
            check_parents(parents)

    def rows(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(parents, tokens, ids) of each row."""
        return list(zip(*(unpack_rows(tensor, self.offsets) for tensor in (self.parents, self.tokens, self.ids))))

    def select(self, first: int, count: int) -> PackedTrees:
        """Rows [first, first + count)."""
        begin, end = int(self.offsets[first]), int(self.offsets[first + count])
        return PackedTrees(self.offsets[first:first + count + 1] - begin, self.parents[begin:end],
                           self.tokens[begin:end], self.ids[begin:end])
