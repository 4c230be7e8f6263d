"""Forwards kept for a backward: a training client's span inputs, held until its backward names them.

A forward request with a `forward_id` leaves its inputs (hidden states, token mask, deep prompts) here; the backward
naming that id finds them, recomputes the span's forward with autograd and returns the gradients of the
inputs (the blocks stay frozen), and forgets them; a refused backward (a gradient of the wrong shape) leaves
them for a corrected one. Only the peer that kept a forward may use it; a forward nobody takes is
forgotten after --kept-forward-timeout seconds, and the inputs held at once are bounded by --kept-forward-bytes.
"""

import time
from dataclasses import dataclass, field

import torch

from bloombee.protocol import InvalidStep
from bloombee.server.memory import SessionRefused


@dataclass
class KeptForward:
    owner: str  # the peer that sent the forward
    start_block: int
    end_block: int
    hidden: torch.Tensor  # [batch, tokens, hidden]
    token_mask: torch.Tensor | None
    prompts: torch.Tensor | None  # [blocks, batch, prefix, hidden]: deep prompts
    adapter: str | None  # the LoRA adapter it computed
    kept_at: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in (self.hidden, self.token_mask, self.prompts) if tensor is not None)


class KeptForwards:
    """The forwards this server keeps for a backward, by id."""

    def __init__(self, max_bytes: int, timeout_s: float):
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self._kept: dict[str, KeptForward] = {}

    @property
    def nbytes(self) -> int:
        return sum(kept.nbytes for kept in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, forward_id: str, kept: KeptForward) -> None:
        """Hold `kept` under `forward_id`; InvalidStep if the id is taken, SessionRefused if it does not fit."""
        self.expire()
        if forward_id in self._kept:
            raise InvalidStep(f"a forward {forward_id!r} is kept already: each forward needs an id of its own")
        if self.nbytes + kept.nbytes > self.max_bytes:
            raise SessionRefused(f"keeping this forward's {kept.nbytes} bytes of inputs would pass this server's "
                                 f"--kept-forward-bytes {self.max_bytes} ({len(self._kept)} forwards wait for their "
                                 f"backward)")
        self._kept[forward_id] = kept

    def find(self, forward_id: str, owner: str) -> KeptForward:
        """The forward kept as `forward_id` for `owner`; InvalidStep naming why there is none."""
        self.expire()
        kept = self._kept.get(forward_id)
        if kept is None:
            raise InvalidStep(f"no forward {forward_id!r} is kept here: never sent with that id, its backward already "
                              f"ran, or it waited over {self.timeout_s:g} s")
        if kept.owner != owner:
            raise InvalidStep(f"forward {forward_id!r} was kept for another peer")
        return kept

    def forget(self, forward_id: str) -> None:
        """Drop a forward whose backward ran."""
        self._kept.pop(forward_id, None)

    def expire(self) -> None:
        """Forget the forwards that waited longer than the timeout."""
        deadline = time.monotonic() - self.timeout_s
        for forward_id in [forward_id for forward_id, kept in self._kept.items() if kept.kept_at < deadline]:
            del self._kept[forward_id]
