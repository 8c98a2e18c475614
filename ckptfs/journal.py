"""The index journal: a durable commit with one flush instead of LMDB's two.

The committer appends each sealed batch (its puts and deletes, table by table)
as one record to a preallocated, zero-filled file beside LMDB's
(`INDEX/journal`) and makes it durable with one fdatasync: the file's blocks
are all written once at creation, so the flush carries the record's pages and
no metadata. The batch stays a read layer over LMDB (`index.py`) until a
checkpoint writes every journaled batch into LMDB in one normal, synced
transaction that also records the generation the journal starts over with;
the journal is then written from its start again. LMDB only ever holds
checkpoints. An index opened replays the records its generation names first.

Which records are valid (and so durable): from offset 0, one after another,
each whole (its CRC-32C matches), of the generation LMDB's meta `journal`
names, with sequence numbers following that record's "applied" seq one by one.
The first record that is not ends the journal: a torn or CRC-bad record was
never acknowledged (its flush never returned), and what lies past it is an
older generation's. A generation is a random 64-bit number, new at every
checkpoint and at every start, so no leftover of an older generation, nor
bytes a torn record left, can be taken for a record of the current one.

Record format (little-endian), at offset 0 and right after each valid record:

    header (32 bytes): magic b"CKJ1", u32 CRC-32C (of the header's bytes after
        the CRC and of the payload), u64 generation, u64 seq, u32 payload
        length, u32 zero
    payload: tables one after another, each: u8 name length, name (a
        sub-database of index.py), u32 count, then count entries: u32 key
        length, u32 value length (0xFFFFFFFF: a delete, no value bytes), key,
        value

Which keys and values mean what is index.py's business: this module only
stores its (table, key, value-or-delete) sets. Everything here may block.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import struct
from typing import Iterable, Iterator, Optional

import trio

from . import native

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal"
JOURNAL_BYTES = 16 << 20          # preallocated and written once; a checkpoint frees it
MAGIC = b"CKJ1"
_HEADER = struct.Struct("<4sIQQII")
_CRC_FROM = 8                      # the CRC covers the header from the generation on
_ENTRY = struct.Struct("<II")
_COUNT = struct.Struct("<I")
_DELETE = 0xFFFFFFFF
_ZEROS_STEP = 1 << 20

Ops = dict[str, Iterable[tuple[bytes, Optional[bytes]]]]


def encode_record(generation: int, seq: int, tables: Ops) -> bytes:
    """One record holding tables: {name: (key, value or None for a delete)}."""
    parts = [b""]
    for name, items in tables.items():
        items = list(items)
        if not items:
            continue
        raw = name.encode()
        parts.append(bytes((len(raw),)) + raw + _COUNT.pack(len(items)))
        for key, value in items:
            if value is None:
                parts.append(_ENTRY.pack(len(key), _DELETE))
                parts.append(key)
            else:
                parts.append(_ENTRY.pack(len(key), len(value)))
                parts.append(key)
                parts.append(value)
    payload = b"".join(parts)
    tail = struct.pack("<QQII", generation, seq, len(payload), 0)
    crc = native.crc32c(payload, native.crc32c(tail))
    return MAGIC + struct.pack("<I", crc) + tail + payload


def decode_payload(payload: bytes) -> Iterator[tuple[str, bytes, Optional[bytes]]]:
    """(table, key, value or None) of a record's payload, in order. ValueError
    when it does not parse (a valid CRC over a payload this module did not
    write)."""
    view = memoryview(payload)
    pos = 0
    try:
        while pos < len(view):
            n = view[pos]
            name = bytes(view[pos + 1:pos + 1 + n]).decode()
            pos += 1 + n
            (count,) = _COUNT.unpack_from(view, pos)
            pos += _COUNT.size
            for _ in range(count):
                klen, vlen = _ENTRY.unpack_from(view, pos)
                pos += _ENTRY.size
                key = bytes(view[pos:pos + klen])
                pos += klen
                if vlen == _DELETE:
                    yield name, key, None
                    continue
                value = bytes(view[pos:pos + vlen])
                pos += vlen
                if len(key) != klen or len(value) != vlen:
                    raise ValueError("entry runs past the payload")
                yield name, key, value
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"payload does not parse: {e}") from e


def read_records(path: str, generation: int, after_seq: int
                 ) -> Iterator[tuple[int, bytes]]:
    """(seq, payload) of the valid records of generation in the journal at
    path (none if there is no file), in order: seq after_seq + 1, + 2, ...
    Stops at the first record that is not whole, not of that generation or
    out of sequence."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        pos, want = 0, after_seq + 1
        while pos + _HEADER.size <= size:
            head = os.pread(fd, _HEADER.size, pos)
            if len(head) < _HEADER.size:
                return
            magic, crc, gen, seq, length, _ = _HEADER.unpack(head)
            if magic != MAGIC or gen != generation or seq != want \
                    or pos + _HEADER.size + length > size:
                return
            payload = os.pread(fd, length, pos + _HEADER.size)
            if len(payload) != length or \
                    native.crc32c(payload, native.crc32c(head[_CRC_FROM:])) != crc:
                return
            yield seq, payload
            pos += _HEADER.size + length
            want += 1
    finally:
        os.close(fd)


def create(path: str, size_bytes: Optional[int] = None) -> bool:
    """Make the journal file at path, every block written (zeros) and durable,
    under a temporary name renamed into place. False (and nothing left) when
    the disk has no room for it: the index then commits without a journal."""
    size_bytes = JOURNAL_BYTES if size_bytes is None else size_bytes
    tmp = path + ".creating"
    try:
        os.unlink(tmp)              # a creation cut off before its rename
    except FileNotFoundError:
        pass
    # O_EXCL: never a file or symlink planted under that name.
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size_bytes)
        zeros = bytes(_ZEROS_STEP)
        done = 0
        while done < size_bytes:
            done += os.pwrite(fd, zeros[:size_bytes - done], done)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        os.unlink(tmp)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return False
        raise
    os.close(fd)
    os.rename(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return True


class Journal:
    """The open journal: where the next record goes. Only the committer
    appends and resets it, one call at a time (on its worker thread, or a
    small batch's record written by a C thread: index.py)."""

    def __init__(self, path: str, generation: int, next_seq: int) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.size_bytes = os.fstat(self.fd).st_size
        self.generation = generation
        self.next_seq = next_seq
        self.used_bytes = 0
        self.records = 0

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.size_bytes

    def append(self, record: bytes) -> None:
        """Write record (from `encode_record` with this generation and
        next_seq) at the end and make it durable: one fdatasync. OSError as
        the disk gives it; the position moves only once it is durable."""
        done = 0
        while done < len(record):
            done += os.pwrite(self.fd, record[done:] if done else record,
                              self.used_bytes + done)
        os.fdatasync(self.fd)
        self.appended(len(record))

    async def append_by(self, writer: "DurableWriter", record: bytes) -> None:
        """`append` done by writer's C thread: the trio thread awaits it, never blocks."""
        await writer.write(self.fd, record, self.used_bytes)
        self.appended(len(record))

    def appended(self, nbytes: int) -> None:
        """A record of nbytes was written at `used_bytes` and made durable
        (by `append`, or by the committer's C thread: index.py)."""
        self.used_bytes += nbytes
        self.next_seq += 1
        self.records += 1

    def reset(self, generation: int) -> None:
        """Start over at offset 0 with generation, which the checkpoint just
        made durable in LMDB (the records before it are applied there)."""
        self.generation = generation
        self.used_bytes = 0
        self.records = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def new_generation() -> int:
    """A random nonzero generation: never one a leftover record carries."""
    while True:
        gen = int.from_bytes(os.urandom(8), "little")
        if gen:
            return gen


class DurableWriter:
    """pwrite + fdatasync of one buffer on a C thread (`native.WriterThreads`,
    never the GIL), awaited from trio: the index journal's append (index.py).

    On a Python worker thread (`trio.to_thread`) a durable commit of a small
    file was two thread hand-overs, each waiting for the GIL the trio thread
    held (strace: ~0.4 ms from the worker's wake to its first byte at load 5);
    here the trio thread queues the job and its own epoll sees the eventfd.
    One write at a time (the committer's); `write` never blocks the trio
    thread and, like `trio.to_thread.run_sync`, is not abandoned when
    cancelled: the bytes must stay alive until the write ends, and the caller
    learns its result."""

    def __init__(self) -> None:
        self._threads: Optional[native.WriterThreads] = None
        self._tokens = itertools.count(1)

    async def write(self, fd: int, data: bytes, off: int) -> None:
        """data at off in fd, then fdatasync(fd); OSError as the disk gives it."""
        if self._threads is None:
            # Started on the first write, after the daemon has forked into its own.
            self._threads = native.WriterThreads(1)
        threads = self._threads
        token = next(self._tokens)
        threads.submit_durable(fd, data, off, token)
        try:
            done = await self._reaped(threads)
        except trio.Cancelled:
            # The write runs on: wait for it, shielded, and report it as if
            # not cancelled (the next checkpoint raises Cancelled again). Only
            # here: a shielded scope around every wait cost each durable
            # close two scope changes on the trio thread.
            with trio.CancelScope(shield=True):
                done = await self._reaped(threads)
        ((got, result),) = done
        assert got == token, (got, token)
        if result < 0:
            raise OSError(-result, os.strerror(-result))

    @staticmethod
    async def _reaped(threads: native.WriterThreads) -> list[tuple[int, int]]:
        """The finished job, once threads' eventfd says there is one."""
        while True:
            await trio.lowlevel.wait_readable(threads.fd)
            try:
                os.read(threads.fd, 8)          # reset the count, then take the job
            except BlockingIOError:
                pass
            done = threads.reap()
            if done:
                return done

    def close(self) -> None:
        """Stop the thread (after its write, if any, ended). May block."""
        if self._threads is not None:
            threads, self._threads = self._threads, None
            threads.close()
