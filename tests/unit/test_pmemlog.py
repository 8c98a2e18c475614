"""The log's allocator, superblock and verified reads, without FUSE."""

from __future__ import annotations

import os
import random

import pytest

from ckptfs.errors import DamagedData, FormatError, NoSpace
from ckptfs.index import CRC_BLOCK_BYTES
from ckptfs.pmemlog import PAGE_BYTES, SUPERBLOCK_BYTES, PmemLog

UUID = b"u" * 16
SIZE = 4 << 20


@pytest.fixture
def plog(tmp_path):
    log = PmemLog.open(str(tmp_path / "pmem.log"), SIZE, UUID)
    log.init_free_space([])
    yield log
    log.close()


def test_new_log_is_preallocated_and_checked_on_reopen(tmp_path):
    path = str(tmp_path / "pmem.log")
    PmemLog.open(path, SIZE, UUID).close()
    assert os.path.getsize(path) == SIZE
    with pytest.raises(FormatError, match="another ckptfs"):
        PmemLog.open(path, None, b"x" * 16)
    with pytest.raises(FormatError, match="shrinking"):
        PmemLog.open(path, SIZE // 2, UUID)
    grown = PmemLog.open(path, SIZE * 2, UUID)
    assert grown.size_bytes == SIZE * 2
    grown.close()
    with open(path, "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(FormatError, match="not a ckptfs log"):
        PmemLog.open(path, None, UUID)


def test_allocate_reserve_release_reuse_every_byte(plog):
    """Byte-exact: pieces, reservations and releases of any length and place
    (a dedup'd chunk gives back bytes in the middle of an arena) tile the log."""
    capacity = plog.capacity_bytes
    rng = random.Random(3)
    held: list[tuple[int, int]] = []
    for _ in range(3000):
        r = rng.random()
        if held and (r < 0.4 or plog.free_bytes < 300_000):
            off, length = held.pop(rng.randrange(len(held)))
            if length > 2 and rng.random() < 0.5:
                # give back a middle part only, keep both ends
                a = rng.randrange(1, length - 1)
                b = rng.randrange(a, length)
                plog.release(off + a, b - a)
                held += [(off, a), (off + b, length - b)]
            else:
                plog.release(off, length)
        elif r < 0.7:
            n = rng.randrange(1, 300_000)
            pieces = plog.allocate(n)
            assert sum(length for _, length in pieces) == n
            held.extend(pieces)
        else:
            n = rng.randrange(1, 300_000)
            off = plog.reserve(n)
            if off is not None:
                held.append((off, n))
                grow = rng.randrange(1, 50_000)
                if plog.reserve(grow, at=off + n) is not None:
                    held.append((off + n, grow))
        held = [(o, n) for o, n in held if n > 0]
        assert plog.free_bytes == capacity - sum(n for _, n in held)
        spans = sorted((off, off + n) for off, n in held)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, "two allocations overlap"
        assert all(off >= SUPERBLOCK_BYTES and off + n <= plog.size_bytes for off, n in held)
    for off, length in held:
        plog.release(off, length)
    assert plog.free_bytes == capacity
    assert plog.allocate(capacity) == [(SUPERBLOCK_BYTES, capacity)]


def test_reserve_in_place_only_where_free(plog):
    off = plog.reserve(10_000)
    assert off is not None
    other = plog.reserve(5_000)
    assert other == off + 10_000                      # next fit: right behind
    assert plog.reserve(1, at=off + 10_000) is None   # taken
    plog.release(other, 5_000)
    assert plog.reserve(5_000, at=off + 10_000) == off + 10_000
    assert plog.reserve(plog.free_bytes + 1) is None


def test_full_log_raises_nospace_and_reserves_nothing(plog):
    plog.allocate(plog.capacity_bytes - PAGE_BYTES)
    before = plog.free_bytes
    with pytest.raises(NoSpace):
        plog.allocate(2 * PAGE_BYTES)
    assert plog.free_bytes == before


def test_free_space_is_the_complement_of_used_records(plog):
    plog.init_free_space([(SUPERBLOCK_BYTES, 10), (3 * PAGE_BYTES, PAGE_BYTES + 1)])
    assert plog.free_bytes == plog.capacity_bytes - 10 - (PAGE_BYTES + 1)
    with pytest.raises(FormatError):
        plog.init_free_space([(3 * PAGE_BYTES, 10), (2 * PAGE_BYTES, 10)])


def test_reads_verify_every_block_and_never_return_damaged_bytes(plog):
    data = os.urandom(3 * CRC_BLOCK_BYTES + 777)
    (off, length), = plog.allocate(len(data))
    crcs = plog.store(off, memoryview(data))
    plog.persist([(off, length)])
    for start, n in ((0, len(data)), (5, 100), (CRC_BLOCK_BYTES - 3, 10), (len(data) - 1, 1)):
        out = bytearray(n)
        plog.read_into(memoryview(out), off, len(data), crcs, start)
        assert bytes(out) == data[start:start + n]
    fd = os.open(plog.path, os.O_RDWR)
    damaged_at = off + CRC_BLOCK_BYTES + 5
    os.pwrite(fd, bytes([os.pread(fd, 1, damaged_at)[0] ^ 0xFF]), damaged_at)
    os.close(fd)
    out = bytearray(10)
    plog.read_into(memoryview(out), off, len(data), crcs, 0)      # block 0 still fine
    with pytest.raises(DamagedData, match="block 1"):
        plog.read_into(memoryview(bytearray(10)), off, len(data), crcs, CRC_BLOCK_BYTES)


def _mapped_rss_bytes(mapping_path: str) -> int:
    """Resident bytes of this process's mappings of mapping_path (smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[:1] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(mapping_path)
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
    return rss


def test_unverified_views_are_the_bytes_and_leave_no_pages_mapped(tmp_path):
    """The chunk feed reads data answered in C through the log's mapping:
    the view is the bytes written (any offset and length), and its pages are
    unmapped after, so the daemon's RSS does not grow with what it fed."""
    path = str(tmp_path / "pmem.log")
    log = PmemLog.open(path, 32 << 20, UUID)
    try:
        log.init_free_space([])
        off = log.allocate(24 << 20)[0][0] + 123
        data = random.Random(5).randbytes((24 << 20) - 123)
        log.write(off, memoryview(data))
        before = _mapped_rss_bytes(path)
        at = 0
        for length in (1, 4095, 4097, 2 << 20, 5 << 20, (24 << 20) - 123 - 7 * (2 << 20)):
            length = min(length, len(data) - at)
            with log.unverified_view(off + at, length) as view:
                assert view.obj is log.mapping      # in place, not a copy
                assert view == data[at:at + length]
            at += length
        assert at > 16 << 20
        assert _mapped_rss_bytes(path) - before <= 2 * PAGE_BYTES
        with log.unverified_view(off, 0) as view:
            assert len(view) == 0
    finally:
        log.close()
