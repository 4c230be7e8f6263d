"""Tree verification: greedy walks, the warping rule, and that speculative sampling keeps the target's distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from bloombee.speculative import verify
from bloombee.speculative.tree import TokenTree
from bloombee.speculative.verify import verify_greedy, verify_sampling, warp_probs

pytestmark = pytest.mark.usefixtures("single_thread_torch")

V = 5
TRIALS = 20_000
# A Markov chain over V tokens: row t is the next-token distribution after token t (target P, draft Q).
P = torch.tensor([[0.40, 0.25, 0.15, 0.15, 0.05],
                  [0.10, 0.50, 0.20, 0.10, 0.10],
                  [0.30, 0.05, 0.05, 0.30, 0.30],
                  [0.20, 0.20, 0.20, 0.20, 0.20],
                  [0.05, 0.15, 0.50, 0.10, 0.20]])
Q = torch.tensor([[0.10, 0.10, 0.50, 0.20, 0.10],
                  [0.30, 0.10, 0.10, 0.40, 0.10],
                  [0.20, 0.20, 0.20, 0.20, 0.20],
                  [0.05, 0.45, 0.05, 0.05, 0.40],
                  [0.40, 0.10, 0.10, 0.30, 0.10]])
PARENTS = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3])  # 3 i.i.d. children at the root, 2 under each


def one_hot_logits(best: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(best), vocab)
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits


def test_greedy_full_acceptance():
    tree = TokenTree(torch.tensor([4, 6, 8]), torch.tensor([-1, 0, 1]))
    assert verify_greedy(tree, one_hot_logits([6, 8, 3])) == ([0, 1, 2], 3)


def test_greedy_rejection_at_depth_one():
    tree = TokenTree(torch.tensor([4, 6, 7, 8]), torch.tensor([-1, 0, 0, 1]))
    assert verify_greedy(tree, one_hot_logits([9, 8, 1, 2])) == ([0], 9)


def test_greedy_chooses_the_matching_sibling():
    tree = TokenTree(torch.tensor([4, 5, 7, 7, 1, 2]), torch.tensor([-1, 0, 0, 0, 2, 3]))
    assert verify_greedy(tree, one_hot_logits([7, 0, 2, 2, 0, 0])) == ([0, 2], 2)  # first of the 7s, whose child is 1
    assert verify_greedy(tree, one_hot_logits([7, 0, 1, 2, 6, 0])) == ([0, 2, 4], 6)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 4, 1.0),
                                                       (1.0, 0, 0.8), (0.9, 7, 0.6)])
def test_warp_probs_equals_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(1)) * 2
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    probs = warp_probs(logits, temperature, top_k, top_p)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, expected.softmax(-1))


def test_warp_probs_rejects_bad_settings():
    with pytest.raises(ValueError):
        warp_probs(torch.zeros(3), temperature=0)
    with pytest.raises(ValueError):
        warp_probs(torch.zeros(3), top_p=0)


def draft_tree(root: int, generator: torch.Generator) -> TokenTree:
    """The root's 3 children drawn i.i.d. from Q[root], each one's 2 children i.i.d. from Q[child]."""
    children = torch.multinomial(Q[root], 3, replacement=True, generator=generator)
    grandchildren = torch.multinomial(Q[children], 2, replacement=True, generator=generator)
    return TokenTree(torch.cat([torch.tensor([root]), children, grandchildren.flatten()]), PARENTS)


def first_two_tokens(generator: torch.Generator, root: int = 0) -> tuple[int, int]:
    """The first two tokens generated after `root` by rounds of draft + verify_sampling."""
    committed = []
    while len(committed) < 2:
        tree = draft_tree(root, generator)
        path, bonus = verify_sampling(tree, P[tree.tokens], Q[tree.tokens], generator)
        committed += tree.tokens[path[1:]].tolist() + [bonus]
        root = committed[-1]
    return committed[0], committed[1]


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against the distribution `expected` (all cells > 0)."""
    n = counts.sum()
    statistic = ((counts - n * expected) ** 2 / (n * expected)).sum()
    dof = torch.tensor(counts.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def sampling_p_values() -> tuple[float, float]:
    """Chi-square p-values of the first token and of the first two tokens against the target chain from token 0."""
    generator = torch.Generator().manual_seed(1234)
    pairs = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(TRIALS):
        pairs[first_two_tokens(generator)] += 1
    target_pairs = (P[0][:, None] * P).double()
    return chi_square_p_value(pairs.sum(1), P[0].double()), chi_square_p_value(pairs.flatten(), target_pairs.flatten())


def test_speculative_sampling_keeps_the_target_distribution():
    first, pair = sampling_p_values()
    assert first > 1e-3 and pair > 1e-3, (first, pair)


def test_the_sampling_test_detects_a_wrong_rule(monkeypatch):
    """Drawing from the original p after a rejection (no residual) biases the output; the test must notice."""
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    first, pair = sampling_p_values()
    assert first < 1e-6 and pair < 1e-6, (first, pair)


def test_sampling_accepts_everything_when_draft_equals_target():
    generator = torch.Generator().manual_seed(0)
    tree = draft_tree(0, generator)
    path, _ = verify_sampling(tree, Q[tree.tokens], Q[tree.tokens], generator)
    assert len(path) == 3
