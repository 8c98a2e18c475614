"""Unit tests for ckptfs.native (the cffi helpers)."""

from __future__ import annotations

import mmap
import os
import platform
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gil import assert_releases_gil

from ckptfs import native
from ckptfs._native import ffi, lib  # tests reach in to check the software path

MIB = 1 << 20


def _make_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _make_table()


def ref_crc32c(data: bytes, seed: int = 0) -> int:
    crc = seed ^ 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ _TABLE[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


def sw_crc32c(data: bytes, seed: int = 0) -> int:
    with ffi.from_buffer(data) as buf:
        return int(lib.ckptfs_crc32c_sw(seed, buf, len(buf)))


@pytest.fixture
def rng() -> random.Random:
    return random.Random(0xC4C5)


@pytest.fixture
def file_map(tmp_path: Path) -> Iterator[tuple[int, mmap.mmap]]:
    size = 1 * MIB
    fd = os.open(tmp_path / "log", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    try:
        yield fd, m
    finally:
        m.close()
        os.close(fd)


# ---- crc32c -----------------------------------------------------------------

# RFC 3720 B.4, the usual check value, and the iSCSI SCSI Read(10) PDU.
READ10_PDU = bytes.fromhex(
    "01c0000000000000000000000000000014000000000004000000001400000018"
    "28000000000000000200000000000000"
)
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (READ10_PDU, 0xD9963A56),
]


@pytest.mark.parametrize(("data", "expected"), VECTORS)
def test_crc32c_known_vectors(data: bytes, expected: int) -> None:
    assert ref_crc32c(data) == expected
    assert native.crc32c(data) == expected
    assert sw_crc32c(data) == expected


def test_crc32c_accepts_buffer_types() -> None:
    data = b"123456789"
    expected = 0xE3069283
    assert native.crc32c(bytearray(data)) == expected
    assert native.crc32c(memoryview(b"xx" + data)[2:]) == expected
    m = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        m[: len(data)] = data
        assert native.crc32c(memoryview(m)[: len(data)]) == expected
    finally:
        m.close()
    with pytest.raises(BufferError):
        native.crc32c(memoryview(bytes(16))[::2])  # not contiguous


def test_crc32c_chaining(rng: random.Random) -> None:
    data = rng.randbytes(100_000)
    whole = native.crc32c(data)
    for cut in (0, 1, 7, 8, 255, 4096, 24_577, 99_999, 100_000):
        assert native.crc32c(data[cut:], native.crc32c(data[:cut])) == whole
    assert native.crc32c(b"", 0x12345678) == 0x12345678


def test_crc32c_all_small_lengths_and_offsets(rng: random.Random) -> None:
    data = rng.randbytes(320)
    view = memoryview(data)
    for offset in range(16):
        for length in range(0, 301):
            chunk = view[offset : offset + length]
            expected = ref_crc32c(bytes(chunk))
            assert native.crc32c(chunk) == expected, (offset, length)
            assert sw_crc32c(bytes(chunk)) == expected, (offset, length)


def test_crc32c_large_hardware_matches_software(rng: random.Random) -> None:
    # Cross the 3 x 256 and 3 x 8192 interleaving thresholds of the SSE4.2 path.
    data = rng.randbytes(200_000)
    view = memoryview(data)
    lengths = [767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1, 2 * 3 * 8192 + 777, 199_990]
    for offset in (0, 1, 5, 8):
        for length in lengths:
            chunk = view[offset : offset + length]
            assert native.crc32c(chunk) == sw_crc32c(bytes(chunk)), (offset, length)
    assert native.crc32c(data) == ref_crc32c(data)


def test_crc32c_uses_hardware_when_available() -> None:
    if platform.machine() in ("x86_64", "AMD64") and "sse4_2" in _cpu_flags():
        assert lib.ckptfs_crc32c_hw() == 1


# ---- crc32c_blocks ----------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 7, 512, 4096, 65_536])
@pytest.mark.parametrize("length", [0, 1, 4095, 4096, 4097, 100_003])
def test_crc32c_blocks_matches_per_block(rng: random.Random, block_size: int, length: int) -> None:
    data = rng.randbytes(length)
    packed = native.crc32c_blocks(data, block_size)
    nblocks = -(-length // block_size)
    assert len(packed) == 4 * nblocks
    expected = [native.crc32c(data[i : i + block_size]) for i in range(0, length, block_size)]
    assert list(struct.unpack(f"<{nblocks}I", packed)) == expected


def test_crc32c_blocks_rejects_bad_block_size() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError):
            native.crc32c_blocks(b"abc", bad)


# ---- flush_instruction --------------------------------------------------------


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_flush_instruction() -> None:
    kind = native.flush_instruction()
    if platform.machine() not in ("x86_64", "AMD64"):
        assert kind == "none"
        return
    flags = _cpu_flags()
    if not flags:
        assert kind in ("clwb", "clflushopt", "clflush")
    elif "clwb" in flags:
        assert kind == "clwb"
    elif "clflushopt" in flags:
        assert kind == "clflushopt"
    else:
        assert kind == "clflush"


# ---- persist --------------------------------------------------------------------


@pytest.mark.parametrize("dax", [False, True])
def test_persist_file_mapping(file_map: tuple[int, mmap.mmap], rng: random.Random, dax: bool) -> None:
    fd, m = file_map
    for offset, length in [(0, 1), (1, 63), (4095, 2), (12_345, 70_000), (len(m) - 1, 1), (0, len(m)), (77, 0)]:
        data = rng.randbytes(length)
        m[offset : offset + length] = data
        native.persist(m, offset, length, dax)
        assert m[offset : offset + length] == data
        assert os.pread(fd, length, offset) == data


def test_persist_anonymous_mapping_dax() -> None:
    m = mmap.mmap(-1, 8 * mmap.PAGESIZE)
    try:
        data = bytes(range(256)) * 100
        m[3 : 3 + len(data)] = data
        native.persist(m, 3, len(data), True)
        assert m[3 : 3 + len(data)] == data
        native.persist(m, 3, len(data), False)  # msync on anonymous memory is a no-op
    finally:
        m.close()


def test_persist_bounds(file_map: tuple[int, mmap.mmap]) -> None:
    _, m = file_map
    for offset, length in [(-1, 1), (0, -1), (len(m), 1), (len(m) - 10, 11)]:
        for dax in (False, True):
            with pytest.raises(ValueError):
                native.persist(m, offset, length, dax)


def test_persist_does_not_pin_the_mapping(tmp_path: Path) -> None:
    # The buffer export must end with the call, or mmap.close() would fail.
    with open(tmp_path / "f", "w+b") as f:
        f.truncate(mmap.PAGESIZE)
        m = mmap.mmap(f.fileno(), mmap.PAGESIZE)
        native.persist(m, 0, 10, False)
        native.copy_nt(m, 0, b"abc")
        m.close()


# ---- copy_nt ----------------------------------------------------------------------


def test_copy_nt_small_unaligned(rng: random.Random) -> None:
    size = 2 * mmap.PAGESIZE
    m = mmap.mmap(-1, size)
    try:
        src_all = rng.randbytes(400)
        src_view = memoryview(src_all)
        for offset in list(range(0, 70)) + [size - 300]:
            for length in range(0, 301):
                src = src_view[offset % 13 : offset % 13 + length]  # unaligned source too
                lo, hi = max(0, offset - 1), min(size, offset + length + 1)
                m[lo:hi] = b"\xa5" * (hi - lo)  # sentinels either side
                native.copy_nt(m, offset, src)
                assert m[offset : offset + length] == src, (offset, length)
                if offset:
                    assert m[offset - 1] == 0xA5
                if offset + length < size:
                    assert m[offset + length] == 0xA5
    finally:
        m.close()


def test_copy_nt_large(file_map: tuple[int, mmap.mmap], rng: random.Random) -> None:
    fd, _ = file_map
    size = 8 * MIB
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    try:
        data = rng.randbytes(5 * MIB)
        native.copy_nt(m, 12_345, data)
        assert m[12_345 : 12_345 + len(data)] == data
        native.persist(m, 12_345, len(data), False)
        assert os.pread(fd, len(data), 12_345) == data
    finally:
        m.close()


def test_copy_nt_bounds_and_writability() -> None:
    m = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        with pytest.raises(ValueError):
            native.copy_nt(m, -1, b"x")
        with pytest.raises(ValueError):
            native.copy_nt(m, mmap.PAGESIZE - 2, b"abc")
        native.copy_nt(m, mmap.PAGESIZE - 3, b"abc")
        assert m[-3:] == b"abc"
    finally:
        m.close()
    ro = mmap.mmap(-1, mmap.PAGESIZE, access=mmap.ACCESS_READ)
    try:
        with pytest.raises((TypeError, BufferError)):
            native.copy_nt(ro, 0, b"x")
    finally:
        ro.close()


# ---- map_log --------------------------------------------------------------------


def test_map_log_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "log"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 4 * MIB)
        m, is_dax = native.map_log(fd, 4 * MIB)
        try:
            assert is_dax is False
            assert len(m) == 4 * MIB
            native.copy_nt(m, 100, b"checkpoint")
            native.persist(m, 100, 10, is_dax)
        finally:
            m.close()
        assert os.pread(fd, 10, 100) == b"checkpoint"
    finally:
        os.close(fd)


def test_map_log_bad_sizes(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "log", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        with pytest.raises(ValueError):
            native.map_log(fd, 2 * mmap.PAGESIZE)
        with pytest.raises(ValueError):
            native.map_log(fd, 0)
    finally:
        os.close(fd)


# ---- GIL and throughput ---------------------------------------------------------------


def test_calls_release_the_gil() -> None:
    def make_call(scale: int) -> Callable[[], None]:
        data = bytes(64 * MIB * scale)

        def call() -> None:
            with ffi.from_buffer(data) as buf:
                lib.ckptfs_crc32c_sw(0, buf, len(buf))
        return call

    assert_releases_gil(make_call)


# ---- open_beneath: reaching files below SOURCE -----------------------------------

@pytest.mark.parametrize("walk", [False, True], ids=["openat2", "component-walk"])
def test_open_beneath_never_follows_a_symlink(tmp_path, walk):
    """Both ways (openat2, and the walk for kernels without it) open plain paths
    beneath the directory and refuse a symlink at any component, '..', '.',
    empty components and absolute paths."""
    import errno as e
    from ckptfs.native import open_beneath
    base = tmp_path / "base"
    (base / "a" / "b").mkdir(parents=True)
    (base / "a" / "b" / "f").write_bytes(b"inside")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"outside")
    os.symlink(outside, base / "a" / "to_outside")      # directory symlink, absolute
    os.symlink("b", base / "a" / "to_b")                # directory symlink, relative, inside
    os.symlink("f", base / "a" / "b" / "to_f")          # file symlink, inside
    os.symlink(outside / "f", base / "to_outside_f")    # file symlink to outside
    dfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for flags in (os.O_RDONLY, os.O_PATH):
            fd = open_beneath(dfd, b"a/b/f", flags, walk=walk)
            try:
                st = os.fstat(fd)
                assert (st.st_dev, st.st_ino) == (os.stat(base / "a" / "b" / "f").st_dev,
                                                  os.stat(base / "a" / "b" / "f").st_ino)
                if flags == os.O_RDONLY:
                    assert os.read(fd, 100) == b"inside"
            finally:
                os.close(fd)
            fd = open_beneath(dfd, b"a/b", flags | os.O_DIRECTORY, walk=walk)
            os.close(fd)
            for path in (b"a/to_outside/f", b"a/to_b/f", b"a/b/to_f", b"to_outside_f",
                         b"a/to_outside"):
                with pytest.raises(OSError) as info:
                    os.close(open_beneath(dfd, path, flags, walk=walk))
                assert info.value.errno in (e.ELOOP, e.ENOTDIR), (path, info.value)
            for path in (b"../outside/f", b"a/../a/b/f", b"./a/b/f", b"a//b/f", b"/etc/passwd",
                         b"", b"a/b/"):
                with pytest.raises(OSError) as info:
                    os.close(open_beneath(dfd, path, flags, walk=walk))
                assert info.value.errno == e.EINVAL, path
            with pytest.raises(FileNotFoundError):
                open_beneath(dfd, b"a/nope", flags, walk=walk)
    finally:
        os.close(dfd)


# ---- verify_payloads: the cold store's check of a pack span ------------------

def _span(rng: random.Random, sizes: list[int]) -> tuple[bytes, list[int], list[int], list[int],
                                                         bytes]:
    from blake3 import blake3
    parts = [rng.randbytes(n) for n in sizes]
    offs, at = [], 0
    for p in parts:
        offs.append(at)
        at += len(p)
    return (b"".join(parts), offs, sizes, [native.crc32c(p) for p in parts],
            b"".join(blake3(p).digest() for p in parts))


needs_blake3 = pytest.mark.skipif(not native.chunk_feed_hashes(),
                                  reason="the module was built without the BLAKE3 library")


@needs_blake3
def test_verify_payloads_passes_good_payloads_and_names_the_first_bad(rng) -> None:
    span, offs, lens, crcs, ids = _span(rng, [1, 4096, 70000, 256 * 1024, 3])
    assert native.verify_payloads(span, offs, lens, crcs, ids) == (5, 0)
    assert native.verify_payloads(span, offs, lens, crcs, None) == (5, 0)
    # A wrong id, a wrong CRC, a payload past the span: the first is named.
    bad_id = ids[:64] + bytes([ids[64] ^ 1]) + ids[65:]
    assert native.verify_payloads(span, offs, lens, crcs, bad_id) == (2, native.VERIFY_ID)
    bad_crc = crcs[:3] + [crcs[3] ^ 1] + crcs[4:]
    assert native.verify_payloads(span, offs, lens, bad_crc, bad_id) == (2, native.VERIFY_ID)
    # A payload checked by its id is not CRC-checked as well: the id over
    # all its bytes proves them. Without its id, its CRC is checked.
    assert native.verify_payloads(span, offs, lens, bad_crc, ids) == (5, 0)
    assert native.verify_payloads(span, offs, lens, bad_crc, None) == (3, native.VERIFY_CRC)
    no_id3 = ids[:96] + bytes(32) + ids[128:]
    assert native.verify_payloads(span, offs, lens, bad_crc, no_id3) == (3, native.VERIFY_CRC)
    assert native.verify_payloads(span, offs, lens[:4] + [4], crcs, ids) == \
        (4, native.VERIFY_RANGE)
    assert native.verify_payloads(span[:-1], offs, lens, crcs, ids) == (4, native.VERIFY_RANGE)
    # Zeros for an id: that payload's id is not checked here (it is encoded).
    no_id = ids[:64] + bytes(32) + ids[96:]
    span2 = span[:offs[2]] + bytes([span[offs[2]] ^ 1]) + span[offs[2] + 1:]
    crcs2 = crcs[:2] + [native.crc32c(span2[offs[2]:offs[2] + lens[2]])] + crcs[3:]
    assert native.verify_payloads(span2, offs, lens, crcs2, no_id) == (5, 0)
    assert native.verify_payloads(span2, offs, lens, crcs2, ids) == (2, native.VERIFY_ID)
    with pytest.raises(ValueError):
        native.verify_payloads(span, offs, lens, crcs, ids[:-32])


@needs_blake3
def test_verify_payloads_releases_the_gil(rng) -> None:
    span, offs, lens, crcs, ids = _span(rng, [MIB])
    n = 200                     # the same MiB 200 times per scale: tens of ms of hashing
    assert_releases_gil(lambda scale: lambda: native.verify_payloads(
        span, offs * n * scale, lens * n * scale, crcs * n * scale, ids * n * scale))
