"""Protocol features: what a server announces in its DHT record, and a client uses only with servers announcing it."""

from enum import StrEnum


class Feature(StrEnum):
    """One protocol feature; on the wire (the record's `features`) its value, a string."""

    PUSH = "push"  # a server pushes a step's output straight to the next server of its route
    EXPLICIT_POSITIONS = "explicit_positions"  # steps name the cache slots they write (start_position)
    BATCH_OFFSET = "batch_offset"  # steps name the first row they write
    TOKEN_MASK = "token_mask"  # steps may mark padding tokens
    ROPE_POSITIONS = "rope_positions"  # steps may carry their tokens' rope positions
    HISTORY = "history"  # a server sends back its outputs so far (a replacement of the next server replays them)
    MICRO_BATCHES = "micro_batches"  # a step may come as several micro-batches of rows
    SESSION_COMPRESSION = "session_compression"  # a session may ask for its own codec mode
    TREE_STEPS = "tree_steps"  # tree steps of speculative decoding (bloombee.protocol.steps.TreeStep)
    TREE_PRUNING = "tree_pruning"  # the server holds a pruner for its last block and prunes tree steps (prune_tau)
    REORDER_ROWS = "reorder_rows"  # a step may reorder the session's rows first (beam search: rows_version, reorder)
    BATCH_INVARIANT = "batch_invariant"  # a row's outputs do not depend on the rows computed with it (its matmuls in
    # the row counts this device rounds alike: bloombee.models.core.invariance)
    EXACT_TREES = "exact_trees"  # a tree step's node outputs equal the same tokens decoded one at a time
    SHARED_STREAMS = "shared_streams"  # one stream carries all of a client's sessions, messages ready at once bundled
    # (bloombee.protocol.bundles)
    BACKWARD = "backward"  # forwards kept for a backward, deep prompts, gradients back (bloombee.server.training)


PROTOCOL_FEATURES = tuple(Feature)  # every feature this version speaks
# what every client of this version uses; a server that does not announce all of them is not routed to
REQUIRED_FEATURES = (Feature.PUSH, Feature.EXPLICIT_POSITIONS, Feature.TOKEN_MASK, Feature.HISTORY)


def announced_features(pruner: bool, batch_invariant: bool, exact_trees: bool) -> tuple[Feature, ...]:
    """What a server of this version announces: every feature, tree pruning only if it holds a `pruner`, batch
    invariance and exact trees only where its blocks compute so."""
    held = {Feature.TREE_PRUNING: pruner, Feature.BATCH_INVARIANT: batch_invariant, Feature.EXACT_TREES: exact_trees}
    return tuple(feature for feature in Feature if held.get(feature, True))
