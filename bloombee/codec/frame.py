"""The codec's wire format: constants, the dtype and layout tables, header packing and parsing.

Frame (version 2), integers little-endian; ``varint`` is unsigned LEB128, at most 9 bytes::

    size      field
    2         magic b"BB"
    1         version (CODEC_VERSION)
    1         layout id (LAYOUT_IDS)
    1         dtype id (DTYPE_IDS)
    1         ndim (at most MAX_NDIM)
    1         lane modes: bit k set = lane k is a zstd frame, clear = lane k is raw bytes
    varint    shape, one per dimension
    varint    stored length of each zstd lane, in lane order (a raw lane's length follows from the shape)
    4         checksum: low 32 bits of the xxh3-64 of every header byte before it and of the payload
    ...       payload: the lanes' stored bytes, back to back, in lane order

The number of lanes follows from the layout and dtype (one for raw and zstd, one per byte of the
element for the byte-split layouts), and so does the decoded size of every lane: nothing in a
frame can make the decoder allocate more than its shape declares, and the shape is checked against
a limit first. The header of a small activation (a [8, 1, 256] decode step) is 17 bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import xxhash

MAGIC = b"BB"
CODEC_VERSION = 2
MAX_NDIM = 32
MAX_VARINT_BYTES = 9  # 63 bits: more than any tensor dimension or lane length

# Layout ids are part of the wire format: never renumber, only append. Id 3 (channel-major lanes,
# never smaller on the codec benchmark) is retired and must not be reused.
LAYOUT_IDS: dict[str, int] = {
    "raw": 0,
    "zstd": 1,
    "bytesplit": 2,
    "bytesplit_rot": 4,
}
LAYOUT_NAMES: dict[int, str] = {v: k for k, v in LAYOUT_IDS.items()}
LAYOUTS: tuple[str, ...] = tuple(LAYOUT_IDS)
WHOLE_TENSOR_LAYOUTS = ("raw", "zstd")  # one lane holding the tensor's bytes; the others: one lane per byte

# Dtype ids are part of the wire format: never renumber, only append.
DTYPE_IDS: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
DTYPES_BY_ID: dict[int, torch.dtype] = {v: k for k, v in DTYPE_IDS.items()}

LANE_RAW = 0
LANE_ZSTD = 1

_FIXED = struct.Struct("<2sBBBBB")  # magic, version, layout, dtype, ndim, lane modes
_FIXED_LAYOUT = 3  # the layout byte's offset
_CHECKSUM = struct.Struct("<I")
FIXED_SIZE = _FIXED.size  # 7
MIN_FRAME = FIXED_SIZE + _CHECKSUM.size


class CodecError(ValueError):
    """A frame could not be decoded (or a tensor cannot be encoded); the message says why."""


@dataclass(frozen=True)
class Header:
    layout: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    lanes: tuple[tuple[int, int], ...]  # (mode, stored length) per lane
    size: int  # header length in bytes, checksum included

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def lane_size(self) -> int:
        """Decoded bytes of every lane."""
        return lane_size(self.layout, self.dtype, self.numel)


def lane_count(layout: str, dtype: torch.dtype) -> int:
    return 1 if layout in WHOLE_TENSOR_LAYOUTS else dtype.itemsize


def lane_size(layout: str, dtype: torch.dtype, numel: int) -> int:
    """Decoded bytes of each lane: the whole tensor, or one byte per element."""
    return numel * dtype.itemsize // lane_count(layout, dtype)


def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def pack_header(layout: str, dtype: torch.dtype, shape: tuple[int, ...], lanes: list[tuple[int, int]]) -> bytearray:
    """Header bytes without the trailing checksum (``checksum`` covers them and the payload)."""
    modes = 0
    for k, (mode, _) in enumerate(lanes):
        if mode == LANE_ZSTD:
            modes |= 1 << k
    out = bytearray(_FIXED.pack(MAGIC, CODEC_VERSION, LAYOUT_IDS[layout], DTYPE_IDS[dtype], len(shape), modes))
    for dim in shape:
        _put_varint(out, dim)
    for mode, length in lanes:
        if mode == LANE_ZSTD:
            _put_varint(out, length)
    return out


def checksum(header_wo_checksum, payload: list) -> bytes:
    """The 4 checksum bytes of a frame with this header and payload."""
    hasher = xxhash.xxh3_64(header_wo_checksum)
    for chunk in payload:
        hasher.update(chunk)
    return _CHECKSUM.pack(hasher.intdigest() & 0xFFFFFFFF)


class _Reader:
    """Reads varints from a header, raising CodecError when the frame ends first."""

    def __init__(self, mv: memoryview, pos: int):
        self.mv, self.pos = mv, pos

    def varint(self, what: str) -> int:
        value = shift = 0
        for _ in range(MAX_VARINT_BYTES):
            if self.pos >= len(self.mv):
                raise CodecError(f"Truncated codec frame: it ends inside the header's {what}.")
            byte = self.mv[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
        raise CodecError(f"Corrupt codec frame: the header's {what} is longer than {MAX_VARINT_BYTES} bytes.")


def _check_size(shape: tuple[int, ...], dtype: torch.dtype, max_bytes: int) -> None:
    itemsize = dtype.itemsize
    numel = 1
    for dim in shape:
        # Checked one dimension at a time so that huge products never get built.
        if dim and numel > max_bytes // itemsize // dim:
            numel = max_bytes + 1
            break
        numel *= dim
    if numel * itemsize > max_bytes:
        raise CodecError(
            f"Codec frame declares a tensor of shape {list(shape)} ({dtype}), larger than the "
            f"{max_bytes}-byte decode limit; raise max_bytes if this tensor is expected."
        )


def frame_layout(frame: bytes) -> str:
    """The layout of a frame this process encoded: its header's layout byte, unchecked (`parse_header` checks a frame
    from elsewhere)."""
    return LAYOUT_NAMES[frame[_FIXED_LAYOUT]]


def parse_header(mv: memoryview, max_bytes: int, verify_checksum: bool = True) -> Header:
    """Parse and validate a frame's header and lengths, and (by default) its checksum.

    Raises CodecError naming the first thing wrong. Allocates nothing proportional to the
    declared tensor size.
    """
    total = len(mv)
    if total < MIN_FRAME:
        raise CodecError(f"Truncated codec frame: {total} bytes is shorter than the smallest valid frame.")
    magic, version, layout_id, dtype_id, ndim, modes = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError("Not a codec frame: the magic bytes are wrong (corrupt data, or not produced by bloombee.codec).")
    if version != CODEC_VERSION:
        raise CodecError(
            f"Unsupported codec frame version {version}: this peer decodes version {CODEC_VERSION} only; "
            "run the same bloombee version on both sides."
        )
    if layout_id not in LAYOUT_NAMES:
        raise CodecError(f"Unknown codec layout id {layout_id}: the sender used a layout this peer does not know.")
    if dtype_id not in DTYPES_BY_ID:
        raise CodecError(f"Unknown codec dtype id {dtype_id}: the frame is corrupt or from a newer codec.")
    if ndim > MAX_NDIM:
        raise CodecError(f"Corrupt codec frame: {ndim} dimensions exceeds the limit of {MAX_NDIM}.")
    layout, dtype = LAYOUT_NAMES[layout_id], DTYPES_BY_ID[dtype_id]
    nlanes = lane_count(layout, dtype)
    if modes >> nlanes:
        raise CodecError(f"Corrupt codec frame: lane modes {modes:#04x} name lanes beyond the {nlanes} of layout {layout}.")
    if layout == "raw" and modes:
        raise CodecError("Corrupt codec frame: a raw frame has a compressed lane.")
    reader = _Reader(mv, FIXED_SIZE)
    shape = tuple(reader.varint("shape") for _ in range(ndim))
    _check_size(shape, dtype, max_bytes)
    lane_bytes = lane_size(layout, dtype, math.prod(shape))
    lanes = tuple(
        (LANE_ZSTD, reader.varint("lane length")) if modes >> k & 1 else (LANE_RAW, lane_bytes) for k in range(nlanes)
    )
    header_size = reader.pos + _CHECKSUM.size
    if total < header_size:
        raise CodecError(f"Truncated codec frame: {total} bytes cannot hold the {header_size}-byte header it declares.")
    payload = total - header_size
    declared = sum(length for _, length in lanes)
    if declared != payload:
        kind = "Truncated" if declared > payload else "Corrupt"
        raise CodecError(
            f"{kind} codec frame: its lanes declare {declared} payload bytes but {payload} follow the header."
        )
    if verify_checksum and mv[reader.pos : header_size] != checksum(mv[: reader.pos], [mv[header_size:]]):
        raise CodecError("Corrupt codec frame: checksum mismatch (the bytes were damaged in transit).")
    return Header(layout=layout, dtype=dtype, shape=shape, lanes=lanes, size=header_size)
