"""Tests for chunk compression: ckptfs.codec and its native helpers.

Everything must round-trip bit-exactly (NaN payloads, denormals, odd lengths,
any element phase, wrong width hints, non-float data, empty input), and a
damaged payload must raise DamagedData, never return wrong bytes.
"""

from __future__ import annotations

import os
import random
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from gil import assert_releases_gil

from ckptfs import codec, native
from ckptfs.chunker import chunk_buffer
from ckptfs.codec import (
    CODEC_FLOAT,
    CODEC_PLANES,
    CODEC_RAW,
    CODEC_ZSTD,
    Encoded,
    decode_chunk,
    decode_chunk_into,
    detect_float_width,
    encode_chunk,
    encode_planes,
)
from ckptfs.errors import DamagedData

np = pytest.importorskip("numpy")

KIB = 1024
MIB = 1 << 20


# ---- data ---------------------------------------------------------------------------


def gen() -> "np.random.Generator":
    return np.random.default_rng(0xC0DEC)


def fp32(n: int, scale: float = 0.02, rng: "np.random.Generator | None" = None) -> bytes:
    rng = rng or gen()
    return (rng.standard_normal(n) * scale).astype("<f4").tobytes()


def bf16(n: int, scale: float = 0.02, rng: "np.random.Generator | None" = None) -> bytes:
    """bf16 bit patterns: the top halves of fp32 values (round to nearest even)."""
    rng = rng or gen()
    u = (rng.standard_normal(n) * scale).astype("<f4").view("<u4").astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype("<u2").tobytes()


def fp16(n: int, rng: "np.random.Generator | None" = None) -> bytes:
    rng = rng or gen()
    return (rng.standard_normal(n) * 0.5).astype("<f2").tobytes()


def adam_sq(n: int, rng: "np.random.Generator | None" = None) -> bytes:
    """Positive, heavy-tailed, like AdamW's exp_avg_sq: the sign bit never varies."""
    rng = rng or gen()
    return ((rng.standard_normal(n) * 1e-3) ** 2).astype("<f4").tobytes()


def roundtrip(data: bytes, **kw: object) -> Encoded:
    enc = encode_chunk(data, **kw)  # type: ignore[arg-type]
    assert isinstance(enc.payload, bytes)
    assert 0 <= enc.param <= 255
    out = decode_chunk(enc.codec, enc.param, enc.payload, len(data))
    assert type(out) is bytes
    assert out == data, f"codec {enc.codec} param {enc.param} did not round-trip"
    if enc.codec != CODEC_RAW:
        assert len(enc.payload) < len(data)
    return enc


def ref_split(data: bytes, width: int) -> bytes:
    n = len(data) // width
    planes = [bytes(data[i * width + p] for i in range(n)) for p in range(width)]
    return b"".join(planes) + data[n * width :]


# ---- byte planes ------------------------------------------------------------------


@pytest.mark.parametrize("width", list(range(1, 17)))
def test_split_merge_planes_match_reference(width: int) -> None:
    rng = random.Random(width)
    for n in sorted({0, 1, width - 1, width, width + 1, 3 * width + 2, 1000, 4099}):
        data = rng.randbytes(n)
        planes = native.split_planes(data, width)
        assert planes == ref_split(data, width), (width, n)
        assert native.merge_planes(planes, width) == data


@pytest.mark.parametrize("width", [2, 4])
def test_split_merge_planes_around_vector_sizes(width: int) -> None:
    rng = random.Random(7)
    for n in range(0, 64 * width + 9):
        data = rng.randbytes(n)
        planes = native.split_planes(data, width)
        assert planes == ref_split(data, width), n
        assert native.merge_planes(planes, width) == data
    data = rng.randbytes(MIB + 3)
    assert native.merge_planes(native.split_planes(data, width), width) == data


def test_split_planes_takes_any_buffer() -> None:
    data = bytearray(range(256)) * 4
    assert native.split_planes(memoryview(data)[1:], 4) == ref_split(bytes(data[1:]), 4)
    with pytest.raises(ValueError):
        native.split_planes(b"abc", 0)


# ---- float detection --------------------------------------------------------------


@pytest.mark.parametrize("phase", [0, 1, 2, 3])
def test_detects_fp32_at_any_phase(phase: int) -> None:
    data = os.urandom(phase) + fp32(20000)
    assert detect_float_width(data) == 4
    assert native.float_layout(data)[:2] == (4, phase)
    assert native.float_layout(adam_sq(20000))[:2] == (4, 0)


@pytest.mark.parametrize("phase", [0, 1])
def test_detects_bf16_and_fp16_at_any_phase(phase: int) -> None:
    for data in (bf16(30000), bf16(30000, scale=1.0), fp16(30000)):
        data = b"\x01" * phase + data
        assert detect_float_width(data) == 2
        assert native.float_layout(data)[:2] == (2, phase)


def test_detection_rejects_non_floats() -> None:
    assert detect_float_width(os.urandom(100000)) is None
    assert detect_float_width(bytes(100000)) is None
    assert detect_float_width(b"the quick brown fox jumps " * 4000) is None
    assert detect_float_width(b"") is None
    assert detect_float_width(b"\x00\x80") is None


def test_width_hint_finds_the_phase() -> None:
    data = b"xyz" + fp32(10000)
    assert native.float_layout(data, 4)[:2] == (4, 3)
    assert native.float_layout(b"x" + bf16(10000), 2)[:2] == (2, 1)
    # fp64: the top byte (sign and 7 exponent bits) ends each element
    f64 = (gen().standard_normal(8000)).astype("<f8").tobytes()
    assert native.float_layout(b"12345" + f64, 8)[:2] == (8, 5)
    with pytest.raises(ValueError):
        native.float_layout(data, 1)


# ---- round trips ------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["bf16", "bf16-wide", "fp16", "fp32", "fp32-adam", "fp64"])
def test_float_chunks_roundtrip_and_shrink(kind: str, offset: int) -> None:
    rng = gen()
    data = {
        "bf16": lambda: bf16(40001, rng=rng),
        "bf16-wide": lambda: bf16(40001, scale=30.0, rng=rng),
        "fp16": lambda: fp16(40001, rng=rng),
        "fp32": lambda: fp32(20001, rng=rng),
        "fp32-adam": lambda: adam_sq(20001, rng=rng),
        "fp64": lambda: rng.standard_normal(10001).astype("<f8").tobytes(),
    }[kind]()
    data = data[offset : len(data) - (offset % 2)]  # odd lengths, any phase
    enc = roundtrip(data)
    if kind != "fp64":
        assert enc.codec == CODEC_FLOAT
        assert enc.param == (4 if kind.startswith("fp32") else 2)
        limit = {"bf16": 0.70, "bf16-wide": 0.70, "fp16": 0.90, "fp32": 0.86, "fp32-adam": 0.86}[kind]
        assert len(enc.payload) / len(data) < limit
    # and with the right hint
    width = {"fp32": 4, "fp32-adam": 4, "fp64": 8}.get(kind, 2)
    enc = roundtrip(data, width_hint=width)
    assert enc.codec == CODEC_FLOAT and enc.param == width


def test_float_codec_beats_zstd_on_bf16() -> None:
    data = bf16(32 * KIB)
    enc = roundtrip(data)
    z = codec._compressor(3).compress(data)
    assert len(enc.payload) < 0.9 * len(z)


def _specials32() -> list[int]:
    return [
        0x00000000, 0x80000000,  # +-0
        0x00000001, 0x80000001, 0x007FFFFF, 0x00400000,  # denormals
        0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  # smallest normal, +-max
        0x7F800000, 0xFF800000,  # +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF, 0x7FC12345,  # NaNs, payloads
    ]


def _specials16() -> list[int]:
    return [
        0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0040,  # +-0, bf16 denormals
        0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80,  # normal, max, inf
        0x7FC0, 0xFFC0, 0x7F81, 0x7FBF, 0xFFFF, 0x7FD5,  # NaNs with payloads
        0x7C00, 0x7E01, 0x03FF,  # fp16 inf, NaN, denormal
    ]


@pytest.mark.parametrize("width", [2, 4])
def test_nan_payloads_denormals_and_infinities_roundtrip(width: int) -> None:
    rng = random.Random(width)
    specials = _specials16() if width == 2 else _specials32()
    fmt = "<H" if width == 2 else "<I"
    base = bytearray(bf16(30000) if width == 2 else fp32(15000))
    for _ in range(3000):  # sprinkled into normal data
        i = rng.randrange(len(base) // width) * width
        base[i : i + width] = struct.pack(fmt, rng.choice(specials))
    for off in range(width):
        enc = roundtrip(bytes(base[off:]))
        assert enc.codec == CODEC_FLOAT
    # chunks made only of specials, in runs and shuffled
    only = b"".join(struct.pack(fmt, rng.choice(specials)) for _ in range(20000))
    roundtrip(only)
    roundtrip(only, width_hint=width)
    runs = b"".join(struct.pack(fmt, s) * 700 for s in specials)
    roundtrip(runs)
    roundtrip(runs, width_hint=width)
    # every NaN payload of bf16
    nans = b"".join(struct.pack("<H", s | v) for s in (0x7F80, 0xFF80) for v in range(1, 128))
    roundtrip(nans * 40, width_hint=2)


def test_all_denormal_fp32() -> None:
    rng = gen()
    data = rng.integers(1, 1 << 23, 30000, dtype=np.uint32).astype("<u4").tobytes()
    roundtrip(data)
    roundtrip(data, width_hint=4)


def test_exponent_runs_choose_planes() -> None:
    """Rows with their own scale (like AdamW state): the exponents repeat in
    runs, zstd on the exponent plane beats the order-0 float coder, and
    encode_chunk keeps whichever is smaller."""
    rng = gen()
    rows = rng.standard_normal((300, 64)) * (10.0 ** rng.uniform(-8, 0, (300, 1)))
    data = b"\x07" + rows.astype("<f4").tobytes()
    w, phase, runs = native.float_layout(data)
    assert (w, phase) == (4, 1) and runs > 1.5
    enc = roundtrip(data)
    floats_only = native.fc_encode(data, w, phase, codec.FLOAT_MAX_BITS, len(data))
    planes = encode_planes(data, w, phase=phase, level=codec._PLANES_LEVEL)
    assert floats_only is not None
    assert len(enc.payload) == min(len(floats_only), len(planes.payload))
    assert enc.codec == CODEC_PLANES
    # independent values: no runs, CODEC_FLOAT
    assert 0.8 < native.float_layout(fp32(20000))[2] < 1.2
    assert 0.8 < native.float_layout(bf16(40000))[2] < 1.2
    assert encode_chunk(fp32(20000)).codec == CODEC_FLOAT


@pytest.mark.parametrize("hint", [2, 3, 4, 5, 8, 16])
def test_wrong_width_hints_still_roundtrip(hint: int) -> None:
    for data in (bf16(20000), fp32(10000), os.urandom(30000), bytes(30000),
                 b"\x00\x00\x80\x3f" * 5000 + os.urandom(7)):
        for off in (0, 1):
            roundtrip(data[off:], width_hint=hint)
    with pytest.raises(ValueError):
        encode_chunk(b"abc" * 1000, width_hint=1)
    with pytest.raises(ValueError):
        encode_chunk(b"abc" * 1000, width_hint=17)


def test_non_float_data() -> None:
    rng = random.Random(3)
    random_data = rng.randbytes(100_003)
    enc = roundtrip(random_data)
    assert enc == Encoded(CODEC_RAW, 0, random_data)
    assert roundtrip(bytes(200_000)).codec == CODEC_ZSTD
    assert roundtrip(b"PK\x03\x04 data.pkl " * 3000).codec == CODEC_ZSTD
    ints = np.arange(40000, dtype="<i8").tobytes()
    roundtrip(ints)
    roundtrip(ints, width_hint=8)
    tokens = gen().integers(0, 50000, 30000).astype("<i4").tobytes()
    roundtrip(tokens)
    # a float tensor that ends in zeros and a header that starts with text
    roundtrip(b'{"__metadata__":{"step":"100"}}    ' + fp32(10000) + bytes(20000))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 63, 64, 65, 511, 512, 513, 1023])
def test_short_chunks(n: int) -> None:
    for data in (os.urandom(n), bytes(n), bf16(n)[:n], fp32(n)[:n]):
        enc = roundtrip(data)
        if n == 0:
            assert enc == Encoded(CODEC_RAW, 0, b"")
        for hint in (2, 4):
            roundtrip(data, width_hint=hint)


def test_empty_input() -> None:
    assert encode_chunk(b"") == Encoded(CODEC_RAW, 0, b"")
    assert encode_chunk(bytearray()) == Encoded(CODEC_RAW, 0, b"")
    assert decode_chunk(CODEC_RAW, 0, b"", 0) == b""
    with pytest.raises(DamagedData):
        decode_chunk(CODEC_RAW, 0, b"x", 0)
    z = codec._compressor(3).compress(b"")
    assert decode_chunk(CODEC_ZSTD, 0, z, 0) == b""
    with pytest.raises(DamagedData):
        decode_chunk(CODEC_FLOAT, 2, b"\x00" * 8, 0)


def test_accepts_any_buffer() -> None:
    data = bf16(20000)
    for buf in (bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint16)):
        enc = encode_chunk(buf)
        assert decode_chunk(enc.codec, enc.param, memoryview(enc.payload), len(data)) == data
    out = bytearray(len(data))
    decode_chunk_into(enc.codec, enc.param, enc.payload, out)
    assert out == data
    with pytest.raises(ValueError):
        decode_chunk_into(enc.codec, enc.param, enc.payload, data)  # read-only


@pytest.mark.parametrize("width", [2, 3, 4, 8])
def test_planes_codec_roundtrip(width: int) -> None:
    rng = gen()
    cases = [
        rng.integers(0, 300, 20000).astype("<i8").tobytes(),
        fp32(10000, rng=rng),
        bf16(20000, rng=rng),
        os.urandom(5000),
        bytes(30000),
    ]
    for data in cases:
        for off in (0, 1, 5):
            piece = data[off:]
            enc = encode_planes(piece, width)
            assert enc.codec in (CODEC_PLANES, CODEC_RAW)
            if enc.codec == CODEC_PLANES:
                assert enc.param == width and len(enc.payload) < len(piece)
            assert decode_chunk(enc.codec, enc.param, enc.payload, len(piece)) == piece
    ints = rng.integers(0, 300, 20000).astype("<i8").tobytes()
    enc = encode_planes(ints, 8, phase=0)
    assert enc.codec == CODEC_PLANES and len(enc.payload) < len(ints) / 4
    with pytest.raises(ValueError):
        encode_planes(ints, 1)
    with pytest.raises(ValueError):
        encode_planes(ints, 4, phase=4)


def test_rans8_roundtrip() -> None:
    rng = gen()
    for data in (bytes(rng.integers(0, 4, 10000, dtype=np.uint8)), b"ab" * 5000,
                 bytes(rng.geometric(0.3, 70000).clip(0, 255).astype(np.uint8))):
        blob = native.rans8_encode(data, len(data))
        assert blob is not None and len(blob) < len(data)
        out = bytearray(len(data))
        assert native.rans8_decode_into(blob, out) and out == data
        assert not native.rans8_decode_into(blob, bytearray(len(data) + 1))
    assert native.rans8_encode(bytes(1000), 1000) is None  # one symbol: not coded
    assert native.rans8_encode(os.urandom(1000), 900) is None  # does not fit


# ---- damage -----------------------------------------------------------------------


def _encodings() -> list[tuple[str, Encoded, bytes]]:
    rng = gen()
    out = []
    for name, data, kw in [
        ("float2", bf16(24000, rng=rng)[1:], {}),
        ("float4", fp32(12000, rng=rng)[3:], {}),
        ("float4-rans-planes", adam_sq(12000, rng=rng)[:20000] + bytes(28000), {"width_hint": 4}),
        ("float8", rng.standard_normal(3000).astype("<f8").tobytes(), {"width_hint": 8}),
        ("zstd", b"header " * 3000 + bytes(5000), {}),
    ]:
        enc = encode_chunk(data, **kw)  # type: ignore[arg-type]
        out.append((name, enc, data))
    ints = rng.integers(0, 300, 6000).astype("<i8").tobytes()
    out.append(("planes", encode_planes(ints, 8), ints))
    return out


def _must_fail(codec_id: int, param: int, payload: bytes, length: int) -> None:
    with pytest.raises(DamagedData):
        decode_chunk(codec_id, param, payload, length)


def _never_wrong(codec_id: int, param: int, payload: bytes, data: bytes) -> bool:
    """DamagedData (True), or exactly the original bytes (False): a flip can
    land on a bit that does not matter, e.g. one of an approximate frequency
    that normalises to the same table, and then the output is still right."""
    try:
        out = decode_chunk(codec_id, param, payload, len(data))
    except DamagedData:
        return True
    assert out == data, "damaged payload decoded to wrong bytes"
    return False


def test_damage_setup() -> None:
    kinds = {name: enc.codec for name, enc, _ in _encodings()}
    assert kinds["float2"] == kinds["float4"] == kinds["float8"] == CODEC_FLOAT
    assert kinds["zstd"] == CODEC_ZSTD and kinds["planes"] == CODEC_PLANES


@pytest.mark.parametrize("name,enc,data", _encodings(), ids=lambda x: x if isinstance(x, str) else "")
def test_flipped_bytes_are_detected(name: str, enc: Encoded, data: bytes) -> None:
    rng = random.Random(name)
    payload = enc.payload
    positions = set(range(min(len(payload), 600)))  # every header byte and table
    positions |= set(range(max(0, len(payload) - 64), len(payload)))  # every tail byte
    positions |= {rng.randrange(len(payload)) for _ in range(400)}
    accepted = 0
    for pos in sorted(positions):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(payload)
            bad[pos] ^= flip
            accepted += not _never_wrong(enc.codec, enc.param, bytes(bad), data)
    assert accepted <= 3, f"{accepted} flips went unnoticed (harmlessly)"


@pytest.mark.parametrize("name,enc,data", _encodings(), ids=lambda x: x if isinstance(x, str) else "")
def test_truncated_extended_and_mislabelled_payloads(name: str, enc: Encoded, data: bytes) -> None:
    payload = enc.payload
    for cut in sorted({0, 1, 2, 5, 9, 40, len(payload) // 2, len(payload) - 5,
                       len(payload) - 4, len(payload) - 1}):
        if cut < len(payload):
            _must_fail(enc.codec, enc.param, payload[:cut], len(data))
    _must_fail(enc.codec, enc.param, payload + b"\x00", len(data))
    _must_fail(enc.codec, enc.param, payload + payload, len(data))
    for length in (0, 1, len(data) - 1, len(data) + 1, 2 * len(data)):
        _must_fail(enc.codec, enc.param, payload, length)
    for param in (0, 1, 2, 3, 4, 7, 8, 17, 255):
        if param != enc.param:
            _must_fail(enc.codec, param, payload, len(data))
    for other in (CODEC_RAW, CODEC_ZSTD, CODEC_PLANES, CODEC_FLOAT, 4, 99, 255):
        if other != enc.codec:
            _must_fail(other, enc.param, payload, len(data))
    out = bytearray(len(data) + 1)
    with pytest.raises(DamagedData):
        decode_chunk_into(enc.codec, enc.param, payload, out)


def test_zstd_frames_of_the_first_codec_still_decode() -> None:
    """The placeholder codec (zstd defaults: no checksum) wrote CODEC_ZSTD
    payloads that must stay readable."""
    import zstandard

    data = b"optimizer " * 5000
    old = zstandard.ZstdCompressor(level=3).compress(data)
    assert not zstandard.get_frame_parameters(old).has_checksum
    assert decode_chunk(CODEC_ZSTD, 0, old, len(data)) == data
    _must_fail(CODEC_ZSTD, 0, old, len(data) - 1)
    _must_fail(CODEC_ZSTD, 0, old + b"\0", len(data))
    _must_fail(CODEC_ZSTD, 0, old[:-1], len(data))
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    assert decode_chunk(CODEC_ZSTD, 0, streamed, len(data)) == data
    _must_fail(CODEC_ZSTD, 0, streamed, len(data) + 1)


def test_raw_payload_length_is_checked() -> None:
    assert decode_chunk(CODEC_RAW, 0, b"abcd", 4) == b"abcd"
    for length in (0, 3, 5):
        _must_fail(CODEC_RAW, 0, b"abcd", length)
    _must_fail(CODEC_RAW, 1, b"abcd", 4)
    _must_fail(CODEC_RAW, 0, b"abcd", -1)


def test_garbage_payloads_never_decode() -> None:
    """Random bytes, and valid payloads with random stretches overwritten:
    DamagedData every time, in bounded time."""
    rng = random.Random(11)
    t0 = time.perf_counter()
    for _ in range(1500):
        length = rng.choice([1, 7, 100, 4096, 65536, 200_001])
        payload = rng.randbytes(rng.randrange(0, 3000))
        for c, p in ((CODEC_FLOAT, rng.choice([2, 4, 8])), (CODEC_PLANES, rng.choice([2, 4])),
                     (CODEC_ZSTD, 0)):
            _must_fail(c, p, payload, length)
    for name, enc, data in _encodings():
        for _ in range(300):
            bad = bytearray(enc.payload)
            start = rng.randrange(len(bad))
            for i in range(start, min(len(bad), start + rng.randrange(1, 40))):
                bad[i] = rng.randrange(256)
            if bytes(bad) == enc.payload:
                continue
            _never_wrong(enc.codec, enc.param, bytes(bad), data)
    # A valid-looking CODEC_FLOAT header in front of garbage rANS streams.
    for _ in range(500):
        n = rng.randrange(64, 5000)
        body = rng.randbytes(rng.randrange(0, 4000))
        payload = bytes([0, rng.choice([8, 11, 12, 16])]) + struct.pack("<I", len(body)) + body
        payload += rng.randbytes(4)
        _must_fail(CODEC_FLOAT, 2, payload, 2 * n)
    assert time.perf_counter() - t0 < 60


# ---- whole checkpoints, threads, GIL, speed ---------------------------------------


def test_chunked_safetensors_like_file_beats_zstd() -> None:
    rng = gen()
    header = b'{"w":{"dtype":"BF16","shape":[300000],"data_offsets":[0,600000]}}'
    header += b" " * (-len(header) % 8)
    blob = struct.pack("<Q", len(header)) + header + bf16(300000, rng=rng) + fp32(100000, rng=rng)
    chunks = chunk_buffer(blob)
    stored = 0
    for off, length in chunks:
        enc = roundtrip(blob[off : off + length])
        stored += len(enc.payload)
    zstd = len(codec._compressor(3).compress(blob))
    assert stored < 0.9 * zstd  # 0.87 here; real checkpoints: docs/COMPRESSION.md


def test_threads_share_nothing() -> None:
    rng = gen()
    datas = [bf16(20000, rng=rng), fp32(9000, rng=rng), b"abc" * 9000, os.urandom(20000)]

    def work(i: int) -> None:
        for _ in range(20):
            data = datas[i % len(datas)]
            enc = encode_chunk(data, level=1 + i % 3)
            assert decode_chunk(enc.codec, enc.param, enc.payload, len(data)) == data

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(16)))


def test_native_codec_releases_the_gil() -> None:
    from ckptfs._native import ffi, lib

    def bf16_mib(scale: int) -> bytes:
        return bf16(48 * MIB // 2 * scale)

    def encode(scale: int) -> Callable[[], object]:
        data = bf16_mib(scale)
        return lambda: native.fc_encode(data, 2, 0, 12, len(data))

    decoded: list[tuple[bytes, bytearray]] = []

    def decode(scale: int) -> Callable[[], object]:
        data = bf16_mib(scale)
        payload = native.fc_encode(data, 2, 0, 12, len(data))
        assert payload is not None
        out = bytearray(len(data))
        decoded.append((data, out))
        return lambda: native.fc_decode_into(payload, 2, out)

    def split_planes(scale: int) -> Callable[[], None]:
        # The C call itself; native.split_planes' copy into a bytes object keeps the
        # GIL. Width 3 takes the plain byte loop: 19-25 ms of CPU per 48 MiB (the
        # vectorized widths 2 and 4 take under 10 ms; calls in a loop would not do,
        # the GIL changes hands between them).
        data = bf16_mib(scale)
        out = bytearray(len(data))

        def call() -> None:
            with ffi.from_buffer(data) as src, \
                    ffi.from_buffer(out, require_writable=True) as dst:
                lib.ckptfs_split_planes(src, len(data), 3, dst)
        return call

    assert_releases_gil(encode)
    assert_releases_gil(decode)
    data, out = decoded[-1]
    assert out == data
    assert_releases_gil(split_planes)

