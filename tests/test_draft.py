"""DraftModel against transformers: greedy chains, node distributions over prefix + path, and commits with holes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bloombee.loading import resolve_model
from bloombee.speculative.draft import DraftModel, tree_size
from bloombee.speculative.verify import warp_probs

pytestmark = pytest.mark.usefixtures("single_thread_torch")

PAD = 2
PROMPTS = [[0, 57, 301, 12, 998, 45, 7], [0, 1500, 33, 609]]
ROOTS = torch.tensor([88, 402])


@pytest.fixture(scope="module")
def reference():
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model("bloombee-tiny-draft")), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def draft():
    return DraftModel("bloombee-tiny-draft")


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.tensor([[PAD] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[False] * (width - len(row)) + [True] * len(row) for row in rows])
    return ids, mask


def started(draft: DraftModel, rows: list[list[int]], max_tree_nodes: int = 16) -> DraftModel:
    draft.start(len(rows), 48, max_tree_nodes)
    draft.prefill(*left_padded(rows))
    return draft


@torch.no_grad()
def reference_probs(model, prefix: list[int], tree) -> torch.Tensor:
    """transformers' next-token distribution [N, V] after prefix + the tokens of the path to each node."""
    tokens = tree.tokens.tolist()
    rows = []
    for node in range(tree.size):
        sequence = prefix + [tokens[i] for i in tree.path_to(node)]
        rows.append(model(torch.tensor([sequence])).logits[0, -1].softmax(-1))
    return torch.stack(rows)


def internal(tree) -> torch.Tensor:
    """The nodes with children (the draft's distributions are kept there only)."""
    return torch.unique(tree.parents[1:])


def assert_matches_reference(model, prefixes: list[list[int]], trees) -> None:
    for prefix, proposed in zip(prefixes, trees):
        nodes = internal(proposed.tree)
        torch.testing.assert_close(proposed.probs[nodes], reference_probs(model, prefix, proposed.tree)[nodes],
                                   atol=1e-4, rtol=0)


def test_tree_size():
    assert tree_size(()) == 1 and tree_size((3, 2, 1)) == 1 + 3 + 6 + 6


def test_greedy_chain_equals_generate(draft, reference):
    trees = started(draft, PROMPTS).propose(ROOTS, (1, 1, 1, 1))
    for prompt, root, proposed in zip(PROMPTS, ROOTS.tolist(), trees):
        assert proposed.tree.parents.tolist() == [-1, 0, 1, 2, 3]
        out = reference.generate(torch.tensor([prompt + [root]]), max_new_tokens=4, do_sample=False,
                                 eos_token_id=None, pad_token_id=PAD)
        assert proposed.tree.tokens.tolist() == [root] + out[0, len(prompt) + 1:].tolist()


def test_wide_tree_distributions_equal_transformers(draft, reference):
    trees = started(draft, PROMPTS).propose(ROOTS, (3, 2, 1))
    assert [proposed.tree.size for proposed in trees] == [16, 16]
    for proposed in trees:
        children = proposed.tree.tokens[1:4]
        assert children.tolist() == proposed.probs[0].topk(3).indices.tolist()
    assert_matches_reference(reference, PROMPTS, trees)


def test_auto_dtype_runs_each_part_in_float32_or_bfloat16_and_keeps_the_distributions(reference):
    """dtype="auto" (what generate() loads a draft with) may mix the two: blocks in one dtype, the head in another,
    each measured faster here. The distributions stay transformers' float32 ones to bfloat16 rounding."""
    mixed = DraftModel("bloombee-tiny-draft", dtype="auto")
    assert {mixed.block_dtype, mixed.head_dtype} <= {torch.float32, torch.bfloat16}
    assert next(mixed.stack.parameters()).dtype == mixed.block_dtype
    assert next(mixed.head.parameters()).dtype == mixed.head_dtype
    for prefix, proposed in zip(PROMPTS, started(mixed, PROMPTS).propose(ROOTS, (3, 2, 1))):
        nodes = internal(proposed.tree)
        expected = reference_probs(reference, prefix, proposed.tree)[nodes]
        assert (proposed.probs[nodes] - expected).abs().max() < 2e-2


def test_greedy_levels_hold_the_most_probable_paths(draft, reference):
    """Depth 2 of a (3, 2) tree: the 6 most probable two-token paths among all children of depth 1, wherever they
    fall (transformers' probabilities), not 2 per node."""
    for prompt, proposed in zip(PROMPTS, started(draft, PROMPTS).propose(ROOTS, (3, 2))):
        tree, probs = proposed.tree, reference_probs(reference, prompt, proposed.tree)
        tokens = tree.tokens.tolist()
        paths = torch.stack([probs[0, tokens[node]] * probs[node] for node in (1, 2, 3)])  # [3 parents, V]
        best = paths.flatten().topk(6).indices
        expected = {(1 + int(index) // paths.shape[1], int(index) % paths.shape[1]) for index in best}
        assert {(int(tree.parents[node]), tokens[node]) for node in range(4, 10)} == expected


def test_sampled_children_come_from_the_warped_distribution(draft, reference):
    generator = torch.Generator().manual_seed(0)
    trees = started(draft, PROMPTS).propose(ROOTS, (3, 2), sample=True, generator=generator)
    assert_matches_reference(reference, PROMPTS, trees)
    def argmax_only(logits):
        return warp_probs(logits, top_k=1)

    for proposed in started(draft, PROMPTS).propose(ROOTS, (3, 2), sample=True, warp=argmax_only,
                                                    generator=generator):
        tokens, parents = proposed.tree.tokens, proposed.tree.parents
        best = proposed.probs.argmax(-1)
        assert torch.equal(tokens[1:], best[parents[1:]])
        assert torch.all(proposed.probs[internal(proposed.tree)].max(-1).values == 1)


def test_commit_with_holes_equals_a_fresh_prefill(draft, reference):
    started(draft, PROMPTS)
    sequences = [list(prompt) for prompt in PROMPTS]
    roots = ROOTS
    for widths, ends in (((3, 2, 1), [12, 1]), ((2, 2), [0, 6])):  # 12 and 6 are leaves
        trees = draft.propose(roots, widths)
        paths = [proposed.tree.path_to(end) for proposed, end in zip(trees, ends)]
        for sequence, proposed, path in zip(sequences, trees, paths):
            sequence += [int(proposed.tree.tokens[node]) for node in path]
        draft.commit([torch.tensor(path) for path in paths], max(len(path) for path in paths))
        roots = torch.tensor([int(proposed.tree.tokens[path[-1]]) + 1 for proposed, path in zip(trees, paths)])
    assert draft.position == len(left_padded(PROMPTS)[0][0]) + 4 + 3
    trees = draft.propose(roots, (2, 2))
    fresh = started(DraftModel("bloombee-tiny-draft"), sequences).propose(roots, (2, 2))
    for after_holes, prefilled in zip(trees, fresh):
        assert torch.equal(after_holes.tree.tokens, prefilled.tree.tokens)
        torch.testing.assert_close(after_holes.probs, prefilled.probs, atol=1e-5, rtol=0)
    assert_matches_reference(reference, sequences, trees)


def test_accepted_leaves_are_run_with_the_next_roots(draft, reference):
    """Leaves are chosen without a pass; every row accepting its leaf, then a lone root (run at once), then a tree:
    its distributions are those of a fresh prefill of the same tokens."""
    started(draft, PROMPTS)
    sequences = [list(prompt) for prompt in PROMPTS]
    roots = ROOTS
    for widths in ((1, 1), ()):
        trees = draft.propose(roots, widths)
        for sequence, proposed in zip(sequences, trees):
            sequence += proposed.tree.tokens.tolist()
        draft.commit([torch.arange(proposed.tree.size) for proposed in trees], trees[0].tree.size)
        roots = torch.tensor([int(proposed.tree.tokens[-1]) + 1 for proposed in trees])
    trees = draft.propose(roots, (2, 2))
    fresh = started(DraftModel("bloombee-tiny-draft"), sequences).propose(roots, (2, 2))
    for after_leaves, prefilled in zip(trees, fresh):
        torch.testing.assert_close(after_leaves.probs, prefilled.probs, atol=1e-5, rtol=0)
    assert_matches_reference(reference, sequences, trees)


def test_bad_calls_raise(draft):
    with pytest.raises(ValueError, match="max_tree_nodes"):
        started(draft, PROMPTS, max_tree_nodes=8).propose(ROOTS, (3, 2))
    started(draft, PROMPTS).propose(ROOTS, (2,))
    with pytest.raises(ValueError, match="ascending"):
        draft.commit([torch.tensor([0, 3]), torch.tensor([0])], 2)
    with pytest.raises(ValueError, match="advance"):
        draft.commit([torch.tensor([0, 1]), torch.tensor([0])], 1)
    with pytest.raises(ValueError, match="rows"):
        draft.propose(ROOTS[:1], (2,))
