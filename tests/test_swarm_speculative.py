"""Tree speculative decoding through a real swarm: bloombee-tiny in float32 on "front" (blocks 0:4, which holds the
pruner head for layer 4 and announces "tree_pruning") and "back" / "back2" (4:8, the second one the replacement when a
back server is SIGKILLed mid-generation).

Greedy speculative output equals plain greedy decoding through the same swarm and local transformers, token for token
(batch 1 with and without pruning, a left-padded batch of 4 plain and with compression and micro-batches, 160 tokens
once); pruning really prunes; assistant_model= and a draft name work, bad arguments are refused clearly; seeded
sampling runs; a tree step right after a commit reads the compacted cache (its compaction rides on it), a step without
it is refused; malformed trees are refused and the server goes on serving; a back server killed mid-generation changes
no token. The failover test kills a server: it runs last."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bloombee.client import AutoDistributedModel, RequestRejected
from bloombee.loading import resolve_model
from bloombee.speculative.draft import DraftModel
from bloombee.speculative.tree import PackedTrees, TokenTree
from swarm_support import KillAfter, capture_sessions, serving

pytestmark = pytest.mark.timeout(300)

MODEL, DRAFT = "bloombee-tiny", "bloombee-tiny-draft"
SERVERS = {"front": "0:4", "back": "4:8", "back2": "4:8"}
WIDTHS = (4, 2, 2, 1)
NEAR_TIE = 1e-4  # a greedy flip is acceptable only where the two top logits are this close (float32 rounding)
PROMPTS = ["def fibonacci(n):\n", "import numpy as np\n\ndef mean(values):\n    return", "class Stack:\n",
           "for i in range(10):\n    print(i"]  # the first ends (EOS) after 2 tokens, the others go on past 160
LONG_PROMPTS = ["Once upon a time", "The quick brown fox"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with serving(MODEL, tmp_path_factory, SERVERS, "--dtype", "float32", "--max-length", "512") as swarm:
        yield swarm


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture(scope="module")
def local():
    return AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft():
    return DraftModel(DRAFT)


@pytest.fixture(scope="module")
def model(swarm):
    with open_model(swarm) as model:
        yield model


def open_model(swarm, **settings):
    return AutoDistributedModel.from_pretrained(MODEL, initial_peers=swarm.initial_peers, dtype=torch.float32,
                                                **settings)


def tree_parents(widths: tuple[int, ...]) -> torch.Tensor:
    """Parents [N] of the tree whose depth-d nodes have widths[d] children each, in breadth-first node order."""
    parents, level = [-1], [0]
    for width in widths:
        first = len(parents)
        parents += [node for node in level for _ in range(width)]
        level = list(range(first, len(parents)))
    return torch.tensor(parents, dtype=torch.long)


def assert_same_greedy(ours: torch.Tensor, reference: torch.Tensor, local, what: str) -> None:
    """Token-for-token equality; a flip is tolerated only as a near-tie of the local model's logits at the first
    differing position (reported), never where the reference token wins by a real gap."""
    assert ours.shape[0] == reference.shape[0], what
    if ours.shape == reference.shape and torch.equal(ours, reference):
        return
    for row in range(ours.shape[0]):
        length = min(ours.shape[1], reference.shape[1])
        differ = (ours[row, :length] != reference[row, :length]).nonzero().flatten()
        if differ.numel() == 0:
            assert ours.shape == reference.shape, f"{what}: row {row} equal up to {length} but lengths differ"
            continue
        at = int(differ[0])
        with torch.inference_mode():
            logits = local(ours[row:row + 1, :at]).logits[0, -1].float()
        gap = float(logits[reference[row, at]] - logits[ours[row, at]])
        report = (f"{what}: row {row} flips at position {at}: ours {int(ours[row, at])}, reference "
                  f"{int(reference[row, at])}, logit gap {gap:.3g}")
        print(report)
        assert abs(gap) < NEAR_TIE, report


def plain_greedy(model, ids, mask, new_tokens):
    """Greedy decoding through the swarm without speculation (inside a session, generate() does not speculate)."""
    with model.inference_session(max_length=ids.shape[1] + new_tokens, batch_size=ids.shape[0]):
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)


def local_greedy(local, ids, mask, new_tokens):
    with torch.inference_mode():
        return local.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)


# -- 1. greedy exactness ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tau", "new_tokens", "prompt"), [(0.2, 160, 0), (0.0, 48, 1)],
                         ids=["pruned-160", "unpruned-48"])
def test_greedy_speculation_is_plain_greedy_decoding(model, local, draft, tokenizer, tau, new_tokens, prompt):
    ids = tokenizer(LONG_PROMPTS[prompt:prompt + 1], return_tensors="pt").input_ids
    spec = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, draft_model=draft, speculation="on",
                          prune_tau=tau, draft_widths=WIDTHS)
    stats = model.last_speculation
    plain = plain_greedy(model, ids, None, new_tokens)
    reference = local_greedy(local, ids, None, new_tokens)
    print(f"tau {tau}: {stats.tree_rounds} tree rounds for {spec.shape[1] - ids.shape[1]} tokens, accepted "
          f"{stats.accepted}, nodes per hop {stats.nodes_per_hop} of {stats.nodes_proposed}")
    assert spec.shape[1] - ids.shape[1] == new_tokens  # no end of sequence: the full length was generated
    assert_same_greedy(spec, plain, local, "speculative vs plain swarm")
    assert_same_greedy(spec, reference, local, "speculative vs transformers")
    assert stats.tree_rounds > 0 and stats.plain_rounds == 0 and max(stats.accepted) > 1
    assert stats.tree_rounds < new_tokens / 1.5  # the trees save rounds
    assert all(len(hops) == 2 for hops in stats.nodes_per_hop)
    if tau:
        pruned = [hops[0] < proposed for hops, proposed in zip(stats.nodes_per_hop, stats.nodes_proposed)]
        assert sum(pruned) > len(pruned) / 2, (stats.nodes_per_hop, stats.nodes_proposed)
        assert all(hops[1] == hops[0] for hops in stats.nodes_per_hop)  # the back server sends on what front kept
    else:
        assert all(hops == [proposed, proposed] for hops, proposed in zip(stats.nodes_per_hop, stats.nodes_proposed))


@pytest.mark.parametrize("settings", [{}, {"compression": "on", "micro_batches": 2}],
                         ids=["plain", "compressed-micro-batched"])
def test_a_left_padded_batch_is_exact_row_by_row(swarm, local, draft, tokenizer, settings):
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    ids, mask = batch.input_ids, batch.attention_mask
    assert len(set(mask.sum(-1).tolist())) > 1  # prompts of different lengths
    new_tokens = 40
    with open_model(swarm, **settings) as model:
        sessions = capture_sessions(model)
        spec = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, draft_model=draft,
                              speculation="on", prune_tau=0.2, draft_widths=WIDTHS)
        stats = model.last_speculation
        plain = plain_greedy(model, ids, mask, new_tokens)
    reference = local_greedy(local, ids, mask, new_tokens)
    print(f"{settings}: {stats.tree_rounds} tree rounds, accepted {stats.accepted}")
    assert_same_greedy(spec, plain, local, "speculative vs plain swarm")
    assert_same_greedy(spec, reference, local, "speculative vs transformers")
    assert torch.equal(spec[:, :ids.shape[1]], ids)
    assert spec.shape[1] == ids.shape[1] + new_tokens and (spec[0] == tokenizer.eos_token_id).any()  # row 0 ended
    assert len(set(stats.accepted[:4])) > 1  # in the first round (all 4 rows live) rows committed different counts
    session = sessions[0]  # the speculative generation's (the plain one opened the second)
    if settings:
        assert session.last_step.micro_batches == 2
        assert session.last_step.client_layout != "raw"
        assert all(report.layout != "raw" for report in session.last_step.reports)


# -- 2. the generate() arguments ----------------------------------------------------------------------------------


def test_assistant_model_and_a_draft_name_work_like_draft_model(model, draft, tokenizer):
    ids = tokenizer(PROMPTS[2:3], return_tensors="pt").input_ids
    common = dict(max_new_tokens=24, do_sample=False, speculation="on", draft_widths=WIDTHS)
    by_draft = model.generate(ids, draft_model=draft, **common)
    by_assistant = model.generate(ids, assistant_model=draft, **common)
    assert model.last_speculation.tree_rounds > 0
    by_name = model.generate(ids, draft_model=DRAFT, **common)
    assert model.last_speculation.tree_rounds > 0
    assert torch.equal(by_assistant, by_draft) and torch.equal(by_name, by_draft)


def test_draft_model_none_decodes_plainly(model, tokenizer):
    """bloombee-tiny's generation config names a default draft; draft_model="none" turns speculation off."""
    ids = tokenizer(PROMPTS[2:3], return_tensors="pt").input_ids
    model.last_speculation = None
    out = model.generate(ids, max_new_tokens=12, do_sample=False, draft_model="none")
    assert model.last_speculation is None
    with model.inference_session(max_length=ids.shape[1] + 12):
        plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, plain)
    model.generate(ids, max_new_tokens=4, do_sample=False)
    assert model.last_speculation is not None  # without it, the default draft speculates


def test_bad_arguments_are_refused_clearly(model, draft, tokenizer):
    ids = tokenizer(LONG_PROMPTS[:1], return_tensors="pt").input_ids
    with pytest.raises(TypeError, match="does not take.*num_return_sequences"):
        model.generate(ids, max_new_tokens=8, draft_model=draft, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_beams must be 1"):
        model.generate(ids, max_new_tokens=8, draft_model=draft, num_beams=2)
    with pytest.raises(TypeError, match="draft_model must be"):
        model.generate(ids, max_new_tokens=8, draft_model=42)
    with pytest.raises(ValueError, match="speculation mode"):
        model.generate(ids, max_new_tokens=8, draft_model=draft, speculation="sometimes")
    with pytest.raises(ValueError, match="keyword arguments only"):
        model.generate(ids, None, max_new_tokens=8, draft_model=draft)
    with model.inference_session(max_length=64):
        with pytest.raises(ValueError, match="opens its own session"):
            model.generate(ids, max_new_tokens=8, draft_model=draft)
    # the model still generates afterwards
    out = model.generate(ids, max_new_tokens=8, do_sample=False, draft_model=draft, speculation="on")
    assert out.shape == (1, ids.shape[1] + 8)


# -- 3. sampling ----------------------------------------------------------------------------------------------------


def test_seeded_speculative_sampling_runs_through_the_swarm(model, draft, tokenizer):
    ids = tokenizer(PROMPTS[:1], return_tensors="pt").input_ids
    runs = []
    for _ in range(2):
        runs.append(model.generate(ids, max_new_tokens=32, do_sample=True, temperature=0.8, top_k=50,
                                   generator=torch.Generator().manual_seed(7), draft_model=draft, speculation="on",
                                   draft_widths=(2, 2, 1)))
        stats = model.last_speculation
        assert stats.tree_rounds > 0 and stats.plain_rounds == 0
        assert all(hops == [proposed, proposed] for hops, proposed in zip(stats.nodes_per_hop, stats.nodes_proposed))
    out = runs[0]
    assert torch.equal(out[:, :ids.shape[1]], ids)
    new = out[0, ids.shape[1]:]
    assert 1 <= new.numel() <= 32 and bool(((new >= 0) & (new < model.config.vocab_size)).all())
    assert torch.equal(runs[1], out)  # the same seed, the same tokens


# -- 5. compaction rides on the next step -------------------------------------------------------------------------


def tolerance(reference: torch.Tensor) -> float:
    """1e-5, or float32 rounding at the tensor's scale where that is more: these hidden states reach ~500 (the
    first position's massive activations), where one float32 ulp is 3e-5 and a different kernel shape (a tree of 7
    nodes against a linear step of 3) rounds a couple of ulps differently."""
    return max(1e-5, 1e-6 * float(reference.abs().max()))


def assert_close_at_scale(actual: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(actual, reference, rtol=0, atol=tolerance(reference))


def packed_trees(tokens_rows: list[torch.Tensor], widths=(2, 2)) -> PackedTrees:
    return PackedTrees.of([TokenTree(tokens, tree_parents(widths)) for tokens in tokens_rows])


def path_inputs(model, trees: PackedTrees, paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden inputs [b, longest path, H] of each row's accepted nodes, holes after the shorter ones, and the mask."""
    longest = max(len(path) for path in paths)
    hidden = torch.zeros(len(paths), longest, model.config.hidden_size)
    mask = torch.zeros(len(paths), longest, dtype=torch.bool)
    for row, ((_, tokens, _), path) in enumerate(zip(trees.rows(), paths)):
        hidden[row, :len(path)] = model.head.embed(tokens[path])
        mask[row, :len(path)] = True
    return hidden, mask


def test_the_step_after_a_commit_reads_the_compacted_cache(model):
    torch.manual_seed(3)
    prompt = model.head.embed(torch.randint(3, 4000, (2, 5)))
    tree1 = packed_trees([torch.randint(3, 4000, (7,)) for _ in range(2)])
    tree2 = packed_trees([torch.randint(3, 4000, (7,)) for _ in range(2)])
    path1, path2 = [[0, 2, 6], [0, 1]], [[0, 1], [0, 2, 5]]  # ids: away from the tree's first slots, with holes
    token = model.head.embed(torch.randint(3, 4000, (2, 1)))
    hidden1, hidden2 = model.head.embed(tree1.tokens), model.head.embed(tree2.tokens)

    with model.remote.inference_session(64, 2) as session:
        session.step(prompt)
        out1, kept1 = session.tree_step(hidden1, tree1)
        assert torch.equal(kept1.ids, tree1.ids)
        assert session.commit_tree([torch.tensor(path) for path in path1]) == 5 + 3
        out2, _ = session.tree_step(hidden2, tree2)  # at once: the compaction of tree 1 rides on this step
        session.commit_tree([torch.tensor(path) for path in path2])
        pending = session._compaction
        session._compaction = None  # a step without the compaction of tree 2: refused, nothing written
        with pytest.raises(RequestRejected, match="holds a tree at slot 8 whose accepted nodes were not sent"):
            session.step(token)
        with pytest.raises(RequestRejected, match="holds a tree at slot 8"):
            session.tree_step(hidden1, tree1)
        session._compaction = pending
        out3 = session.step(token)  # a linear step carries it as well

    with model.remote.inference_session(64, 2) as linear:
        linear.step(prompt)
        inputs, mask = path_inputs(model, tree1, path1)
        lin1 = linear.step(inputs, mask)
        ref2, _ = linear.tree_step(hidden2, tree2)
    with model.remote.inference_session(64, 2) as linear:
        linear.step(prompt)
        linear.step(inputs, mask)
        inputs2, mask2 = path_inputs(model, tree2, path2)
        linear.step(inputs2, mask2)
        ref3 = linear.step(token)

    offsets1 = tree1.offsets.tolist()
    for row, path in enumerate(path1):  # the tree step and the linear one computed the accepted nodes alike
        assert_close_at_scale(out1[[offsets1[row] + node for node in path]], lin1[row, :len(path)])
    assert_close_at_scale(out2, ref2)
    assert_close_at_scale(out3, ref3)
    print(f"compaction: tree step after commit within {float((out2 - ref2).abs().max()):.2g}, linear step within "
          f"{float((out3 - ref3).abs().max()):.2g} of the linear sessions (scale {float(ref2.abs().max()):.0f})")
    # what a stale cache would give (tree 1's first slots read instead of its accepted nodes) is far off
    with model.remote.inference_session(64, 2) as stale:
        stale.step(prompt)
        stale.step(*path_inputs(model, tree1, [list(range(len(path))) for path in path1]))
        wrong, _ = stale.tree_step(hidden2, tree2)
    assert (wrong - ref2).abs().max() > 1000 * tolerance(ref2)


# -- 6. malformed trees ---------------------------------------------------------------------------------------------


def test_malformed_trees_are_refused_and_the_server_goes_on(swarm, draft, tokenizer):
    good = packed_trees([torch.randint(3, 4000, (7,)) for _ in range(2)])
    not_a_tree = good.parents.clone()
    not_a_tree[1] = 5
    bad = {  # what the server's refusal names: each reaches it as built (one micro-batch)
        "every tree node but the root must have an earlier node as its parent":
            PackedTrees(good.offsets, not_a_tree, good.tokens, good.ids),
        "node 0 of a tree is its root and has parent -1, got 0":
            PackedTrees(good.offsets, good.parents.clamp(min=0), good.tokens, good.ids),
        "tree offsets must rise from 0 to the 14 nodes sent, each row holding a node at least":
            PackedTrees(torch.tensor([0, 14, 14]), tree_parents((2, 2, 2))[:14], good.tokens, good.ids),
        "tree offsets must rise from 0": PackedTrees(torch.tensor([0, 15, 14]), good.parents, good.tokens, good.ids),
        "tree ids must be integers": PackedTrees(good.offsets, good.parents, good.tokens, good.ids.float()),
    }
    ids = tokenizer(LONG_PROMPTS[:1], return_tensors="pt").input_ids
    with open_model(swarm, micro_batches=1) as model:
        hidden = model.head.embed(good.tokens)
        with model.remote.inference_session(64, 2) as session:
            session.step(model.head.embed(torch.randint(3, 4000, (2, 4))))
            for problem, trees in bad.items():
                with pytest.raises(RequestRejected, match=f"server front rejected the request: {problem}"):
                    session.tree_step(hidden, trees)
            tokens_beyond = PackedTrees(good.offsets, good.parents, good.tokens + 10**6, good.ids)
            with pytest.raises(RequestRejected, match="server front rejected the request: tree tokens must be ids"):
                session.tree_step(hidden, tokens_beyond, prune_tau=0.5)  # what the pruner would score
            # offsets that do not cover the nodes given: the client refuses them rather than send a part of them
            with pytest.raises(ValueError, match="tree offsets must run from 0 to the 14 nodes given"):
                session.tree_step(hidden, PackedTrees(torch.tensor([0, 7, 10]), good.parents, good.tokens, good.ids))
            out, kept = session.tree_step(hidden, good)  # the same session goes on
            assert out.shape == hidden.shape and torch.equal(kept.parents, good.parents)
        out = model.generate(ids, max_new_tokens=16, do_sample=False, draft_model=draft, speculation="on")
        assert model.last_speculation.tree_rounds > 0
        assert torch.equal(out, plain_greedy(model, ids, None, 16))


# -- 4. failover (kills a server: last) -----------------------------------------------------------------------------


def test_a_back_server_killed_mid_generation_changes_no_token(swarm, model, draft, tokenizer):
    ids = tokenizer(PROMPTS[1:2], return_tensors="pt").input_ids
    args = dict(max_new_tokens=96, do_sample=False, draft_model=draft, speculation="on", prune_tau=0.2,
                draft_widths=WIDTHS)
    undisturbed = model.generate(ids, **args)
    sessions = capture_sessions(model)
    killer = KillAfter(swarm, sessions, 40, span_index=1)
    out = model.generate(ids, streamer=killer, **args)
    (session,) = sessions
    print(f"killed {killer.victim} after {killer.killed_at} tokens; recoveries {session.recoveries}, chain "
          f"{[span.record.public_name for span in session.spans]}")
    assert killer.victim in ("back", "back2") and killer.killed_at < 80 and session.recoveries >= 1
    assert killer.victim not in {span.record.public_name for span in session.spans}
    assert torch.equal(out, undisturbed)
