"""Token trees (ancestry, masks, packing, validation, subtrees) and KV cache compaction."""

from __future__ import annotations

import random

import pytest
import torch

from bloombee.models.core.kv_cache import KVCache, compact_slots
from bloombee.speculative.tree import (TokenTree, ancestry, check_offsets, check_parents, close_under_ancestors,
                                       dense_rows, depths, pack_rows, packed_rows, tree_mask, unpack_rows)


def random_parents(size: int, rng: random.Random) -> torch.Tensor:
    return torch.tensor([-1] + [rng.randrange(node) for node in range(1, size)])


def ancestors_of(parents: list[int], node: int) -> list[int]:
    """Brute force: `node` and every node up its parent chain."""
    chain = [node]
    while parents[chain[-1]] >= 0:
        chain.append(parents[chain[-1]])
    return chain


def test_depths_and_ancestry_equal_brute_force():
    rng = random.Random(0)
    for size in (1, 2, 7, 20):
        parents = random_parents(size, rng)
        listed = parents.tolist()
        expected = torch.zeros(size, size, dtype=torch.bool)
        for node in range(size):
            expected[node, ancestors_of(listed, node)] = True
        assert torch.equal(ancestry(parents), expected)
        assert depths(parents).tolist() == [len(ancestors_of(listed, node)) - 1 for node in range(size)]


def test_tree_mask_equals_brute_force_with_ragged_rows_and_padded_prefix():
    rng = random.Random(1)
    parents_rows = [random_parents(size, rng) for size in (5, 1, 3)]
    width = 6
    prefix_keys = torch.tensor([[False, False, True, True],  # left padding
                                [True, True, True, True],
                                [False, True, False, True]])  # padding and a hole
    mask = tree_mask(parents_rows, width, prefix_keys)
    prefix = prefix_keys.shape[1]
    assert mask.shape == (3, width, prefix + width) and mask.dtype == torch.bool
    for row, parents in enumerate(parents_rows):
        listed = parents.tolist()
        for query in range(width):
            for key in range(prefix + width):
                if query >= len(listed):
                    allowed = key == prefix + query
                elif key < prefix:
                    allowed = bool(prefix_keys[row, key])
                else:
                    allowed = key - prefix in ancestors_of(listed, query)
                assert bool(mask[row, query, key]) == allowed, (row, query, key)


def test_packing_round_trips_with_ragged_offsets():
    rows = [torch.arange(3) * 10, torch.arange(1) + 100, torch.arange(4) + 200]
    features = [torch.randn(row.numel(), 2) for row in rows]
    packed, offsets = pack_rows(rows)
    assert offsets.tolist() == [0, 3, 4, 8]
    check_offsets(offsets, packed.numel())
    assert all(torch.equal(a, b) for a, b in zip(unpack_rows(packed, offsets), rows))
    dense = dense_rows(packed, offsets, 5)
    assert dense.shape == (3, 5)
    assert dense[1].tolist() == [100, 0, 0, 0, 0]
    assert torch.equal(packed_rows(dense, [3, 1, 4]), packed)
    packed_features, feature_offsets = pack_rows(features)
    dense_features = dense_rows(packed_features, feature_offsets, 4)
    assert dense_features.shape == (3, 4, 2) and torch.equal(dense_features[0, 3], torch.zeros(2))
    assert torch.equal(packed_rows(dense_features, [3, 1, 4]), packed_features)


@pytest.mark.parametrize("parents", [[], [0], [-1, 1], [-1, 0, 2], [-1, -1], [-1, 0, 5]])
def test_check_parents_rejects_non_trees(parents):
    with pytest.raises(ValueError):
        check_parents(torch.tensor(parents, dtype=torch.long))


def test_check_parents_rejects_bad_tensors():
    with pytest.raises(ValueError):
        check_parents(torch.tensor([-1.0, 0.0]))
    with pytest.raises(ValueError):
        check_parents(torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError):
        TokenTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0]))


@pytest.mark.parametrize("offsets, total", [([0, 2, 2, 5], 5), ([1, 5], 5), ([0, 4], 5), ([0, 6], 5), ([0], 0),
                                            ([0, 3, 2, 5], 5)])
def test_check_offsets_rejects_bad_splits(offsets, total):
    with pytest.raises(ValueError):
        check_offsets(torch.tensor(offsets, dtype=torch.long), total)


def test_check_offsets_rejects_bad_tensors():
    with pytest.raises(ValueError):
        check_offsets(torch.tensor([0.0, 2.0]), 2)
    with pytest.raises(ValueError):
        check_offsets(torch.tensor([[0, 2]]), 2)


def test_subtree_closes_under_ancestors_and_remaps_parents():
    #        0
    #      1   2
    #     3 4   5
    #     6
    tree = TokenTree(torch.tensor([10, 11, 12, 13, 14, 15, 16]), torch.tensor([-1, 0, 0, 1, 1, 2, 3]))
    keep = torch.tensor([False, True, False, False, True, True, True])  # 2 dropped takes 5; 3 dropped takes 6
    assert close_under_ancestors(tree.parents, keep).tolist() == [True, True, False, False, True, False, False]
    sub, kept = tree.subtree(keep)
    assert kept.tolist() == [0, 1, 4]
    assert sub.tokens.tolist() == [10, 11, 14]
    assert sub.parents.tolist() == [-1, 0, 1]
    sub, kept = tree.subtree(torch.tensor([True, False, True, True, False, True, True]))
    assert kept.tolist() == [0, 2, 5] and sub.parents.tolist() == [-1, 0, 1]
    assert tree.path_to(6) == [0, 1, 3, 6] and tree.path_to(0) == [0]


def test_compact_slots_moves_each_row_independently():
    tensor = torch.arange(4 * 10).reshape(4, 10)
    original = tensor.clone()
    compact_slots(tensor, 1, 3, [torch.tensor([0, 2, 5]), torch.tensor([1]), torch.tensor([], dtype=torch.long)],
                  batch_offset=1)
    assert torch.equal(tensor[0], original[0])
    assert tensor[1].tolist() == original[1, :3].tolist() + original[1, [3, 5, 8]].tolist() + original[1, 6:].tolist()
    assert tensor[2].tolist() == original[2, :3].tolist() + [original[2, 4].item()] + original[2, 4:].tolist()
    assert torch.equal(tensor[3], original[3])


@pytest.mark.parametrize("value_dim", [None, 6])  # 6: values of another width (latent attention's latents)
def test_kv_cache_compact_moves_keys_and_values_of_the_rows(value_dim):
    cache = KVCache(3, 2, 8, 4, value_dim=value_dim)
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    k, v = cache.k.clone(), cache.v.clone()
    cache.compact(2, [torch.tensor([1, 3]), torch.tensor([0, 1, 4])], batch_offset=1)
    for tensor, before in ((cache.k, k), (cache.v, v)):
        assert torch.equal(tensor[0], before[0])
        assert torch.equal(tensor[1, :, :2], before[1, :, :2])
        assert torch.equal(tensor[1, :, 2:4], before[1, :, [3, 5]])
        assert torch.equal(tensor[1, :, 4:], before[1, :, 4:])
        assert torch.equal(tensor[2, :, 2:5], before[2, :, [2, 3, 6]])
        assert torch.equal(tensor[2, :, 5:], before[2, :, 5:])
