"""The tree pruner shipped with bloombee-tiny (bloombee/assets/bloombee-tiny/pruner.safetensors).

Loading (every layer 1..7, None for a missing layer or file), tree invariants on random trees
(closed under ancestors, root kept, tau edge cases, scores in [0, 1]) and quality: on held-out
text (``bloombee/assets/eval/heldout_sample.txt``, validation split) the layer-4 classifier ranks
the draft's candidates that equal the full model's argmax above the others (ROC AUC well above
chance, so a broken or untrained classifier fails).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from bloombee.loading import resolve_model
from bloombee.speculative.pruning import PRUNER_FILE, TreePruner, candidate_features, read_metadata

transformers = pytest.importorskip("transformers")

TINY = resolve_model("bloombee-tiny")
LAYERS = list(range(1, 8))


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pruner4() -> TreePruner:
    return TreePruner.load(TINY, 4)


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    parents = torch.full((n,), -1, dtype=torch.long)
    for i in range(1, n):
        parents[i] = int(torch.randint(0, i, (1,), generator=gen))
    return parents


def reference_closure(keep: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    out = keep.clone()
    out[0] = True
    for i in range(1, len(parents)):
        out[i] = bool(out[i]) and bool(out[parents[i]])
    return out


def test_shipped_file_loads_every_layer():
    for k in LAYERS:
        pruner = TreePruner.load(TINY, k)
        assert pruner is not None and pruner.layer == k
        assert pruner.layers == LAYERS
    assert TreePruner.load(str(TINY), 8) is None
    assert TreePruner.load(TINY, 0) is None
    meta = read_metadata(TINY / PRUNER_FILE)
    assert meta["layers"] == LAYERS and meta["hidden_size"] == 256 and meta["vocab_size"] == 4096
    assert "train_pruner.py" in meta["command"] and set(meta["eval"]) == {str(k) for k in LAYERS}


def test_folder_without_file_gives_none(tmp_path):
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    assert TreePruner.load(tmp_path, 4) is None


def test_candidate_features():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0]])
    f = candidate_features(logits, torch.tensor([1, 0]))
    assert f.dtype == torch.float32 and f.shape == (2, 3)
    torch.testing.assert_close(f[0], torch.tensor([0.25, 0.25, float(torch.log(torch.tensor(4.0)))]))
    assert f[1, 0] > 0.99 and f[1, 1] > 0.99 and f[1, 2] < 0.01


def test_random_trees_invariants(pruner4):
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 40, 129):
        parents = random_tree(n, gen)
        hidden = torch.randn(n, 256, generator=gen)
        tokens = torch.randint(0, 4096, (n,), generator=gen)
        scores = pruner4.keep_scores(hidden, tokens, parents)
        assert scores.dtype == torch.float32 and scores.shape == (n,)
        assert scores[0] == 1.0 and bool(((scores >= 0) & (scores <= 1)).all())
        for tau in (0.05, 0.2, 0.5, float(scores[1:].median()) if n > 1 else 0.5):
            keep = pruner4.prune(hidden, tokens, parents, tau)
            assert keep.dtype == torch.bool and keep[0]
            assert torch.equal(keep, reference_closure(scores >= tau, parents))
            assert bool((~keep[1:] | keep[parents[1:]]).all())  # closed under ancestors
        assert bool(pruner4.prune(hidden, tokens, parents, 0.0).all())
        assert bool(pruner4.prune(hidden, tokens, parents, -1.0).all())
        only_root = pruner4.prune(hidden, tokens, parents, 1.01)
        assert only_root[0] and not bool(only_root[1:].any())


def test_scores_use_parent_hidden_and_any_dtype(pruner4):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 256, generator=gen)
    tokens = torch.randint(0, 4096, (5,), generator=gen)
    parents = torch.tensor([-1, 0, 0, 1, 1])
    scores = pruner4.keep_scores(hidden, tokens, parents)
    direct = pruner4.score_candidates(hidden[parents[1:]], tokens[1:])
    torch.testing.assert_close(scores[1:], direct)
    half = pruner4.keep_scores(hidden.bfloat16(), tokens, parents)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, scores, atol=0.05, rtol=0)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(random positive scores above random negative), ties counted half."""
    pos, neg = scores[labels], scores[~labels]
    greater = (pos[:, None] > neg[None, :]).double().mean()
    ties = (pos[:, None] == neg[None, :]).double().mean()
    return float(greater + 0.5 * ties)


@torch.no_grad()
def test_classifier_ranks_accepted_candidates_on_heldout_text(pruner4):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    target = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(resolve_model("bloombee-tiny-draft"), dtype=torch.float32).eval()
    text = (TINY.parent / "eval" / "heldout_sample.txt").read_text()
    ids = tok(text, return_tensors="pt", verbose=False).input_ids[0]
    windows = ids[: (len(ids) // 256) * 256].view(-1, 256)[:4]
    out = target(input_ids=windows, output_hidden_states=True)
    full_argmax = out.logits.argmax(-1).reshape(-1)
    hidden = out.hidden_states[4].reshape(-1, 256)
    top = draft(input_ids=windows).logits.topk(4, dim=-1).indices.reshape(-1, 4)
    scores = pruner4.score_candidates(hidden.repeat_interleave(4, 0), top.reshape(-1))
    labels = (top == full_argmax[:, None]).reshape(-1)
    assert 0.05 < labels.float().mean() < 0.6
    auc = roc_auc(scores, labels)
    assert auc > 0.8, auc
    # and the same through a tree: one root per position is not a tree, so check one position's star
    star_hidden = torch.cat([hidden[:1], torch.zeros(4, 256)])
    star = pruner4.keep_scores(star_hidden, torch.cat([torch.zeros(1, dtype=torch.long), top[0]]),
                               torch.tensor([-1, 0, 0, 0, 0]))
    torch.testing.assert_close(star[1:], scores[:4])
