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


def test_allocate_release_reuses_every_page(plog):
    capacity = plog.capacity_bytes
    rng = random.Random(3)
    held: list[tuple[int, int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.45 or plog.free_bytes < 300_000):
            off, length = held.pop(rng.randrange(len(held)))
            plog.release(off, length)
        else:
            n = rng.randrange(1, 300_000)
            pieces = plog.allocate(n)
            assert sum(length for _, length in pieces) == n
            held.extend(pieces)
        assert plog.free_bytes == capacity - sum(-(-ln // PAGE_BYTES) * PAGE_BYTES
                                                 for _, ln in held)
        spans = sorted((off, off + -(-ln // PAGE_BYTES) * PAGE_BYTES) for off, ln in held)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, "two allocations overlap"
        assert all(off >= SUPERBLOCK_BYTES and off % PAGE_BYTES == 0 for off, _ in held)
    for off, length in held:
        plog.release(off, length)
    assert plog.free_bytes == capacity
    assert plog.allocate(capacity) == [(SUPERBLOCK_BYTES, capacity)]


def test_full_log_raises_nospace_and_reserves_nothing(plog):
    plog.allocate(plog.capacity_bytes - PAGE_BYTES)
    before = plog.free_bytes
    with pytest.raises(NoSpace):
        plog.allocate(2 * PAGE_BYTES)
    assert plog.free_bytes == before


def test_free_space_is_the_complement_of_used_records(plog):
    plog.init_free_space([(SUPERBLOCK_BYTES, 10), (3 * PAGE_BYTES, PAGE_BYTES + 1)])
    assert plog.free_bytes == plog.capacity_bytes - 3 * PAGE_BYTES
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
