"""encode / decode: tensor <-> framed bytes, with the raw, zstd and byte-split layouts.

Layouts (all lossless, bit-exact, NaN payloads and -0.0 included):

- ``raw``: the tensor's bytes as they are.
- ``zstd``: the tensor's bytes through zstd.
- ``bytesplit``: byte ``k`` of every element goes to lane ``k`` (fp16/bf16: 2 lanes, fp32: 4); each
  lane is zstd-compressed on its own (see ``lane_zstd``), except a lane whose estimated entropy is
  near 8 bits/byte (or that zstd does not shrink), which is stored raw.
- ``bytesplit_rot``: as ``bytesplit``, after rotating each element's bits left by one, so the sign
  bit (random in activations) becomes the lowest bit of the low lane and the high lane starts at
  the exponent: bf16 and fp32 get their whole 8-bit exponent in one lane.

Encoding makes the lanes (one pass that splits, and rotates where asked), zstd's output and the
frame; decoding makes zstd's output and one interleaving pass into the result.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from .entropy import estimate_byte_entropy
from .frame import (
    CODEC_VERSION,
    DTYPE_IDS,
    LANE_RAW,
    LANE_ZSTD,
    LAYOUTS,
    WHOLE_TENSOR_LAYOUTS,
    CodecError,
    Header,
    checksum,
    pack_header,
    parse_header,
)
from .lane_zstd import LaneCompressor

logger = logging.getLogger(__name__)

# Compression level used when the caller gives none. Chosen by benchmarks/codec_bench.py.
DEFAULT_LEVEL = 1
# "auto" sends tensors smaller than this raw: the frame and zstd overheads eat any gain.
MIN_COMPRESS_BYTES = 256
# "auto" keeps a compressed frame only if it is at least this fraction smaller than the raw frame.
MIN_GAIN = 0.02
# A lane whose estimated order-0 entropy is at least this many bits/byte is stored raw, not zstd'd.
RAW_LANE_ENTROPY_BITS = 7.9
# Shorter lanes skip the estimate (~10-15 us) and are tried with zstd, which gives up on a random
# 2 KiB lane in ~4 us; from 16 KiB on the estimate is the cheaper of the two (and 15x cheaper at 1 MiB).
ESTIMATE_MIN_LANE = 1 << 14
# "auto" rotates bf16 tensors smaller than this (bytesplit_rot): the whole exponent in one lane
# makes them 0.5-1 % smaller, which decides whether short decode steps come within 3 % of the lane
# entropy bound. On larger tensors the rotation's three extra passes cost 25-35 % of decode speed
# and 10-40 % of encode time for the same 0.5 %, so they go plain. fp16 gains nothing from it; fp32
# gains 0.3 % at the same cost. (benchmarks/results/codec.json)
ROTATE_BELOW_BYTES = 1 << 20
# Decoding refuses frames declaring a tensor larger than this (bytes) unless told otherwise.
DEFAULT_MAX_BYTES = 8 << 30

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WORD_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size dtypes numpy has
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_WORD_NUMPY = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # numpy twins of _WORD_VIEW
_tls = threading.local()


def _compressor(level: int, lanes: bool = False):
    """This thread's compressor for whole tensors (python-zstandard) or for byte lanes."""
    cache = getattr(_tls, "compressors", None)
    if cache is None:
        cache = _tls.compressors = {}
    key = (level, lanes)
    cctx = cache.get(key)
    if cctx is None:
        if lanes:
            cctx = LaneCompressor(level)
        else:
            params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=True, write_checksum=False)
            cctx = zstandard.ZstdCompressor(compression_params=params)
        cache[key] = cctx
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_tls, "decompressor", None)
    if dctx is None:
        dctx = _tls.decompressor = zstandard.ZstdDecompressor()
    return dctx


def _check_host() -> None:
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        raise CodecError("bloombee.codec supports little-endian hosts only.")


# ----------------------------------------------------------------------------------------- encode


def _prepare(tensor: torch.Tensor) -> torch.Tensor:
    """A dense, contiguous CPU tensor holding ``tensor``'s values (no copy when it already is one)."""
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"encode() takes a torch.Tensor, not {type(tensor).__name__}.")
    if tensor.dtype not in DTYPE_IDS:
        raise CodecError(
            f"encode() cannot send dtype {tensor.dtype}; supported: "
            + ", ".join(str(d).removeprefix("torch.") for d in DTYPE_IDS)
            + "."
        )
    if tensor.layout != torch.strided:
        raise CodecError(f"encode() takes dense tensors, not {tensor.layout}.")
    t = tensor.detach() if tensor.requires_grad else tensor
    if not t.is_cpu:
        if t.is_meta:
            raise CodecError("encode() got a meta tensor, which has no data to send.")
        t = t.cpu()
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def _words(t: torch.Tensor) -> np.ndarray:
    """The contiguous tensor's elements as unsigned integers of the same size: a flat numpy view, no copy."""
    size = t.element_size()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(_WORD_VIEW[size]).numpy().view(_UINT[size]).reshape(-1)


def _pack_lane(lane: np.ndarray, level: int, estimate: bool) -> tuple[int, object]:
    """One contiguous uint8 byte lane -> (mode, stored buffer). With ``estimate``, a lane whose
    estimated entropy says zstd cannot shrink it is stored raw without trying."""
    if lane.size == 0:
        return LANE_RAW, lane
    if estimate and lane.size >= ESTIMATE_MIN_LANE and estimate_byte_entropy(lane) >= RAW_LANE_ENTROPY_BITS:
        return LANE_RAW, lane
    packed = _compressor(level, lanes=True).compress(lane)
    if len(packed) >= lane.size:
        return LANE_RAW, lane
    return LANE_ZSTD, packed


def _pack_whole(data: np.ndarray, level: int) -> tuple[int, object]:
    packed = _compressor(level).compress(data) if data.size else b""
    return (LANE_ZSTD, packed) if 0 < len(packed) < data.size else (LANE_RAW, data)


def _lanes_for(layout: str, t: torch.Tensor, level: int) -> list[tuple[int, object]]:
    words = _words(t)
    if layout == "raw":
        return [(LANE_RAW, words.view(np.uint8))]
    if layout == "zstd":
        return [_pack_whole(words.view(np.uint8), level)]
    if layout == "bytesplit":
        lanes = _split(words)
    elif layout == "bytesplit_rot":
        lanes = _split(_rotate_left(words))
    else:  # pragma: no cover - resolved before
        raise AssertionError(layout)
    # The top byte (sign and exponent) is nearly always compressible: zstd straight away. Lower
    # bytes (mantissa) are often near-random: the entropy estimate first.
    top = lanes.shape[0] - 1
    return [_pack_lane(lanes[k], level, estimate=k < top) for k in range(lanes.shape[0])]


def _split(words: np.ndarray) -> np.ndarray:
    """Flat unsigned words -> contiguous [itemsize, n] uint8 lanes (lane k = byte k, little-endian).

    Shifting the words and truncating them into each lane runs ~4x faster than numpy's strided
    byte copies.
    """
    size = words.itemsize
    lanes = np.empty((size, words.size), dtype=np.uint8)
    np.copyto(lanes[0], words, casting="unsafe")
    for k in range(1, size):
        np.right_shift(words, 8 * k, out=lanes[k], casting="unsafe")
    return lanes


def _rotate_left(words: np.ndarray) -> np.ndarray:
    """Every element's bits rotated left by one, in a new array (one-byte elements stay as they are)."""
    if words.itemsize == 1:
        return words
    out = np.left_shift(words, 1)
    out |= words >> (8 * words.itemsize - 1)
    return out


def _rotate_right_inplace(words: np.ndarray) -> None:
    if words.itemsize == 1:
        return
    low = words << (8 * words.itemsize - 1)
    words >>= 1
    words |= low


def _frame(layout: str, t: torch.Tensor, lanes: list[tuple[int, object]]) -> bytes:
    header = pack_header(layout, t.dtype, tuple(t.shape), [(mode, _nbytes(buf)) for mode, buf in lanes])
    payload = [buf for _, buf in lanes]
    return b"".join([header, checksum(header, payload), *payload])


def _nbytes(buf) -> int:
    return buf.nbytes if isinstance(buf, np.ndarray) else len(buf)


def auto_candidates(dtype: torch.dtype, shape: tuple[int, ...]) -> list[str]:
    """Compressing layouts "auto" tries for this tensor, best first (the benchmark decides the order)."""
    if dtype == torch.bfloat16 and math.prod(shape) * dtype.itemsize < ROTATE_BELOW_BYTES:
        return ["bytesplit_rot", "bytesplit", "zstd"]
    if dtype in _FLOAT_DTYPES:
        return ["bytesplit", "bytesplit_rot", "zstd"]
    if dtype.itemsize > 1:
        return ["zstd", "bytesplit"]
    return ["zstd"]


def _resolve(layout: str, t: torch.Tensor, accepted: Iterable[str] | None) -> tuple[str, bool]:
    """-> (concrete layout, whether it is 'auto' so a raw fallback applies)."""
    allowed = LAYOUTS if accepted is None else set(accepted) | {"raw"}
    if layout == "auto":
        if t.numel() * t.element_size() < MIN_COMPRESS_BYTES:
            return "raw", False
        for candidate in auto_candidates(t.dtype, tuple(t.shape)):
            if candidate in allowed:
                return candidate, True
        return "raw", False
    if layout not in LAYOUTS:
        raise CodecError(f"Unknown codec layout {layout!r}; known: auto, {', '.join(LAYOUTS)}.")
    if layout not in allowed:
        return "raw", False
    return layout, False


def encode(
    tensor: torch.Tensor,
    layout: str = "auto",
    *,
    level: int | None = None,
    accepted: Iterable[str] | None = None,
) -> bytes:
    """Encode a tensor (any device, any strides) into one self-describing frame.

    ``layout``: "auto" or one of ``LAYOUTS``. ``accepted``: the layouts the receiving peer
    decodes (raw always is); a layout outside it is replaced by raw. ``level``: zstd level.
    """
    _check_host()
    t = _prepare(tensor)
    concrete, fallback = _resolve(layout, t, accepted)
    level = DEFAULT_LEVEL if level is None else level
    lanes = _lanes_for(concrete, t, level)
    if fallback:
        stored = sum(_nbytes(buf) for _, buf in lanes)
        raw_size = t.numel() * t.element_size()
        if stored > raw_size * (1.0 - MIN_GAIN) or all(mode == LANE_RAW for mode, _ in lanes):
            concrete, lanes = "raw", _lanes_for("raw", t, level)
    return _frame(concrete, t, lanes)


# ----------------------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class FrameInfo:
    """What a frame holds, read from its header (see ``inspect``)."""

    version: int
    layout: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    lane_modes: tuple[str, ...]
    raw_bytes: int
    frame_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.frame_bytes if self.frame_bytes else 1.0


def _memoryview(data) -> memoryview:
    try:
        mv = memoryview(data)
    except TypeError:
        raise CodecError(f"decode() takes bytes-like data, not {type(data).__name__}.") from None
    if not mv.c_contiguous:
        raise CodecError("decode() takes contiguous bytes-like data.")
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    return mv


def _check_zstd_lane(buf: memoryview, want: int) -> None:
    try:
        size = zstandard.frame_content_size(buf)
    except zstandard.ZstdError:
        raise CodecError("Corrupt codec frame: a compressed lane is not a valid zstd frame.") from None
    if size != want:
        what = "no size" if size < 0 else f"{size} bytes"
        raise CodecError(
            f"Corrupt codec frame: a compressed lane declares {what} of content, the declared shape needs {want}."
        )


def _lane_data(mode: int, buf: memoryview, want: int) -> np.ndarray:
    if mode == LANE_RAW:
        return np.frombuffer(buf, dtype=np.uint8)
    try:
        out = _decompressor().decompress(buf, max_output_size=want, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"Corrupt codec frame: a compressed lane failed to decompress ({exc}).") from None
    if len(out) != want:
        raise CodecError(f"Corrupt codec frame: a compressed lane gave {len(out)} bytes, expected {want}.")
    return np.frombuffer(out, dtype=np.uint8)


def _lane_spans(mv: memoryview, h: Header) -> list[tuple[int, memoryview, int]]:
    """(mode, stored bytes, decoded size) per lane; every zstd lane's declared size checked first."""
    want = h.lane_size
    spans = []
    pos = h.size
    for mode, length in h.lanes:
        buf = mv[pos : pos + length]
        if mode == LANE_ZSTD:
            _check_zstd_lane(buf, want)
        spans.append((mode, buf, want))
        pos += length
    return spans


def decode(data, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Decode one frame into a new CPU tensor; raises CodecError (one sentence) on any problem.

    Everything (header, lengths, checksum, every lane's declared size) is validated before the
    output is allocated; a frame declaring more than ``max_bytes`` of tensor is refused.
    """
    _check_host()
    mv = _memoryview(data)
    h = parse_header(mv, max_bytes)
    spans = _lane_spans(mv, h)
    n, size = h.numel, h.itemsize
    words = np.empty(n, dtype=_UINT[size])
    if h.layout in WHOLE_TENSOR_LAYOUTS:
        words.view(np.uint8)[:] = _lane_data(*spans[0])
    else:
        _interleave(words, [_lane_data(*span) for span in spans])
        if h.layout == "bytesplit_rot":
            _rotate_right_inplace(words)
    if h.dtype == torch.bool and n and words.max() > 1:
        raise CodecError("Corrupt codec frame: a bool tensor holds bytes other than 0 and 1.")
    return torch.from_numpy(words.view(_WORD_NUMPY[size])).view(h.dtype).reshape(h.shape)


def _interleave(words: np.ndarray, lanes: list[np.ndarray]) -> None:
    """Byte k of every word = lanes[k]. Two lanes: widening and OR-ing (SIMD) runs ~2.5x faster than
    strided byte copies; with more lanes the temporaries cost more than the copies save."""
    if len(lanes) == 2:
        np.multiply(lanes[1], 256, out=words, dtype=words.dtype)
        np.bitwise_or(words, lanes[0], out=words)
        return
    u8 = words.view(np.uint8).reshape(words.size, words.itemsize)
    for k, lane in enumerate(lanes):
        u8[:, k] = lane


def inspect(data, *, verify: bool = True, max_bytes: int = DEFAULT_MAX_BYTES) -> FrameInfo:
    """Read a frame's header (and, with ``verify``, its checksum) without decoding the tensor."""
    mv = _memoryview(data)
    h = parse_header(mv, max_bytes, verify_checksum=verify)
    return FrameInfo(
        version=CODEC_VERSION,
        layout=h.layout,
        dtype=h.dtype,
        shape=h.shape,
        lane_modes=tuple("zstd" if mode == LANE_ZSTD else "raw" for mode, _ in h.lanes),
        raw_bytes=h.numel * h.itemsize,
        frame_bytes=len(mv),
    )
