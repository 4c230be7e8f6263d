"""encode / decode: tensor <-> framed bytes, with the raw, zstd and byte-split layouts.

Layouts (all lossless, bit-exact, NaN payloads and -0.0 included):

- ``raw``: the tensor's bytes as they are.
- ``zstd``: the tensor's bytes through zstd.
- ``bytesplit``: byte ``k`` of every element goes to lane ``k`` (fp16/bf16: 2 lanes, fp32: 4); each
  lane is zstd-compressed on its own, except a lane whose sampled entropy is near 8 bits/byte
  (or that zstd does not shrink), which is stored raw.
- ``bytesplit_ch``: as ``bytesplit``, but each lane is ordered channel-major (the last dimension
  outermost, i.e. lane viewed as ``[H, rows]``), so one hidden channel's bytes across all tokens
  sit together.
- ``bytesplit_rot``: as ``bytesplit``, after rotating each element's bits left by one, so the sign
  bit (random in activations) becomes the lowest bit of the low lane and the high lane starts at
  the exponent: bf16 and fp32 get their whole 8-bit exponent in one lane.

Lanes are compressed with the level's parameters but ``min_match=7, hash_log=10``: byte lanes of
activations hold few long repeats, and a small match table that ignores short matches makes zstd
code them mostly as Huffman literals, which is both faster and (on low-entropy lanes) smaller than
chasing short matches, while real repeats (e.g. the embeddings of repeated tokens) are still found.

Encoding makes one transposing copy (the lanes) and zstd's output; decoding makes zstd's output
and one interleaving copy into the result.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from .entropy import byte_entropy
from .frame import (
    CODEC_VERSION,
    DTYPE_IDS,
    LANE_RAW,
    LANE_ZSTD,
    LAYOUTS,
    CodecError,
    Header,
    frame_crc,
    pack_crc,
    pack_header,
    parse_header,
)

logger = logging.getLogger(__name__)

# Compression level used when the caller gives none. Chosen by benchmarks/codec_bench.py.
DEFAULT_LEVEL = 1
# "auto" sends tensors smaller than this raw: the frame and zstd overheads eat any gain.
MIN_COMPRESS_BYTES = 256
# "auto" keeps a compressed frame only if it is at least this fraction smaller than the raw frame.
MIN_GAIN = 0.02
# A lane whose sampled order-0 entropy is at least this many bits/byte is stored raw, not zstd'd.
RAW_LANE_ENTROPY_BITS = 7.9
# Lanes shorter than this skip the entropy estimate and are simply tried with zstd (zstd gives
# up on incompressible blocks quickly; the estimate's fixed cost only pays on longer lanes).
ENTROPY_MIN_LANE = 1 << 16
# zstd parameters for byte lanes, on top of the level's (see the module docstring).
# Bytes sampled for that estimate: the plug-in estimate's bias at 16 Ki samples is ~0.011 bits,
# far below the margin to the threshold, and the histogram costs a fifth of a 64 Ki one.
ENTROPY_DECISION_SAMPLE = 1 << 14
LANE_MIN_MATCH = 7
LANE_HASH_LOG = 10
# Decoding refuses frames declaring a tensor larger than this (bytes) unless told otherwise.
DEFAULT_MAX_BYTES = 8 << 30

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_tls = threading.local()


def _compressor(level: int, lanes: bool = False) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "compressors", None)
    if cache is None:
        cache = _tls.compressors = {}
    cctx = cache.get((level, lanes))
    if cctx is None:
        extra = {"min_match": LANE_MIN_MATCH, "hash_log": LANE_HASH_LOG} if lanes else {}
        params = zstandard.ZstdCompressionParameters.from_level(
            level, write_content_size=True, write_checksum=False, **extra
        )
        cctx = cache[(level, lanes)] = zstandard.ZstdCompressor(compression_params=params)
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
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"encode() takes a torch.Tensor, not {type(tensor).__name__}.")
    if tensor.dtype not in DTYPE_IDS:
        raise CodecError(
            f"encode() cannot send dtype {tensor.dtype}; supported: "
            + ", ".join(str(d).removeprefix("torch.") for d in DTYPE_IDS)
            + "."
        )
    if tensor.is_meta:
        raise CodecError("encode() got a meta tensor, which has no data to send.")
    t = tensor.detach()
    if t.layout != torch.strided:
        raise CodecError(f"encode() takes dense tensors, not {t.layout}.")
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.contiguous()


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 [numel, itemsize] numpy view (no copy)."""
    if t.numel() == 0:
        return np.empty((0, t.element_size()), dtype=np.uint8)
    flat = t.reshape(-1)
    return flat.view(torch.uint8).numpy().reshape(flat.numel(), t.element_size())


def _pack_lane(lane: np.ndarray, level: int, split: bool = True) -> tuple[int, object]:
    """One contiguous uint8 lane -> (mode, stored buffer). ``split``: a byte lane (entropy check,
    lane parameters) rather than a whole tensor's bytes."""
    n = lane.size
    if n == 0:
        return LANE_RAW, lane
    if split and n >= ENTROPY_MIN_LANE and byte_entropy(lane, ENTROPY_DECISION_SAMPLE) >= RAW_LANE_ENTROPY_BITS:
        return LANE_RAW, lane
    packed = _compressor(level, lanes=split).compress(lane)
    if len(packed) >= n:
        return LANE_RAW, lane
    return LANE_ZSTD, packed


def _lanes_for(layout: str, t: torch.Tensor, level: int) -> list[tuple[int, object]]:
    u8 = _bytes_view(t)  # [n, itemsize]
    if layout == "raw":
        return [(LANE_RAW, u8.reshape(-1))]
    if layout == "zstd":
        return [_pack_lane(u8.reshape(-1), level, split=False)]
    if layout == "bytesplit":
        lanes = _split(u8)
    elif layout == "bytesplit_rot":
        lanes = _split(_rotate(u8, left=True))
    elif layout == "bytesplit_ch":
        h = t.shape[-1] if t.dim() >= 1 else 1
        rows = u8.shape[0] // h if h else 0
        # [rows, H, itemsize] -> [itemsize, H, rows]: lane k, channel-major; still one copy.
        lanes = np.ascontiguousarray(u8.reshape(rows, h, u8.shape[1]).transpose(2, 1, 0)).reshape(u8.shape[1], -1)
    else:  # pragma: no cover - resolved before
        raise AssertionError(layout)
    return [_pack_lane(lanes[k], level) for k in range(lanes.shape[0])]


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _split(u8: np.ndarray) -> np.ndarray:
    """[n, itemsize] uint8 -> contiguous [itemsize, n] lanes (lane k = byte k, little-endian).

    Truncating casts of the shifted words run ~3x faster than numpy's strided transpose copy.
    """
    n, size = u8.shape
    lanes = np.empty((size, n), dtype=np.uint8)
    if n == 0:
        return lanes
    words = u8.reshape(-1).view(_UINT[size])
    np.copyto(lanes[0], words, casting="unsafe")
    for k in range(1, size):
        np.copyto(lanes[k], words >> (8 * k), casting="unsafe")
    return lanes


def _rotate(u8: np.ndarray, left: bool) -> np.ndarray:
    """Rotate every element's bits by one ([n, itemsize] uint8 in, new [n, itemsize] uint8 out)."""
    size = u8.shape[1]
    if size == 1 or u8.shape[0] == 0:
        return u8.copy()
    words = u8.reshape(-1).view(_UINT[size])
    top = 8 * size - 1
    if left:
        out = np.left_shift(words, 1)
        out |= words >> top
    else:
        out = np.right_shift(words, 1)
        out |= words << top
    return out.view(np.uint8).reshape(u8.shape)


def _unrotate_inplace(u8: np.ndarray) -> None:
    size = u8.shape[1]
    if size == 1 or u8.shape[0] == 0:
        return
    words = u8.reshape(-1).view(_UINT[size])
    low = words << (8 * size - 1)
    words >>= 1
    words |= low


def _frame(layout: str, t: torch.Tensor, lanes: list[tuple[int, object]]) -> bytes:
    header = pack_header(layout, t.dtype, tuple(t.shape), [(mode, _nbytes(buf)) for mode, buf in lanes])
    payload = [buf for _, buf in lanes]
    return b"".join([header, pack_crc(frame_crc(header, payload)), *payload])


def _nbytes(buf) -> int:
    return buf.nbytes if isinstance(buf, np.ndarray) else len(buf)


def auto_candidates(dtype: torch.dtype, shape: tuple[int, ...]) -> list[str]:
    """Compressing layouts "auto" tries for this tensor, best first (the benchmark decides the order)."""
    if dtype == torch.float16:
        return ["bytesplit", "bytesplit_rot", "zstd"]
    if dtype in _FLOAT_DTYPES:  # bf16, fp32, fp64: the rotation puts the whole exponent in one lane
        return ["bytesplit_rot", "bytesplit", "zstd"]
    if dtype.itemsize > 1:
        return ["zstd", "bytesplit"]
    return ["zstd"]


def _resolve(layout: str, t: torch.Tensor, accepted: Iterable[str] | None) -> tuple[str, bool]:
    """-> (concrete layout, whether it is 'auto' so a raw fallback applies)."""
    allowed = set(LAYOUTS) if accepted is None else set(accepted) | {"raw"}
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


def _expected_lane_sizes(h: Header) -> list[int]:
    n, size = h.numel, h.itemsize
    if h.layout in ("raw", "zstd"):
        expected = [n * size]
    else:
        expected = [n] * size
    if len(h.lanes) != len(expected):
        raise CodecError(
            f"Corrupt codec frame: layout {h.layout} of {h.dtype} needs {len(expected)} lanes, "
            f"the frame has {len(h.lanes)}."
        )
    if h.layout == "raw" and h.lanes[0][0] != LANE_RAW:
        raise CodecError("Corrupt codec frame: a raw frame has a compressed lane.")
    for (mode, length), want in zip(h.lanes, expected):
        if mode == LANE_RAW and length != want:
            raise CodecError(
                f"Corrupt codec frame: a raw lane holds {length} bytes, the declared shape needs {want}."
            )
    return expected


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


def decode(data, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Decode one frame into a new CPU tensor; raises CodecError (one sentence) on any problem.

    Everything (header, lengths, checksum, every lane's declared size) is validated before the
    output is allocated; a frame declaring more than ``max_bytes`` of tensor is refused.
    """
    _check_host()
    mv = _memoryview(data)
    h = parse_header(mv, max_bytes)
    expected = _expected_lane_sizes(h)
    spans = []
    pos = h.size
    for (mode, length), want in zip(h.lanes, expected):
        buf = mv[pos : pos + length]
        if mode == LANE_ZSTD:
            _check_zstd_lane(buf, want)
        spans.append((mode, buf, want))
        pos += length

    n, size = h.numel, h.itemsize
    out = np.empty((n, size), dtype=np.uint8)
    if h.layout in ("raw", "zstd"):
        mode, buf, want = spans[0]
        out.reshape(-1)[:] = _lane_data(mode, buf, want)
    elif h.layout in ("bytesplit", "bytesplit_rot"):
        lanes = [_lane_data(*span) for span in spans]
        _interleave(out, lanes)
        if h.layout == "bytesplit_rot":
            _unrotate_inplace(out)
    else:  # bytesplit_ch
        hdim = h.shape[-1] if h.shape else 1
        rows = n // hdim if hdim else 0
        view = out.reshape(rows, hdim, size)
        for k, span in enumerate(spans):
            view[:, :, k] = _lane_data(*span).reshape(hdim, rows).T
    if h.dtype == torch.bool and n and out.max() > 1:
        raise CodecError("Corrupt codec frame: a bool tensor holds bytes other than 0 and 1.")
    return torch.from_numpy(out.reshape(-1)).view(h.dtype).reshape(h.shape)


def _interleave(out: np.ndarray, lanes: list[np.ndarray]) -> None:
    """out[:, k] = lanes[k]: OR-ing shifted lanes into words runs ~2.5x faster than strided copies."""
    size = len(lanes)
    if size == 1:
        out[:, 0] = lanes[0]
        return
    if out.shape[0] == 0:
        return
    wide_t = _UINT[size]
    wide = out.reshape(-1).view(wide_t)
    np.left_shift(lanes[size - 1], 8 * (size - 1), out=wide, dtype=wide_t)
    for k in range(size - 2, 0, -1):
        wide |= np.left_shift(lanes[k], 8 * k, dtype=wide_t)
    np.bitwise_or(wide, lanes[0], out=wide)


def inspect(data, *, verify: bool = True, max_bytes: int = DEFAULT_MAX_BYTES) -> FrameInfo:
    """Read a frame's header (and, with ``verify``, its checksum) without decoding the tensor."""
    mv = _memoryview(data)
    h = parse_header(mv, max_bytes, verify_crc=verify)
    _expected_lane_sizes(h)
    return FrameInfo(
        version=CODEC_VERSION,
        layout=h.layout,
        dtype=h.dtype,
        shape=h.shape,
        lane_modes=tuple("zstd" if mode == LANE_ZSTD else "raw" for mode, _ in h.lanes),
        raw_bytes=h.numel * h.itemsize,
        frame_bytes=len(mv),
    )
