"""The codec's wire format: constants, the dtype and layout tables, header packing and parsing.

Frame, all integers little-endian::

    offset  size      field
    0       4         magic b"BBAC"
    4       1         version (CODEC_VERSION)
    5       1         layout id (LAYOUT_IDS)
    6       1         dtype id (DTYPE_IDS)
    7       1         ndim (at most MAX_NDIM)
    8       1         number of lanes
    9       3         reserved, must be zero
    12      8*ndim    shape, one u64 per dimension
    ..      9*lanes   per lane: mode u8 (LANE_RAW | LANE_ZSTD), stored length u64
    ..      4         crc32 of every header byte before it and of the whole payload
    ..      ...       payload: the lanes' stored bytes, back to back, in lane order

The decoded size of every lane follows from the layout, dtype and shape; nothing in the frame can
make the decoder allocate more than those declare (and those are checked against a limit first).
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"BBAC"
CODEC_VERSION = 1
MAX_NDIM = 32

# Layout ids are part of the wire format: never renumber, only append.
LAYOUT_IDS: dict[str, int] = {
    "raw": 0,
    "zstd": 1,
    "bytesplit": 2,
    "bytesplit_ch": 3,
    "bytesplit_rot": 4,
}
LAYOUT_NAMES: dict[int, str] = {v: k for k, v in LAYOUT_IDS.items()}
LAYOUTS: tuple[str, ...] = tuple(LAYOUT_IDS)

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

_FIXED = struct.Struct("<4sBBBBB3s")  # magic, version, layout, dtype, ndim, nlanes, reserved
_LANE = struct.Struct("<BQ")
_CRC = struct.Struct("<I")
FIXED_SIZE = _FIXED.size  # 12


class CodecError(ValueError):
    """A frame could not be decoded (or a tensor cannot be encoded); the message says why."""


@dataclass(frozen=True)
class Header:
    layout: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    lanes: tuple[tuple[int, int], ...]  # (mode, stored length) per lane
    size: int  # header length in bytes, crc included

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


def pack_header(layout: str, dtype: torch.dtype, shape: tuple[int, ...], lanes: list[tuple[int, int]]) -> bytes:
    """Header bytes without the trailing crc (the caller appends it after hashing the payload)."""
    parts = [
        _FIXED.pack(MAGIC, CODEC_VERSION, LAYOUT_IDS[layout], DTYPE_IDS[dtype], len(shape), len(lanes), b"\0\0\0"),
        struct.pack(f"<{len(shape)}Q", *shape),
    ]
    parts.extend(_LANE.pack(mode, length) for mode, length in lanes)
    return b"".join(parts)


def frame_crc(header_wo_crc: bytes, payload: list) -> int:
    crc = zlib.crc32(header_wo_crc)
    for chunk in payload:
        crc = zlib.crc32(chunk, crc)
    return crc


def pack_crc(crc: int) -> bytes:
    return _CRC.pack(crc)


def parse_header(mv: memoryview, max_bytes: int, verify_crc: bool = True) -> Header:
    """Parse and validate a frame's header and lengths; checks the crc over the whole frame.

    Raises CodecError naming the first thing wrong. Allocates nothing proportional to the
    declared tensor size.
    """
    total = len(mv)
    if total < FIXED_SIZE + _CRC.size:
        raise CodecError(f"Truncated codec frame: {total} bytes is shorter than the smallest valid frame.")
    magic, version, layout_id, dtype_id, ndim, nlanes, reserved = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError("Not a codec frame: the magic bytes are wrong (corrupt data, or not produced by bloombee.codec).")
    if version != CODEC_VERSION:
        raise CodecError(
            f"Unsupported codec frame version {version}: this peer decodes version {CODEC_VERSION} only; "
            "upgrade bloombee on the older side."
        )
    if layout_id not in LAYOUT_NAMES:
        raise CodecError(f"Unknown codec layout id {layout_id}: the sender used a layout this peer does not know.")
    if dtype_id not in DTYPES_BY_ID:
        raise CodecError(f"Unknown codec dtype id {dtype_id}: the frame is corrupt or from a newer codec.")
    if reserved != b"\0\0\0":
        raise CodecError("Corrupt codec frame: reserved header bytes are not zero.")
    if ndim > MAX_NDIM:
        raise CodecError(f"Corrupt codec frame: {ndim} dimensions exceeds the limit of {MAX_NDIM}.")
    layout = LAYOUT_NAMES[layout_id]
    dtype = DTYPES_BY_ID[dtype_id]
    header_size = FIXED_SIZE + 8 * ndim + _LANE.size * nlanes + _CRC.size
    if total < header_size:
        raise CodecError(f"Truncated codec frame: {total} bytes cannot hold the {header_size}-byte header it declares.")
    shape = struct.unpack_from(f"<{ndim}Q", mv, FIXED_SIZE)
    itemsize = dtype.itemsize
    numel = 1
    for dim in shape:
        # Checked one dimension at a time so that huge products never get built.
        if dim and numel > max_bytes // itemsize // dim:
            numel = None
            break
        numel *= dim
    if numel is None or numel * itemsize > max_bytes:
        raise CodecError(
            f"Codec frame declares a tensor of shape {list(shape)} ({dtype}), larger than the "
            f"{max_bytes}-byte decode limit; raise max_bytes if this tensor is expected."
        )
    pos = FIXED_SIZE + 8 * ndim
    lanes = []
    for _ in range(nlanes):
        mode, length = _LANE.unpack_from(mv, pos)
        pos += _LANE.size
        if mode not in (LANE_RAW, LANE_ZSTD):
            raise CodecError(f"Corrupt codec frame: unknown lane mode {mode}.")
        lanes.append((mode, length))
    payload = total - header_size
    declared = sum(length for _, length in lanes)
    if declared != payload:
        kind = "Truncated" if declared > payload else "Corrupt"
        raise CodecError(
            f"{kind} codec frame: its lanes declare {declared} payload bytes but {payload} follow the header."
        )
    (crc,) = _CRC.unpack_from(mv, header_size - _CRC.size)
    if verify_crc and crc != zlib.crc32(mv[header_size:], zlib.crc32(mv[: header_size - _CRC.size])):
        raise CodecError("Corrupt codec frame: checksum mismatch (the bytes were damaged in transit).")
    return Header(layout=layout, dtype=dtype, shape=tuple(shape), lanes=tuple(lanes), size=header_size)
