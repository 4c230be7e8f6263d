"""A deliberately faulty block server, for tests only: `python tests/faulty_server.py FAULT_FROM <bloombee-server flags>`.

It serves like `bloombee-server`, but from position FAULT_FROM on the outputs of its inference steps carry noise of
their own scale (written to its output history too, so that what it reports is what it sent on), and it announces a
throughput a thousand times its own, so that clients route through it. Stateless forwards stay honest.
"""

import sys
from dataclasses import replace

import torch

from bloombee.cli.server import main
from bloombee.server.backend import BlockBackend, PreparedStep
from bloombee.server.server import Server
from bloombee.server.sessions import Session

BOAST = 1000.0  # the factor of the announced throughput over the real one


class FaultyBackend(BlockBackend):
    """A backend whose session steps add noise to every output at positions from `fault_from` on."""

    fault_from = 0

    def prepare_step(self, session: Session, hidden: torch.Tensor, start_position: int, batch_offset: int,
                     token_mask: torch.Tensor | None, rope_positions: torch.Tensor | None) -> PreparedStep:
        """The honest step, its output noisy at positions >= fault_from, as returned and as kept in the history."""
        prepared = super().prepare_step(session, hidden, start_position, batch_offset, token_mask, rope_positions)
        first = max(self.fault_from - start_position, 0)
        if first >= hidden.shape[1]:
            return prepared

        def noisy(out: torch.Tensor) -> torch.Tensor:
            out = prepared.finish(out).clone()
            generator = torch.Generator().manual_seed(start_position)
            noise = torch.randn(out[:, first:].shape, generator=generator) * out.float().std()
            out[:, first:] += noise.to(out.dtype)
            rows = slice(batch_offset, batch_offset + out.shape[0])
            session.output_history[rows, start_position + first:start_position + out.shape[1]] = out[:, first:]
            return out

        return replace(prepared, finish=noisy)


class FaultyServer(Server):
    """A Server with a FaultyBackend that boasts of its throughput."""

    def _load(self, start: int, end: int) -> BlockBackend:
        """The honest server's blocks, run by a FaultyBackend."""
        honest = super()._load(start, end)
        return FaultyBackend(honest.stack, honest.device, honest.dtype, honest.offload)

    def record(self):
        """The honest record, but for a boasted throughput."""
        record = super().record()
        return record.model_copy(update={"throughput": record.throughput * BOAST})


if __name__ == "__main__":
    FaultyBackend.fault_from = int(sys.argv[1])
    main(sys.argv[2:], server_class=FaultyServer)
