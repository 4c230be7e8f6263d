"""bloombee.codec: bit-exact round trips for every layout, and clean errors on every bad frame."""

import random
import struct

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bloombee import codec
from bloombee.codec import CodecError, decode, encode

FLOATS = [torch.float16, torch.bfloat16, torch.float32]
INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
ALL_LAYOUTS = ["auto", *codec.LAYOUTS]

# Bit patterns that must survive: NaNs with assorted payloads and signs, infinities, signed zeros,
# subnormals, the largest finite values.
SPECIAL_BITS = {
    torch.float16: [0x7E00, 0x7C01, 0x7D55, 0xFE00, 0xFFFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x7BFF],
    torch.bfloat16: [0x7FC0, 0x7F81, 0x7FAA, 0xFFC0, 0xFFFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x007F, 0x8001, 0x7F7F],
    torch.float32: [
        0x7FC00000, 0x7F800001, 0x7FABCDEF, 0xFFC00000, 0xFFFFFFFF, 0x7F800000, 0xFF800000,
        0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x80000001, 0x7F7FFFFF,
    ],
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor as integers (so NaN == NaN and -0.0 != 0.0)."""
    return t.contiguous().view(INT_VIEW[t.dtype]) if t.dim() else t.reshape(1).view(INT_VIEW[t.dtype])


def make_tensor(dtype: torch.dtype, shape: tuple, seed: int, kind: str) -> torch.Tensor:
    """Activation-like values (compressible), raw random bit patterns, or mostly special values."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape)) if shape else 1
    if kind == "activations":
        vals = rng.standard_normal(n).astype(np.float32) * rng.choice([0.01, 1.0, 30.0])
        t = torch.from_numpy(vals).to(dtype)
    else:
        width = torch.finfo(dtype).bits
        raw = rng.integers(0, 1 << width, n, dtype=np.uint64)
        t = torch.from_numpy(raw.astype(np.int64)).to(torch.int64)
        t = t.to(torch.int32).view(torch.float32) if width == 32 else t.to(torch.int16).view(dtype)
    flat = t.reshape(-1).clone()
    if kind != "bits" and n:
        special = torch.tensor(SPECIAL_BITS[dtype], dtype=torch.int64)
        special = special.to(torch.int32) if dtype == torch.float32 else special.to(torch.int16)
        special = special.view(dtype)
        count = n if kind == "special" else max(1, n // 17)
        idx = torch.from_numpy(rng.integers(0, n, count))
        flat[idx] = special[torch.from_numpy(rng.integers(0, len(special), count))]
    return flat.reshape(shape)


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple) | st.sampled_from(
    [(1, 5120), (3, 1, 4096), (2, 57, 129), (9000,), (1, 2, 8193), (0, 4096), (4096, 0)]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(FLOATS),
    shape=shapes,
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["activations", "bits", "special"]),
    layout=st.sampled_from(ALL_LAYOUTS),
    level=st.sampled_from([None, 1, 3, -5]),
)
def test_round_trip_is_bit_identical(dtype, shape, seed, kind, layout, level):
    x = make_tensor(dtype, shape, seed, kind)
    y = decode(encode(x, layout, level=level))
    assert y.dtype == x.dtype and y.shape == x.shape and y.device.type == "cpu"
    assert torch.equal(bits(y), bits(x))


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_every_special_value_survives(dtype, layout):
    special = torch.tensor(SPECIAL_BITS[dtype] * 400, dtype=torch.int64)
    x = (special.to(torch.int32) if dtype == torch.float32 else special.to(torch.int16)).view(dtype).reshape(40, -1)
    y = decode(encode(x, layout))
    assert torch.equal(bits(y), bits(x))
    assert torch.isnan(y).sum() == torch.isnan(x).sum()
    assert (torch.signbit(y) == torch.signbit(x)).all()


@pytest.mark.parametrize(
    "x",
    [
        torch.arange(-500, 500, dtype=torch.int64).reshape(10, 100),
        torch.randint(0, 2, (3, 333)).bool(),
        torch.randint(-128, 127, (7, 77), dtype=torch.int8),
        torch.randint(0, 255, (1000,), dtype=torch.uint8),
        torch.randn(17, 33, dtype=torch.float64),
        torch.randint(-(2**31), 2**31 - 1, (5, 500), dtype=torch.int32),
        torch.randint(-(2**15), 2**15 - 1, (5, 500), dtype=torch.int16),
    ],
    ids=lambda x: str(x.dtype),
)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_other_dtypes_round_trip(x, layout):
    y = decode(encode(x, layout))
    assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, x)


def test_activations_compress_and_auto_picks_a_compressed_layout():
    x = make_tensor(torch.float16, (16, 4096), 0, "activations")
    data = encode(x)
    info = codec.inspect(data)
    assert info.layout in codec.auto_candidates(x.dtype, tuple(x.shape))
    assert info.frame_bytes < 0.9 * info.raw_bytes
    assert info.lane_modes == ("raw", "zstd")  # the fp16 low byte is near-random: stored raw


def test_auto_sends_tiny_and_incompressible_tensors_raw():
    assert codec.inspect(encode(torch.randn(8).half())).layout == "raw"
    noise = make_tensor(torch.float16, (64, 512), 1, "bits")
    assert codec.inspect(encode(noise)).layout == "raw"


def test_accepted_restricts_layouts_to_what_the_peer_decodes():
    x = make_tensor(torch.bfloat16, (8, 2048), 2, "activations")
    assert codec.inspect(encode(x, "bytesplit", accepted={"zstd"})).layout == "raw"
    assert codec.inspect(encode(x, "auto", accepted={"raw"})).layout == "raw"
    assert codec.inspect(encode(x, "auto", accepted=["zstd"])).layout == "zstd"
    assert codec.inspect(encode(x, "auto", accepted=codec.LAYOUTS)).layout in codec.auto_candidates(x.dtype, x.shape)
    assert torch.equal(bits(decode(encode(x, "bytesplit", accepted=()))), bits(x))


def test_unknown_layout_and_unsupported_input_are_refused_on_encode():
    with pytest.raises(CodecError, match="Unknown codec layout"):
        encode(torch.zeros(3), "lz4")
    with pytest.raises(CodecError, match="dtype"):
        encode(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(CodecError, match="meta"):
        encode(torch.zeros(3, device="meta"))
    with pytest.raises(CodecError, match="torch.Tensor"):
        encode(np.zeros(3))


def test_public_constants():
    assert isinstance(codec.CODEC_VERSION, int)
    assert set(codec.LAYOUTS) == {"raw", "zstd", "bytesplit", "bytesplit_rot"}
    assert issubclass(CodecError, ValueError)


# ------------------------------------------------------------------------- inputs and outputs


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_non_contiguous_inputs(layout):
    base = make_tensor(torch.float16, (6, 40, 64), 3, "activations")
    views = [
        base.transpose(0, 2),
        base[:, ::3, 1::2],
        base[..., 5],
        base[0:1].expand(4, 40, 64),
        base.permute(2, 0, 1),
        base.unsqueeze(0).to(memory_format=torch.channels_last),
        base.flip(0),
    ]
    for v in views:
        y = decode(encode(v, layout))
        assert y.is_contiguous() and y.shape == v.shape and torch.equal(bits(y), bits(v))


def test_requires_grad_and_conj_neg_views_are_encoded_by_value():
    x = torch.randn(4, 300, requires_grad=True)
    assert torch.equal(decode(encode(x)), x.detach())
    neg = torch._neg_view(torch.randn(4, 300))
    assert neg.is_neg() and torch.equal(decode(encode(neg)), neg.resolve_neg())


ACCELERATORS = [d for d in ("cuda", "mps", "xpu") if getattr(torch, d, None) is not None and getattr(torch, d).is_available()]


@pytest.mark.skipif(not ACCELERATORS, reason="no accelerator on this machine")
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_tensors_on_other_devices_encode_and_decode_to_cpu(layout):
    x = make_tensor(torch.bfloat16, (4, 1000), 4, "special").to(ACCELERATORS[0])
    y = decode(encode(x, layout))
    assert y.device.type == "cpu" and torch.equal(bits(y), bits(x.cpu()))


def test_decoded_tensor_owns_its_memory_and_is_writable():
    x = make_tensor(torch.float16, (4, 2048), 5, "activations")
    for layout in codec.LAYOUTS:
        buf = bytearray(encode(x, layout))
        y = decode(buf)
        buf[:] = bytes(len(buf))
        assert torch.equal(bits(y), bits(x))
        y.view(torch.int16)[0, 0] = 7  # writable
        assert bits(y)[0, 0] == 7


def test_decode_accepts_bytes_like_objects():
    x = make_tensor(torch.float32, (3, 700), 6, "activations")
    data = encode(x)
    for obj in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert torch.equal(bits(decode(obj)), bits(x))
    with pytest.raises(CodecError, match="bytes-like"):
        decode("not bytes")


def test_threads_share_nothing_mutable():
    from concurrent.futures import ThreadPoolExecutor

    xs = [make_tensor(torch.float16, (8, 1024), s, "activations") for s in range(16)]

    def work(x):
        return torch.equal(bits(decode(encode(x, "bytesplit"))), bits(x))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, xs * 4))


# --------------------------------------------------------------------------------- corruption


def sample_frames():
    x16 = make_tensor(torch.float16, (3, 700), 7, "activations")
    return {
        "raw": encode(x16, "raw"),
        "zstd": encode(x16, "zstd"),
        "bytesplit": encode(x16, "bytesplit"),
        "bytesplit_rot": encode(make_tensor(torch.bfloat16, (2, 900), 11, "activations"), "bytesplit_rot"),
        "fp32": encode(make_tensor(torch.float32, (2, 2, 300), 9, "activations"), "bytesplit"),
    }


@pytest.mark.parametrize("name", list(sample_frames()))
def test_every_truncation_raises_codec_error(name):
    frame = sample_frames()[name]
    assert codec.inspect(frame).layout == ("bytesplit" if name == "fp32" else name)
    for length in range(len(frame)):
        with pytest.raises(CodecError):
            decode(frame[:length])
    with pytest.raises(CodecError):
        decode(frame + b"\0")


@pytest.mark.parametrize("name", list(sample_frames()))
def test_random_byte_flips_raise_codec_error(name):
    frame = sample_frames()[name]
    rng = random.Random(1234)
    for _ in range(1500):
        damaged = bytearray(frame)
        for _ in range(rng.choice([1, 1, 1, 2, 5])):
            pos = rng.randrange(len(frame))
            damaged[pos] ^= rng.randrange(1, 256)
        with pytest.raises(CodecError):
            decode(bytes(damaged))


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def split_frame(frame: bytes):
    """-> (fields dict, payload lanes) of a valid frame, to forge frames with a correct checksum.

    Written from the format description in bloombee/codec/frame.py, independently of its code."""
    magic, version, layout, dtype, ndim, modes = struct.unpack_from("<2sBBBBB", frame)
    pos = 7
    shape = []
    for _ in range(ndim):
        dim, pos = read_varint(frame, pos)
        shape.append(dim)
    whole = layout in (0, 1)  # raw, zstd
    itemsize = {1: 2, 2: 2, 3: 4, 4: 8, 5: 1, 6: 1, 7: 2, 8: 4, 9: 8, 10: 1}[dtype]
    nlanes = 1 if whole else itemsize
    numel = int(np.prod(shape)) if shape else 1
    sizes = []
    for k in range(nlanes):
        if modes >> k & 1:
            length, pos = read_varint(frame, pos)
            sizes.append(length)
        else:
            sizes.append(numel * (itemsize if whole else 1))
    pos += 4
    payload = []
    for length in sizes:
        payload.append(frame[pos : pos + length])
        pos += length
    assert pos == len(frame)
    lengths = [n for k, n in enumerate(sizes) if modes >> k & 1]
    fields = dict(magic=magic, version=version, layout=layout, dtype=dtype, shape=shape, modes=modes, lengths=lengths)
    return fields, payload


def forge(fields, payload, fix_lengths=False):
    zstd_lanes = [p for k, p in enumerate(payload) if fields["modes"] >> k & 1]
    lengths = [len(p) for p in zstd_lanes] if fix_lengths else fields["lengths"]
    header = struct.pack(
        "<2sBBBBB", fields["magic"], fields["version"], fields["layout"], fields["dtype"],
        len(fields["shape"]), fields["modes"],
    )
    header += b"".join(map(varint, fields["shape"])) + b"".join(map(varint, lengths))
    digest = xxhash.xxh3_64(header + b"".join(payload)).intdigest() & 0xFFFFFFFF
    return header + struct.pack("<I", digest) + b"".join(payload)


def test_forge_helper_reproduces_a_valid_frame():
    for frame in sample_frames().values():
        assert forge(*split_frame(frame)) == frame


def forged(name, mutate, fix_lengths=False):
    fields, payload = split_frame(sample_frames()[name])
    payload = mutate(fields, payload) or payload
    return forge(fields, payload, fix_lengths)


@pytest.mark.parametrize(
    "name, mutate, message",
    [
        ("bytesplit", lambda f, p: f.update(magic=b"XX"), "magic"),
        ("bytesplit", lambda f, p: f.update(version=3), "version 3"),
        ("bytesplit", lambda f, p: f.update(layout=77), "layout id 77"),
        ("bytesplit", lambda f, p: f.update(dtype=99), "dtype id 99"),
        ("bytesplit", lambda f, p: f.update(shape=f["shape"] + [1] * 40), "dimensions"),
        ("bytesplit", lambda f, p: f["shape"].__setitem__(0, 4), "lanes declare"),
        ("raw", lambda f, p: f["shape"].__setitem__(0, 2), "lanes declare"),
        ("bytesplit", lambda f, p: f.update(shape=[2**40, 2**40]), "decode limit"),
        ("bytesplit", lambda f, p: f.update(shape=[2**62, 2**62, 0]), "decode limit"),
        ("bytesplit", lambda f, p: f.update(dtype=3), "lanes declare"),
        ("raw", lambda f, p: f.update(modes=1), "raw frame has a compressed lane"),
        ("bytesplit", lambda f, p: f.update(modes=f["modes"] | 4), "lane modes"),
        ("bytesplit", lambda f, p: f["lengths"].__setitem__(0, f["lengths"][0] + 5), "Truncated"),
        ("bytesplit", lambda f, p: f["lengths"].__setitem__(0, f["lengths"][0] - 5), "Corrupt codec frame"),
        ("bytesplit", lambda f, p: f["shape"].__setitem__(0, 2**70), "longer than 9 bytes"),
    ],
)
def test_forged_headers_with_valid_checksums_are_refused(name, mutate, message):
    with pytest.raises(CodecError, match=message):
        decode(forged(name, mutate))


def test_zstd_lanes_that_lie_about_their_size_are_refused_before_decompressing():
    cctx = zstandard.ZstdCompressor(level=1)

    def bomb(fields, payload):  # content far larger than the declared shape needs
        return [payload[0], cctx.compress(bytes(50_000_000))]

    with pytest.raises(CodecError, match="declares 50000000 bytes"):
        decode(forged("bytesplit", bomb, fix_lengths=True))

    def short(fields, payload):
        return [payload[0], cctx.compress(bytes(10))]

    with pytest.raises(CodecError, match="declares 10 bytes"):
        decode(forged("bytesplit", short, fix_lengths=True))

    def unsized(fields, payload):
        writer = zstandard.ZstdCompressor(write_content_size=False)
        return [payload[0], writer.compress(bytes(2100))]

    with pytest.raises(CodecError, match="declares no size"):
        decode(forged("bytesplit", unsized, fix_lengths=True))

    def not_zstd(fields, payload):
        return [payload[0], b"\x00" * 40]

    with pytest.raises(CodecError, match="not a valid zstd frame"):
        decode(forged("bytesplit", not_zstd, fix_lengths=True))

    def trailing(fields, payload):
        return [payload[0], payload[1] + b"\0\0"]

    with pytest.raises(CodecError, match="failed to decompress"):
        decode(forged("bytesplit", trailing, fix_lengths=True))


def test_max_bytes_limits_what_a_frame_may_declare():
    x = make_tensor(torch.float16, (64, 1024), 10, "activations")
    data = encode(x)
    assert torch.equal(bits(decode(data, max_bytes=x.numel() * 2)), bits(x))
    with pytest.raises(CodecError, match="decode limit"):
        decode(data, max_bytes=x.numel() * 2 - 1)


def test_bool_frames_holding_other_bytes_are_refused():
    data = encode(torch.ones(600, dtype=torch.bool), "raw")

    def twos(fields, payload):
        return [b"\x02" * 600]

    fields, payload = split_frame(data)
    with pytest.raises(CodecError, match="bool"):
        decode(forge(fields, twos(fields, payload)))


# ------------------------------------------------------------------------- lane helpers


def test_entropy_estimate_tracks_the_exact_entropy():
    from bloombee.codec.entropy import byte_entropy, estimate_byte_entropy

    rng = np.random.default_rng(0)
    random_lane = rng.integers(0, 256, 2048, dtype=np.uint8)
    assert abs(estimate_byte_entropy(random_lane) - 8.0) < 0.05 < 8.0 - byte_entropy(random_lane)
    skewed = np.minimum(rng.geometric(0.3, 1 << 20), 255).astype(np.uint8)
    assert abs(estimate_byte_entropy(skewed) - byte_entropy(skewed)) < 0.05
    assert estimate_byte_entropy(np.zeros(5000, np.uint8)) == 0.0
    assert estimate_byte_entropy(np.empty(0, np.uint8)) == 0.0


@pytest.mark.parametrize("level", [-5, 1, 3, 19])
def test_lane_compressor_writes_standard_zstd_frames(level):
    from bloombee.codec.lane_zstd import LaneCompressor

    rng = np.random.default_rng(level + 10)
    lane = np.minimum(rng.geometric(0.2, 300_000), 255).astype(np.uint8)
    packed = LaneCompressor(level).compress(lane)
    assert len(packed) < 0.6 * lane.size  # literals are Huffman-coded even with the search step
    assert zstandard.frame_content_size(packed) == lane.size
    assert zstandard.ZstdDecompressor().decompress(packed) == lane.tobytes()


def test_header_of_a_small_decode_step_is_small():
    x = make_tensor(torch.float16, (8, 1, 256), 12, "activations")
    assert len(encode(x, "raw")) - x.numel() * 2 == 15  # 7 fixed + shape varints 1+1+2 + 4 checksum
    info = codec.inspect(encode(x, "bytesplit"))
    assert info.lane_modes == ("raw", "zstd")


def test_auto_rotates_only_small_bf16_tensors_and_never_fp16_or_fp32():
    small = make_tensor(torch.bfloat16, (8, 1, 2048), 13, "activations")
    large = make_tensor(torch.bfloat16, (1, 128, 4096), 14, "activations")  # exactly 1 MiB
    assert codec.inspect(encode(small)).layout == "bytesplit_rot"
    assert codec.inspect(encode(large)).layout == "bytesplit"
    for dtype in (torch.float16, torch.float32):
        assert codec.inspect(encode(make_tensor(dtype, (8, 1, 2048), 15, "activations"))).layout == "bytesplit"
