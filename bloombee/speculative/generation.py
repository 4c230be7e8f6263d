"""Speculative generation through a swarm session: the draft proposes token trees, the chain computes them in one
pass, the client verifies them with its LM head and commits the longest accepted path plus one token.

Each row of a batch advances by its own accepted count; the session's slots advance by the longest,
and the other rows' unused slots stay masked (holes). The first token comes from the prompt's step;
every round's tree is rooted at the row's last committed token, which no model has computed yet.
Greedy verification gives exactly plain greedy decoding; sampling uses multi-candidate rejection
sampling, so tokens follow the target's distribution (pruning is off there: dropping candidates by
their value would bias the rule).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bloombee.speculative.draft import DraftModel, tree_size
from bloombee.speculative.switch import SpeculationSwitch
from bloombee.speculative.tree import PackedTrees, TokenTree, unpack_rows
from bloombee.speculative.verify import verify_greedy, verify_sampling, warp_probs

logger = logging.getLogger(__name__)

DEFAULT_WIDTHS = (2, 2, 1, 1)  # children per node at each depth: 1 + 2 + 4 + 4 + 4 = 15 nodes


def cut(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """A row's generated tokens up to max_new_tokens and its first end of sequence."""
    tokens = tokens[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[:tokens.index(eos_token_id) + 1]
    return tokens


@dataclass
class Sampling:
    """How the next token is chosen: greedy, or sampled from the warped distribution."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp_probs(logits, self.temperature, self.top_k, self.top_p)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of `logits` [b, V]."""
        if not self.do_sample:
            return logits.argmax(-1)
        return torch.multinomial(self.probs(logits), 1, generator=self.generator).squeeze(-1)


@dataclass
class RoundStats:
    """What speculation did over a generation: rounds, committed tokens and tree nodes sent per hop."""

    tree_rounds: int = 0
    plain_rounds: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens committed per row per tree round
    nodes_proposed: list[int] = field(default_factory=list)  # tree nodes per tree round (all rows)
    nodes_per_hop: list[list[int]] = field(default_factory=list)  # per tree round, the nodes each server sent on
    completed_at: list[float] = field(default_factory=list)  # seconds from the start when each row finished
    chain: list[tuple[str, int, int]] = field(default_factory=list)  # (server name, first block, end) at the end


class SpeculativeGenerator:
    """Runs one generate() call of `model` with `draft` in a session of its own."""

    def __init__(self, model, draft: DraftModel, widths: tuple[int, ...] = DEFAULT_WIDTHS,
                 prune_tau: float | None = None, switch: SpeculationSwitch | None = None, streamer=None,
                 on_tokens: Callable[[int, list[int]], bool] | None = None):
        self.model, self.draft, self.widths = model, draft, tuple(widths)
        self.prune_tau, self.switch = prune_tau, switch or SpeculationSwitch("on")
        self.streamer = streamer  # transformers-style: put(tokens [1, n]) as row 0's tokens come, end() at the end
        self.on_tokens = on_tokens  # (row, its new tokens) after each round; True ends that row
        self.stats = RoundStats()

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
                 sampling: Sampling, eos_token_id: int | None, pad_token_id: int | None) -> torch.Tensor:
        """The sequences [b, T + new]: prompt, generated tokens, and after a row's end of sequence its padding."""
        batch = input_ids.shape[0]
        room = tree_size(self.widths)
        began = time.perf_counter()
        length = self._session_length(input_ids.shape[1], max_new_tokens, room, batch)
        with self.model.remote.inference_session(length, batch) as session:
            logits = self._logits(session.step(self.model.head.embed(input_ids), attention_mask))[:, -1]
            generated = [[int(token)] for token in sampling.choose(logits)]
            self._stream(input_ids[:1])
            streamed = self._stream_new(generated[0], 0, max_new_tokens, eos_token_id)
            done = [self._told_to_stop(row, tokens) or self._finished(tokens, max_new_tokens, eos_token_id)
                    for row, tokens in enumerate(generated)]
            self._mark_done(done, [False] * batch, began)
            draft_in_step = False
            while not all(done):
                self.switch.bandwidths = session.figures.hop_bandwidths(session.spans)  # the client's view of the chain
                roots = torch.tensor([row[-1] for row in generated])
                if self.switch.speculate() and session.supports_tree_steps() and self._worth_trying(session):
                    if not draft_in_step:
                        self._prefill_draft(session, input_ids, attention_mask, generated, room)
                        draft_in_step = True
                    new_tokens = self._tree_round(session, roots, done, sampling, max_new_tokens - min(
                        len(row) for row, finished in zip(generated, done) if not finished))
                else:
                    new_tokens, draft_in_step = self._plain_round(session, roots, sampling), False
                was_done = list(done)
                for row, tokens in enumerate(new_tokens):
                    if not done[row]:
                        generated[row].extend(tokens)
                        done[row] = (self._told_to_stop(row, tokens)
                                     or self._finished(generated[row], max_new_tokens, eos_token_id))
                streamed = self._stream_new(generated[0], streamed, max_new_tokens, eos_token_id)
                self._mark_done(done, was_done, began)
            self.stats.chain = [(span.record.public_name or span.peer_id[-8:], span.start, span.end)
                                for span in session.spans]
        if self.streamer is not None:
            self.streamer.end()
        return self._sequences(input_ids, generated, max_new_tokens, eos_token_id, pad_token_id)

    def _session_length(self, prompt: int, max_new_tokens: int, room: int, batch: int) -> int:
        """Positions to open: the sequence, a tree's room, and with several rows the slots rows that accept less than
        the longest path leave unused (up to one per new token), within the servers' announced limit (trees shrink to
        what is left, so a session of just the sequence still completes)."""
        length = prompt + max_new_tokens
        wanted = length + room + (max_new_tokens if batch > 1 else 0)
        limit = self.model.remote.session_length_limit()
        return max(length, min(wanted, limit)) if limit else wanted

    def _told_to_stop(self, row: int, tokens: list[int]) -> bool:
        """Hand a row's new tokens to `on_tokens`; whether it ends the row."""
        return self.on_tokens is not None and self.on_tokens(row, tokens)

    def _stream(self, tokens: torch.Tensor) -> None:
        if self.streamer is not None:
            self.streamer.put(tokens)

    def _stream_new(self, row: list[int], streamed: int, max_new_tokens: int, eos_token_id: int | None) -> int:
        """Stream row 0's tokens after the first `streamed`, up to its end; how many are streamed now."""
        kept = cut(row, max_new_tokens, eos_token_id)
        if len(kept) > streamed:
            self._stream(torch.tensor([kept[streamed:]]))
        return max(len(kept), streamed)

    def _tree_round(self, session, roots: torch.Tensor, done: list[bool], sampling: Sampling,
                    tokens_left: int) -> list[list[int]]:
        """One speculative round: the tokens each row commits after its root."""
        widths = self._widths_that_fit(session, tokens_left)
        began = round_began = time.perf_counter()
        proposed = self.draft.propose(roots, widths, sample=sampling.do_sample, warp=sampling.probs,
                                      generator=sampling.generator)
        trees = [TokenTree(tree.tree.tokens[:1], tree.tree.parents[:1]) if finished else tree.tree
                 for tree, finished in zip(proposed, done)]
        draft_s = time.perf_counter() - began
        packed = PackedTrees.of(trees)
        hidden = self.model.head.embed(packed.tokens)
        tau = None if sampling.do_sample else self.switch.prune_tau(self.prune_tau)
        out, kept = session.tree_step(hidden, packed, tau)
        logits = self._logits(out)
        accepted_ids, new_tokens = [], []
        for row, (row_logits, (parents, tokens, ids)) in enumerate(zip(unpack_rows(logits, kept.offsets), kept.rows())):
            tree = TokenTree(tokens, parents)
            if sampling.do_sample:
                path, bonus = verify_sampling(tree, sampling.probs(row_logits), proposed[row].probs[ids].cpu(),
                                              sampling.generator)
            else:
                path, bonus = verify_greedy(tree, row_logits)
            accepted_ids.append(ids[path])
            new_tokens.append(tokens[path[1:]].tolist() + [bonus])
        session.commit_tree(accepted_ids)
        self.draft.commit(accepted_ids, max(ids.numel() for ids in accepted_ids))
        self._record_tree_round(session, packed, new_tokens, done, draft_s, time.perf_counter() - round_began)
        return new_tokens

    def _worth_trying(self, session) -> bool:
        """Before the switch tries a tree: whether the planner's model says it could pay at all."""
        if not self.switch.untried():
            return True
        widths = self.switch.widths(self.widths)
        return self.switch.consider(session.predicted_step_s(1), session.predicted_step_s(tree_size(widths)), len(widths))

    def _prefill_draft(self, session, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       generated: list[list[int]], room: int) -> None:
        """Start the draft on each row's committed tokens but the last (each tree's root), left-padded."""
        prompt_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        rows = [torch.cat([input_ids[row][prompt_mask[row]], torch.tensor(tokens[:-1], dtype=input_ids.dtype)])
                for row, tokens in enumerate(generated)]
        longest = max(row.numel() for row in rows)
        ids = torch.zeros(len(rows), longest, dtype=input_ids.dtype)
        mask = torch.zeros(len(rows), longest, dtype=torch.bool)
        for index, row in enumerate(rows):
            ids[index, longest - row.numel():], mask[index, longest - row.numel():] = row, True
        self.draft.start(len(rows), session.max_length, room)
        self.draft.prefill(ids, mask)

    def _plain_round(self, session, roots: torch.Tensor, sampling: Sampling) -> list[list[int]]:
        """One ordinary decode step (the draft is not run: it is started again before the next tree)."""
        began = time.perf_counter()
        logits = self._logits(session.step(self.model.head.embed(roots[:, None])))[:, -1]
        new_tokens = [[int(token)] for token in sampling.choose(logits)]
        self.switch.observe_plain(time.perf_counter() - began, session.last_step)
        self.stats.plain_rounds += 1
        return new_tokens

    def _record_tree_round(self, session, packed: PackedTrees, new_tokens: list[list[int]], done: list[bool],
                           draft_s: float, round_s: float) -> None:
        step = session.last_step
        live = [len(tokens) for tokens, finished in zip(new_tokens, done) if not finished]
        self.stats.tree_rounds += 1
        self.stats.accepted.extend(live)
        self.stats.nodes_proposed.append(packed.parents.numel())
        self.stats.nodes_per_hop.append([report.nodes for report in step.reports])
        self.switch.observe_tree(round_s - draft_s, draft_s, min(live, default=1), step,  # the batch waits for its
                                 max(len(live), 1))  # slowest row

    def _widths_that_fit(self, session, tokens_left: int) -> tuple[int, ...]:
        """The configured widths cut to the depth worth proposing (no deeper than the most tokens a row still
        wants) and to the session's free slots: the tree must fit, and leave a slot for each token the slowest row
        wants after this round (a round advances the slots by its longest accepted path, and gives every row at
        least one token), so the generation always completes."""
        widths = self.switch.widths(self.widths)[:max(tokens_left - 1, 0)]
        free = session.max_length - session.position
        while widths and (tree_size(widths) > free or free - (len(widths) + 1) < tokens_left - 1):
            widths = widths[:-1]
        return widths

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.head
        return head.logits(hidden.to(next(head.parameters()).dtype)).float()

    @staticmethod
    def _finished(row: list[int], max_new_tokens: int, eos_token_id: int | None) -> bool:
        return len(row) >= max_new_tokens or (eos_token_id is not None and eos_token_id in row)

    def _mark_done(self, done: list[bool], was_done: list[bool], began: float) -> None:
        elapsed = time.perf_counter() - began
        self.stats.completed_at.extend(elapsed for now, before in zip(done, was_done) if now and not before)

    @staticmethod
    def _sequences(input_ids: torch.Tensor, generated: list[list[int]], max_new_tokens: int, eos_token_id: int | None,
                   pad_token_id: int | None) -> torch.Tensor:
        """Each row cut after its end of sequence (or at max_new_tokens), padded to the longest row."""
        rows = [cut(tokens, max_new_tokens, eos_token_id) for tokens in generated]
        longest = max(len(tokens) for tokens in rows)
        pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)
        new = torch.full((len(rows), longest), pad, dtype=input_ids.dtype)
        for index, tokens in enumerate(rows):
            new[index, :len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
        return torch.cat([input_ids, new], dim=1)
