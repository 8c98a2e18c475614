"""The log writer: pwrites on C threads (native.WriterThreads), awaited from
trio (ckptfs.logwriter.LogWriter); checked against os.pwrite of the same bytes."""

from __future__ import annotations

import errno
import os
import random
import select

import pytest
import trio

from ckptfs import native
from ckptfs.logwriter import LogWriter
from ckptfs.pmemlog import SUPERBLOCK_BYTES, PmemLog

MIB = 1 << 20
SIZE = 64 * MIB
UUID = b"u" * 16


def _reap_all(threads: native.WriterThreads, n: int) -> dict[int, int]:
    got: dict[int, int] = {}
    while len(got) < n:
        select.select([threads.fd], [], [], 10)
        try:
            os.read(threads.fd, 8)
        except BlockingIOError:
            pass
        got.update(threads.reap())
    return got


def test_writer_threads_match_pwrite(tmp_path) -> None:
    rng = random.Random(7)
    ours = os.open(tmp_path / "ours", os.O_RDWR | os.O_CREAT, 0o600)
    ref = os.open(tmp_path / "ref", os.O_RDWR | os.O_CREAT, 0o600)
    threads = native.WriterThreads(3)
    try:
        jobs = {}
        for token in range(1, 201):       # more than one reap batch, overlapping none
            data = rng.randbytes(rng.choice([1, 4096, 65537, MIB]))
            off = (token - 1) * (MIB + 4096) + rng.randrange(4096)
            threads.submit(ours, data, 0, len(data), off, token)
            jobs[token] = len(data)
            os.pwrite(ref, data, off)
        assert _reap_all(threads, len(jobs)) == jobs
    finally:
        threads.close()
    assert os.fstat(ours).st_size == os.fstat(ref).st_size
    assert os.pread(ours, os.fstat(ref).st_size, 0) == os.pread(ref, os.fstat(ref).st_size, 0)
    os.close(ours)
    os.close(ref)


def test_writer_threads_report_errno(tmp_path) -> None:
    ro = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
    threads = native.WriterThreads(1)
    try:
        threads.submit(ro, b"x" * 10, 0, 10, 0, 5)
        with pytest.raises(ValueError):
            threads.submit(ro, b"x" * 10, 5, 6, 0, 6)
        assert _reap_all(threads, 1) == {5: -errno.EBADF}
    finally:
        threads.close()
        os.close(ro)


def test_close_waits_for_queued_writes(tmp_path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    threads = native.WriterThreads(1)
    data = os.urandom(4 * MIB)
    for k in range(8):
        threads.submit(fd, data, 0, len(data), k * len(data), k + 1)
    threads.close()                       # nothing reaped: the writes still land
    assert os.pread(fd, 32 * MIB, 0) == data * 8
    os.close(fd)


@pytest.fixture
def plog(tmp_path):
    log = PmemLog.open(str(tmp_path / "pmem.log"), SIZE, UUID)
    yield log
    log.close()


def test_log_writer_writes_pieces_concurrently(plog) -> None:
    rng = random.Random(3)
    writes = []
    off = SUPERBLOCK_BYTES
    for _ in range(40):
        data = rng.randbytes(rng.choice([MIB, 3 * MIB // 2, 100_000]))
        cut = rng.randrange(1, len(data))
        # two pieces, the second before the first in the log
        pieces = [(off + len(data) - cut + 512, 0, cut), (off, cut, len(data) - cut)]
        writes.append((data, pieces))
        off += len(data) + 512 + 4096

    async def main() -> None:
        writer = LogWriter(plog)
        async with trio.open_nursery() as nursery:
            for data, pieces in writes:
                nursery.start_soon(writer.write, data, pieces)

    trio.run(main)
    for data, pieces in writes:
        for log_off, pos, length in pieces:
            assert os.pread(plog.fd, length, log_off) == data[pos:pos + length]


def test_log_writer_cancelled_waits_for_the_copy(plog) -> None:
    data = os.urandom(8 * MIB)
    pieces = [(SUPERBLOCK_BYTES + k * MIB, k * MIB, MIB) for k in range(8)]

    async def main() -> None:
        writer = LogWriter(plog)
        with trio.CancelScope() as scope:
            scope.cancel()                    # already cancelled when it starts
            await writer.write(data, pieces)
        assert scope.cancelled_caught
        assert not writer._waiting            # returned only once every piece was in

    trio.run(main)
    assert os.pread(plog.fd, 8 * MIB, SUPERBLOCK_BYTES) == data


def test_log_writer_raises_the_pwrite_error(plog, tmp_path) -> None:
    class ReadOnly:
        fd = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o600)

        def on_close(self, fn) -> None:
            plog.on_close(fn)

    async def main() -> None:
        with pytest.raises(OSError) as e:
            await LogWriter(ReadOnly()).write(b"y" * MIB, [(0, 0, MIB)])
        assert e.value.errno == errno.EBADF

    trio.run(main)


def test_durable_writer_writes_flushes_and_reports_errno(tmp_path) -> None:
    """journal.DurableWriter (the index journal's append on a C thread): the
    bytes land where asked, the fdatasync runs (counted through the job's
    result: a failing fdatasync is an error too), a bad fd's errno comes back
    as OSError, and a cancelled write still ends before `write` returns."""
    from ckptfs.journal import DurableWriter
    path = tmp_path / "journal"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    ro = os.open(path, os.O_RDONLY)
    writer = DurableWriter()
    data = random.Random(3).randbytes(5000)

    async def main():
        await writer.write(fd, data, 4096)
        with pytest.raises(OSError) as err:
            await writer.write(ro, data, 0)
        assert err.value.errno == errno.EBADF
        with trio.CancelScope() as scope:
            scope.cancel()
            await writer.write(fd, b"z" * 100, 0)     # shielded: it ends first
        await trio.lowlevel.checkpoint()

    try:
        trio.run(main)
    finally:
        writer.close()
        os.close(ro)
    assert os.pread(fd, 5000, 4096) == data
    assert os.pread(fd, 100, 0) == b"z" * 100
    os.close(fd)
    # No bytes to write, then an fdatasync that fails (a pipe): its errno.
    threads = native.WriterThreads(1)
    r, w = os.pipe()
    try:
        threads.submit_durable(w, b"", 0, 1)
        ((_, result),) = _reap_all(threads, 1).items()
        assert result == -errno.EINVAL
    finally:
        threads.close()
        os.close(r)
        os.close(w)


def test_durable_writer_enters_no_cancel_scope_unless_cancelled(tmp_path) -> None:
    """A durable close's wait for its journal record costs no cancel scope on
    the trio thread (each is two scope changes per close); the shield comes
    only once the wait is cancelled, and the write still ends first."""
    from unittest import mock
    from ckptfs.journal import DurableWriter
    fd = os.open(tmp_path / "journal", os.O_RDWR | os.O_CREAT, 0o600)
    writer = DurableWriter()
    made = []
    real = trio.CancelScope

    def counting(*args, **kwargs):
        made.append(kwargs)
        return real(*args, **kwargs)

    async def main():
        with mock.patch.object(trio, "CancelScope", counting):
            for i in range(3):
                await writer.write(fd, b"a" * 100, i * 100)
            assert made == []
            with real() as scope:
                scope.cancel()
                await writer.write(fd, b"b" * 100, 300)     # returns: the caller learns it
                reported = True
                await trio.lowlevel.checkpoint()
            assert reported and scope.cancelled_caught
            assert made == [{"shield": True}]

    try:
        trio.run(main)
    finally:
        writer.close()
    assert os.pread(fd, 400, 0) == b"a" * 300 + b"b" * 100
    os.close(fd)
