"""The persistent-memory log: where file data lives while it is hot.

A file (or DAX device) of `size_bytes`, memory-mapped. The first page is a
superblock; the rest is handed out byte-exact: a chunk's record is exactly
its bytes, so a chunk cut out of the middle of a stream (and found to be a
duplicate) gives back exactly its bytes. The log keeps no headers of its
own: the index names every record (offset, length, CRC-32C per 64 KiB
block), so the free space is simply the complement of the index's `logmap`
and mount-time recovery never scans the log.

Persistence: on a real DAX mapping (MAP_SYNC) stores are non-temporal copies
and the persist barrier is a cache-line flush plus fence; on an ordinary
file, stores are pwrite(2) (faster than faulting fresh mmap pages) and the
barrier is msync(2)/fdatasync(2). Either way the native module does the byte
work with the GIL released.

Creation: a new log file is made under a temporary name (PATH.creating:
fallocate, superblock, fsync) and renamed into place, so a log at PATH is
always whole; a PATH.creating that a killed first mount left is removed and
made again. An existing log whose superblock page is blank (all zero: a new
DAX device, an empty file) is formatted in place only when the caller says
that nothing lives in it.

Which functions may block: `store`, `persist`, `read_into` and `create`/`open`/`close`
do I/O and belong on a worker thread for anything large. The allocator
(`allocate`, `reserve`, `release`) is pure bookkeeping for the trio thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import stat
import struct
import threading
from typing import Iterable, Iterator, Optional

from sortedcontainers import SortedDict

from . import native
from .debugpause import pause_blocking, pausing_at
from .errors import DamagedData, FormatError, NoSpace, OperationFailed
from .index import CRC_BLOCK_BYTES

log = logging.getLogger(__name__)

# Linux 5.14's madvise: map a range's pages now, one call instead of a fault
# per 16 pages (Python 3.11's mmap module does not name it).
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
# A fault maps the pages around it too (fault-around: the aligned 64 KiB
# that hold it, those in the page cache): what a view unmaps after is
# widened to this alignment, so no page beyond a view stays mapped.
_UNMAP_ALIGN_BYTES = 256 << 10

PAGE_BYTES = 4096
SUPERBLOCK_BYTES = PAGE_BYTES
MAGIC = b"CKPTLOG1"
_SUPER = struct.Struct("<8sIQ16s")    # magic, version, size, fs uuid; then crc32c
LOG_VERSION = 1
MIN_SIZE_BYTES = 16 * PAGE_BYTES      # the superblock and a little room
CREATING_SUFFIX = ".creating"         # a new log file until it is whole


def round_up(n: int, to: int = PAGE_BYTES) -> int:
    return (n + to - 1) // to * to


class PmemLog:
    """A mapped log file with a byte-exact, next-fit free-space allocator."""

    # Large writes into a log on a file may bypass `write` for the log writer's
    # C threads (logwriter.py); a log that must see every store says False.
    threaded_writes = True

    def __init__(self, path: str, fd: int, size_bytes: int, dax: bool, mapping) -> None:
        self.path = path
        self.fd = fd
        self.size_bytes = size_bytes
        self.dax = dax
        self.mapping = mapping
        self._free = SortedDict()        # offset -> length, coalesced
        self.free_bytes = 0
        self._cursor = SUPERBLOCK_BYTES  # next-fit keeps writes sequential in the log
        self._scratch = threading.local()  # read_extents_into's partial blocks, per thread
        self._closers: list = []         # run before the fd closes (logwriter's threads)
        self._writeback: Optional[native.WriterThreads] = None    # `start_writeback`'s thread
        self._writeback_lock = threading.Lock()
        self.cut_to: Optional[int] = None  # the file's end, if cut short (open's allow_short)
        # A SIGBUS on the mapping is a counted fault, not a dead daemon
        # (native/ckptfs_logfault.c); unguarded (-1: DAX, or no slot), views copy.
        self._fault_slot = -1 if dax else native.guard_log_mapping(mapping, writable=True)

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, path: str, size_bytes: int, fs_uuid: bytes) -> "PmemLog":
        """Make a new log file at path (which must not exist). May block.

        Built whole under PATH.creating, then renamed: a creation cut off
        anywhere (killed during fallocate or the superblock write) leaves no
        PATH, only a PATH.creating, which the next create removes.
        """
        size_bytes = cls._check_size(size_bytes)
        tmp = path + CREATING_SUFFIX
        if os.path.exists(tmp):
            log.warning("removing %s: the creation of a log was cut off there", tmp)
            os.unlink(tmp)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise OperationFailed(f"cannot create the log {path}: {e.strerror} (pmem= must "
                                  "name a file in an existing directory)") from e
        try:
            _preallocate(fd, size_bytes, path)
            cls._write_superblock(fd, size_bytes, fs_uuid)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        _fsync_dir(os.path.dirname(path) or ".")
        log.info("created log %s: %d bytes reserved", path, size_bytes)
        return cls._mapped(path, fd, size_bytes)

    @classmethod
    def open(cls, path: str, size_bytes: Optional[int], fs_uuid: bytes,
             format_blank: bool = False, allow_short: bool = False) -> "PmemLog":
        """Open a log (a file or a DAX device); create a missing file. May block.

        size_bytes=None keeps the log's size; a larger size grows it; a
        smaller one is refused (committed data may live at the end). A blank
        log (superblock page all zero: a new device, an empty file) is
        formatted only with format_blank (the index names nothing in it);
        a device then gets size_bytes, or all of it.

        A log file shorter than its superblock says (cut short outside
        ckptfs: its end is lost) is refused, unless allow_short (fsck: only
        the part that is there is mapped, reads past it fail as damaged;
        `cut_to` says where it ends).
        """
        if not os.path.exists(path):
            if size_bytes is None:
                raise FormatError(f"{path}: no pmem_size given for a new log")
            return cls.create(path, size_bytes, fs_uuid)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        cut_to = None
        try:
            st = os.fstat(fd)
            is_device = stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode)
            current = _device_size(fd) if is_device else st.st_size
            if _is_blank(fd):
                if not format_blank:
                    raise FormatError(f"{path}: the log is blank (never formatted, or wiped) "
                                      "and the index may name data in it: restore the right "
                                      "log (ckptfs fsck SOURCE shows what is affected)")
                size_bytes = cls._lay_out(fd, path, size_bytes or current, fs_uuid, is_device,
                                          current)
                log.info("formatted blank log %s: %d bytes", path, size_bytes)
            else:
                stored_size, stored_uuid = cls._read_superblock(fd, path)
                if stored_uuid != fs_uuid:
                    raise FormatError(f"{path} belongs to another ckptfs filesystem (each "
                                      "needs its own log: point pmem= at another path)")
                if not is_device and current < stored_size:
                    if not allow_short:
                        raise FormatError(
                            f"{path} is {current} bytes, but the log is {stored_size}: it was "
                            f"cut short outside ckptfs and the data past byte {current} is "
                            "lost (ckptfs fsck SOURCE lists the chunks; `truncate -s "
                            f"{stored_size} {path}` lets it mount, reads of them give EIO)")
                    cut_to, size_bytes = current, stored_size
                elif size_bytes is None or size_bytes == stored_size:
                    size_bytes = stored_size
                elif size_bytes < stored_size:
                    raise FormatError(f"{path}: pmem_size {size_bytes} is smaller than the "
                                      f"log's {stored_size}; shrinking is not supported (mount "
                                      "without pmem_size to keep its size)")
                else:
                    size_bytes = cls._lay_out(fd, path, size_bytes, fs_uuid, is_device, current)
                    log.info("grew log %s from %d to %d bytes", path, stored_size, size_bytes)
        except BaseException:
            os.close(fd)
            raise
        if cut_to is None:
            return cls._mapped(path, fd, size_bytes)
        plog = cls._mapped(path, fd, size_bytes, map_bytes=cut_to // PAGE_BYTES * PAGE_BYTES)
        plog.cut_to = cut_to
        return plog

    @classmethod
    def _mapped(cls, path: str, fd: int, size_bytes: int,
                map_bytes: Optional[int] = None) -> "PmemLog":
        try:
            mapping, dax = native.map_log(fd, map_bytes or size_bytes)
        except BaseException:
            os.close(fd)
            raise
        log.debug("log %s: %d bytes, dax=%s, flush=%s", path, size_bytes, dax,
                  native.flush_instruction())
        return cls(path, fd, size_bytes, dax, mapping)

    @staticmethod
    def is_blank(path: str) -> bool:
        """The superblock page is all zero (or the file is shorter and zero): never formatted."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _is_blank(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _check_size(size_bytes: int) -> int:
        if size_bytes < MIN_SIZE_BYTES:
            raise FormatError(f"pmem_size {size_bytes} is too small (minimum {MIN_SIZE_BYTES})")
        return size_bytes // PAGE_BYTES * PAGE_BYTES

    @classmethod
    def _lay_out(cls, fd: int, path: str, size_bytes: int, fs_uuid: bytes, is_device: bool,
                 current: int) -> int:
        """Make the log at fd size_bytes long (rounded down to pages; a device
        must hold them, a file gets its blocks) with its superblock: a blank
        log formatted, or one grown. Returns the size. Blocks (fsync)."""
        size_bytes = cls._check_size(size_bytes)
        if is_device and size_bytes > current:
            raise FormatError(f"{path}: device holds only {current} bytes (give a "
                              f"pmem_size of at most {current >> 20}M)")
        if not is_device:
            _preallocate(fd, size_bytes, path)
        cls._write_superblock(fd, size_bytes, fs_uuid)
        return size_bytes

    @staticmethod
    def _write_superblock(fd: int, size_bytes: int, fs_uuid: bytes) -> None:
        body = _SUPER.pack(MAGIC, LOG_VERSION, size_bytes, fs_uuid)
        block = body + struct.pack("<I", native.crc32c(body))
        os.pwrite(fd, block.ljust(SUPERBLOCK_BYTES, b"\0"), 0)
        os.fsync(fd)

    @staticmethod
    def _read_superblock(fd: int, path: str) -> tuple[int, bytes]:
        raw = os.pread(fd, _SUPER.size + 4, 0)
        if len(raw) < _SUPER.size + 4:
            raise FormatError(f"{path} is not a ckptfs log (too short)")
        magic, version, size_bytes, fs_uuid = _SUPER.unpack_from(raw)
        if magic != MAGIC:
            raise FormatError(f"{path} is not a ckptfs log (bad magic): point pmem= at "
                              "another path, or remove it if it holds nothing you need")
        (crc,) = struct.unpack_from("<I", raw, _SUPER.size)
        if crc != native.crc32c(raw[:_SUPER.size]):
            raise FormatError(f"{path}: log superblock is damaged (ckptfs fsck SOURCE shows "
                              "what the index names in it)")
        if version != LOG_VERSION:
            raise FormatError(f"{path}: log version {version} is not supported (mount it with "
                              "the ckptfs that made it)")
        return size_bytes, fs_uuid

    def on_close(self, fn) -> None:
        """Call fn() first when the log closes (threads that write into its fd)."""
        self._closers.append(fn)

    def close(self) -> None:
        try:
            while self._closers:
                self._closers.pop()()
            native.unguard_log_mapping(self._fault_slot)
            self._fault_slot = -1
            try:
                self.mapping.close()
            except BufferError:
                # A view of it still lives (a failed chunk feed's traceback):
                # the mapping goes with its last view.
                log.debug("log %s: mapping still viewed at close", self.path)
        finally:
            os.close(self.fd)

    # ------------------------------------------------------------ allocator

    def init_free_space(self, used: Iterable[tuple[int, int]]) -> None:
        """Free space := data area minus `used` (offset, length), in log order."""
        self._free.clear()
        pos = SUPERBLOCK_BYTES
        for off, length in used:
            if off < pos or off + length > self.size_bytes:
                raise FormatError(f"log record at {off}+{length} overlaps another or the end")
            if off > pos:
                self._free[pos] = off - pos
            pos = off + length
        if pos < self.size_bytes:
            self._free[pos] = self.size_bytes - pos
        self.free_bytes = sum(self._free.values())

    @property
    def capacity_bytes(self) -> int:
        return self.size_bytes - SUPERBLOCK_BYTES

    def allocate(self, nbytes: int) -> list[tuple[int, int]]:
        """Reserve room for nbytes: a list of (offset, length) pieces.

        Next-fit from a cursor so that a stream lands contiguously; when no
        single hole is big enough the bytes are spread over several. Raises
        NoSpace (nothing reserved) when the log cannot hold them at all.
        """
        if nbytes > self.free_bytes:
            raise NoSpace(f"log full: {nbytes} bytes wanted, {self.free_bytes} free")
        pieces: list[tuple[int, int]] = []
        remaining = nbytes
        while remaining:
            off, length = self._hole_at_or_after(self._cursor)
            take = min(length, remaining)
            self._take(off, length, off, take)
            pieces.append((off, take))
            remaining -= take
        return pieces

    def reserve(self, nbytes: int, at: Optional[int] = None) -> Optional[int]:
        """Reserve nbytes in one piece; return its offset, or None if no hole fits.

        With `at`, only exactly there (growing a reservation in place).
        """
        if nbytes <= 0 or nbytes > self.free_bytes:
            return None
        if at is not None:
            i = self._free.bisect_right(at) - 1
            if i < 0:
                return None
            off = self._free.keys()[i]
            length = self._free[off]
            if at + nbytes > off + length:
                return None
            self._take(off, length, at, nbytes)
            return at
        # Next-fit: the first hole from the cursor on (wrapping) that is big enough.
        keys = self._free.keys()
        start = max(self._free.bisect_right(self._cursor) - 1, 0)
        for i in itertools.chain(range(start, len(keys)), range(0, start)):
            off = keys[i]
            length = self._free[off]
            end = off + length
            if off < self._cursor < end and end - self._cursor >= nbytes:
                pos = self._cursor
            elif length >= nbytes:
                pos = off
            else:
                continue
            self._take(off, length, pos, nbytes)
            return pos
        return None

    def _take(self, hole: int, hole_len: int, off: int, nbytes: int) -> None:
        """Cut [off, off+nbytes) out of the hole starting at `hole`."""
        del self._free[hole]
        if off > hole:
            self._free[hole] = off - hole
        end = off + nbytes
        if end < hole + hole_len:
            self._free[end] = hole + hole_len - end
        self.free_bytes -= nbytes
        self._cursor = end

    def _hole_at_or_after(self, pos: int) -> tuple[int, int]:
        i = self._free.bisect_right(pos) - 1
        if i >= 0:
            off = self._free.keys()[i]
            if off + self._free[off] > pos:
                return off, self._free[off]
        i = self._free.bisect_left(pos)
        if i < len(self._free):
            off = self._free.keys()[i]
            return off, self._free[off]
        off = self._free.keys()[0]    # wrap around
        return off, self._free[off]

    def release(self, off: int, length: int) -> None:
        """Give bytes back. Only for space no durable index names."""
        if length <= 0:
            return
        size = length
        i = self._free.bisect_left(off)
        if i > 0:
            prev = self._free.keys()[i - 1]
            if prev + self._free[prev] == off:
                off, size = prev, size + self._free.pop(prev)
                i -= 1
        if i < len(self._free):
            nxt = self._free.keys()[i]
            if off + size == nxt:
                size += self._free.pop(nxt)
        self._free[off] = size
        self.free_bytes += length

    # -------------------------------------------------------------- byte I/O

    def store(self, off: int, data: memoryview) -> bytes:
        """Write one record's bytes at off; return its per-block CRC-32Cs. May block."""
        crcs = native.crc32c_blocks(data, CRC_BLOCK_BYTES)
        self.write(off, data)
        return crcs

    def write(self, off: int, data: memoryview) -> None:
        """Write bytes at off, exactly (neighbours may be other records). May block."""
        if self.dax:
            native.copy_nt(self.mapping, off, data)
            return
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], off + done)

    @staticmethod
    def crcs_of(data: memoryview) -> bytes:
        return native.crc32c_blocks(data, CRC_BLOCK_BYTES)

    def persist(self, ranges: list[tuple[int, int]]) -> None:
        """Make the given log bytes durable. May block.

        On a plain file, several ranges cost one fdatasync (each msync of a
        range would be its own journal commit).
        """
        merged = _merge_ranges(ranges)
        if not merged:
            return
        if not self.dax and len(merged) > 4:
            os.fdatasync(self.fd)
            return
        for off, length in merged:
            native.persist(self.mapping, off, length, self.dax)

    def start_writeback(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Have the given log bytes start on their way to the disk: a later
        `persist` of them waits only for what is still in flight. Makes
        nothing durable. Never blocks: a C thread of its own submits them
        (the submission sleeps while the device is busy), in order. On a
        DAX log nothing to do. A failure is left to the `persist` that makes
        them durable, which reports it."""
        if self.dax:
            return
        with self._writeback_lock:
            threads = self._writeback
            if threads is None:
                # Started on first use, after the daemon has forked into its own.
                threads = self._writeback = native.WriterThreads(1)
                self.on_close(threads.close)
        for off, length in ranges:
            try:
                threads.start_writeback(self.fd, off, length)
            except OSError as e:
                log.debug("writeback of log bytes [%d, +%d) not queued: %s", off, length, e)
                return

    def read_into(self, out: memoryview, log_off: int, chunk_len: int, crcs: bytes,
                  chunk_off: int) -> None:
        """Fill out with chunk bytes [chunk_off, chunk_off+len(out)), verified. May block.

        Reads whole 64 KiB checksum blocks; a block whose CRC does not match
        raises DamagedData, so wrong bytes are never returned.
        """
        n = len(out)
        b0 = chunk_off // CRC_BLOCK_BYTES
        b1 = (chunk_off + n - 1) // CRC_BLOCK_BYTES
        blk_start = b0 * CRC_BLOCK_BYTES
        blk_end = min((b1 + 1) * CRC_BLOCK_BYTES, chunk_len)
        direct = blk_start == chunk_off and blk_end == chunk_off + n
        buf = out if direct else memoryview(bytearray(blk_end - blk_start))
        self._read_exact(buf, log_off + blk_start)
        got = native.crc32c_blocks(buf, CRC_BLOCK_BYTES)
        want = crcs[b0 * 4:(b1 + 1) * 4]
        if got != want:
            # A record with fewer CRCs than blocks (never stored) is damaged too.
            bad = next(i for i in range(0, len(got), 4) if got[i:i + 4] != want[i:i + 4])
            raise DamagedData(f"log record at offset {log_off}: checksum mismatch in block "
                              f"{b0 + bad // 4} (bytes {blk_start + bad // 4 * CRC_BLOCK_BYTES}..)")
        if not direct:
            out[:] = buf[chunk_off - blk_start:chunk_off - blk_start + n]

    def read_raw(self, off: int, length: int) -> bytes:
        """The bytes at [off, off+length) as written, unverified (the committer
        copies a small batch's new chunks into the index). May block."""
        buf = memoryview(bytearray(length))
        self._read_exact(buf, off)
        return bytes(buf)

    def _read_exact(self, buf: memoryview, off: int) -> None:
        if self.dax:
            buf[:] = self.mapping[off:off + len(buf)]
            return
        done = 0
        while done < len(buf):
            n = os.preadv(self.fd, [buf[done:]], off + done)
            if n == 0:
                raise DamagedData(f"log {self.path} ends before offset {off + done}")
            done += n

    def read_extents_into(self, out: memoryview, table: native.ExtentTable, first: int,
                          count: int, file_off: int, nowait: bool = False) -> bool:
        """Fill out with file bytes [file_off, file_off+len(out)) from the LOG
        extents [first, first+count) of table (zeros between them): one
        preadv per run contiguous in the log, every 64 KiB block verified
        before it returns, as `read_into` does. May block (GIL released),
        unless nowait: then False if a byte is not in the page cache."""
        scratch = getattr(self._scratch, "buf", None)
        if scratch is None:
            scratch = self._scratch.buf = bytearray(2 * CRC_BLOCK_BYTES)
        kind, err, log_off, block = table.read_into(self.fd, first, count, CRC_BLOCK_BYTES,
                                                    file_off, out, scratch, nowait)
        if kind == 0:
            return True
        if kind == native.READ_WOULD_BLOCK:
            return False
        if kind == native.READ_FAILED_CHECKSUM:
            raise DamagedData(f"log record at offset {log_off}: checksum mismatch in block "
                              f"{block} (bytes {block * CRC_BLOCK_BYTES}..)")
        if kind == native.READ_FAILED_SHORT_LOG:
            raise DamagedData(f"log {self.path} ends before offset {log_off}")
        if kind == native.READ_FAILED_IO:
            raise OSError(err, f"reading the log {self.path} at {log_off}: {os.strerror(err)}")
        raise DamagedData(f"extent {block} of a read plan cannot be one ckptfs wrote "
                          f"(log offset {log_off})")

    def read_unverified_into(self, out: memoryview, off: int) -> None:
        """Bytes of data not yet cut into chunks (no CRCs yet). May block."""
        self._read_exact(out, off)

    @contextlib.contextmanager
    def unverified_view(self, off: int, length: int) -> Iterator[memoryview]:
        """Bytes [off, off+length) of data not yet cut into chunks (no CRCs
        yet), read in place through the log's mapping rather than copied out
        (the chunk feed reads each once). On a file the range is mapped in
        first (MADV_POPULATE_READ) and unmapped after (the page cache keeps
        the pages), so the daemon's RSS does not grow with the log. Where
        it cannot be mapped in (a page that cannot be read back: that would
        be a SIGBUS on access; a kernel before 5.14), the bytes are copied
        out with pread as before, and a read error is DamagedData.

        A page that faults while the caller reads the view anyway (the log
        cut short, or a page reclaimed after the populate whose read from
        the disk failed) reads as zeros and the view's exit raises
        DamagedData: what the caller computed from it must be thrown away
        (native/ckptfs_logfault.c). May block."""
        if length <= 0:
            yield memoryview(b"")
            return
        gen0 = 0
        if not self.dax:
            # Unguarded: never read in place. A page still zeroed by an
            # earlier fault: mapped back, this one copied.
            gen0 = native.log_fault_gen() if self._fault_slot >= 0 else 0
            if self._fault_slot < 0 or not native.log_mapping_clean(self._fault_slot, gen0):
                if self._fault_slot >= 0:
                    native.repair_log_mapping(self._fault_slot, self.fd)
                buf = memoryview(bytearray(length))
                self._read_exact(buf, off)
                yield buf
                return
            page = mmap.PAGESIZE
            start = off - off % page
            end = min(-(-(off + length) // page) * page, len(self.mapping))
            try:
                self.mapping.madvise(_MADV_POPULATE_READ, start, end - start)
            except OSError:
                buf = memoryview(bytearray(length))
                self._read_exact(buf, off)
                yield buf
                return
            if pausing_at("log-view"):
                pause_blocking("log-view")
        whole = memoryview(self.mapping)
        view = whole[off:off + length]
        try:
            yield view
        finally:
            view.release()
            whole.release()
            if not self.dax:
                lo = off - off % _UNMAP_ALIGN_BYTES
                hi = min(-(-(off + length) // _UNMAP_ALIGN_BYTES) * _UNMAP_ALIGN_BYTES,
                         len(self.mapping))
                self.mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        if not self.dax and not native.log_mapping_clean(self._fault_slot, gen0):
            native.repair_log_mapping(self._fault_slot, self.fd)
            raise DamagedData(f"log {self.path}: a page of bytes {off}..{off + length} could "
                              "not be read while read in place (SIGBUS: the log file cut "
                              "short, or a read from the disk failed)")


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for off, length in sorted(ranges):
        if merged and off <= merged[-1][0] + merged[-1][1]:
            last_off, last_len = merged[-1]
            merged[-1] = (last_off, max(last_len, off + length - last_off))
        else:
            merged.append((off, length))
    return merged


def _device_size(fd: int) -> int:
    return os.lseek(fd, 0, os.SEEK_END)


def _is_blank(fd: int) -> bool:
    return not any(os.pread(fd, SUPERBLOCK_BYTES, 0))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _preallocate(fd: int, size_bytes: int, path: str) -> None:
    """Reserve the log's blocks now so that a full disk cannot fail a write later."""
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as e:
        raise NoSpace(f"cannot reserve {size_bytes} bytes for the log at {path}: "
                      f"{os.strerror(e.errno)}") from e
    os.fsync(fd)
