"""Tree speculative decoding: draft trees, their verification, pruning at the first server, and when to speculate."""
