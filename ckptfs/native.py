"""Typed wrapper over the cffi extension ``ckptfs._native``.

The rest of the package imports this module, never ``_native`` itself.  Every
C call releases the GIL (cffi API mode), so checksums, flushes and chunking
scans of large buffers do not stall the event loop's other threads.  Buffer
arguments take any contiguous buffer-protocol object: bytes, bytearray,
memoryview, mmap.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import sys
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    if sys.version_info >= (3, 12):
        from collections.abc import Buffer
    else:
        from typing_extensions import Buffer

try:
    from ckptfs._native import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "ckptfs._native is not built: run `python ckptfs/_native_build.py` "
        "or `pip install -e .`"
    ) from exc

__all__ = [
    "crc32c",
    "crc32c_blocks",
    "flush_instruction",
    "persist",
    "copy_nt",
    "map_log",
    "GearScanner",
    "ChunkFeeder",
    "gear_cut_points",
    "find4",
    "open_beneath",
]

# Linux values; Python's mmap module does not export them before 3.13/3.14.
MAP_SHARED_VALIDATE = 0x03
MAP_SYNC = 0x80000

_FLUSH_NAMES = {0: "none", 1: "clflush", 2: "clflushopt", 3: "clwb"}


def address_of(data: Buffer) -> int:
    """The address of data's memory: valid while data is alive and, for a
    bytearray, not resized (a memoryview of it that is alive prevents that)."""
    with ffi.from_buffer(data) as buf:
        return int(ffi.cast("uintptr_t", buf))


def crc32c(data: Buffer, seed: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``; pass a previous result as ``seed`` to chain."""
    with ffi.from_buffer(data) as buf:
        return int(lib.ckptfs_crc32c(seed, buf, len(buf)))


def crc32c_blocks(data: Buffer, block_size: int) -> bytes:
    """CRC-32C of each ``block_size`` piece of ``data`` (the last may be short).

    Returns the CRCs packed as little-endian uint32s, 4 bytes per block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    with ffi.from_buffer(data) as buf:
        nblocks = -(-len(buf) // block_size)
        out = ffi.new("uint8_t[]", 4 * nblocks)
        lib.ckptfs_crc32c_blocks(buf, len(buf), block_size, out)
    return ffi.buffer(out)[:]


# What verify_payloads found wrong (ckptfs_verify_payloads's *what).
VERIFY_RANGE = 1        # the payload is not inside the buffer
VERIFY_CRC = 2          # its CRC-32C differs
VERIFY_ID = 3           # its BLAKE3-256 differs from its id


def verify_payloads(data: Buffer, offs: list[int], lens: list[int], crcs: list[int],
                    ids: bytes | None) -> tuple[int, int]:
    """Check payloads lying in ``data`` in one call, GIL released: payload k
    is ``data[offs[k]:offs[k] + lens[k]]``. With ``ids`` (32 bytes per
    payload) and the module built with BLAKE3, its BLAKE3-256 must be
    ``ids[32k:32k + 32]`` unless those are all zeros; a payload checked by
    its id is not also CRC-checked (the id over all its bytes proves them).
    Every other payload's CRC-32C must be ``crcs[k]``.
    Returns (len(offs), 0) if all pass, else (k, VERIFY_*) of the
    first that does not. ValueError if ids are given and the module has no
    BLAKE3 (`chunk_feed_hashes`)."""
    n = len(offs)
    if not n == len(lens) == len(crcs) or (ids is not None and len(ids) != 32 * n):
        raise ValueError("verify_payloads: offs, lens, crcs and ids differ in count")
    what = ffi.new("int *")
    with ffi.from_buffer(data) as buf:
        k = lib.ckptfs_verify_payloads(buf, len(buf), n, offs, lens, crcs,
                                       ffi.NULL if ids is None else ids, what)
    if k < 0:
        raise ValueError("verify_payloads: ids given, but this build has no BLAKE3")
    return int(k), int(what[0])


def flush_instruction() -> str:
    """The cache-line flush in use: "clwb", "clflushopt", "clflush", or "none" off x86."""
    return _FLUSH_NAMES[lib.ckptfs_flush_kind()]


def _check_range(size: int, offset: int, length: int) -> None:
    if offset < 0 or length < 0 or offset + length > size:
        raise ValueError(f"range [{offset}, {offset + length}) outside mapping of {size} bytes")


def persist(mapping: mmap.mmap, offset: int, length: int, dax: bool) -> None:
    """Make ``mapping[offset:offset + length]`` durable.

    ``dax=True`` (a MAP_SYNC mapping): flush its cache lines with clwb,
    clflushopt or clflush, then sfence.  ``dax=False``: msync(MS_SYNC) over
    the pages covering the range.  Raises OSError if msync fails.
    """
    _check_range(len(mapping), offset, length)
    with ffi.from_buffer(mapping) as buf:
        err = lib.ckptfs_persist(buf + offset, length, 1 if dax else 0)
    if err:
        raise OSError(err, os.strerror(err))


def copy_nt(mapping: mmap.mmap, offset: int, src: Buffer) -> None:
    """Copy ``src`` into ``mapping`` at ``offset`` with non-temporal stores.

    Nothing is left dirty in the cache and the copy ends with sfence, so on a
    DAX mapping the data is durable on return.  ``src`` must not overlap the
    destination.
    """
    with ffi.from_buffer(src) as s:
        _check_range(len(mapping), offset, len(s))
        with ffi.from_buffer(mapping, require_writable=True) as dst:
            lib.ckptfs_copy_nt(dst + offset, s, len(s))


def map_log(fd: int, size_bytes: int) -> tuple[mmap.mmap, bool]:
    """Map the first ``size_bytes`` of ``fd`` read/write, shared.

    Tries MAP_SHARED_VALIDATE | MAP_SYNC first (true DAX: CPU stores reach
    persistent memory with only cache flushes), else plain MAP_SHARED.
    Returns ``(mapping, is_dax)``.  The file must already be at least
    ``size_bytes`` long.
    """
    if size_bytes <= 0:  # mmap would take 0 to mean "the whole file"
        raise ValueError(f"size_bytes must be positive, got {size_bytes}")
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    try:
        return mmap.mmap(fd, size_bytes, flags=MAP_SHARED_VALIDATE | MAP_SYNC, prot=prot), True
    except OSError as exc:
        # EOPNOTSUPP: not a DAX file; EINVAL: kernel without MAP_SHARED_VALIDATE.
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    return mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=prot), False


# ---- content-defined chunking ---------------------------------------------------

# Cut offsets returned per C call; a scan that finds more simply calls again.
_CUTS_PER_CALL = 1024


def check_gear_sizes(min_size: int, avg_size: int, max_size: int) -> None:
    """Raise ValueError unless the sizes are valid for the gear scan."""
    if not 64 <= min_size <= avg_size <= max_size:
        raise ValueError(
            f"need 64 <= min_size <= avg_size <= max_size, got {min_size}/{avg_size}/{max_size}"
        )
    if avg_size & (avg_size - 1) or avg_size > 1 << 40:
        raise ValueError(f"avg_size must be a power of two <= 2**40, got {avg_size}")


class GearScanner:
    """Streaming gear-hash cut-point scan over one byte stream.

    Feed the stream's bytes in order with :meth:`scan`; each call returns the
    end offsets (relative to that call's buffer) of the chunks that end inside
    it.  Nothing is copied or kept: the scanner carries only the running hash
    and the length of the pending chunk, so a chunk may span any number of
    calls.  :meth:`reset` starts a new chunk here (a forced cut).  The cut rule
    is in native/ckptfs_native.h.  One scanner per stream; not thread-safe.
    """

    __slots__ = ("min_size", "avg_size", "max_size", "_state", "_cuts")

    def __init__(self, min_size: int, avg_size: int, max_size: int) -> None:
        check_gear_sizes(min_size, avg_size, max_size)
        self.min_size = min_size
        self.avg_size = avg_size
        self.max_size = max_size
        self._state = ffi.new("ckptfs_gear_state *")
        self._cuts = ffi.new("size_t[]", _CUTS_PER_CALL)

    @property
    def pending(self) -> int:
        """Bytes of the current chunk scanned so far (0 right after a cut)."""
        return int(self._state.pending)

    def reset(self) -> None:
        """Forget the pending chunk: the next byte starts a new one."""
        self._state.hash = 0
        self._state.pending = 0

    def scan(self, data: Buffer) -> list[int]:
        """Continue the stream with ``data``; return the chunk ends found in it."""
        out: list[int] = []
        with ffi.from_buffer(data) as buf:
            size = len(buf)
            base = 0
            while True:
                n = lib.ckptfs_gear_cuts(
                    self._state, buf + base, size - base,
                    self.min_size, self.avg_size, self.max_size,
                    self._cuts, _CUTS_PER_CALL,
                )
                cuts = ffi.unpack(self._cuts, n)
                out.extend(cuts if base == 0 else [base + c for c in cuts])
                if n < _CUTS_PER_CALL:
                    return out
                base += cuts[-1]


class ChunkFeeder:
    """Streaming cut-point scan that also checksums what it cuts
    (``ckptfs_chunk_feed``): one C call per buffer finds the chunks that end
    in it and, for each, its length, whether it is all zeros and its per-block
    CRC-32Cs counted from the chunk's start.  A chunk may span any number of
    calls; the state carries its CRCs so far.  One feeder per stream; not
    thread-safe."""

    __slots__ = ("min_size", "avg_size", "max_size", "crc_block", "hashes", "_state")

    CRC_BYTES = 64          # per chunk in the packed CRC output (16 blocks at most)

    def __init__(self, min_size: int, avg_size: int, max_size: int, crc_block: int,
                 hash_ids: bool = True) -> None:
        check_gear_sizes(min_size, avg_size, max_size)
        if crc_block <= 0 or max_size > 16 * crc_block:
            raise ValueError(f"max_size {max_size} needs more than 16 CRC blocks of {crc_block}")
        self.min_size = min_size
        self.avg_size = avg_size
        self.max_size = max_size
        self.crc_block = crc_block
        # Also BLAKE3 ids, when the module was built with the BLAKE3 library.
        self.hashes = hash_ids and chunk_feed_hashes()
        self._state = ffi.new("ckptfs_chunk_state *")

    @property
    def pending(self) -> int:
        """Bytes of the pending chunk so far."""
        return int(self._state.absorbed)

    def feed(self, data: Buffer, forced: list[int]
             ) -> tuple[list[int], list[int], bytes, bytes, bytes]:
        """Continue the stream with ``data``, cutting also at the ``forced``
        offsets (ascending, within [0, len(data)]).  Returns, for the chunks
        ending in ``data``: their end offsets in it, their whole lengths, a
        zero flag byte each, their CRCs packed ``CRC_BYTES`` apart, and with
        ``hashes`` their BLAKE3 ids packed 32 bytes apart (zeros for a zero
        chunk; else b"")."""
        with ffi.from_buffer(data) as buf:
            size = len(buf)
            cap = size // self.min_size + len(forced) + 1
            ends = _new_uninit("uint64_t[]", cap)
            lengths = _new_uninit("uint64_t[]", cap)
            zero = _new_uninit("uint8_t[]", cap)
            crcs = _new_uninit("uint8_t[]", cap * self.CRC_BYTES)
            ids = _new_uninit("uint8_t[]", cap * 32) if self.hashes else ffi.NULL
            n = lib.ckptfs_chunk_feed(self._state, buf, size, forced, len(forced),
                                      self.min_size, self.avg_size, self.max_size,
                                      self.crc_block, ends, lengths, zero, crcs, ids, cap)
        if n == ffi.cast("size_t", -1):
            raise ValueError(f"forced cuts {forced} not ascending within [0, {size}]")
        if n == 0:
            return [], [], b"", b"", b""
        return (ffi.unpack(ends, n), ffi.unpack(lengths, n), ffi.buffer(zero, n)[:],
                ffi.buffer(crcs, n * self.CRC_BYTES)[:],
                ffi.buffer(ids, n * 32)[:] if self.hashes else b"")

    def finish(self) -> tuple[int, bool, bytes, bytes]:
        """End the stream: (length, all zero, CRCs, id or b"") of the pending
        chunk (length 0: none); the feeder starts a new stream."""
        lengths = ffi.new("uint64_t[1]")
        zero = ffi.new("uint8_t[1]")
        crcs = ffi.new("uint8_t[]", self.CRC_BYTES)
        ids = ffi.new("uint8_t[32]") if self.hashes else ffi.NULL
        if not lib.ckptfs_chunk_finish(self._state, self.crc_block, lengths, zero, crcs, ids):
            return 0, False, b"", b""
        length = int(lengths[0])
        nblocks = -(-length // self.crc_block)
        return (length, bool(zero[0]), ffi.buffer(crcs, 4 * nblocks)[:],
                ffi.buffer(ids, 32)[:] if self.hashes else b"")


def name_pieces(data: Buffer, offs: list[int], lens: list[int], crc_block: int,
                hash_ids: bool = True) -> tuple[bytes, bytes, bytes]:
    """Name each piece [offs[k], offs[k] + lens[k]) of ``data`` as one whole
    chunk (``ckptfs_name_pieces``: for pieces no cut falls inside), in one C
    call: a zero flag byte each, CRCs packed ``ChunkFeeder.CRC_BYTES`` apart
    and, with hash_ids and ``chunk_feed_hashes()``, BLAKE3 ids packed 32 bytes apart
    (zeros for a zero piece; else b"")."""
    n = len(offs)
    if n != len(lens):
        raise ValueError("offs and lens differ in length")
    if n == 0:
        return b"", b"", b""
    hashes = hash_ids and chunk_feed_hashes()
    zero = _new_uninit("uint8_t[]", n)
    crcs = _new_uninit("uint8_t[]", n * ChunkFeeder.CRC_BYTES)
    ids = _new_uninit("uint8_t[]", n * 32) if hashes else ffi.NULL
    with ffi.from_buffer(data) as buf:
        if lib.ckptfs_name_pieces(buf, len(buf), offs, lens, n, crc_block, zero, crcs, ids):
            raise ValueError(f"pieces outside [0, {len(buf)}), empty or over 16 CRC blocks "
                             f"of {crc_block}")
    return (ffi.buffer(zero, n)[:], ffi.buffer(crcs, n * ChunkFeeder.CRC_BYTES)[:],
            ffi.buffer(ids, n * 32)[:] if hashes else b"")


def chunk_feed_hashes() -> bool:
    """ChunkFeeder names chunks with BLAKE3 in C (built with the BLAKE3 library)."""
    return bool(lib.ckptfs_chunk_hashes())


def gear_cut_points(data: Buffer, min_size: int, avg_size: int, max_size: int) -> list[int]:
    """Content-defined chunk ends of ``data`` taken as a whole stream.

    Returns the end offset of every chunk in order, the last one always
    ``len(data)`` (empty data: no chunks).  Every chunk is ``min_size`` to
    ``max_size`` bytes except possibly the last.
    """
    scanner = GearScanner(min_size, avg_size, max_size)
    cuts = scanner.scan(data)
    if scanner.pending:
        cuts.append(memoryview(data).nbytes)
    return cuts


def open_beneath(dir_fd: int, path: bytes, flags: int, *, walk: bool = False) -> int:
    """Open ``path`` (relative, plain names) beneath the directory ``dir_fd``
    without following a symlink at any component; returns the new fd.

    openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), or a component walk with
    O_NOFOLLOW | O_DIRECTORY when ``walk`` is set or the kernel has no openat2.
    O_NOFOLLOW and O_CLOEXEC are always added. Raises OSError: ELOOP or
    ENOTDIR where a symlink is met, EINVAL for an absolute path or one with an
    empty, "." or ".." component, and whatever the lookup itself answers.
    May block (a lookup on a slow filesystem).
    """
    fd = lib.ckptfs_open_beneath(dir_fd, bytes(path), flags, 1 if walk else 0)
    if fd < 0:
        raise OSError(-fd, os.strerror(-fd), path)
    return fd


def find4(data: Buffer, needle: bytes, start: int = 0, end: int | None = None) -> int:
    """Lowest offset >= ``start`` where the 4-byte ``needle`` lies wholly
    inside ``data[start:end]``, or -1: ``bytes.find`` for any buffer, without
    negative indices (``start`` and ``end`` are clamped to the buffer)."""
    if len(needle) != 4:
        raise ValueError("needle must be 4 bytes")
    with ffi.from_buffer(data) as buf:
        size = len(buf)
        stop = size if end is None else max(0, min(end, size))
        start = max(0, start)
        if stop - start < 4:
            return -1
        i = lib.ckptfs_find4(buf + start, stop - start, needle)
    return -1 if i == stop - start else start + i


# ---- chunk compression (ckptfs.codec) -------------------------------------------

# Output buffers that C fills completely need no zeroing first.
_new_uninit = ffi.new_allocator(should_clear_after_alloc=False)

__all__ += [
    "split_planes",
    "merge_planes",
    "float_layout",
    "fc_encode",
    "fc_decode",
    "fc_decode_into",
    "rans8_encode",
    "rans8_decode_into",
]


def split_planes(data: Buffer, width: int) -> bytes:
    """Byte planes of ``data`` taken as ``width``-byte elements: byte i of
    every element goes to plane i, the planes one after the other, then the
    ``len(data) % width`` trailing bytes unchanged."""
    return _planes(lib.ckptfs_split_planes, data, width)


def merge_planes(data: Buffer, width: int) -> bytes:
    """Inverse of :func:`split_planes`."""
    return _planes(lib.ckptfs_merge_planes, data, width)


def _planes(fn: Callable[..., None], data: Buffer, width: int) -> bytes:
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    with ffi.from_buffer(data) as src:
        n = len(src)
        out = _new_uninit("uint8_t[]", max(n, 1))
        fn(src, n, width, out)
    return ffi.buffer(out, n)[:]


def float_layout(data: Buffer, width: int = 0) -> tuple[int, int, float]:
    """``(width, phase, runs)`` of ``data`` seen as little-endian floats.

    ``width=0`` detects: 2 (bf16/fp16), 4 (fp32) or 0 (not float-like).  A
    ``width`` of 2..16 is taken as given.  ``phase`` is the offset of the
    first whole element (chunks are cut anywhere, not at element
    boundaries).  ``runs`` is how many times more often neighbouring
    elements share their sign/exponent byte than chance (about 1.0 for
    weights; more for optimizer state, where an LZ coder can pay).
    """
    if width < 0 or width == 1 or width > 16:
        raise ValueError(f"width must be 0 or 2..16, got {width}")
    out = ffi.new("unsigned[2]")
    with ffi.from_buffer(data) as src:
        w = lib.ckptfs_float_layout(src, len(src), width, out, out + 1)
    return int(w), int(out[0]), out[1] / 1000


def fc_encode(data: Buffer, width: int, phase: int, max_bits: int, cap: int) -> bytes | None:
    """CODEC_FLOAT payload of ``data``, or None if it would exceed ``cap``
    bytes (or cannot be built: see ckptfs_fc_encode)."""
    if cap <= 0:
        return None
    out = _new_uninit("uint8_t[]", cap)
    with ffi.from_buffer(data) as src:
        k = lib.ckptfs_fc_encode(src, len(src), width, phase, max_bits, out, cap)
    return ffi.buffer(out, k)[:] if k else None


def fc_decode(payload: Buffer, width: int, length: int) -> bytes | None:
    """Decode a CODEC_FLOAT payload into ``length`` new bytes; None if the
    payload is damaged.  Raises MemoryError if C could not allocate."""
    out = _new_uninit("uint8_t[]", max(length, 1))
    with ffi.from_buffer(payload) as src:
        rc = lib.ckptfs_fc_decode(src, len(src), width, out, length)
    if rc == -2:
        raise MemoryError("ckptfs_fc_decode")
    return ffi.buffer(out, length)[:] if rc == 0 else None


def fc_decode_into(payload: Buffer, width: int, out: Buffer) -> bool:
    """Decode a CODEC_FLOAT payload into all of ``out`` (writable, exactly
    the chunk's length); False if the payload is damaged.  Raises
    MemoryError if C could not allocate its scratch."""
    with ffi.from_buffer(payload) as src, ffi.from_buffer(out, require_writable=True) as dst:
        rc = lib.ckptfs_fc_decode(src, len(src), width, dst, len(dst))
    if rc == -2:
        raise MemoryError("ckptfs_fc_decode")
    return rc == 0


def rans8_encode(data: Buffer, cap: int) -> bytes | None:
    """Order-0 rANS of a byte string, or None if it needs more than ``cap`` bytes."""
    if cap <= 0:
        return None
    out = _new_uninit("uint8_t[]", cap)
    with ffi.from_buffer(data) as src:
        k = lib.ckptfs_rans8_encode(src, len(src), out, cap)
    return ffi.buffer(out, k)[:] if k else None


def rans8_decode_into(payload: Buffer, out: Buffer) -> bool:
    """Decode :func:`rans8_encode` output into all of ``out``; False if damaged."""
    with ffi.from_buffer(payload) as src, ffi.from_buffer(out, require_writable=True) as dst:
        return lib.ckptfs_rans8_decode(src, len(src), dst, len(dst)) == 0


# ---- the read executor (ckptfs/chunkread.py, native/ckptfs_readx.h) ------------

__all__ += ["ExtentTable", "READ_FAILED_CHECKSUM", "READ_FAILED_SHORT_LOG",
            "READ_FAILED_BAD_EXTENT", "READ_FAILED_IO", "READ_WOULD_BLOCK"]

READ_FAILED_CHECKSUM = 1     # a block's CRC-32C does not match
READ_FAILED_SHORT_LOG = 2    # the log ends before a byte an extent names
READ_FAILED_BAD_EXTENT = 3   # an extent that cannot be one ckptfs wrote
READ_FAILED_IO = 4           # preadv failed (errno in the result)
READ_WOULD_BLOCK = 5         # nowait: not all in the page cache (read again, may block)


_RX_EXTENT = struct.Struct("=6Q")     # ckptfs_rx_extent: six uint64_t, native order
if _RX_EXTENT.size != ffi.sizeof("ckptfs_rx_extent"):  # pragma: no cover - a stale build
    raise ImportError("ckptfs._native's ckptfs_rx_extent is not six uint64s: rebuild it")


class ExtentTable:
    """A file's LOG extents in the executor's form, built once and read many times.

    rows: (file_off, length, log_off, chunk_off, chunk_len, crcs) in file
    order, crcs the chunk's per-block CRC-32Cs as stored (little-endian
    uint32s). Immutable once built; `read_into` may run on any thread.
    """

    __slots__ = ("count", "_ext", "_crcs", "_n_crcs")

    def __init__(self, rows: list[tuple[int, int, int, int, int, bytes]]) -> None:
        self.count = len(rows)
        packed = bytearray(_RX_EXTENT.size * max(len(rows), 1))
        parts = []
        at = 0
        crc_at: dict[tuple[int, bytes], int] = {}   # a chunk named twice: its CRCs once
        pack_into = _RX_EXTENT.pack_into
        for i, (file_off, length, log_off, chunk_off, chunk_len, crcs) in enumerate(rows):
            where = crc_at.get((log_off, crcs))
            if where is None:
                where = crc_at[log_off, crcs] = at
                parts.append(crcs)
                at += len(crcs) // 4
            pack_into(packed, i * _RX_EXTENT.size, file_off, length, log_off, chunk_off,
                      chunk_len, where)
        # Packed in Python (one call per row, not six field stores through cffi).
        self._ext = ffi.from_buffer("ckptfs_rx_extent[]", packed)
        self._n_crcs = at
        self._crcs = ffi.from_buffer("uint8_t[]", b"".join(parts) or b"\0\0\0\0")

    @classmethod
    def from_records(cls, keys: bytes, vals: bytes, recs: bytes, rec_lens: Buffer, count: int,
                     max_chunk: int, block_bytes: int) -> Optional["ExtentTable"]:
        """The table of count extents from their index records as stored
        (ckptfs_window_rows: keys 16 bytes and values 24 bytes each, joined;
        their chunk records joined in recs, rec_lens uint32 lengths), the
        same rows the constructor would be given from the decoded records
        (the CRCs of a chunk named twice are kept twice). None if any
        extent is not a LOG chunk the executor reads whole (the caller then
        decodes them)."""
        if len(keys) != 16 * count or len(vals) != 24 * count \
                or len(rec_lens) != 4 * count:
            raise ValueError("records of another number of extents")
        self = cls.__new__(cls)
        packed = bytearray(_RX_EXTENT.size * max(count, 1))
        crcs = bytearray(max(len(recs), 4))
        with ffi.from_buffer(rec_lens) as lens, \
                ffi.from_buffer("ckptfs_rx_extent[]", packed) as rows, \
                ffi.from_buffer(crcs) as out:
            n = lib.ckptfs_window_rows(keys, vals, recs, ffi.cast("const uint32_t *", lens),
                                       count, max_chunk, block_bytes, rows, out, len(out))
        if n < 0:
            return None
        self.count = count
        self._ext = ffi.from_buffer("ckptfs_rx_extent[]", packed)
        self._n_crcs = n
        self._crcs = ffi.from_buffer("uint8_t[]", bytes(crcs[:4 * n]) if n else b"\0\0\0\0")
        return self

    def read_into(self, fd: int, first: int, count: int, block_bytes: int, off: int,
                  out: Buffer, scratch: Buffer, nowait: bool = False
                  ) -> tuple[int, int, int, int]:
        """File bytes [off, off + len(out)) from extents [first, first + count)
        into out, every block verified; zeros where no extent is. Returns (0,
        ...) or (kind, errno, log_off, block): see ckptfs_rx_error. scratch:
        2 * block_bytes writable bytes. nowait: READ_WOULD_BLOCK rather than
        wait for the disk. May block unless nowait (GIL released)."""
        if first < 0 or count < 0 or first + count > self.count:
            raise ValueError(f"extents [{first}, {first + count}) of {self.count}")
        err = ffi.new("ckptfs_rx_error *")
        with ffi.from_buffer(out, require_writable=True) as dst, \
                ffi.from_buffer(scratch, require_writable=True) as scr:
            if len(scr) < 2 * block_bytes:
                raise ValueError("scratch holds less than two blocks")
            rc = lib.ckptfs_read_extents(fd, self._ext + first, count, self._crcs,
                                         self._n_crcs, block_bytes, off, dst, len(dst), scr,
                                         1 if nowait else 0, err)
        if rc == 0:
            return 0, 0, 0, 0
        return int(err.kind), int(err.err), int(err.log_off), int(err.block)

    def addresses(self) -> tuple[int, int, int, int]:
        """(extents, count, CRCs, CRC count) as addresses, for the FUSE fast
        path's read table (fastpath.read_table): valid while self lives."""
        return (int(ffi.cast("uintptr_t", self._ext)), self.count,
                int(ffi.cast("uintptr_t", self._crcs)), self._n_crcs)

    def hint(self, fd: int, off: int, length: int) -> None:
        """Ask the kernel to read ahead the log bytes of file bytes [off,
        off + length). Advice only; may block briefly (GIL released)."""
        lib.ckptfs_hint_extents(fd, self._ext, self.count, off, length)


def read_executor_addresses() -> tuple[int, int]:
    """The addresses of ckptfs_read_extents and ckptfs_hint_extents, for
    the FUSE fast path (a module of its own that calls them)."""
    return (int(ffi.cast("uintptr_t", ffi.addressof(lib, "ckptfs_read_extents"))),
            int(ffi.cast("uintptr_t", ffi.addressof(lib, "ckptfs_hint_extents"))))


def crc32c_address() -> int:
    """The address of ckptfs_crc32c, for the FUSE fast path's checks of
    READs it answers from the log's mapping."""
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, "ckptfs_crc32c")))


# ---- log faults (native/ckptfs_logfault.c) ------------------------------------

_HAVE_GUARD = hasattr(lib, "ckptfs_logfault_guard")
__all__ += ["guard_log_mapping", "unguard_log_mapping", "log_fault_gen", "log_mapping_clean",
            "repair_log_mapping", "log_faults", "log_fault_api_address"]


def guard_log_mapping(mapping: mmap.mmap, writable: bool) -> int:
    """Guard a shared mapping of the log: a SIGBUS on one of its pages is
    a zero page and a counted fault, not a dead process. The slot, or -1
    (then nothing may be read from it in place; also from a _native built
    before the guard). Unguard before it closes."""
    if not _HAVE_GUARD:
        return -1
    with ffi.from_buffer(mapping) as buf:
        base = int(ffi.cast("uintptr_t", buf))
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return int(lib.ckptfs_logfault_guard(base, len(mapping), prot))


def unguard_log_mapping(slot: int) -> None:
    if slot >= 0:
        lib.ckptfs_logfault_unguard(slot)


def log_fault_gen() -> int:
    """Take before touching a guarded mapping (`log_mapping_clean` after)."""
    return int(lib.ckptfs_logfault_gen())


def log_mapping_clean(slot: int, gen0: int) -> bool:
    """No log fault came since gen0 and no page of slot's mapping is zeroed:
    what was read from it is the file's."""
    return bool(lib.ckptfs_logfault_clean(slot, gen0))


def repair_log_mapping(slot: int, fd: int) -> int:
    """Map the log file (fd, mapped from offset 0) back over the slot's
    zeroed pages: how many. Raises OSError if mmap fails."""
    n = int(lib.ckptfs_logfault_repair(slot, fd, 0))
    if n < 0:
        raise OSError(-n, f"mapping the log back after a fault: {os.strerror(-n)}")
    return n


def log_faults() -> int:
    """Faults on guarded log mappings since the process started."""
    return int(lib.ckptfs_logfault_count()) if _HAVE_GUARD else 0


def log_fault_api_address() -> int:
    """The guard's functions for the FUSE fast path (ckptfs_logfault.h); 0:
    none (it then answers no READ from the log's mapping)."""
    return int(lib.ckptfs_logfault_api_address()) if _HAVE_GUARD else 0


# ---- the log writer (ckptfs/logwriter.py, native/ckptfs_logwr.h) ----------------

__all__ += ["WriterThreads"]


class WriterThreads:
    """pwrite(2)s on C threads that never take the GIL; finished jobs are
    announced on an eventfd (`fd`) and taken with `reap`. Nothing here blocks
    but `close`, which waits for queued writes."""

    REAP_BATCH = 64

    def __init__(self, nthreads: int) -> None:
        handle = lib.ckptfs_logwr_new(nthreads)
        if handle == ffi.NULL:
            err = ffi.errno
            raise OSError(err, f"starting the log writer threads: {os.strerror(err)}")
        self._handle = handle
        self.fd: int = lib.ckptfs_logwr_fd(handle)
        self._tokens = ffi.new("uint64_t[]", self.REAP_BATCH)
        self._results = ffi.new("int64_t[]", self.REAP_BATCH)
        self._held: dict = {}        # token -> the cffi view of its bytes, until reaped

    def submit(self, fd: int, data: Buffer, pos: int, length: int, off: int,
               token: int) -> None:
        """Queue pwrite(fd, data[pos:pos+length], off); data is kept alive
        (and must not change) until the job's token is reaped."""
        if pos < 0 or length < 0 or pos + length > len(data):
            raise ValueError(f"piece {pos}+{length} outside {len(data)} bytes")
        buf = ffi.from_buffer(data)
        rc = lib.ckptfs_logwr_submit(self._handle, fd, buf + pos, length, off, token)
        if rc:
            raise OSError(-rc, os.strerror(-rc))
        self._held[token] = buf

    def submit_durable(self, fd: int, data: Buffer, off: int, token: int) -> None:
        """Queue pwrite(fd, data, off) then fdatasync(fd): the result reaped is
        len(data) once both succeeded, else -errno. data is kept alive (and
        must not change) until the token is reaped."""
        buf = ffi.from_buffer(data)
        rc = lib.ckptfs_logwr_submit_durable(self._handle, fd, buf, len(data), off, token)
        if rc:
            raise OSError(-rc, os.strerror(-rc))
        self._held[token] = buf

    def start_writeback(self, fd: int, off: int, length: int) -> None:
        """Queue the start of the writeback of fd's dirty pages in [off,
        off+length) to the disk (sync_file_range WRITE, not waited for,
        never reaped). Any thread."""
        rc = lib.ckptfs_logwr_submit(self._handle, fd, ffi.NULL, length, off, 0)
        if rc:
            raise OSError(-rc, os.strerror(-rc))

    def reap(self) -> list[tuple[int, int]]:
        """(token, bytes written or -errno) of every finished job."""
        out: list[tuple[int, int]] = []
        while True:
            n = lib.ckptfs_logwr_reap(self._handle, self._tokens, self._results,
                                      self.REAP_BATCH)
            out += zip(self._tokens[0:n], self._results[0:n])
            if n < self.REAP_BATCH:
                break
        for token, _ in out:
            del self._held[token]
        return out

    def close(self) -> None:
        """Let queued writes finish, stop the threads. May block."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            lib.ckptfs_logwr_free(handle)    # every queued write has ended
            self._held.clear()
