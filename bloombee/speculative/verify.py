"""Verification of a draft tree against the target model: the longest accepted path and the next (bonus) token.

Greedy: follow the children carrying the target's argmax. Sampling: SpecInfer's multi-candidate
speculative sampling for children drawn i.i.d. from the draft's distribution q, under which the
committed tokens are distributed exactly as the target's (warped) distribution p. Target and draft
distributions must come from the same ``warp_probs`` settings.
"""

from __future__ import annotations

import torch

from bloombee.speculative.tree import TokenTree


def warp_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """float32 probabilities [..., V] of logits divided by `temperature`, cut to the `top_k` most likely tokens
    (0: all; ties at the cut kept) and to the smallest most-likely set of mass >= `top_p`."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use greedy decoding for 0), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the more likely tokens already reach top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return logits.softmax(-1)


def children_lists(tree: TokenTree) -> list[list[int]]:
    """Each node's children, in node order."""
    children = [[] for _ in range(tree.size)]
    for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children[parent].append(node)
    return children


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """The accepted path (node indices, root first) and the bonus token: the target's argmax after the path."""
    best = target_logits.argmax(-1).tolist()
    tokens = tree.tokens.tolist()
    children = children_lists(tree)
    path = [0]
    while True:
        wanted = best[path[-1]]
        match = next((child for child in children[path[-1]] if tokens[child] == wanted), None)
        if match is None:
            return path, wanted
        path.append(match)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(p - q, 0)); `p` itself where that has no mass (a rejection of probability 0 in exact math)."""
    rest = (p - q).clamp(min=0)
    total = rest.sum()
    return rest / total if total > 0 else p


def verify_sampling(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The accepted path (root first) and the next token, by multi-candidate speculative sampling: each child c of
    the current node is accepted with probability min(1, p[c] / q[c]), else p becomes the residual of p - q and the
    next child is tried; with every child rejected (or at a leaf) the next token is drawn from the current p."""
    tokens = tree.tokens.tolist()
    children = children_lists(tree)
    path = [0]
    while True:
        node = path[-1]
        p, q = target_probs[node].float(), draft_probs[node].float()
        accepted = None
        for child in children[node]:
            token = tokens[child]
            if float(torch.rand((), generator=generator, device=p.device)) * float(q[token]) < float(p[token]):
                accepted = child
                break
            p = residual(p, q)
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(accepted)
