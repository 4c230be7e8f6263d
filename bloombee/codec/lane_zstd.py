"""zstd for byte lanes: literals always Huffman-coded, the match search skipping ahead.

A byte lane of activations is close to an order-0 source: its few long repeats (the embeddings of
repeated tokens) matter, the many short coincidental matches do not. The fast strategy with a
larger search step (``targetLength``) and ``min_match=7`` finds the long repeats and skips the rest,
2-3x faster than level 1 on bf16 exponent lanes and no larger (smaller, in fact, on those). zstd
switches literal compression off whenever the fast strategy has a ``targetLength``, and
python-zstandard's ``ZstdCompressor`` has no parameter to switch it back on, so lanes are compressed
through the cffi binding of libzstd that python-zstandard ships, with
``ZSTD_c_literalCompressionMode`` forced on. The output is a standard zstd frame.
"""

from __future__ import annotations

import numpy as np
from zstandard._cffi import ffi, lib

# Search step of the fast strategy (zstd's ``targetLength``): chosen by benchmarks/codec_bench.py.
LANE_ACCELERATION = 16
LANE_MIN_MATCH = 7
LANE_HASH_LOG = 10


def _checked(code: int) -> int:
    if lib.ZSTD_isError(code):
        raise RuntimeError(f"zstd: {ffi.string(lib.ZSTD_getErrorName(code)).decode()}")
    return code


class LaneCompressor:
    """One zstd compression context with the lane parameters at one level; not thread-safe."""

    def __init__(self, level: int):
        self._cctx = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
        params = [
            (lib.ZSTD_c_compressionLevel, level),
            (lib.ZSTD_c_minMatch, LANE_MIN_MATCH),
            (lib.ZSTD_c_hashLog, LANE_HASH_LOG),
            (lib.ZSTD_c_literalCompressionMode, lib.ZSTD_ps_enable),
            (lib.ZSTD_c_contentSizeFlag, 1),
            (lib.ZSTD_c_checksumFlag, 0),
        ]
        if lib.ZSTD_getCParams(level, 0, 0).strategy == lib.ZSTD_fast:
            # Negative levels are already faster ("acceleration"): keep the larger step.
            params.append((lib.ZSTD_c_targetLength, max(LANE_ACCELERATION, -level)))
        for param, value in params:
            _checked(lib.ZSTD_CCtx_setParameter(self._cctx, param, value))

    def compress(self, lane: np.ndarray) -> bytes:
        """One contiguous uint8 array -> one zstd frame."""
        bound = lib.ZSTD_compressBound(lane.nbytes)
        out = np.empty(bound, dtype=np.uint8)
        size = _checked(lib.ZSTD_compress2(self._cctx, ffi.from_buffer(out), bound, ffi.from_buffer(lane), lane.nbytes))
        return out[:size].tobytes()
