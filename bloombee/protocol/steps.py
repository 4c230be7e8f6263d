"""The kinds of step a step message carries: their tensors on the wire, and how a server classifies and checks them.

The names of a step's tensors decide its kind:

- a linear step: `hidden` [b, T, H], consecutive tokens of each row, maybe with `token_mask` and `rope_positions`
  [b, T];
- a tree step: `hidden` [nodes, H], each row's token tree packed, and the trees (`tree_offsets`, `tree_parents`,
  `tree_tokens`, `tree_ids`: a `bloombee.speculative.tree.PackedTrees`).

Either kind also carries a compaction (`compact_ids`, `compact_offsets`) when its header names `compact_start`: the
accepted nodes of each row's previous tree. Whether the tensors fit the session (rows, positions, width) the server's
backend checks when it computes the step.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

import torch

from bloombee.protocol.errors import InvalidStep
from bloombee.speculative.tree import PackedTrees, check_offsets, pack_rows, unpack_rows

Tensors = Mapping[str, torch.Tensor]


class StepKind(StrEnum):
    LINEAR = "linear"
    TREE = "tree"


@dataclass(frozen=True)
class LinearStep:
    """Consecutive tokens of each row: their hidden states, which of them are tokens, and their rope positions."""

    kind: ClassVar[StepKind] = StepKind.LINEAR
    TENSORS: ClassVar[tuple[str, ...]] = ("hidden", "token_mask", "rope_positions")
    REQUIRED: ClassVar[tuple[str, ...]] = ("hidden",)
    hidden: torch.Tensor
    token_mask: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None

    @classmethod
    def from_tensors(cls, tensors: Tensors) -> LinearStep:
        return cls(*(tensors.get(name) for name in cls.TENSORS))

    @staticmethod
    def rows_of(tensors: Tensors) -> int:
        """The rows a linear step's tensors hold."""
        return tensors["hidden"].shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The step's tensors by wire name (those it carries)."""
        return {name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None}


@dataclass(frozen=True)
class TreeStep:
    """Each row's token tree: its nodes' hidden states, packed, and the trees."""

    kind: ClassVar[StepKind] = StepKind.TREE
    TREE_TENSORS: ClassVar[tuple[str, ...]] = ("tree_offsets", "tree_parents", "tree_tokens", "tree_ids")
    TENSORS: ClassVar[tuple[str, ...]] = ("hidden",) + TREE_TENSORS
    REQUIRED: ClassVar[tuple[str, ...]] = TENSORS
    hidden: torch.Tensor
    trees: PackedTrees

    @classmethod
    def from_tensors(cls, tensors: Tensors) -> TreeStep:
        """The step; InvalidStep naming what is malformed in its trees."""
        trees = PackedTrees(*(tensors[name] for name in cls.TREE_TENSORS))
        try:
            trees.check()
        except ValueError as error:  # the trees' own checks: they know nothing of the wire
            raise InvalidStep(str(error)) from error
        return cls(tensors["hidden"], trees)

    @staticmethod
    def rows_of(tensors: Tensors) -> int:
        """The rows (trees) a tree step's tensors hold."""
        return tensors["tree_offsets"].numel() - 1

    def tensors(self) -> dict[str, torch.Tensor]:
        trees = self.trees
        return {"hidden": self.hidden, **dict(zip(self.TREE_TENSORS, (trees.offsets, trees.parents, trees.tokens,
                                                                      trees.ids)))}


@dataclass(frozen=True)
class Compaction:
    """The accepted nodes (ids, root first) of each row's previous tree, packed: ids and offsets [b + 1]."""

    TENSORS: ClassVar[tuple[str, ...]] = ("compact_ids", "compact_offsets")
    ids: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def of(cls, rows: list[torch.Tensor]) -> Compaction:
        return cls(*pack_rows(rows))

    @classmethod
    def from_tensors(cls, tensors: Tensors) -> Compaction:
        """The compaction; InvalidStep naming what is malformed."""
        ids, offsets = (tensors[name] for name in cls.TENSORS)
        if ids.ndim != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise InvalidStep(f"compact_ids must be a 1-d integer tensor, got {ids.dtype} {list(ids.shape)}")
        try:
            check_offsets(offsets, ids.numel())
        except ValueError as error:
            raise InvalidStep(str(error)) from error
        return cls(ids, offsets)

    def rows(self) -> list[torch.Tensor]:
        """Each row's accepted node ids."""
        return unpack_rows(self.ids, self.offsets)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.TENSORS, (self.ids, self.offsets)))


Step = LinearStep | TreeStep
STEP_TENSORS = tuple(dict.fromkeys(LinearStep.TENSORS + TreeStep.TENSORS + Compaction.TENSORS))  # all a step may carry


def step_kind(names: Collection[str], compact: bool = False) -> type[LinearStep] | type[TreeStep]:
    """The kind of step whose tensors are `names` (with a compaction if `compact`); InvalidStep naming what it lacks or
    what does not belong to it."""
    kind = TreeStep if any(name in names for name in TreeStep.TREE_TENSORS) else LinearStep
    extra = Compaction.TENSORS if compact else ()
    what = f"a {kind.kind.value} step{' with compact_start' if compact else ''}"
    missing = [name for name in kind.REQUIRED + extra if name not in names]
    if missing:
        raise InvalidStep(f"{what} needs the tensors {missing}")
    unexpected = [name for name in names if name not in kind.TENSORS + extra]
    if unexpected:
        raise InvalidStep(f"{what} carries only {list(kind.TENSORS + extra)}, not {unexpected}")
    return kind


def parse_step(tensors: Tensors, compact: bool) -> tuple[Step, Compaction | None]:
    """The step a step message's tensors make, and its compaction if its header names one (`compact`); InvalidStep
    naming what is malformed."""
    step = step_kind(tensors, compact).from_tensors(tensors)
    return step, Compaction.from_tensors(tensors) if compact else None


def step_rows(tensors: Tensors) -> int:
    """The rows whose tokens a step's tensors hold."""
    return step_kind(tensors).rows_of(tensors)
