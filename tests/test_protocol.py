"""The wire vocabulary (bloombee.protocol): message kinds, step kinds and their tensors, features, and which failures
a server answers as the sender's fault (INVALID) or its own (INTERNAL)."""

import asyncio
import json

import pytest
import torch
from pydantic import ValidationError
from test_swarm_units import record

from bloombee.codec import CodecError
from bloombee.dht.records import ServerRecord
from bloombee.protocol import (
    PROTOCOL_FEATURES,
    AckMessage,
    Compaction,
    ErrorKind,
    ErrorMessage,
    Feature,
    HistoryMessage,
    InfoMessage,
    InvalidStep,
    LinearStep,
    StepHeader,
    StepMessage,
    TreeStep,
    announced_features,
    envelope,
    pack,
    parse_message,
    parse_step,
    step_kind,
    unpack,
)
from bloombee.server.backend import error_reply
from bloombee.server.pipeline import PipelineContext, SessionPipeline
from bloombee.server.memory import MemoryBudget, SessionRefused
from bloombee.server.batching import BatchLimits, StepBatcher
from bloombee.server.metrics import ServerMetrics
from bloombee.server.sessions import Session, SessionRegistry
from bloombee.speculative.tree import PackedTrees, TokenTree


def trees() -> PackedTrees:
    return PackedTrees.of([TokenTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0])),
                           TokenTree(torch.tensor([8, 9]), torch.tensor([-1, 0]))])


# -- messages ---------------------------------------------------------------------------------------------------------


def test_a_message_parses_as_the_model_of_its_kind():
    assert isinstance(parse_message(b'{"kind": "ack", "step_id": 3}'), AckMessage)
    history = parse_message(envelope(HistoryMessage(end_position=4, step_id=2)).metadata)
    assert isinstance(history, HistoryMessage) and (history.end_position, history.step_id) == (4, 2)
    with pytest.raises(ValidationError):
        parse_message(b'{"kind": "ack", "open": {"session_id": "s"}}')  # a field of another kind
    with pytest.raises(ValidationError):
        parse_message(b'{"kind": "history"}')  # a history message names its end


def test_a_message_of_another_kind_than_expected_is_invalid():
    with pytest.raises(InvalidStep, match="expected a message of kind 'info' or 'ack', got 'error'"):
        parse_message(envelope(ErrorMessage(error_kind=ErrorKind.INVALID, error="no")).metadata, InfoMessage,
                      AckMessage)


def test_the_header_on_the_wire_is_the_flat_one_of_earlier_versions():
    metadata = json.loads(envelope(ErrorMessage(error_kind=ErrorKind.EXPIRED, error="idle", step_id=1)).metadata)
    assert metadata == {"kind": "error", "reports": [], "error_kind": "expired", "error": "idle", "step_id": 1}


# -- steps ------------------------------------------------------------------------------------------------------------


def test_the_tensors_decide_the_kind_of_step():
    linear, _ = parse_step({"hidden": torch.zeros(2, 3, 4), "token_mask": torch.ones(2, 3, dtype=torch.bool)}, False)
    assert isinstance(linear, LinearStep) and set(linear.tensors()) == {"hidden", "token_mask"}
    tree, compaction = parse_step({**TreeStep(torch.zeros(5, 4), trees()).tensors(),
                                   **Compaction.of([torch.tensor([0, 2]), torch.tensor([0])]).tensors()}, True)
    assert isinstance(tree, TreeStep) and torch.equal(tree.trees.parents, trees().parents)
    assert [row.tolist() for row in compaction.rows()] == [[0, 2], [0]]


@pytest.mark.parametrize("names, compact, problem", [
    (["token_mask"], False, r"a linear step needs the tensors \['hidden'\]"),
    (["hidden", "tree_parents"], False, r"a tree step needs the tensors \['tree_offsets', 'tree_tokens', 'tree_ids'\]"),
    (["hidden", "compact_ids", "compact_offsets"], False, r"carries only .*, not \['compact_ids', 'compact_offsets'\]"),
    (["hidden"], True, r"a linear step with compact_start needs the tensors \['compact_ids', 'compact_offsets'\]"),
    (["hidden", "rope_positions", *TreeStep.TREE_TENSORS], False, r"not \['rope_positions'\]"),
])
def test_a_step_lacking_or_carrying_a_tensor_of_another_kind_is_invalid(names, compact, problem):
    with pytest.raises(InvalidStep, match=problem):
        step_kind(names, compact)


def test_malformed_trees_and_compactions_are_invalid_steps():
    bad = trees()
    with pytest.raises(InvalidStep, match="every tree node but the root"):
        TreeStep.from_tensors(TreeStep(torch.zeros(5, 4), PackedTrees(bad.offsets, torch.tensor([-1, 2, 0, -1, 0]),
                                                                       bad.tokens, bad.ids)).tensors())
    with pytest.raises(InvalidStep, match="tree offsets must rise"):
        Compaction.from_tensors({"compact_ids": torch.tensor([0, 1]), "compact_offsets": torch.tensor([0, 3])})


# -- features ---------------------------------------------------------------------------------------------------------


def test_features_travel_as_strings_and_pruning_and_invariance_only_where_held():
    assert Feature.TREE_PRUNING in PROTOCOL_FEATURES
    assert Feature.TREE_PRUNING not in announced_features(pruner=False, batch_invariant=True, exact_trees=True)
    assert Feature.BATCH_INVARIANT not in announced_features(pruner=True, batch_invariant=False, exact_trees=False)
    announced = record(0, 2, features=announced_features(pruner=True, batch_invariant=True, exact_trees=True))
    assert json.loads(announced.model_dump_json())["features"] == [feature.value for feature in Feature]
    assert Feature.TREE_STEPS in ServerRecord.model_validate_json(announced.model_dump_json()).features


# -- INVALID or INTERNAL ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("error, kind", [
    (InvalidStep("rows [0, 3) exceed the session's batch size 2"), ErrorKind.INVALID),
    (CodecError("the frame's checksum does not match"), ErrorKind.INVALID),
    (ValueError("a bug in the compute"), ErrorKind.INTERNAL),
    (RuntimeError("out of memory"), ErrorKind.INTERNAL),
    (SessionRefused("over --kept-forward-bytes"), ErrorKind.REFUSED),
])
def test_only_validated_bad_input_is_the_senders_fault(error, kind):
    assert error_reply(error)[0] == kind


class FailingBackend:
    def __init__(self, error: Exception):
        self.error = error

    def check_step(self, *args) -> None:
        pass

    def check_chunk(self, *args) -> None:
        pass

    def prepare_step(self, *args):
        return "a prepared step"

    def run(self, steps, adapter):
        raise self.error


async def in_this_thread(fn, *args):
    return fn(*args)


async def codec_in_this_thread(num_bytes, fn, *args):
    return fn(*args)


@pytest.mark.parametrize("error, kind", [(ValueError("a bug in the compute"), ErrorKind.INTERNAL),
                                         (InvalidStep("a step that does not fit"), ErrorKind.INVALID)])
@pytest.mark.parametrize("predicted_s", [0.0, 1.0], ids=["on the event loop", "in the compute thread"])
def test_a_step_whose_compute_raises_is_answered_by_who_is_at_fault(error, kind, predicted_s):
    session = Session("s", 0, 1, 1, 8, [], torch.zeros(1, 8, dtype=torch.bool), torch.zeros(1, 8, 4))
    metrics = ServerMetrics(SessionRegistry(MemoryBudget(1 << 20, 1 << 20)))
    backend = FailingBackend(error)
    batcher = StepBatcher(backend, in_this_thread, BatchLimits(max_rows=8, max_tokens=64, wait_s=0.0),
                          lambda vectors, blocks: predicted_s)
    context = PipelineContext(backend, batcher, "peer", 5.0, 1 << 20, in_this_thread, codec_in_this_thread,
                              None, None, None, None, metrics)

    async def replies():
        pipeline = SessionPipeline(context, session)
        step = StepMessage(step=StepHeader(session_id="s", step_id=3, start_position=0))
        session.inbox.put_nowait(pack(step, {"hidden": torch.zeros(1, 2, 4)}))
        session.inbox.put_nowait(None)
        return [unpack(reply)[0] async for reply in pipeline.responses()]

    (message,) = asyncio.run(replies())
    assert isinstance(message, ErrorMessage) and (message.error_kind, message.step_id) == (kind, 3)
    assert metrics.registry.get_sample_value("bloombee_server_refusals_total", {"reason": kind.value}) == 1
