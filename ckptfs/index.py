"""The LMDB index: the single source of truth for what is committed.

This module owns every sub-database, every key and value encoding, and the
group-commit pipeline. Nothing else in ckptfs talks to LMDB, names a
sub-database or slices a key: other modules use the typed operations at the
end of this file ("tables": entries, xattrs, symlinks, orphans, extents,
chunks, chunk ids, the log map, packs, counters, and read-only scans of each
table). Each works on the live Index, a DirectTxn and (reads) a ReadView
alike; the raw `_get/_put/_delete/_items` are private to this module.

Schema (all integers big-endian in keys so that LMDB's byte order is numeric
order; little-endian in values):

    meta      b"format" -> u32 FORMAT_VERSION
              b"uuid"   -> 16 bytes, also written in the log superblock so a
                           log and an index that do not belong together are
                           refused
              b"next_ino", b"next_chunk", b"next_cookie" -> u64 counters;
                           ids are never reused
              b"clean"  -> b"1" after a clean unmount, b"0" while mounted
              b"next_pack" -> u64 counter, never reused
              b"store_uuid" -> 16 bytes: the backing store attached (its
                           marker names it); absent until the first one is
              b"store_path" -> where that store was created (used when no
                           backing= is given)
              b"pack_intent/" + u64 pack no -> u64 wall-clock ns: "this pack
                           is being written". Durable before the pack's first
                           byte is; deleted in the batch that records the pack
                           (the tiering flip), or once the pack an interrupted
                           pass left is deleted (next mount, gc).
              b"pack_dead/" + u64 pack no -> u64 wall-clock ns: the pack's last
                           chunk went (its record is deleted in the same
                           batch); its blob is deleted once a snapshot
                           published after that is in the store, then this key
                           (it survives a crash: the next mount's first
                           snapshot deletes it). A pack in the store that no
                           record, intent or dead mark names was not written
                           by this filesystem's mover.
              b"log_path" -> the log this index was last mounted with: relative
                           to the state directory when it lies inside it, else
                           absolute (used by mount and fsck when no pmem= is
                           given); its superblock names this index's uuid
              b"next_head" -> u64 counter, never reused: the sequence number of
                           the next snapshot head published to the backing
                           store (docs/STORE.md); durable before the head is
                           written, so heads are numbered in commit order
              b"chunks", b"stored_log_bytes", b"stored_source_bytes",
              b"stored_pack_bytes", b"pack_logical_bytes", b"copy_pack_bytes",
              b"copy_logical_bytes", b"unpublished_bytes" -> u64 totals
                           over the chunk table, kept in the same
                           transactions as the chunks (what `ckptfs stat`
                           shows)
              b"files", b"file_bytes" -> u64 totals over the inode table:
                           regular files and the sum of their sizes, kept by
                           put_inode and delete_inode in the same
                           transactions (`ckptfs stat` without a scan)
              b"journal" -> (format 7) u64 generation + u64 seq: the journal's
                           generation (journal.py) and the seq of the last
                           journal record this index holds; records of that
                           generation with the following seqs are replayed
                           when the index is opened. Absent: no journal yet
              b"volume" -> the volume this filesystem is in its store
                           (VolumeRecord, JSON): name, lease generation, the
                           head its state started from, and whether it was
                           recovered from the store and still has to take
                           the volume over (docs/STORE.md, "Volumes")
    inodes    ino -> Inode (see INODE_STRUCT). `parent` is kept for
              directories only (they have exactly one); `data_bytes` is the
              sum of extent lengths (what `du` shows).
    dirents   parent + name -> child ino + cookie
    dirlist   parent + cookie -> name          (readdir order; cookies are
              never reused, so a readdir resumed after concurrent changes
              neither repeats nor skips surviving entries)
    extents   ino + file offset -> chunk no + offset in chunk + length.
              Extents of one inode never overlap; a range with no extent is
              a hole and reads as zeros.
    chunks    chunk no -> kind, refcount, length, location. refcount is the
              number of extents that point into the chunk; a chunk whose
              refcount drops to 0 is deleted in the same transaction and
              its space is reused only after that transaction is durable.
              LOG and PACK chunks are at most MAX_CHUNK_BYTES (chunker.py);
              `chunk_record_problem` says why a record cannot be one ckptfs
              wrote, and every reader asks before trusting its lengths.
              kind LOG:    log offset + chunk id (BLAKE3-256 of the bytes; all
                           zeros for data stored without dedup) + CRC-32C
                           per CRC_BLOCK_BYTES block
                           A LOG chunk may also have a *copy* in a pack
                           (published, docs/STORE.md): then its record is
                           kind byte LOG_COPIED (4), log offset + chunk id +
                           the pack location as for PACK + the CRCs; it is
                           read from the log, counts in its pack's live
                           chunks, and tiering only drops its log copy
              kind PACK:   pack no + offset + stored length + codec + codec
                           param + CRC-32C of the stored payload + chunk id:
                           a cold chunk, compressed in a pack file in the
                           backing store
              kind SOURCE: a file that was in the directory before it was
                           mounted over: how its identity was recorded
                           (SOURCE_FS_*), its st_dev and st_ino at adoption,
                           then its path relative to SOURCE (a file with hard
                           links lists every name, NUL-separated). It is read
                           and deleted only if what that path reaches, with no
                           symlink on the way, still has that identity
    chunkids  chunk id -> chunk no, for every chunk that has an id: how a
              write finds that its bytes are already stored
    packs     pack no -> live chunks + their stored bytes + the pack's size
              (live: PACK chunks and copies of LOG chunks in it; a pack
              whose last live chunk goes is deleted from the backing store
              once that is durable). Pack numbers: the high 32 bits are a
              space the volume's lease claimed in the store, so pack names
              are unique across the volumes of a store (volumes.py)
    unpublished chunk no -> b"" for every LOG chunk without a copy in a
              pack: what publishing still has to copy to the store
    logmap    log offset -> chunk no, for every LOG chunk: the log's used
              space, so the free space is its complement (read at mount)
    xattrs    ino + name -> value
    symlinks  ino -> target
    orphans   ino -> b"" for inodes unlinked while still open; purged at
              last close, or at the next mount after a crash
    logredo   u64 record no -> the new log bytes of one small batch (LOG_REDO:
              count, then per chunk its log offset, length and chunk no, then
              the bytes of each in that order). A batch whose new log bytes
              are at most REDO_BATCH_MAX_BYTES carries them here, in its own
              transaction, instead of persisting the log before it: the bytes
              are durable with the batch, one flush less per small fsync or
              close. The log ranges are persisted later (REDO_PENDING_MAX_BYTES
              waiting, REDO_MAX_AGE_S, or the committer stopping), and the
              records are deleted in the transaction after that persist. The
              next mount writes back each chunk a record holds whose record
              still says it is at that log offset (chunk numbers are never
              reused) and whose CRCs match, persists the log and clears the
              table (`FileData.replay_log_redo`). Record numbers only grow
              while records are kept.

Room (docs/OPERATIONS.md, "the index disk fills"): LMDB grows its file as
the index grows, and a commit that finds no room on that disk fails. While
mounted, the index keeps a reserve of space preallocated past the end of its
data (RESERVE_*): LMDB writes its new pages there, so a commit does not need
the disk to have room at that moment. The first WRITTEN_AHEAD_BYTES of it are
written with zeros, not just allocated: a commit's fdatasync is then a data
flush, with no journal commit for the extents LMDB's new pages land in. Changes that grow the index are
admitted only while the reserve can take them (`admit`, `check_room`:
IndexFull, ENOSPC, otherwise); changes that free space are always admitted
and commit from what is left. A batch that still finds no room is kept and
retried (never dropped: the overlay, the counters and the log allocator
already include it) until room comes back; meanwhile everything that waits
for durability gets IndexFull. Any other commit failure turns the filesystem
read-only: a failed persist of log data cannot be retried safely (the kernel
may have dropped the pages it could not write).

Journal (journal.py, the record format): once `start_journal` ran (the
mount), a durable commit is one record appended to INDEX/journal and one
fdatasync, not an LMDB transaction (two flushes). A journaled batch stays a
read layer over LMDB (`_journaled`: every journaled batch merged, newest
value of each key; a batch's changes wait in `_jpend`, sorted only when
the table is read in key order, merged into it once they are an eighth of
it) for the live index and for `read_view`, until a checkpoint writes them all, with a batch, in one synced LMDB transaction
that also puts the journal's new generation (meta `journal`); the journal
then starts over. Checkpoints: when a record does not fit in the journal,
past JOURNAL_MAX_ENTRIES keys held in the layer, when the committer is idle
JOURNAL_IDLE_CHECKPOINT_S and at stop; always on the committer's worker
thread. Opening an index replays the valid records past the seq LMDB holds
into LMDB, in one transaction with a new generation, before anything reads
(offline tools included). Without room for the journal file the index
commits to LMDB as before.

Concurrency contract: reads and writes are called on the trio thread only.
Writes go to an in-memory batch (overlaid on LMDB for every read, so the
namespace is consistent at once); the committer task writes whole batches in
one LMDB write transaction on a worker thread, after persisting the log
ranges the batch references. A batch is atomic; batches are durable in order.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import struct
import time
import uuid as uuidlib
from array import array
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Collection, Iterable, Iterator, Optional

import lmdb
import trio

from . import journal as jr
from .chunker import MAX_CHUNK_BYTES
from .debugpause import failing_at
from .errors import CkptfsError, DamagedData, FormatError, IndexFailure, IndexFull, ReadOnly

log = logging.getLogger(__name__)

# 1: no chunk ids; 2: SOURCE chunks without the identity of the file adopted;
# 3: no file totals; 4: no copies of LOG chunks in packs, no unpublished
# table; 5: no logredo table, so a format 5 ckptfs would read the log
# without the bytes a crash left there; 6: no journal, so a format 6 ckptfs
# would open an index without the commits its journal holds (all upgraded in
# place by upgrade_format).
FORMAT_VERSION = 7
ROOT_INO = 1
FIRST_COOKIE = 16  # cookies 1 and 2 are "." and ".." in readdir
CRC_BLOCK_BYTES = 64 * 1024

CHUNK_LOG = 1
CHUNK_SOURCE = 2
CHUNK_PACK = 3
_LOG_COPIED = 4          # the record's kind byte of a LOG chunk with a pack copy

DB_NAMES = ("meta", "inodes", "dirents", "dirlist", "extents", "chunks", "chunkids",
            "logmap", "packs", "xattrs", "symlinks", "orphans", "unpublished", "logredo")

CHUNK_ID_BYTES = 32
MAX_OFF_T = (1 << 63) - 1       # no inode is larger (files.MAX_FILE_BYTES is the real limit)
# How a SOURCE chunk knows the file adopted (st_dev is not stable across
# reboots for every device, so the common case is recorded relative to SOURCE).
SOURCE_FS_UNKNOWN = 0      # not recorded (the upgrade could not reach it safely): never matches
SOURCE_FS_SAME = 1         # on SOURCE's own filesystem: st_dev must be SOURCE's at mount
SOURCE_FS_OTHER = 2        # on another filesystem below SOURCE: st_dev as recorded
NO_CHUNK_ID = bytes(CHUNK_ID_BYTES)

ID_COUNTERS = (b"next_ino", b"next_chunk", b"next_cookie", b"next_pack", b"next_head")
# Totals over the chunk table; add_chunk/delete_chunk/move_chunk keep them exact.
STAT_COUNTERS = (b"chunks", b"stored_log_bytes", b"stored_source_bytes", b"stored_pack_bytes",
                 b"pack_logical_bytes", b"copy_pack_bytes", b"copy_logical_bytes",
                 b"unpublished_bytes")
# Totals over the inode table; put_inode/delete_inode keep them exact.
FILE_COUNTERS = (b"files", b"file_bytes")

# The reserve of room for the index's growth (see the module docstring): an
# eighth of the index's size, within these bounds. Growing changes are refused
# once less than half of it is left, so that the other half takes the commits
# that free space (LMDB copies every page it changes, even to delete).
RESERVE_MIN_BYTES = 4 << 20
# With the journal: journaled batches wait for their checkpoint in the reserve
# (`_plan_log_bytes`), so it is larger (preallocated, not written). Each 4 KiB
# random-write cycle (16 rewrites + fsync) promises ~0.1-1 MiB of it (a page per
# key, its `logredo` record): 32 MiB took a checkpoint for room every ~10 cycles.
JOURNAL_RESERVE_MIN_BYTES = 128 << 20
JOURNAL_RESERVE_DISK_FRACTION = 32    # but no more than this part of a small disk
RESERVE_MAX_BYTES = 256 << 20
RESERVE_FRACTION = 8
RESERVE_STEP_BYTES = 1 << 20          # preallocation step when the disk is nearly full
# Past the index's last page, this much of its file is kept written (zeros,
# flushed once) rather than only preallocated: LMDB's new pages then overwrite
# written blocks, and a commit's fdatasync is a data flush alone, not also a
# journal commit for unwritten extents converted or the file's size grown.
# Written again once less than half of it is left ahead.
WRITTEN_AHEAD_BYTES = 8 << 20
# Emptied batch layers kept for reuse (`Index._recycle_layers`): more than the
# tables one batch touches.
SPARE_LAYERS = 32
ROOM_POLL_S = 1.0                     # how often a full index looks for room coming back
STALL_RETRY_MAX_S = 2.0               # longest wait between retries of a batch without room
UNMOUNT_RETRY_S = 10.0                # an unmount waits this long for room before giving up
# What a change may add to the index at most, per record it writes (a record
# plus its share of half-full B-tree pages and of the pages copied on the way),
# and per commit of a file (the paths of pages copied in a dozen sub-databases).
GROWTH_PER_RECORD_BYTES = 512
GROWTH_PER_FILE_COMMIT_BYTES = 4096
# Log bytes carried in the index (`logredo`, see the schema): a batch with at
# most this many new log bytes journals them instead of persisting the log;
# the log is persisted and the records dropped once this many wait, or this
# long after the oldest of them, or when the committer stops.
REDO_BATCH_MAX_BYTES = 256 << 10
REDO_PENDING_MAX_BYTES = 8 << 20
REDO_MAX_AGE_S = 10.0

_U64 = struct.Struct(">Q")
_U64x2 = struct.Struct(">QQ")
# What `Index.watch_maps` reports: inodes too, since a read window may only
# answer reads below the file's size.
# The journal (journal.py): a checkpoint once the journaled read layer holds
# this many keys (its memory: ~150 bytes a key) or the committer was idle this long.
JOURNAL_MAX_ENTRIES = 1 << 16
JOURNAL_IDLE_CHECKPOINT_S = 2.0
# A table's journaled changes not yet merged into it (`Index._jpend`) are
# merged when an ordered read finds them an eighth of the table or more (and
# at least this many keys): until then they are a layer of their own.
JOURNALED_PEND_FRACTION = 8
JOURNALED_PEND_MIN_FOLD = 1024
JOURNAL_PAGE_BYTES = 4096
# A value longer than this goes to LMDB's overflow pages (4 KiB pages: a node
# of at most ~2,040 bytes, key and header included): a run of contiguous
# pages, which freed pages scattered inside the file cannot serve.
LMDB_OVERFLOW_MIN_BYTES = 1900
# A batch this small (log bytes it carries, keys) has its journal record made
# on the trio thread and written and flushed by a C thread (`_append_small`):
# no Python worker thread, no GIL hand-overs on a durable close's path.
# Byte work this size runs on the trio thread elsewhere too (staging.INLINE_BYTES).
JOURNAL_INLINE_LOG_BYTES = 64 << 10
JOURNAL_INLINE_KEYS = 256
_JOURNAL_META = struct.Struct("<QQ")   # generation, last seq applied

_WATCHED_DBS = frozenset(("extents", "chunks", "inodes"))
_EXTENT = struct.Struct("<QQQ")
_DIRENT = struct.Struct("<QQ")
_CHUNK_HEAD = struct.Struct("<BIQ")
_LOGLOC = struct.Struct("<Q")
_LOG_HEAD = struct.Struct("<BIQQ")      # _CHUNK_HEAD then _LOGLOC: a LOG record's start in one pack
_PACKLOC = struct.Struct("<QQIBBI")     # pack no, offset, stored length, codec, param, crc
_LOG_FIXED = _CHUNK_HEAD.size + _LOGLOC.size + CHUNK_ID_BYTES   # a LOG record before its CRCs
_PACK = struct.Struct("<QQQ")           # live chunks, live stored bytes, pack size
_SOURCE_ID = struct.Struct("<BQQ")      # SOURCE_FS_*, st_dev, st_ino
_REDO_COUNT = struct.Struct("<I")
_REDO_ENTRY = struct.Struct("<QIQ")     # log offset, length, chunk no
INODE_STRUCT = struct.Struct("<IIIIQQqqqQQ")


def u64(n: int) -> bytes:
    return _U64.pack(n)


def u64_le(n: int) -> bytes:
    """Counter values in `meta` are little-endian like every other value."""
    return _LOGLOC.pack(n)


def read_counter(kv, name: bytes) -> int:
    raw = kv._get("meta", name)
    return _LOGLOC.unpack(raw)[0] if raw else 0


def read_u64(b: bytes) -> int:
    return _U64.unpack(b)[0]


@dataclass(slots=True)
class Inode:
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int = 0
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    parent: int = 0
    data_bytes: int = 0

    def encode(self) -> bytes:
        return INODE_STRUCT.pack(self.mode, self.nlink, self.uid, self.gid, self.rdev,
                                 self.size, self.atime_ns, self.mtime_ns, self.ctime_ns,
                                 self.parent, self.data_bytes)

    @classmethod
    def decode(cls, ino: int, b: bytes) -> "Inode":
        try:
            inode = cls(ino, *INODE_STRUCT.unpack(b))
        except struct.error:
            raise FormatError(f"inode {ino}: damaged record ({len(b)} bytes)") from None
        if inode.size > MAX_OFF_T:
            raise FormatError(f"inode {ino}: damaged record (size {inode.size})")
        return inode


@dataclass(slots=True, frozen=True)
class Extent:
    """file range [file_off, file_off + length) -> chunk bytes from chunk_off."""

    file_off: int
    length: int
    chunk_no: int
    chunk_off: int

    @property
    def end(self) -> int:
        return self.file_off + self.length


def _log_record(refcount: int, length: int, log_off: int, chunk_id: bytes, crcs: bytes) -> bytes:
    """A LOG chunk's record (not copied to a pack): head, log offset, id
    (NO_CHUNK_ID for none), CRCs. One pack and one join: a big file's
    commit makes ~16 per MiB on the trio thread (`add_chunks`)."""
    return b"".join((_LOG_HEAD.pack(CHUNK_LOG, refcount, length, log_off),
                     chunk_id or NO_CHUNK_ID, crcs))


@dataclass(slots=True)
class Chunk:
    chunk_no: int
    kind: int
    refcount: int
    length: int
    log_off: int = 0                 # CHUNK_LOG
    crcs: bytes = b""                # CHUNK_LOG: u32 LE per CRC_BLOCK_BYTES block
    source_path: bytes = b""         # CHUNK_SOURCE: its original path(s), NUL-separated
    source_fs: int = SOURCE_FS_UNKNOWN   # CHUNK_SOURCE: the identity of the file adopted
    source_dev: int = 0
    source_ino: int = 0
    chunk_id: bytes = b""            # BLAKE3-256 of the bytes; b"" when not deduplicated
    pack_no: int = 0                 # CHUNK_PACK, or a copied LOG chunk: where its
    pack_off: int = 0                # compressed payload is
    stored_length: int = 0
    codec: int = 0
    codec_param: int = 0
    payload_crc: int = 0
    copied: bool = False             # CHUNK_LOG: a copy is in a pack too (published)

    @property
    def in_store(self) -> bool:
        """Its bytes are in a pack of the backing store (cold, or a published copy)."""
        return self.kind == CHUNK_PACK or (self.kind == CHUNK_LOG and self.copied)

    @property
    def source_paths(self) -> list[bytes]:
        """Every original name of a pre-existing file (hard links give several)."""
        return self.source_path.split(b"\0")

    def encode(self) -> bytes:
        if self.kind == CHUNK_LOG and self.copied:
            return _CHUNK_HEAD.pack(_LOG_COPIED, self.refcount, self.length) \
                + _LOGLOC.pack(self.log_off) + self.chunk_id + self._packloc() + self.crcs
        if self.kind == CHUNK_LOG:
            return _log_record(self.refcount, self.length, self.log_off, self.chunk_id, self.crcs)
        head = _CHUNK_HEAD.pack(self.kind, self.refcount, self.length)
        if self.kind == CHUNK_PACK:
            return head + self._packloc() + self.chunk_id
        return head + _SOURCE_ID.pack(self.source_fs, self.source_dev, self.source_ino) \
            + self.source_path

    def _packloc(self) -> bytes:
        return _PACKLOC.pack(self.pack_no, self.pack_off, self.stored_length, self.codec,
                             self.codec_param, self.payload_crc)

    @classmethod
    def decode(cls, chunk_no: int, b: bytes) -> "Chunk":
        try:
            return cls._decode(chunk_no, b)
        except struct.error:
            raise FormatError(f"chunk {chunk_no}: damaged record ({len(b)} bytes)") from None

    @classmethod
    def _decode(cls, chunk_no: int, b: bytes) -> "Chunk":
        kind, refcount, length = _CHUNK_HEAD.unpack_from(b)
        rest = b[_CHUNK_HEAD.size:]
        if kind == CHUNK_LOG:
            cid_end = _LOGLOC.size + CHUNK_ID_BYTES
            cid = bytes(rest[_LOGLOC.size:cid_end])
            return cls(chunk_no, kind, refcount, length, log_off=_LOGLOC.unpack_from(rest)[0],
                       crcs=bytes(rest[cid_end:]), chunk_id=b"" if cid == NO_CHUNK_ID else cid)
        if kind == _LOG_COPIED:
            cid_end = _LOGLOC.size + CHUNK_ID_BYTES
            pack_no, pack_off, stored, codec, param, crc = _PACKLOC.unpack_from(rest, cid_end)
            return cls(chunk_no, CHUNK_LOG, refcount, length, log_off=_LOGLOC.unpack_from(rest)[0],
                       chunk_id=bytes(rest[_LOGLOC.size:cid_end]), copied=True, pack_no=pack_no,
                       pack_off=pack_off, stored_length=stored, codec=codec, codec_param=param,
                       payload_crc=crc, crcs=bytes(rest[cid_end + _PACKLOC.size:]))
        if kind == CHUNK_PACK:
            pack_no, pack_off, stored, codec, param, crc = _PACKLOC.unpack_from(rest)
            return cls(chunk_no, kind, refcount, length, pack_no=pack_no, pack_off=pack_off,
                       stored_length=stored, codec=codec, codec_param=param, payload_crc=crc,
                       chunk_id=bytes(rest[_PACKLOC.size:]))
        if kind == CHUNK_SOURCE:
            fs, dev, ino = _SOURCE_ID.unpack_from(rest)
            return cls(chunk_no, kind, refcount, length, source_fs=fs, source_dev=dev,
                       source_ino=ino, source_path=bytes(rest[_SOURCE_ID.size:]))
        raise FormatError(f"chunk {chunk_no}: unknown kind {kind}")


class BatchLayer(dict):
    """Changes to one table: key -> value (None: deleted), with the part of
    SortedDict's interface the reads use (`irange`, `bisect_left`,
    `peekitem`): a batch's layer, and a table of the journaled layer. Its
    keys are sorted the first time a read asks for them in order, then kept
    sorted as keys are added (an `update` merges its new keys in, one pass
    over the list, if they were read in order since the last update; else
    they are sorted again when next asked): a commit's ~150 puts
    were a SortedDict insert each (a third of them ever read in order: the
    extents a punch looks up), and so were the ~50 extents each commit folds
    into the journaled `extents` table. Changed on the trio thread only; a
    worker reads a table only once sorted and never changed again (a
    journaled table it holds is copied before the next fold)."""

    __slots__ = ("_keys", "_read")

    def __init__(self) -> None:
        super().__init__()
        self._keys: Optional[list[bytes]] = None
        self._read = False          # read in order since the last update

    def __setitem__(self, key: bytes, value: Optional[bytes]) -> None:
        if self._keys is not None and key not in self:
            insort(self._keys, key)
        dict.__setitem__(self, key, value)

    def update(self, items: "Iterable[tuple[bytes, Optional[bytes]]] | dict[bytes, Optional[bytes]]"  # type: ignore[override]
               ) -> None:
        keys = self._keys
        if keys is None or not self._read:
            # Not read in order since it was last sorted (a table of chunks
            # a rare scan sorted): sorted again, whole, if ever asked.
            dict.update(self, items)
            self._keys = None
            return
        self._read = False
        changes = items if isinstance(items, dict) else dict(items)    # a key once, its last value
        new = sorted(k for k in changes if k not in self)
        dict.update(self, changes)
        if len(new) * 16 >= len(keys):
            keys.extend(new)
            keys.sort()
            return
        # A few keys into many (a commit's ~50 extents into a journaled table
        # of up to ~10 k): the runs between them copied as slices, one pass;
        # list.sort would compare every key to find its sorted run first.
        merged: list[bytes] = []
        at = 0
        for k in new:
            i = bisect_left(keys, k, at)
            merged += keys[at:i]
            merged.append(k)
            at = i
        merged += keys[at:]
        self._keys = merged

    def copy(self) -> "BatchLayer":  # type: ignore[override]
        other = BatchLayer()
        dict.update(other, self)
        if self._keys is not None:
            other._keys = list(self._keys)
            other._read = self._read
        return other

    def clear(self) -> None:
        dict.clear(self)
        self._keys = None
        self._read = False

    def _sorted(self) -> list[bytes]:
        self._read = True
        keys = self._keys
        if keys is None:
            keys = self._keys = sorted(dict.keys(self))
        return keys

    def bisect_left(self, key: bytes) -> int:
        return bisect_left(self._sorted(), key)

    def peekitem(self, i: int) -> tuple[bytes, Optional[bytes]]:
        key = self._sorted()[i]
        return key, dict.__getitem__(self, key)

    def irange(self, lo: bytes, hi: bytes, inclusive: tuple[bool, bool] = (True, False),
               reverse: bool = False) -> Iterator[bytes]:
        """Keys in [lo, hi) (the one bound the reads use), a copy: the
        layer may change while the caller goes through them."""
        assert inclusive == (True, False)
        keys = self._sorted()
        run = keys[bisect_left(keys, lo):bisect_left(keys, hi)]
        return reversed(run) if reverse else iter(run)


@dataclass
class Batch:
    """Changes that will be committed together in one LMDB transaction."""

    seq: int
    ops: dict[str, BatchLayer] = field(default_factory=dict)
    persist_ranges: list[tuple[int, int]] = field(default_factory=list)
    after_durable: list[Callable[[], None]] = field(default_factory=list)
    opened_at: Optional[float] = None      # when its first change arrived
    promised_bytes: int = 0                # index growth admitted into it (`Index.admit`)
    persisted: bool = False                # its log ranges are durable (a retry skips them)
    # The new chunks behind persist_ranges: (log offset, length, chunk no).
    log_chunks: list[tuple[int, int, int]] = field(default_factory=list)
    journal_log: bool = False              # sealed to carry its log bytes (`logredo`)
    flush_redo: bool = False               # sealed to persist the log of the records kept
    redo: Optional[bytes] = None           # its `logredo` record, once read from the log
    redo_flushed: Optional[list[int]] = None   # records whose log bytes it persisted
    # The index's room right after its transaction, when no upkeep was due
    # (`Index._room_without_upkeep`); None: `_refill_reserve` measures it.
    room_after: Optional[int] = None
    checkpoint: bool = False               # sealed to checkpoint the journal (idle, stop)
    checkpoint_why: str = ""               # why it checkpoints (`Index.checkpoint_reasons`)
    journaled: bool = False                # made durable in the journal, not in LMDB
    checkpointed: bool = False             # its LMDB transaction held every journaled batch
    checkpoint_generation: int = 0         # the journal's generation that transaction put
    journal_promise: int = 0               # reserve its checkpoint may take (`_plan_log_bytes`)
    # Its `logredo` puts and deletes (journaled: merged into the read layer).
    extra_ops: list[tuple[str, bytes, Optional[bytes]]] = field(default_factory=list)
    # The journaled layer as its worker saw it (`Index._journaled_snapshot`):
    # what a checkpoint writes first, tables then the changes newer than them.
    journaled_layers: list[tuple[str, dict]] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.ops and not self.after_durable

    def op_count(self) -> int:
        return sum(len(d) for d in self.ops.values())


class Index:
    """The LMDB environment, its sub-databases and the group-commit pipeline."""

    def __init__(self, path: str, *, map_size_bytes: int = 1 << 40) -> None:
        os.makedirs(path, exist_ok=True)
        try:
            # metasync stays on: without it a power loss may undo the last
            # transaction, which would break "durable once close returns".
            self.env = lmdb.open(path, map_size=map_size_bytes, max_dbs=len(DB_NAMES) + 2,
                                 sync=True, metasync=True, readahead=False,
                                 writemap=False, max_readers=64)
        except lmdb.Error as e:
            raise FormatError(f"cannot open index at {path}: {e}") from e
        self.path = path
        self._dbs = {name: self.env.open_db(name.encode()) for name in DB_NAMES}
        # The journal (None: commits go to LMDB) and the journaled batches'
        # read layer: table -> key -> value (None: deleted). Tables a ReadView
        # holds are copied before the next merge changes them.
        self._journal: Optional[jr.Journal] = None
        self._journal_writer: Optional[jr.DurableWriter] = None     # `_append_small`'s C thread
        self._journaled: dict[str, BatchLayer] = {}
        self._journaled_shared: set[str] = set()
        # Journaled changes newer than the table of their db, not merged in
        # yet (`_fold`): a dict.update per batch instead of a sorted insert per
        # key; they are sorted only when something reads the table in key
        # order (a commit's punches read `extents`; `chunks`, `chunkids`,
        # `logmap` mostly go to the checkpoint unsorted), then read as a layer
        # of their own over the table until they are an eighth of it: merging
        # a commit's ~50 extents into a table of ~10 k keys costs a pass
        # over the table. Never shared with a view.
        self._jpend: dict[str, BatchLayer] = {}
        # Keys in the layer; a key both in a table and in its pending changes
        # counts twice until folded (a bound: a checkpoint comes no later).
        self._journaled_entries = 0
        self._journaled_promised = 0
        # What the journaled batches' checkpoint may take of the reserve
        # (`_checkpoint_need`), summed since the last checkpoint: keys per
        # table, their growth admitted, the page-per-key estimate, the need.
        self._ckpt_keys: dict[str, int] = {}
        self._ckpt_growth_bytes = 0
        self._ckpt_per_key_bytes = 0
        self._ckpt_need_bytes = 0
        # Of it, the journaled values bound for LMDB's overflow pages (their
        # `logredo` records above all), pages rounded up: they need room past
        # LMDB's last page (`_past_end_bytes`), not pages freed inside.
        self._ckpt_overflow_bytes = 0
        self._past_end_bytes = 0            # the reserve past LMDB's last page, last measured
        # LMDB's pages per table and beside the tables (`_lmdb_pages`): LMDB
        # does not change between checkpoints. None: not counted yet.
        self._ckpt_lmdb_pages: Optional[tuple[dict[str, int], int]] = None
        # The generation LMDB's meta `journal` holds while the journaled layer
        # is not in LMDB yet; a checkpoint's transaction changes it before the
        # trio thread drops the layer (`read_view` tells the two apart by it).
        self._journaled_gen: Optional[int] = None
        self.checkpoints = 0
        # Why checkpoints happened (a count per reason) and what the journal
        # took: records appended, their bytes, the checkpoints' seconds.
        self.checkpoint_reasons: dict[str, int] = {}
        self.journal_records_total = 0
        self.journal_bytes_total = 0
        self.checkpoint_seconds_total = 0.0
        # Room for growth; None until `keep_reserve` (fsck and recover keep none).
        # Set before the replay: its no-room check (`_no_room`) reads them
        # (no data.mdb fd yet: the disk's free space by the index's path).
        self.room_bytes: Optional[int] = None
        self.reserve_target_bytes = 0
        self._reserve_min_bytes = RESERVE_MIN_BYTES
        self._data_fd = -1
        try:
            self.replayed_records = self._replay_journal()
        except BaseException:
            self.env.close()            # else this process can never open it again
            raise
        self._rtxn = self.env.begin()
        self._open = Batch(seq=1)
        self._committing: Optional[Batch] = None
        self.durable_seq = 0
        self.failure: Optional[BaseException] = None
        self.fenced: Optional[str] = None       # why the filesystem is read-only (`fence`)
        # `watch_maps`: told of a file's extent map or inode record (its
        # inode number), and of chunk records (their numbers, many at a time).
        self._extent_watchers: list[Callable[[int], None]] = []
        self._chunk_watchers: list[Callable[[Collection[int]], None]] = []
        self._entry_watchers: list[Callable[[int], None]] = []
        self.direct_writes = 0          # write_direct calls: watchers saw none of them
        # Chunk id entries put so far (live index): a file whose new chunks were
        # looked up by id when this was N finds no twin at commit while it is N.
        self.chunk_ids_put = 0
        self._work = trio.Event()
        self._durable_changed = trio.Event()
        self._stopping = False
        self._wanted_seq = 0           # the newest batch somebody waits for
        self._urgent = trio.Event()
        self.commits = 0
        self.commit_seconds_total = 0.0
        self.on_commit: Optional[Callable[[float], None]] = None   # metrics: seconds per batch
        # Told of every durable batch: its seq and when its first change arrived
        # (time.monotonic()): the publisher's lag (publish.py).
        self.on_durable: list[Callable[[int, float], None]] = []
        self.counters: dict[bytes, int] = {}
        self._spare_layers: list[BatchLayer] = []     # emptied layers of durable batches
        self._load_counters()
        self.stalled: Optional[BaseException] = None   # the batch in commit finds no room
        self._promised_total = 0          # admitted growth not yet committed
        self._written_to = 0            # data.mdb is written (not just allocated) below this
        self._full_since: Optional[float] = None
        # Log bytes carried in the index (`logredo`): how the committer reads
        # them (None: it persists the log instead), and the records durable
        # here whose log ranges are not persisted yet (record no -> ranges).
        # Only the committer's worker thread changes these, between batches.
        self._read_log: Optional[Callable[[int, int], bytes]] = None
        self._redo: dict[int, list[tuple[int, int]]] = {}
        self._redo_bytes = 0
        self._redo_since = 0.0
        self._redo_next = 1
        self._load_redo()

    # ------------------------------------------------------------------ room

    def keep_reserve(self) -> None:
        """Keep room for the index's growth preallocated from now on. May block.

        Also allocates LMDB's lock file: it is mapped and written through the
        mapping, and a page of it that the disk cannot back would kill the
        daemon (SIGBUS) on a full disk.
        """
        lock_path = os.path.join(self.path, "lock.mdb")
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
        except OSError as e:
            log.warning("could not allocate %s (%s): a full disk may stop the daemon",
                        lock_path, e.strerror)
        finally:
            os.close(fd)
        self._data_fd = os.open(os.path.join(self.path, "data.mdb"), os.O_RDWR | os.O_CLOEXEC)
        self.room_bytes = self._refill_reserve()

    def _refill_reserve(self) -> int:
        """Measure the room for growth: pages LMDB has freed inside its file plus
        the space preallocated past its end, preallocating up to the target
        when a quarter of it is used. Returns the room. May block."""
        psize = self.env.stat()["psize"]
        used = (self.env.info()["last_pgno"] + 1) * psize
        target = min(max(used // RESERVE_FRACTION, self._reserve_min_bytes), RESERVE_MAX_BYTES)
        self.reserve_target_bytes = target
        size = os.fstat(self._data_fd).st_size
        # Pages freed inside the file count too, but only matter when the room
        # past its end runs short (counting them takes a look at every table).
        inside = self._free_pages() * psize if size - used < target * 3 // 4 else 0
        want = target - (size - used) - inside
        step = want
        while want > target // 4:
            n = min(step, want)
            try:
                os.posix_fallocate(self._data_fd, size, n)
            except OSError:
                if n <= RESERVE_STEP_BYTES // 4:
                    break           # the disk is full: keep what there is
                step = RESERVE_STEP_BYTES if n > RESERVE_STEP_BYTES else n // 2
                continue
            size += n
            want -= n
        self._write_ahead(used)
        self._past_end_bytes = max(os.fstat(self._data_fd).st_size - used, 0)
        return self._past_end_bytes + inside

    def _room_without_upkeep(self) -> Optional[int]:
        """The room `_refill_reserve` would return when it would do nothing but
        measure (no free pages to count, nothing to preallocate or write ahead);
        None when upkeep is due. A few microseconds: the committer's worker
        measures it right after a transaction, so the trio thread needs no
        second thread hop per commit for it. May block (fstat)."""
        psize = self.env.stat()["psize"]
        used = (self.env.info()["last_pgno"] + 1) * psize
        target = min(max(used // RESERVE_FRACTION, self._reserve_min_bytes), RESERVE_MAX_BYTES)
        size = os.fstat(self._data_fd).st_size
        # The conditions under which `_refill_reserve` counts no pages, grows
        # nothing and `_write_ahead` writes nothing.
        if size - used < target * 3 // 4 \
                or max(self._written_to, used) - used < WRITTEN_AHEAD_BYTES // 2:
            return None
        self.reserve_target_bytes = target
        self._past_end_bytes = size - used
        return size - used

    def _write_ahead(self, used: int) -> None:
        """Keep WRITTEN_AHEAD_BYTES past the index's last page (used) written
        with zeros and flushed, so that the next commits' new pages overwrite
        written blocks (WRITTEN_AHEAD_BYTES). Only between transactions (the
        committer's worker, `keep_reserve`): a page past `used` is then no
        page of any transaction. May block; a full disk leaves it short
        (LMDB still writes where posix_fallocate reserved)."""
        start = max(self._written_to, used)
        if start - used >= WRITTEN_AHEAD_BYTES // 2:
            return
        end = used + WRITTEN_AHEAD_BYTES
        zeros = bytes(RESERVE_STEP_BYTES)
        written = start
        try:
            while written < end:
                written += os.pwrite(self._data_fd, zeros[:end - written], written)
        except OSError as e:
            log.debug("index write-ahead stopped at %d: %s", written, e.strerror)
        if written == start:
            return          # nothing written (a full disk): no flush either
        try:
            os.fdatasync(self._data_fd)
        except OSError as e:
            # LMDB's own flush of its next commit sees a write error too.
            log.warning("could not flush the index's written-ahead space: %s", e.strerror)
            return
        self._written_to = written

    def _free_pages(self) -> int:
        """Pages inside LMDB's file that no sub-database uses (freed by earlier
        commits; LMDB reuses them before it grows the file)."""
        in_use = 2                                      # the two meta pages
        with self.env.begin() as txn:
            for st in [self.env.stat()] + [txn.stat(db) for db in self._dbs.values()]:
                in_use += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return max(self.env.info()["last_pgno"] + 1 - in_use, 0)

    def _room_left(self) -> int:
        return (self.room_bytes or 0) - self._promised_total - self.reserve_target_bytes // 2

    def _disk_free_bytes(self) -> int:
        """Free space on the index's disk (as this process may use it). While
        mounted through the fd opened before the mount: the path may lead
        through the mount itself."""
        st = os.fstatvfs(self._data_fd) if self._data_fd >= 0 else os.statvfs(self.path)
        return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize

    def _has_room(self, nbytes: int) -> bool:
        """Room for nbytes more growth: in the reserve, or on the disk beyond a
        whole reserve (the next commit preallocates it)."""
        if self._room_left() >= nbytes:
            return True
        short = nbytes - self._room_left()
        return self._disk_free_bytes() >= short + self.reserve_target_bytes

    @property
    def full(self) -> bool:
        """No room for changes that grow the index (they get IndexFull)."""
        return self.stalled is not None or (self.room_bytes is not None and
                                            not self._has_room(GROWTH_PER_FILE_COMMIT_BYTES))

    def check_room(self) -> None:
        """Raise IndexFull while changes that grow the index are refused. Trio thread."""
        if self.full:
            self._note_full()
            raise IndexFull(self._full_message())

    def admit(self, nbytes: int) -> None:
        """Admit a change that grows the index by up to nbytes into the open batch,
        or raise IndexFull (nothing admitted). Call it once nothing else can make
        the change fail, right before it goes into the batch. Trio thread."""
        if self.room_bytes is None:
            return
        if self.stalled is not None or not self._has_room(nbytes):
            self._note_full()
            raise IndexFull(self._full_message())
        self.promise(nbytes)

    def promise(self, nbytes: int) -> None:
        """Count nbytes of growth the open batch now holds (checked with `admit`,
        or with `check_room` before a change that may still fail). Trio thread."""
        if self.room_bytes is not None:
            self._open.promised_bytes += nbytes
            self._promised_total += nbytes

    def _full_message(self) -> str:
        if self.stalled is not None:
            return f"the index could not commit: {self.stalled}"
        return (f"no room for the index in {self.path}: {max(self.room_bytes or 0, 0)} bytes "
                f"of its reserve left, {self.reserve_target_bytes // 2} kept for deletes")

    def _note_full(self) -> None:
        if self._full_since is None:
            self._full_since = time.monotonic()
            log.warning("index disk full (%s): new files and writes get ENOSPC, deleting "
                        "files still works; ckptfs goes on by itself once the disk has room",
                        self._full_message())

    def _note_room(self) -> None:
        if self._full_since is not None and not self.full:
            log.warning("index has room again after %.0f s: writes are accepted again",
                        time.monotonic() - self._full_since)
            self._full_since = None

    # ----------------------------------------------------------------- setup

    def is_formatted(self) -> bool:
        return self._get("meta", b"format") is not None

    def format(self, fs_uuid: bytes, now_ns: int, uid: int, gid: int) -> None:
        """Write a new, empty filesystem (root directory only). May block."""
        with self.env.begin(write=True) as txn:
            m = self._dbs["meta"]
            txn.put(b"format", struct.pack("<I", FORMAT_VERSION), db=m)
            txn.put(b"uuid", fs_uuid, db=m)
            txn.put(b"next_ino", _LOGLOC.pack(ROOT_INO + 1), db=m)
            txn.put(b"next_chunk", _LOGLOC.pack(1), db=m)
            txn.put(b"next_cookie", _LOGLOC.pack(FIRST_COOKIE), db=m)
            txn.put(b"clean", b"1", db=m)
            root = Inode(ROOT_INO, 0o40755, 2, uid, gid, atime_ns=now_ns, mtime_ns=now_ns,
                         ctime_ns=now_ns, parent=ROOT_INO)
            txn.put(u64(ROOT_INO), root.encode(), db=self._dbs["inodes"])
        self._renew_read_txn()
        self._load_counters()

    def check_format(self) -> bytes:
        """Return the filesystem uuid; refuse an index of another format."""
        version = self.format_version()
        if version < FORMAT_VERSION:
            raise FormatError(f"{self.path} holds a format {version} index: mount it once with "
                              "this ckptfs to upgrade it (fsck does not change formats)")
        if version != FORMAT_VERSION:
            raise FormatError(f"index format {version} is not supported (expected {FORMAT_VERSION})")
        return self._get("meta", b"uuid") or b""

    def format_version(self) -> int:
        raw = self._get("meta", b"format")
        if raw is None:
            raise FormatError(f"{self.path} holds no ckptfs index")
        return struct.unpack("<I", raw)[0]

    def upgrade_format(self, source_identity: Optional[Callable[[list[bytes]],
                                                                tuple[int, int, int]]] = None
                       ) -> bool:
        """Bring an older index to FORMAT_VERSION in one transaction. May block.

        Format 1 had no chunk ids and no chunk totals: every LOG chunk gets an
        all-zero id (stored without dedup, never a dedup target) and the
        totals are counted. Formats 1-3 had no file totals: counted (one scan
        of the inodes). Formats 1-4 had no copies of LOG chunks in packs:
        every LOG chunk is listed as unpublished. Format 2 did not record which file a SOURCE chunk
        adopted: source_identity(paths) gives (SOURCE_FS_*, st_dev, st_ino) of
        what the paths reach now, safely (sources.SourceFiles.identify); without
        it, or when it raises OSError, the chunk's identity stays unknown and
        its reads give EIO (logged). Returns whether anything changed.
        """
        version = self.format_version()
        if version >= FORMAT_VERSION:
            return False
        unknown = []

        def upgrade(txn: "DirectTxn") -> None:
            if version == 1:
                _upgrade_chunk_ids(txn)
            if version < 3:
                # Only format 2's SOURCE records are head + paths: later ones
                # carry the identity, which must not be read as a path.
                for k, raw in list(txn._items("chunks", u64(0), u64((1 << 64) - 1))):
                    kind, refcount, length = _CHUNK_HEAD.unpack_from(raw)
                    if kind != CHUNK_SOURCE:
                        continue
                    paths = bytes(raw[_CHUNK_HEAD.size:])
                    chunk = Chunk(read_u64(k), kind, refcount, length, source_path=paths)
                    try:
                        if source_identity is None:
                            raise OSError("no SOURCE directory to look in")
                        chunk.source_fs, chunk.source_dev, chunk.source_ino = \
                            source_identity(chunk.source_paths)
                    except OSError as e:
                        unknown.append(f"{paths.split(bytes(1))[0]!r} ({e})")
                    txn._put("chunks", k, chunk.encode())
            if version < 4:
                for name, value in count_files(txn).items():
                    txn._put("meta", name, _LOGLOC.pack(value))
            if version < 5:
                _upgrade_unpublished(txn)
            # 5 -> 6: the logredo table, empty (LMDB made it at open).
            # 6 -> 7: nothing to convert (the journal starts with the mount).
            txn._put("meta", b"format", struct.pack("<I", FORMAT_VERSION))

        self.write_direct(upgrade)
        log.info("upgraded index %s from format %d to %d", self.path, version, FORMAT_VERSION)
        for what in unknown:
            log.warning("pre-existing file %s could not be identified at the upgrade (a "
                        "symlink on its path, or gone): its reads give EIO", what)
        return True

    # --------------------------------------------------------------- journal

    def _journal_path(self) -> str:
        return os.path.join(self.path, jr.JOURNAL_NAME)

    def _journal_state(self) -> Optional[tuple[int, int]]:
        with self.env.begin() as txn:
            raw = txn.get(b"journal", db=self._dbs["meta"])
        return None if raw is None else _JOURNAL_META.unpack(raw)

    def _replay_journal(self) -> int:
        """Write the journal's valid records past the seq LMDB holds into LMDB,
        in order, in one transaction that also starts a new generation (what
        is left in the file can then never count). Returns how many. Replaying
        again (a crash before that transaction) writes the same values: the
        records hold values, not changes. May block.

        When that transaction finds no room (a full disk: one transaction
        cannot reuse the pages it frees, nor find long runs of freed pages for
        big values), each record is applied in a transaction of its own, with
        its seq, as the batches were committed before the journal; then the
        new generation. Only when one record does not fit either does the
        opening fail (IndexFull: nothing lost, free some space)."""
        state = self._journal_state()
        if state is None:
            return 0
        generation, applied = state
        records = list(jr.read_records(self._journal_path(), generation, applied))
        if not records:
            return 0
        last = records[-1][0]
        try:
            try:
                self._apply_records(records, jr.new_generation())
            except IndexFull:
                log.warning("index %s: no room to replay %d journaled commits at once: "
                            "one transaction each", self.path, len(records))
                for record in records:
                    self._apply_records([record], generation)
                self._apply_records([], jr.new_generation(), last)
        except IndexFull as e:
            raise IndexFull(f"no room in {self.path} to replay the {len(records)} journaled "
                            f"commits into the index ({e}): free some space on its disk "
                            "and open it again; nothing is lost") from e
        log.info("index %s: replayed %d journaled commits (seq %d-%d)", self.path,
                 len(records), records[0][0], last)
        return len(records)

    def _apply_records(self, records: list[tuple[int, bytes]], generation: int,
                       last: Optional[int] = None) -> None:
        """records' changes into LMDB in one transaction that records
        (generation, the last record's seq, or last). May block."""
        try:
            with self.env.begin(write=True) as txn:
                for _, payload in records:
                    self._apply_ops(txn, jr.decode_payload(payload))
                seq = records[-1][0] if records else last
                txn.put(b"journal", _JOURNAL_META.pack(generation, seq), db=self._dbs["meta"])
        except (ValueError, KeyError) as e:
            raise FormatError(f"{self._journal_path()}: a journal record with a valid "
                              f"CRC does not parse ({e})") from e
        except lmdb.Error as e:
            # An EIO counts only on a disk with no room left: a failing disk's
            # EIO is no "free some space".
            if isinstance(e, lmdb.MapFullError) or self._no_room(e):
                raise IndexFull(str(e)) from e
            raise

    def start_journal(self) -> bool:
        """Commit through the journal from now on (the mount; before the
        committer runs): the file made if missing (False, with a warning, when
        its disk has no room: commits go to LMDB), a new generation durable in
        LMDB. May block."""
        assert self._committing is None and self._open.is_empty() and not self._journaled
        path = self._journal_path()
        if not os.path.exists(path) and not jr.create(path):
            log.warning("no room for the index journal in %s: every commit goes to LMDB "
                        "(two flushes instead of one)", self.path)
            return False
        state = self._journal_state()
        applied = 0 if state is None else state[1]
        generation = jr.new_generation()
        with self.env.begin(write=True) as txn:
            txn.put(b"journal", _JOURNAL_META.pack(generation, applied), db=self._dbs["meta"])
        self._renew_read_txn()
        self._journal = jr.Journal(path, generation, applied + 1)
        self._journaled_gen = generation
        if self.room_bytes is not None:
            st = os.fstatvfs(self._data_fd)
            self._reserve_min_bytes = max(RESERVE_MIN_BYTES, min(
                JOURNAL_RESERVE_MIN_BYTES, st.f_blocks * st.f_frsize // JOURNAL_RESERVE_DISK_FRACTION))
            self.room_bytes = self._refill_reserve()
        return True

    def _load_counters(self) -> None:
        for name in ID_COUNTERS + STAT_COUNTERS + FILE_COUNTERS:
            self.counters[name] = read_counter(self, name)
        # What the durable index (or the last sealed batch) holds: a batch
        # carries only the counters that changed since.
        self._counters_sealed = dict(self.counters)

    def _load_redo(self) -> None:
        """Learn the `logredo` records kept (a crash left them, or the mount
        replays and clears them): they are persisted and dropped like new ones."""
        self._redo.clear()
        self._redo_bytes = 0
        for no, off, length, _, _ in scan_log_redo(self, lambda why: None):
            self._redo.setdefault(no, []).append((off, length))
            self._redo_bytes += length
            self._redo_next = max(self._redo_next, no + 1)
        self._redo_since = time.monotonic()

    def allocate_id(self, name: bytes) -> int:
        """Next value of a never-reused counter (next_ino, next_chunk, next_cookie)."""
        value = self.counters[name]
        self.counters[name] = value + 1
        # Written with the next batch, not now: an id is only durable where a
        # durable record names it, and a counter alone must not cost a commit.
        return value

    def reserve_id(self, name: bytes) -> int:
        """Like allocate_id, but the open batch carries the counter: once the
        caller has waited for that batch, the id can never be handed out again,
        even after a crash (snapshot heads need that; see docs/STORE.md)."""
        value = self.allocate_id(name)
        self._put("meta", name, _LOGLOC.pack(self.counters[name]))
        return value

    def read_view(self) -> "ReadView":
        """A read-only view of the durable state (no pending batch), for a worker
        thread: one LMDB read transaction, consistent until closed."""
        txn = self.env.begin()
        journaled: dict[str, BatchLayer] = {}
        if self._journaled:
            # Between a checkpoint's LMDB transaction (on the committer's
            # worker) and its trio side dropping the layer, LMDB holds the
            # layer and the checkpoint's own batch: the layer over it would
            # put older values over that batch's.
            raw = txn.get(b"journal", db=self._dbs["meta"])
            if raw is not None and _JOURNAL_META.unpack(raw)[0] == self._journaled_gen:
                for db in list(self._jpend):
                    self._fold(db)          # a view reads one sorted layer a table
                for table in self._journaled.values():
                    table._sorted()         # here: the view's thread never sorts it
                self._journaled_shared.update(self._journaled)
                journaled = dict(self._journaled)
        return ReadView(txn, self._dbs, journaled)

    def adjust_counter(self, name: bytes, delta: int) -> None:
        """Add delta to a chunk-table total; it commits with the open batch."""
        self.counters[name] += delta
        self._note_change()

    def set_clean(self, clean: bool) -> None:
        self._put("meta", b"clean", b"1" if clean else b"0")

    def was_clean(self) -> bool:
        return self._get("meta", b"clean") != b"0"

    def write_direct(self, fn: Callable[["DirectTxn"], None]) -> None:
        """Run fn in one durable write transaction now. May block.

        Only for start-up work (adoption, recovery) before the committer runs.
        """
        assert self._committing is None and self._open.is_empty() and not self._journaled
        self.direct_writes += 1
        with self.env.begin(write=True) as txn:
            fn(DirectTxn(txn, self._dbs))
        self._renew_read_txn()
        self._load_counters()
        self._load_redo()

    # ----------------------------------------------------------------- reads

    def _get(self, db: str, key: bytes) -> Optional[bytes]:
        for batch in (self._open, self._committing):
            if batch is not None:
                layer = batch.ops.get(db)
                if layer is not None and key in layer:
                    return layer[key]
        pend = self._jpend.get(db)
        if pend is not None and key in pend:
            return pend[key]
        layer = self._journaled.get(db)
        if layer is not None and key in layer:
            return layer[key]
        return self._rtxn.get(key, db=self._dbs[db])

    def _layers(self, db: str) -> list:
        """The pending and journaled layers of db over LMDB, newest first,
        sorted on demand (`BatchLayer`)."""
        pend = self._jpend.get(db)
        table = self._journaled.get(db)
        if (pend is not None and len(pend) >= JOURNALED_PEND_MIN_FOLD
                and len(pend) * JOURNALED_PEND_FRACTION >= (len(table) if table else 0)):
            self._fold(db)
            pend, table = None, self._journaled.get(db)
        layers = [layer for batch in (self._open, self._committing) if batch is not None
                  for layer in (batch.ops.get(db),) if layer]
        for layer in (pend, table):
            if layer:
                layers.append(layer)
        return layers

    def _lookup_layers(self, db: str) -> list[dict]:
        """The layers of db over LMDB, newest first, for look-ups by key only
        (`in`, `[]`): nothing is sorted for them."""
        layers: list[dict] = [layer for batch in (self._open, self._committing)
                              if batch is not None for layer in (batch.ops.get(db),) if layer]
        for layer in (self._jpend.get(db), self._journaled.get(db)):
            if layer:
                layers.append(layer)
        return layers

    def _items(self, db: str, lo: bytes, hi: bytes, reverse: bool = False
              ) -> Iterator[tuple[bytes, bytes]]:
        """Committed-or-pending items with lo <= key < hi, in key order.

        Consume it without awaiting in between: the view is only consistent
        within one synchronous stretch of the trio thread.
        """
        # Lazy k-way merge, newest layer first: a caller that stops after one
        # item (a floor lookup) pays for one item, not for the whole batch.
        layers = self._layers(db)
        if len(layers) == 1:
            yield from _merge_over(layers[0], lo, hi, self._lmdb_items(db, lo, hi, reverse),
                                   reverse)
            return
        sources: list[Iterator[tuple[bytes, Optional[bytes]]]] = [
            _layer_items(layer, lo, hi, reverse) for layer in layers]
        sources.append(self._lmdb_items(db, lo, hi, reverse))
        yield from _merge_layers(sources, reverse)

    def _floor_below(self, db: str, lo: bytes, below: bytes) -> Optional[tuple[bytes, bytes]]:
        """The committed-or-pending item with the greatest key in [lo, below),
        if any: what `_items(db, lo, below, reverse=True)` yields first, found
        by bisection in each layer and one cursor, with no merge of iterators.
        Same consistency rule as `_items`."""
        return self.floor_finder(db, lo)(below)

    def floor_finder(self, db: str, lo: bytes
                     ) -> Callable[[bytes], Optional[tuple[bytes, bytes]]]:
        """`_floor_below(db, lo, below)` for many `below`s: the layers and the
        cursor taken once, not per look-up (a commit's punches look up two
        extents per rewrite). Use it before the next await and before the
        next change to db: it reads the layers as they were when made."""
        layers = self._layers(db)
        cur = self._rtxn.cursor(self._dbs[db])

        def floor(below: bytes) -> Optional[tuple[bytes, bytes]]:
            while True:
                # Each source's greatest key below `below` (a layer's may be a
                # pending deletion); the greatest of them, newest source first on a tie.
                if cur.set_range(below):
                    ok = cur.prev()
                else:
                    ok = cur.last()
                key = cur.key() if ok else None
                if key is not None and key < lo:
                    key = None
                for layer in layers:
                    i = layer.bisect_left(below)
                    if i:
                        k = layer.peekitem(i - 1)[0]
                        if k >= lo and (key is None or k > key):
                            key = k
                if key is None:
                    return None
                for layer in layers:
                    if key in layer:
                        value = layer[key]
                        break
                else:
                    value = cur.value()      # only the cursor has it, and it is there
                if value is not None:
                    return key, value
                below = key                  # deleted in a pending batch: look further down
        return floor

    def _lmdb_items(self, db: str, lo: bytes, hi: bytes, reverse: bool
                    ) -> Iterator[tuple[bytes, bytes]]:
        cur = self._rtxn.cursor(self._dbs[db])
        if not reverse:
            yield from _cursor_range(cur, lo, hi)
        else:
            if cur.set_range(hi):
                ok = cur.prev()
            else:
                ok = cur.last()
            while ok:
                k = cur.key()
                if k < lo:
                    return
                yield k, cur.value()
                ok = cur.prev()

    # ---------------------------------------------------------------- writes

    def _put(self, db: str, key: bytes, value: bytes) -> None:
        if self.fenced is not None:
            raise ReadOnly(self.fenced)
        self._layer(db)[key] = value
        if db in _WATCHED_DBS:
            self._map_changed(db, key)
        elif db == "chunkids":
            self.chunk_ids_put += 1
        elif db == "dirents":
            self._entry_changed(key)

    def _put_many(self, db: str, items: list[tuple[bytes, Optional[bytes]]],
                  numbers: Optional[Collection[int]] = None) -> None:
        """`_put` (or `_delete`: value None) of many keys at once, in order (a
        later item of a key wins): one update of the open batch's layer instead
        of a call per key (a big file's commit puts four records per chunk, 16
        chunks per MiB; a commit's punches delete and split extents).
        numbers: the distinct numbers the keys of a watched table begin with,
        when the caller has them (a file's extents: its inode number), so
        they are not read back out of every key."""
        if self.fenced is not None:
            raise ReadOnly(self.fenced)
        if not items:
            return
        self._layer(db).update(items)
        if db in _WATCHED_DBS:
            # Watchers drop what they cached of a number: once per number will do.
            if numbers is None:
                numbers = dict.fromkeys(_U64.unpack_from(key)[0] for key, _ in items)
            if db == "chunks":
                # A big file's commit: ~16 new chunk numbers per MiB, one call
                # per watcher (a call per number and watcher took ~1 us a chunk).
                for chunks_changed in self._chunk_watchers:
                    chunks_changed(numbers)
                return
            for number in numbers:
                self._numbers_changed(db, number)
        elif db == "chunkids":
            self.chunk_ids_put += len(items)
        elif db == "dirents":
            for key, _ in items:
                self._entry_changed(key)

    def _delete(self, db: str, key: bytes) -> None:
        if self.fenced is not None:
            raise ReadOnly(self.fenced)
        self._layer(db)[key] = None
        if db in _WATCHED_DBS:
            self._map_changed(db, key)
        elif db == "dirents":
            self._entry_changed(key)

    def watch_maps(self, extents_changed: Callable[[int], None],
                   chunks_changed: Optional[Callable[[Collection[int]], None]] = None
                   ) -> None:
        """Be told of every change to a file's extent map or inode record
        (its inode number: extents_changed) and, given chunks_changed, to
        chunk records (their numbers, distinct, a collection per change
        that may hold many), as each is made, on the trio
        thread: caches of them (chunkread.py's read windows) drop what
        changed. Every write of the live index passes `_put`/`_delete`/
        `_put_many`, so no change escapes them."""
        self._extent_watchers.append(extents_changed)
        if chunks_changed is not None:
            self._chunk_watchers.append(chunks_changed)

    def watch_entries(self, entries_changed: Callable[[int], None]) -> None:
        """Be told of every directory entry added, retargeted or removed (its
        directory's inode number), as each is made, on the trio thread: the
        tiering planner's catalog of versions re-reads that directory."""
        self._entry_watchers.append(entries_changed)

    def _entry_changed(self, key: bytes) -> None:
        if self._entry_watchers:
            parent = _U64.unpack_from(key)[0]
            for entries_changed in self._entry_watchers:
                entries_changed(parent)

    def _map_changed(self, db: str, key: bytes) -> None:
        # inodes: ino; extents: (ino, off); chunks: chunk_no
        self._numbers_changed(db, _U64.unpack_from(key)[0])

    def _numbers_changed(self, db: str, number: int) -> None:
        if db == "chunks":
            for chunks_changed in self._chunk_watchers:
                chunks_changed((number,))
            return
        for extents_changed in self._extent_watchers:
            extents_changed(number)

    def check_writable(self) -> None:
        """ReadOnly once an index failure or a fence made the filesystem read-only."""
        if self.failure is not None:
            raise ReadOnly(f"index failed earlier ({self.failure}); filesystem is read-only")
        if self.fenced is not None:
            raise ReadOnly(self.fenced)

    def fence(self, reason: str) -> None:
        """No change is accepted from now on (the volume went to another node:
        publish.py); what is already in a batch still commits."""
        self.fenced = reason

    def _layer(self, db: str) -> BatchLayer:
        if self.failure is not None:
            raise ReadOnly(f"index failed earlier ({self.failure}); filesystem is read-only")
        layer = self._open.ops.get(db)
        if layer is None:
            layer = self._open.ops[db] = (self._spare_layers.pop() if self._spare_layers
                                          else BatchLayer())
            self._note_change()
        return layer

    def _recycle_layers(self, batch: Batch) -> None:
        """Keep a durable batch's layers, emptied, for the next batches: a new
        SortedDict costs several times an emptied one's reuse, and a commit
        opens one per table it touches. Nothing reads a batch's layers once it
        is durable and no longer `_committing` (readers of the layers, as of
        the read transaction renewed with it, finish before the next await)."""
        for layer in batch.ops.values():
            if len(self._spare_layers) < SPARE_LAYERS:
                layer.clear()
                self._spare_layers.append(layer)
        batch.ops = {}

    def _note_change(self) -> None:
        if self._open.opened_at is None:
            self._open.opened_at = time.monotonic()
        self._work.set()

    def persist_chunks_before_commit(self, chunks: list[tuple[int, int, int]]) -> None:
        """`persist_before_commit` of many new chunks, (log offset, length,
        chunk no) each: a big file's commit, in two list extends."""
        self._open.persist_ranges += [(log_off, length) for log_off, length, _ in chunks]
        self._open.log_chunks += chunks

    def persist_before_commit(self, log_off: int, length: int, chunk_no: int = 0) -> None:
        """The open batch references these log bytes (chunk_no's, if given): make
        them durable before it or with it (small batches: `logredo`)."""
        self._open.persist_ranges.append((log_off, length))
        if chunk_no:
            self._open.log_chunks.append((log_off, length, chunk_no))

    def after_durable(self, fn: Callable[[], None]) -> None:
        """Run fn on the trio thread once the open batch is durable."""
        self._open.after_durable.append(fn)
        self._note_change()

    # ---------------------------------------------------------------- commit

    def current_seq(self) -> int:
        """The batch a caller's changes so far are in (0 = nothing pending)."""
        return self._open.seq if not self._open.is_empty() else self._open.seq - 1

    def pending_age_s(self) -> float:
        """How long the oldest not-yet-durable change has waited."""
        oldest = self._committing or (None if self._open.is_empty() else self._open)
        if oldest is None or oldest.opened_at is None:
            return 0.0
        return time.monotonic() - oldest.opened_at

    async def wait_durable(self, seq: int) -> None:
        if seq > self._wanted_seq and self.durable_seq < seq:
            self._wanted_seq = seq
            self._urgent.set()
        while self.durable_seq < seq:
            if self.failure is not None:
                raise IndexFailure(f"commit failed: {self.failure}")
            if self.stalled is not None:
                # Kept, and committed once there is room: not durable now.
                raise IndexFull(f"{self._full_message()}; the changes wait for room")
            await self._durable_changed.wait()
        if self.failure is not None and self.durable_seq < seq:
            raise IndexFailure(f"commit failed: {self.failure}")

    async def run_committer(self, persist: Callable[[list[tuple[int, int]]], None],
                            limiter: trio.CapacityLimiter, idle_delay_s: float = 0.0,
                            read_log: Optional[Callable[[int, int], bytes]] = None) -> None:
        """Commit batches one after another until stop() and nothing is left.

        While one batch is being written, new changes gather in the next: that
        is the group commit. A batch nobody waits for yet may gather changes
        for up to idle_delay_s before it is written, so that a create and the
        close that follows it cost one durable commit, not two.

        read_log(off, length) returns log bytes as written (may block): given,
        a batch with few new log bytes carries them in its transaction
        (`logredo`) instead of persisting the log first, and the log is
        persisted later, before the records go (see the schema).

        An unexpected exception (a bug anywhere in the loop, a callback's
        included) makes the filesystem read-only like a failed commit
        (docs/CONSISTENCY.md): every waiter gets IndexFailure (EIO) instead of
        waiting for a committer that is gone, reads go on, and the unmount
        completes; the next mount recovers every durable commit.
        """
        self._read_log = read_log
        try:
            await self._commit_batches(persist, limiter, idle_delay_s)
        except Exception as e:  # noqa: BLE001 - never leave writers waiting on a dead committer
            batch = self._committing or self._open
            log.exception("the index committer failed unexpectedly at batch %d (last durable "
                          "%d): %r; filesystem is now read-only (reads go on; a remount "
                          "recovers every durable commit)", batch.seq, self.durable_seq, e)
            if self.failure is None:
                self.failure = e
            self._durable_changed.set()
            self._durable_changed = trio.Event()

    async def _commit_batches(self, persist: Callable[[list[tuple[int, int]]], None],
                              limiter: trio.CapacityLimiter, idle_delay_s: float) -> None:
        if self._committing is not None and self.failure is None:
            # A committer cancelled after it sealed a batch and before that batch
            # was durable left it here. Its changes are visible (the overlay) and
            # the id and file counters the next batch carries already include
            # them: it commits first and whole, or the next batch would make
            # totals durable without the records they count.
            if not await self._commit_sealed(self._committing, persist, limiter):
                return
        while True:
            if self._open.is_empty() and not self._open.checkpoint \
                    and not (self._stopping and self._redo):
                if self._stopping:
                    if not self._journaled:
                        return
                    self._open.checkpoint = True      # the journaled batches into LMDB
                    self._open.checkpoint_why = "stop"
                    continue
                if self._journaled and not self.full:
                    # Idle a while: the journaled batches into LMDB, off the
                    # writers' path (and the next mount replays nothing).
                    with trio.move_on_after(JOURNAL_IDLE_CHECKPOINT_S):
                        await self._work.wait()
                    if not self._work.is_set():
                        self._open.checkpoint = True
                        self._open.checkpoint_why = "idle"
                        continue
                elif self.full and self.room_bytes is not None:
                    # Nothing to commit and growth refused: look for room coming back.
                    with trio.move_on_after(ROOM_POLL_S):
                        await self._work.wait()
                    if not self._work.is_set():
                        self.room_bytes = await trio.to_thread.run_sync(
                            self._refill_reserve, limiter=limiter)
                        self._note_room()
                        continue
                else:
                    await self._work.wait()
                self._work = trio.Event()
                continue
            if not self._stopping and not self._open.checkpoint \
                    and self._wanted_seq < self._open.seq and idle_delay_s > 0:
                remaining = idle_delay_s - (time.monotonic() - self._open.opened_at)
                if remaining > 0:
                    with trio.move_on_after(remaining):
                        await self._urgent.wait()
                    self._urgent = trio.Event()
                    continue
            # Only the counters that changed: batches commit in the order they
            # are sealed, each before the next is sealed, so the others' values
            # are durable already (an unchanged one read back is the same).
            sealed = self._counters_sealed
            for name, value in self.counters.items():
                if sealed.get(name) != value:
                    self._layer("meta")[name] = _LOGLOC.pack(value)
                    sealed[name] = value
            self._plan_log_bytes(self._open)
            batch, self._open = self._open, Batch(seq=self._open.seq + 1)
            self._committing = batch
            if not await self._commit_sealed(batch, persist, limiter):
                return

    async def _commit_sealed(self, batch: Batch,
                             persist: Callable[[list[tuple[int, int]]], None],
                             limiter: trio.CapacityLimiter) -> bool:
        """Make the sealed batch (`_committing`) durable and tell its waiters.
        False when the commit failed (the filesystem is read-only now).

        Cancelled before its transaction committed, the batch stays in
        `_committing`, and the next run_committer commits it before any newer
        one: batches become durable in the order they were sealed, none skipped.
        """
        started = time.monotonic()
        try:
            await self._commit_until_room(batch, persist, limiter)
        except BaseException as e:  # noqa: BLE001 - any failure makes us read-only
            if isinstance(e, trio.Cancelled):
                raise
            log.error("index commit of batch %d failed: %s; filesystem is now read-only",
                      batch.seq, e)
            self.failure = e
            self._durable_changed.set()
            self._durable_changed = trio.Event()
            return False
        if failing_at("commit-durable"):
            raise RuntimeError(f"failure injected after batch {batch.seq} became durable "
                               "(CKPTFS_DEBUG_FAIL)")
        self._renew_read_txn()
        if batch.journaled:
            self._merge_journaled(batch)
        elif batch.checkpointed:
            # LMDB holds every journaled batch now (the read transaction just
            # renewed sees them): the layer goes, with the growth it promised.
            self._journaled = {}
            self._journaled_shared.clear()
            self._jpend = {}
            self._journaled_entries = 0
            self._journaled_gen = batch.checkpoint_generation
            self._promised_total -= self._journaled_promised
            self._journaled_promised = 0
            self._ckpt_keys = {}
            self._ckpt_growth_bytes = self._ckpt_per_key_bytes = self._ckpt_need_bytes = 0
            self._ckpt_overflow_bytes = 0
            self._ckpt_lmdb_pages = None
        self._committing = None
        self._recycle_layers(batch)
        self.durable_seq = batch.seq
        self.stalled = None
        elapsed = time.monotonic() - started
        self.commits += 1
        self.commit_seconds_total += elapsed
        if self.on_commit is not None:
            self.on_commit(elapsed)
        for fn in self.on_durable if batch.ops or not batch.checkpoint else ():
            fn(batch.seq, batch.opened_at if batch.opened_at is not None else started)
        for fn in batch.after_durable:
            fn()
        self._durable_changed.set()
        self._durable_changed = trio.Event()
        # The room the batch left: measured by its worker when no upkeep was
        # due, else once its waiters are told (off their fsync's path) and
        # before the next transaction (the reserve's upkeep writes past the
        # last page: only between transactions). Until then its growth stays
        # promised: the room counted is less than there is.
        if batch.room_after is not None and self.room_bytes is not None:
            self.room_bytes = batch.room_after
        else:
            await self._measure_room(limiter)
        if batch.journaled:
            # Its growth reaches LMDB with the checkpoint: promised until then,
            # its `logredo` record too (what `_plan_log_bytes` counts against
            # the room), so that the checkpoint, and a replay on a full disk,
            # find room for it in the reserve.
            more = max(batch.journal_promise - batch.promised_bytes, 0)
            self._promised_total += more
            self._journaled_promised += batch.promised_bytes + more
        else:
            self._promised_total -= batch.promised_bytes
        self._note_room()
        return True

    def _merge_journaled(self, batch: Batch) -> None:
        """A journaled batch's changes into the journaled read layer (trio
        thread, before it stops being `_committing`): into the pending changes
        of each table, unsorted (`_fold` sorts them in when the table is read
        in key order). A rewrite cycle's batch puts ~130 keys in five tables;
        a SortedDict insert each was ~10 % of the trio thread's time."""
        pending = self._jpend
        for db, layer in batch.ops.items():
            pend = pending.get(db)
            if pend is None:
                pend = pending[db] = BatchLayer()
                if db not in self._journaled:
                    # Never empty while it holds changes: the checkpoints
                    # and `read_view` ask whether `_journaled` is.
                    self._journaled[db] = BatchLayer()
            pend.update(dict.items(layer))
        for db, key, value in batch.extra_ops:
            pend = pending.get(db)
            if pend is None:
                pend = pending[db] = BatchLayer()
                if db not in self._journaled:
                    self._journaled[db] = BatchLayer()
            pend[key] = value
        self._count_journaled()

    def _count_journaled(self) -> None:
        self._journaled_entries = (sum(map(len, self._journaled.values()))
                                   + sum(map(len, self._jpend.values())))

    def _fold(self, db: str) -> None:
        """db's journaled changes sorted into its table (trio thread). A
        table a ReadView or a checkpoint's worker holds is copied first: they
        never see a table change."""
        pend = self._jpend.pop(db, None)
        if not pend:
            return
        table = self._journaled_table(db)
        table._sorted()             # so the update merges the new keys in
        table.update(pend)
        self._count_journaled()

    def _journaled_snapshot(self) -> list[tuple[str, dict]]:
        """The journaled layer for a worker thread: each table, then the
        changes newer than it (a checkpoint writes them in that order). The
        tables are marked shared (a fold meanwhile copies one first); a fold
        only drops its pending dict, never changes it."""
        self._journaled_shared.update(self._journaled)
        return list(self._journaled.items()) + list(self._jpend.items())

    def _journaled_table(self, db: str) -> BatchLayer:
        table = self._journaled.get(db)
        if table is None:
            table = self._journaled[db] = BatchLayer()
        elif db in self._journaled_shared:
            table = self._journaled[db] = table.copy()
            self._journaled_shared.discard(db)
        return table

    async def _measure_room(self, limiter: trio.CapacityLimiter) -> None:
        """`_refill_reserve` on a worker thread after a commit (no reserve: nothing)."""
        if self.room_bytes is None:
            return
        with trio.CancelScope(shield=True):     # short, and the accounting needs it
            try:
                self.room_bytes = await trio.to_thread.run_sync(self._refill_reserve,
                                                                limiter=limiter)
            except OSError as e:
                log.warning("could not measure the index's room: %s", e)

    async def _commit_until_room(self, batch: Batch,
                                 persist: Callable[[list[tuple[int, int]]], None],
                                 limiter: trio.CapacityLimiter) -> None:
        """Commit batch, retrying while its disk has no room.

        Retrying is safe: LMDB aborted the failed transaction, so the durable
        index is still the one before this batch, and nothing newer commits
        first. Raises what cannot be retried, and IndexFull when unmounting
        after UNMOUNT_RETRY_S without room.
        """
        delay = 0.05
        give_up_at = None
        while True:
            try:
                if await self._append_small(batch):
                    return None
                # It may checkpoint: the worker writes what the layer is now.
                batch.journaled_layers = self._journaled_snapshot()
                return await trio.to_thread.run_sync(self._write_batch, batch, persist,
                                                     limiter=limiter)
            except IndexFull as e:
                if self.stalled is None:
                    log.warning("index commit of batch %d found no room (%s): it is kept and "
                                "retried; meanwhile fsync and close get ENOSPC", batch.seq, e)
                self.stalled = e
                self._note_full()
                self._durable_changed.set()        # waiters learn it now
                self._durable_changed = trio.Event()
                if self._stopping:
                    give_up_at = give_up_at or time.monotonic() + UNMOUNT_RETRY_S
                    if time.monotonic() > give_up_at:
                        raise
            await trio.sleep(delay)
            delay = min(delay * 2, STALL_RETRY_MAX_S)
            if self.room_bytes is not None:
                self.room_bytes = await trio.to_thread.run_sync(self._refill_reserve,
                                                                limiter=limiter)

    def _plan_log_bytes(self, batch: Batch) -> None:
        """Decide, as the batch is sealed, whether it carries its new log bytes
        (`logredo`) and whether it persists the log of the records kept."""
        total = sum(length for _, length, _ in batch.log_chunks)
        if self._redo:
            waiting = self._redo_bytes + total
            batch.flush_redo = (self._stopping or waiting > REDO_PENDING_MAX_BYTES
                                or time.monotonic() - self._redo_since > REDO_MAX_AGE_S)
        room_ok = True
        if self.room_bytes is not None:
            need = 2 * total + GROWTH_PER_FILE_COMMIT_BYTES
            room_ok = self._room_left() >= need
            if not room_ok and self._journaled_promised \
                    and self._room_left() + self._journaled_promised >= need:
                # The journaled batches' growth (their `logredo` records
                # above all) holds the room: they go into LMDB with this batch
                # (a checkpoint), and the reserve is measured again after it.
                batch.checkpoint = True
                batch.checkpoint_why = "room"
                room_ok = True
        # A batch that persists the log anyway persists its own bytes with it.
        batch.journal_log = (self._read_log is not None and not batch.flush_redo
                             and 0 < total <= REDO_BATCH_MAX_BYTES
                             and len(batch.log_chunks) == len(batch.persist_ranges)
                             and room_ok)
        if self._journal is not None and self.room_bytes is not None and not batch.checkpoint:
            # What its checkpoint may take of the reserve at most (more than
            # it took so far: `_checkpoint_need`) and its `logredo` record.
            # Journaled only while the reserve holds it, so that a checkpoint,
            # or the replay after a crash, finds room in the reserve even
            # when the disk is full.
            keys, per_key, need = self._checkpoint_need(batch)
            overflow = self._overflow_bytes(batch, total if batch.journal_log else 0)
            promise = need - self._ckpt_need_bytes + overflow
            # Its overflow values must fit past LMDB's last page with every
            # journaled batch's, even the first's: else it goes into LMDB now,
            # where no room means IndexFull (nothing promised), not a journaled
            # commit that cannot be replayed on the full disk.
            if (self._journaled_promised and self._room_left() < promise) or (
                    overflow and self._ckpt_overflow_bytes + overflow
                    > self._past_end_bytes - self.reserve_target_bytes // 4):
                batch.checkpoint = True
                batch.checkpoint_why = "reserve"
            else:
                batch.journal_promise = promise
                self._ckpt_keys = keys
                self._ckpt_growth_bytes += batch.promised_bytes
                self._ckpt_per_key_bytes = per_key
                self._ckpt_need_bytes = need
                self._ckpt_overflow_bytes += overflow

    @staticmethod
    def _overflow_bytes(batch: Batch, redo_bytes: int) -> int:
        """What the batch's values bound for LMDB's overflow pages take there,
        pages rounded up: its values longer than LMDB_OVERFLOW_MIN_BYTES and
        its `logredo` record (redo_bytes of log, 0: none). Trio thread; one
        length per value.

        Overflow pages are a run of contiguous pages: a checkpoint (or the
        replay after a crash) on a nearly full disk finds them past LMDB's
        last page, not among the pages freed inside the file, which are
        scattered (a full ext4 replay failed with 1,348 pages free inside and
        62 past the end). A page per key would not cover them either."""
        page = JOURNAL_PAGE_BYTES
        nbytes = 0
        for layer in batch.ops.values():
            for value in dict.values(layer):
                if value is not None and len(value) > LMDB_OVERFLOW_MIN_BYTES:
                    nbytes += (len(value) + 16 + page - 1) // page * page
        if redo_bytes:
            nbytes += (redo_bytes + page + page - 1) // page * page    # its header too
        return nbytes

    def _checkpoint_need(self, batch: Batch) -> tuple[dict[str, int], int, int]:
        """What the checkpoint of the journaled batches and this one may take
        of the reserve, its `logredo` records aside: (keys per table, the
        page-per-key estimate, the need). Trio thread.

        The checkpoint writes every journaled batch in one transaction, so
        pages freed between them are not reused. Two bounds, the smaller
        counts: a page per key and two per table (each key's leaf page
        copied, or split); or, once the batches hold more keys than their
        tables have pages, every page of those tables copied once (a
        transaction copies a page once, then writes the copy), what LMDB
        keeps beside them (the main database, the free list, which records
        the pages freed) and the growth the batches were admitted with
        (`admit`: the new records and the pages they split)."""
        keys = dict(self._ckpt_keys)
        for db, layer in batch.ops.items():
            keys[db] = keys.get(db, 0) + len(layer)
        # Its `logredo` keys (`_write_batch`): its record, the records it drops.
        redo_keys = int(batch.journal_log) + (len(self._redo) if batch.flush_redo else 0)
        if redo_keys:
            keys["logredo"] = keys.get("logredo", 0) + redo_keys
        per_key = self._ckpt_per_key_bytes + JOURNAL_PAGE_BYTES * (
            batch.op_count() + redo_keys + 2 * len(batch.ops))
        if self._ckpt_lmdb_pages is None:
            self._ckpt_lmdb_pages = self._lmdb_pages()
        table_pages, other_pages = self._ckpt_lmdb_pages
        copied = sum(min(n + 2, table_pages.get(db, 0) + 2) for db, n in keys.items())
        capped = (JOURNAL_PAGE_BYTES * (copied + other_pages + 2 + copied // 512)
                  + self._ckpt_growth_bytes + batch.promised_bytes)
        return keys, per_key, min(per_key, capped)

    def _lmdb_pages(self) -> tuple[dict[str, int], int]:
        """LMDB's branch and leaf pages per table, and what a transaction may
        write beside the tables: the main database's pages, the two meta
        pages, and the free list's (its record of the pages free now and of
        those the transaction frees: 8 bytes a page). A few stat calls."""
        tables: dict[str, int] = {}
        in_tables = 0
        with self.env.begin() as txn:
            for name, db in self._dbs.items():
                st = txn.stat(db)
                tables[name] = st["branch_pages"] + st["leaf_pages"]
                in_tables += tables[name] + st["overflow_pages"]
        main = self.env.stat()
        main_pages = main["branch_pages"] + main["leaf_pages"] + main["overflow_pages"]
        free = max(self.env.info()["last_pgno"] + 1 - 2 - main_pages - in_tables, 0)
        return tables, main_pages + 2 + free // 512 + 1

    def _redo_record(self, log_chunks: list[tuple[int, int, int]]) -> bytes:
        """The `logredo` value of these chunks, their bytes read from the log."""
        # In log order: chunks next to each other in the log (a commit's
        # small rewrites are) are read in one read, their bytes following
        # each other in the record as its entries do.
        log_chunks = sorted(log_chunks)
        parts = [_REDO_COUNT.pack(len(log_chunks))]
        parts += [_REDO_ENTRY.pack(off, length, no) for off, length, no in log_chunks]
        k = 0
        while k < len(log_chunks):
            off, length, _ = log_chunks[k]
            end = off + length
            k += 1
            while k < len(log_chunks) and log_chunks[k][0] == end:
                end += log_chunks[k][1]
                k += 1
            data = self._read_log(off, end - off)
            if len(data) != end - off:
                raise DamagedData(f"log ends before offset {end}")
            parts.append(data)
        return b"".join(parts)

    def stop(self) -> None:
        """Let run_committer return once everything pending is durable."""
        self._stopping = True
        self._work.set()
        self._urgent.set()

    def _write_batch(self, batch: Batch, persist: Callable[[list[tuple[int, int]]], None]
                     ) -> None:
        """Worker thread: persist log data, then one durable LMDB transaction.

        Raises IndexFull when the index's disk had no room (the transaction
        was aborted: it may be retried), anything else when it may not.
        """
        ranges: list[tuple[int, int]] = []
        if batch.persist_ranges and not batch.persisted:
            if batch.journal_log:
                batch.redo = self._redo_record(batch.log_chunks)
            else:
                ranges += batch.persist_ranges
        flushing = None
        if batch.flush_redo and batch.redo_flushed is None:
            # Every record kept: its log bytes durable first (in the same
            # persist as the batch's own), then it goes in this transaction.
            flushing = list(self._redo)
            ranges += [r for no in flushing for r in self._redo[no]]
        if ranges:
            persist(ranges)
        batch.persisted = True
        if flushing is not None:
            batch.redo_flushed = flushing
        journal = self._journal
        if not batch.ops and batch.redo is None and not batch.redo_flushed \
                and not (batch.checkpoint and self._journaled):
            return
        redo_no = self._redo_next
        extra: list[tuple[str, bytes, Optional[bytes]]] = [
            ("logredo", u64(no), None) for no in batch.redo_flushed or ()]
        if batch.redo is not None:
            extra.append(("logredo", u64(redo_no), batch.redo))
        record = None
        if journal is not None and not batch.checkpoint and not self._stopping:
            if self._journaled_entries + batch.op_count() + len(extra) > JOURNAL_MAX_ENTRIES:
                batch.checkpoint_why = "keys"
            else:
                record = _journal_record(journal, batch, extra)
                if record is None:      # the journal is full: this batch checkpoints
                    batch.checkpoint_why = "journal full"
        if record is not None:
            with _journal_room():
                journal.append(record)
            self._note_journaled(batch, extra, record)
        else:
            self._lmdb_commit(batch, extra, journal)
        self._after_write(batch, redo_no)

    async def _append_small(self, batch: Batch) -> bool:
        """Trio thread: make a small journaled batch durable without a worker
        thread, as `_write_batch` would (the same record, the same state
        after): its `logredo` bytes read and its record encoded here (byte
        work of at most JOURNAL_INLINE_LOG_BYTES and JOURNAL_INLINE_KEYS),
        the record written and flushed by the journal's C thread. False, with
        nothing done but the `logredo` bytes read, for any other batch: one
        that persists log ranges, checkpoints, or does not fit the journal
        (`_write_batch` takes it).

        A small file's durable close waited for two hand-overs of the GIL to
        and from the worker thread (strace at load 5: ~0.4 ms from the
        worker's wake to its first byte); an eventfd the trio thread polls
        anyway needs none."""
        journal = self._journal
        if journal is None or batch.checkpoint or self._stopping or batch.flush_redo \
                or batch.redo_flushed or not batch.ops \
                or (batch.persist_ranges and not batch.persisted and not batch.journal_log) \
                or sum(length for _, length, _ in batch.log_chunks) > JOURNAL_INLINE_LOG_BYTES \
                or batch.op_count() > JOURNAL_INLINE_KEYS:
            return False
        if batch.persist_ranges and not batch.persisted:
            batch.redo = self._redo_record(batch.log_chunks)     # journal_log: it carries them
        batch.persisted = True
        redo_no = self._redo_next
        extra: list[tuple[str, bytes, Optional[bytes]]] = []
        if batch.redo is not None:
            extra.append(("logredo", u64(redo_no), batch.redo))
        if self._journaled_entries + batch.op_count() + len(extra) > JOURNAL_MAX_ENTRIES:
            return False
        record = _journal_record(journal, batch, extra)
        if record is None:
            return False
        if self._journal_writer is None:
            self._journal_writer = jr.DurableWriter()
        with _journal_room():
            await journal.append_by(self._journal_writer, record)
        self._note_journaled(batch, extra, record)
        self._after_write(batch, redo_no)
        return True

    def _note_journaled(self, batch: Batch, extra: list[tuple[str, bytes, Optional[bytes]]],
                        record: bytes) -> None:
        """batch's record is durable in the journal (either writer's path)."""
        batch.journaled = True
        batch.extra_ops = extra
        self.journal_records_total += 1
        self.journal_bytes_total += len(record)

    def _after_write(self, batch: Batch, redo_no: int) -> None:
        """The batch is durable (journaled, or in LMDB): its `logredo` records'
        and the room's bookkeeping, on the thread that wrote it (the worker;
        the trio thread for `_append_small`, whose batch is journaled: nothing
        here blocks then)."""
        for no in batch.redo_flushed or ():
            self._redo_bytes -= sum(length for _, length in self._redo.pop(no))
        if batch.redo is not None:
            if not self._redo:
                self._redo_since = time.monotonic()
            self._redo[redo_no] = [(off, length) for off, length, _ in batch.log_chunks]
            self._redo_bytes += sum(length for _, length, _ in batch.log_chunks)
            self._redo_next = redo_no + 1
        if batch.journaled:
            batch.room_after = self.room_bytes     # LMDB did not change
        elif self.room_bytes is not None:
            try:
                batch.room_after = self._room_without_upkeep()
            except (OSError, lmdb.Error):
                batch.room_after = None     # `_measure_room` tries again, and says why

    def _lmdb_commit(self, batch: Batch, extra: list[tuple[str, bytes, Optional[bytes]]],
                     journal: Optional[jr.Journal]) -> None:
        """Worker thread: batch in one durable LMDB transaction; with a journal,
        a checkpoint: every journaled batch first, and the journal's new
        generation (it then starts over). Raises IndexFull when there was no
        room (aborted: it may be retried)."""
        generation = jr.new_generation() if journal is not None else 0
        started = time.monotonic()
        try:
            with self.env.begin(write=True) as txn:
                if journal is not None:
                    self._apply_layers(txn, batch.journaled_layers)
                self._apply_layers(txn, batch.ops.items())
                self._apply_ops(txn, extra)
                if journal is not None:
                    txn.put(b"journal", _JOURNAL_META.pack(generation, journal.next_seq - 1),
                            db=self._dbs["meta"])
                    if failing_at("checkpoint"):
                        raise RuntimeError("failure injected in a checkpoint's transaction "
                                           "(CKPTFS_DEBUG_FAIL)")
        except lmdb.MapFullError as e:
            self._without_redo(batch)
            raise IndexFull("index map is full") from e
        except lmdb.Error as e:      # DiskError for ENOSPC, Error for a short write's EIO
            if self._no_room(e):
                self._without_redo(batch)
                raise IndexFull(str(e)) from e
            raise
        if journal is not None:
            journal.reset(generation)
            batch.checkpointed = True
            batch.checkpoint_generation = generation
            self.checkpoints += 1
            why = batch.checkpoint_why or ("stop" if self._stopping else "other")
            self.checkpoint_reasons[why] = self.checkpoint_reasons.get(why, 0) + 1
            self.checkpoint_seconds_total += time.monotonic() - started

    def _apply_layers(self, txn: lmdb.Transaction, layers: Iterable[tuple[str, dict]]) -> None:
        """Each table's puts and deletes (None) into txn, layers in the order
        given (a later layer of a table wins), a layer's keys in key order.
        Worker thread.

        Key order because LMDB splits a full page in halves unless the new
        key goes last: torch.save's file has 3 of its 14,431 chunk records
        out of order, which put every later one before a page's last key and
        left the table's pages half full (488-538 against 289 sorted), each
        one faulted in by a read after a cache drop. The sort costs ~6 ms
        per GiB of new chunks, nearly all of it the chunk ids (hashes)."""
        for db_name, layer in layers:
            db = self._dbs[db_name]
            if None not in dict.values(layer):
                # Puts only (a big file's new chunks and extents): one C loop,
                # not a Python call per key (2 GiB's 143 k puts 72 -> 40 ms).
                # The pairs made as LMDB takes them (zip reuses its tuple):
                # a list of 143 k tuples set off a young collection of the
                # cyclic collector that traversed them all (5-8 ms).
                keys = sorted(dict.keys(layer))
                with txn.cursor(db=db) as cur:
                    cur.putmulti(zip(keys, map(layer.__getitem__, keys)))
                continue
            for k, v in sorted(dict.items(layer)):
                if v is None:
                    txn.delete(k, db=db)
                else:
                    txn.put(k, v, db=db)

    def _apply_ops(self, txn: lmdb.Transaction,
                   ops: Iterable[tuple[str, bytes, Optional[bytes]]]) -> None:
        """(table, key, value or None for a delete) into txn, in order."""
        for db_name, k, v in ops:
            if v is None:
                txn.delete(k, db=self._dbs[db_name])
            else:
                txn.put(k, v, db=self._dbs[db_name])

    @staticmethod
    def _without_redo(batch: Batch) -> None:
        """A batch that found no room is retried persisting its log bytes
        instead of carrying them: they may be what did not fit."""
        if batch.redo is not None:
            batch.redo = None
            batch.journal_log = False
            batch.persisted = False

    def _no_room(self, e: lmdb.Error) -> bool:
        """Did this commit fail for lack of room on the index's disk? LMDB says
        so, or says EIO for the short write a full disk gives (checked against
        what the disk has left)."""
        msg = str(e)
        if any(os.strerror(code) in msg for code in (errno.ENOSPC, errno.EDQUOT)):
            return True
        if os.strerror(errno.EIO) in msg:
            return self._disk_free_bytes() < max(self.reserve_target_bytes, RESERVE_MIN_BYTES)
        return False

    def _renew_read_txn(self) -> None:
        self._rtxn.abort()
        self._rtxn = self.env.begin()

    def close(self) -> None:
        """Close the environment. May block (final sync). Journaled batches not
        checkpointed stay in the journal: the next opening replays them."""
        if self._journal_writer is not None:
            self._journal_writer.close()
        if self._journal is not None:
            self._journal.close()
        self._rtxn.abort()
        self.env.sync(True)
        self.env.close()
        if self._data_fd >= 0:
            os.close(self._data_fd)
            self._data_fd = -1

    def stats(self) -> dict[str, object]:
        info = self.env.info()
        st = self.env.stat()
        return {"index_map_bytes": info["map_size"],
                "index_used_bytes": (info["last_pgno"] + 1) * st["psize"],
                "index_room_bytes": self.room_bytes,
                "index_full": self.full,
                "index_checkpoints": self.checkpoints,
                "index_checkpoint_reasons": dict(self.checkpoint_reasons),
                "index_checkpoint_seconds": round(self.checkpoint_seconds_total, 3),
                "index_journal_records": self.journal_records_total,
                "index_journal_bytes": self.journal_bytes_total}


class DirectTxn:
    """A write transaction used at start-up, with the same typed helpers."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict) -> None:
        self.txn = txn
        self.dbs = dbs

    def _get(self, db: str, key: bytes) -> Optional[bytes]:
        return self.txn.get(key, db=self.dbs[db])

    def _put(self, db: str, key: bytes, value: bytes) -> None:
        self.txn.put(key, value, db=self.dbs[db])

    def _put_many(self, db: str, items: list[tuple[bytes, bytes]],
                  numbers: Optional[Collection[int]] = None) -> None:
        for key, value in items:        # numbers: nothing watches a start-up transaction
            self._put(db, key, value)

    def _delete(self, db: str, key: bytes) -> None:
        self.txn.delete(key, db=self.dbs[db])

    def _items(self, db: str, lo: bytes, hi: bytes) -> Iterator[tuple[bytes, bytes]]:
        yield from _cursor_range(self.txn.cursor(self.dbs[db]), lo, hi)

    def adjust_counter(self, name: bytes, delta: int) -> None:
        self._put("meta", name, _LOGLOC.pack(read_counter(self, name) + delta))


class ReadView:
    """Durable state seen through one read transaction (`Index.read_view`):
    the last checkpoint in LMDB and, over it, the journaled batches of that
    moment (their tables are never changed while a view holds them: the next
    merge copies them first).

    Usable from any one thread at a time; the typed helpers below take it like
    an Index. Close it (or use `with`) before the index is closed.
    """

    def __init__(self, txn: lmdb.Transaction, dbs: dict,
                 journaled: Optional[dict[str, BatchLayer]] = None) -> None:
        self.txn = txn
        self.dbs = dbs
        self.journaled = journaled or {}

    def _get(self, db: str, key: bytes) -> Optional[bytes]:
        layer = self.journaled.get(db)
        if layer is not None and key in layer:
            return layer[key]
        return self.txn.get(key, db=self.dbs[db])

    def _items(self, db: str, lo: bytes, hi: bytes, reverse: bool = False
              ) -> Iterator[tuple[bytes, bytes]]:
        layer = self.journaled.get(db)
        if layer:
            yield from _merge_over(layer, lo, hi, self._lmdb_items(db, lo, hi, reverse), reverse)
            return
        yield from self._lmdb_items(db, lo, hi, reverse)

    def _lmdb_items(self, db: str, lo: bytes, hi: bytes, reverse: bool
                    ) -> Iterator[tuple[bytes, bytes]]:
        cur = self.txn.cursor(self.dbs[db])
        if not reverse:
            yield from _cursor_range(cur, lo, hi)
            return
        ok = cur.prev() if cur.set_range(hi) else cur.last()
        while ok and cur.key() >= lo:
            yield cur.key(), cur.value()
            ok = cur.prev()

    def close(self) -> None:
        self.txn.abort()

    def __enter__(self) -> "ReadView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cursor_range(cur: lmdb.Cursor, lo: bytes, hi: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Items with lo <= key < hi, ascending."""
    if not cur.set_range(lo):
        return
    for k, v in cur:
        if k >= hi:
            return
        yield k, v


_END = object()


def _layer_items(layer: BatchLayer, lo: bytes, hi: bytes, reverse: bool
                 ) -> Iterator[tuple[bytes, Optional[bytes]]]:
    for k in layer.irange(lo, hi, inclusive=(True, False), reverse=reverse):
        yield k, layer[k]


def _merge_over(layer: BatchLayer, lo: bytes, hi: bytes, below: Iterator[tuple[bytes, bytes]],
                reverse: bool) -> Iterator[tuple[bytes, bytes]]:
    """`_merge_layers` of one layer's items in [lo, hi) over a sorted stream
    (LMDB's): the layer's value wins on equal keys, its None hides the key.
    One comparison per item of either, none of the k-way merge's lists: a
    publish walks a file's every extent through the journaled layer."""
    keys = layer.irange(lo, hi, inclusive=(True, False), reverse=reverse)
    lk = next(keys, None)
    if lk is None:
        yield from below
        return
    for k, v in below:
        while lk is not None and (lk > k if reverse else lk < k):
            lv = layer[lk]
            if lv is not None:
                yield lk, lv
            lk = next(keys, None)
        if lk == k:
            lv = layer[lk]
            if lv is not None:
                yield lk, lv
            lk = next(keys, None)
        else:
            yield k, v
    while lk is not None:
        lv = layer[lk]
        if lv is not None:
            yield lk, lv
        lk = next(keys, None)


def _merge_layers(sources: list[Iterator[tuple[bytes, Optional[bytes]]]], reverse: bool
                  ) -> Iterator[tuple[bytes, bytes]]:
    """Merge sorted (key, value) streams; on equal keys the earliest stream wins.

    A winning value of None is a pending deletion and hides the key.
    """
    heads = [next(src, _END) for src in sources]
    pick = max if reverse else min
    while True:
        keys = [h[0] for h in heads if h is not _END]
        if len(keys) <= 1:
            # One stream left (with no pending batch, LMDB's alone: every
            # window load of a reader): the rest of it as it comes, without
            # a merge step per item (that was most of a cold reader's
            # window loads on the trio thread).
            for i, head in enumerate(heads):
                if head is not _END:
                    if head[1] is not None:
                        yield head
                    for item in sources[i]:
                        if item[1] is not None:
                            yield item
            return
        key = pick(keys)
        value = _END
        for i, head in enumerate(heads):
            if head is not _END and head[0] == key:
                if value is _END:
                    value = head[1]
                heads[i] = next(sources[i], _END)
        if value is not None:
            yield key, value


def new_fs_uuid() -> bytes:
    return uuidlib.uuid4().bytes


# ------------------------------------------------------------- key helpers
# Encodings, and the typed accessors on top of the private _get/_put/_items
# (see "tables" below). They take an Index, a DirectTxn or a ReadView.

def ino_key(ino: int) -> bytes:
    return _U64.pack(ino)


def dirent_key(parent: int, name: bytes) -> bytes:
    return _U64.pack(parent) + name


def dirent_value(ino: int, cookie: int) -> bytes:
    return _DIRENT.pack(ino, cookie)


def dirent_decode(b: bytes) -> tuple[int, int]:
    try:
        return _DIRENT.unpack(b)
    except struct.error:
        raise FormatError(f"directory entry: damaged record ({len(b)} bytes)") from None


def dirlist_key(parent: int, cookie: int) -> bytes:
    return _U64x2.pack(parent, cookie)


def dirlist_cookie(key: bytes) -> int:
    return _U64x2.unpack(key)[1]


def extent_key(ino: int, file_off: int) -> bytes:
    return _U64x2.pack(ino, file_off)


def extent_encode(e: Extent) -> bytes:
    return _EXTENT.pack(e.chunk_no, e.chunk_off, e.length)


def extent_decode(key: bytes, value: bytes) -> Extent:
    try:
        file_off = _U64x2.unpack(key)[1]
        chunk_no, chunk_off, length = _EXTENT.unpack(value)
    except struct.error:
        raise FormatError(f"extent {key.hex()}: damaged record ({len(value)} bytes)") from None
    return Extent(file_off, length, chunk_no, chunk_off)


def xattr_key(ino: int, name: bytes) -> bytes:
    return _U64.pack(ino) + name


def prefix_range(ino: int) -> tuple[bytes, bytes]:
    """Keys that start with this inode number: [lo, hi)."""
    return _U64.pack(ino), _U64.pack(ino + 1)


def get_inode(kv, ino: int) -> Optional[Inode]:
    raw = kv._get("inodes", ino_key(ino))
    return None if raw is None else Inode.decode(ino, raw)


def put_inode(kv, inode: Inode) -> None:
    key = ino_key(inode.ino)
    raw = inode.encode()
    _count_file(kv, kv._get("inodes", key), raw)
    kv._put("inodes", key, raw)


def delete_inode_record(kv, ino: int) -> None:
    """Delete an inode's record (and nothing else), keeping the file totals."""
    key = ino_key(ino)
    _count_file(kv, kv._get("inodes", key), None)
    kv._delete("inodes", key)


_INODE_MODE = struct.Struct("<I")
_INODE_SIZE_AT = 24                 # INODE_STRUCT: mode, nlink, uid, gid (u32), rdev, size


def _file_weight(raw: Optional[bytes]) -> tuple[int, int]:
    """What an encoded inode adds to the file totals: (1, size) for a regular
    file, else (0, 0); a damaged record adds nothing (fsck recounts)."""
    if raw is None or len(raw) != INODE_STRUCT.size:
        return 0, 0
    if not stat.S_ISREG(_INODE_MODE.unpack_from(raw)[0]):
        return 0, 0
    return 1, _LOGLOC.unpack_from(raw, _INODE_SIZE_AT)[0]


def _count_file(kv, old: Optional[bytes], new: Optional[bytes]) -> None:
    (f0, b0), (f1, b1) = _file_weight(old), _file_weight(new)
    if f1 != f0:
        kv.adjust_counter(b"files", f1 - f0)
    if b1 != b0:
        kv.adjust_counter(b"file_bytes", b1 - b0)


def count_files(kv) -> dict[bytes, int]:
    """The file totals, counted over the inode table (upgrade, fsck). May block."""
    files = size = 0
    for _, raw in kv._items("inodes", u64(0), u64((1 << 64) - 1)):
        f, b = _file_weight(raw)
        files += f
        size += b
    return {b"files": files, b"file_bytes": size}


def get_chunk(kv, chunk_no: int) -> Optional[Chunk]:
    raw = kv._get("chunks", u64(chunk_no))
    return None if raw is None else Chunk.decode(chunk_no, raw)


def log_location(kv, chunk_no: int) -> Optional[tuple[int, int, bytes]]:
    """(log_off, length, crcs) of a LOG chunk (copied to a pack or not) whose
    record `chunk_record_problem` finds nothing wrong with; None for any
    other chunk, a missing one or a damaged record (`get_chunk` says more).
    The read windows' loader (chunkread.py): a third of `get_chunk`'s cost."""
    raw = kv._get("chunks", u64(chunk_no))
    return None if raw is None else _log_location(raw)


def window_chunk(kv, chunk_no: int) -> tuple[Optional[tuple[int, int, bytes]], Optional[Chunk]]:
    """(`log_location`, None) of a LOG chunk that has one, else (None,
    `get_chunk`) with one lookup: the read windows' loader, whose cold
    extents need their records (FormatError if damaged)."""
    raw = kv._get("chunks", u64(chunk_no))
    if raw is None:
        return None, None
    loc = _log_location(raw)
    return (loc, None) if loc is not None else (None, Chunk.decode(chunk_no, raw))


def _log_location(raw: bytes) -> Optional[tuple[int, int, bytes]]:
    if len(raw) < _LOG_FIXED:
        return None
    kind, _, length = _CHUNK_HEAD.unpack_from(raw)
    if length > MAX_CHUNK_BYTES:
        return None
    if kind == CHUNK_LOG:
        crcs_at = _LOG_FIXED
    elif kind == _LOG_COPIED:
        crcs_at = _LOG_FIXED + _PACKLOC.size
        if len(raw) < crcs_at or _PACKLOC.unpack_from(raw, _LOG_FIXED)[2] > length:
            return None
    else:
        return None
    if len(raw) - crcs_at != 4 * -(-length // CRC_BLOCK_BYTES):
        return None
    return _LOGLOC.unpack_from(raw, _CHUNK_HEAD.size)[0], length, raw[crcs_at:]


def extent_store_ids(kv, ino: int) -> Iterator[tuple[int, int, Optional[bytes], int]]:
    """(file_off, length, chunk id, chunk_off) of every extent of ino in file
    order, the chunk id the store knows its bytes by (as
    `snapshots.packed_chunk_id` gives it: a PACK chunk's or a copied LOG
    chunk's), None for a chunk not in the store or missing. The snapshot
    walk's loop (snapshots.py), from the records as stored: no Extent or
    Chunk decoded. FormatError where `iter_extents` or `get_chunk` raise it."""
    lo, hi = prefix_range(ino)
    get, key_of = kv._get, _U64.pack
    for k, v in kv._items("extents", lo, hi):
        if len(k) == _U64x2.size and len(v) == _EXTENT.size:
            file_off = _U64x2.unpack(k)[1]
            chunk_no, chunk_off, length = _EXTENT.unpack(v)
        else:
            e = extent_decode(k, v)         # damaged: FormatError
            file_off, length, chunk_no, chunk_off = e.file_off, e.length, e.chunk_no, \
                e.chunk_off
        yield file_off, length, _store_id(chunk_no, get("chunks", key_of(chunk_no))), chunk_off


_PACK_FIXED = _CHUNK_HEAD.size + _PACKLOC.size      # a PACK record before its chunk id
_COPIED_FIXED = _LOG_FIXED + _PACKLOC.size          # a copied LOG record before its CRCs
_CID_AT = _CHUNK_HEAD.size + _LOGLOC.size           # a LOG record's chunk id


def _store_id(chunk_no: int, raw: Optional[bytes]) -> Optional[bytes]:
    """The store's id of a chunk record's bytes (`extent_store_ids`)."""
    if raw is None:
        return None
    n = len(raw)
    if n >= _PACK_FIXED:                # long enough for every kind's fixed part but copied
        kind = raw[0]
        if kind == CHUNK_LOG:
            return None
        if kind == CHUNK_PACK:
            return raw[_PACK_FIXED:] or None
        if kind == _LOG_COPIED and n >= _COPIED_FIXED:
            return raw[_CID_AT:_LOG_FIXED]
    chunk = Chunk.decode(chunk_no, raw)     # anything else, as get_chunk would
    return chunk.chunk_id if chunk.in_store and chunk.chunk_id else None


def chunk_record_problem(chunk: Chunk) -> Optional[str]:
    """Why this chunk record cannot be one ckptfs wrote, or None.

    Cold reads, the mover and fsck ask before they allocate or read anything
    by a record's lengths: a damaged record is EIO or a finding, never a
    2 GiB allocation. LOG and PACK chunks are at most MAX_CHUNK_BYTES; a
    pack payload is never longer than its chunk (the codecs store raw what
    does not shrink); a LOG record has one CRC per CRC_BLOCK_BYTES block."""
    if chunk.kind == CHUNK_SOURCE:
        if chunk.source_fs not in (SOURCE_FS_UNKNOWN, SOURCE_FS_SAME, SOURCE_FS_OTHER):
            return f"unknown kind {chunk.source_fs} of pre-existing file identity"
        return None if chunk.source_path else "no original path"
    if chunk.kind not in (CHUNK_LOG, CHUNK_PACK):
        return f"unknown kind {chunk.kind}"
    if chunk.length > MAX_CHUNK_BYTES:
        return f"claims {chunk.length} bytes, more than any chunk ({MAX_CHUNK_BYTES})"
    if chunk.kind == CHUNK_LOG:
        blocks = -(-chunk.length // CRC_BLOCK_BYTES)
        if len(chunk.crcs) != 4 * blocks:
            return f"{len(chunk.crcs) // 4} block CRCs for {blocks} blocks"
        if len(chunk.chunk_id) not in (0, CHUNK_ID_BYTES):
            return f"chunk id of {len(chunk.chunk_id)} bytes"
        if not chunk.copied:
            return None
    if chunk.stored_length > chunk.length:
        return f"payload of {chunk.stored_length} bytes for a {chunk.length}-byte chunk"
    if len(chunk.chunk_id) != CHUNK_ID_BYTES:
        return f"chunk id of {len(chunk.chunk_id)} bytes"
    return None


def check_chunk_record(chunk: Chunk) -> Chunk:
    """The chunk, if its record is plausible (chunk_record_problem); else DamagedData."""
    why = chunk_record_problem(chunk)
    if why is not None:
        raise DamagedData(f"chunk {chunk.chunk_no}: damaged record: {why}")
    return chunk


def get_store_uuid(kv) -> Optional[bytes]:
    return kv._get("meta", b"store_uuid")


def get_store_path(kv) -> Optional[bytes]:
    return kv._get("meta", b"store_path")


def set_store(kv, store_uuid: bytes, path: bytes) -> None:
    kv._put("meta", b"store_uuid", store_uuid)
    kv._put("meta", b"store_path", path)


def get_log_path(kv) -> Optional[bytes]:
    """The log the index was last mounted with, as `set_log_path` stored it."""
    return kv._get("meta", b"log_path")


def set_log_path(kv, path: bytes) -> None:
    kv._put("meta", b"log_path", path)


def find_chunk_no(kv, chunk_id: bytes) -> Optional[int]:
    """The number of the stored chunk whose bytes have this BLAKE3 id, if any."""
    raw = kv._get("chunkids", chunk_id)
    return None if raw is None else read_u64(raw)


def _journal_record(journal: jr.Journal, batch: Batch,
                    extra: list[tuple[str, bytes, Optional[bytes]]]) -> Optional[bytes]:
    """batch's journal record (its tables and the `logredo` extra ops), or None
    when it does not fit in what is left of the journal."""
    tables: jr.Ops = {db: layer.items() for db, layer in batch.ops.items()}
    if extra:
        tables["logredo"] = [(k, v) for _, k, v in extra]
    record = jr.encode_record(journal.generation, journal.next_seq, tables)
    return record if journal.fits(len(record)) else None


@contextlib.contextmanager
def _journal_room() -> Iterator[None]:
    """A journal append that fails for lack of room raises IndexFull (the
    batch is kept and retried whole, like a commit LMDB found no room for)."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise IndexFull(f"index journal: {e.strerror}") from e
        raise


def chunk_no_finder(index: "Index") -> Callable[[bytes], Optional[int]]:
    """`find_chunk_no` for many ids in one synchronous stretch of the trio
    thread (a write's batch): the pending layers and the read transaction
    looked up once, not per id. Use it before the next await only."""
    layers = index._lookup_layers("chunkids")
    rtxn, db = index._rtxn, index._dbs["chunkids"]

    def find(chunk_id: bytes) -> Optional[int]:
        for layer in layers:
            if chunk_id in layer:
                raw = layer[chunk_id]
                break
        else:
            raw = rtxn.get(chunk_id, db=db)
        return None if raw is None else read_u64(raw)
    return find


def find_chunk(kv, chunk_id: bytes) -> Optional[Chunk]:
    """The stored chunk whose bytes have this BLAKE3 id, if any."""
    raw = kv._get("chunkids", chunk_id)
    return None if raw is None else get_chunk(kv, read_u64(raw))


def add_chunks(kv, chunks: list[Chunk]) -> None:
    """`add_chunk` of many new chunks (a file's commit), one bulk put per
    table: the same records and totals, in fewer, larger steps."""
    records: list[tuple[bytes, bytes]] = []
    ids: list[tuple[bytes, bytes]] = []
    logmap: list[tuple[bytes, bytes]] = []
    unpublished: list[tuple[bytes, bytes]] = []
    numbers: list[int] = []
    log_bytes = 0
    # A 2 GiB file's fsync adds ~32 k chunks here, on the trio thread while
    # the writer waits: the packer bound once, no Chunk.encode dispatch.
    pack_key = _U64.pack
    for chunk in chunks:
        if chunk.kind != CHUNK_LOG or chunk.copied:
            add_chunk(kv, chunk)            # rare at commit: one at a time
            continue
        number = chunk.chunk_no
        no = pack_key(number)
        records.append((no, _log_record(chunk.refcount, chunk.length, chunk.log_off,
                                        chunk.chunk_id, chunk.crcs)))
        numbers.append(number)
        if chunk.chunk_id:
            ids.append((chunk.chunk_id, no))
        # As `_count_chunk` does for a new LOG chunk not yet in the store.
        logmap.append((pack_key(chunk.log_off), no))
        unpublished.append((no, b""))
        log_bytes += chunk.length
    if not records:
        return
    kv._put_many("chunks", records, numbers=numbers)
    kv._put_many("chunkids", ids)
    kv._put_many("logmap", logmap)
    kv._put_many("unpublished", unpublished)
    kv.adjust_counter(b"stored_log_bytes", log_bytes)
    kv.adjust_counter(b"unpublished_bytes", log_bytes)
    kv.adjust_counter(b"chunks", len(records))


def add_chunk(kv, chunk: Chunk) -> None:
    """Store a new chunk: its record, where it lives, its id, the totals."""
    kv._put("chunks", u64(chunk.chunk_no), chunk.encode())
    _count_chunk(kv, chunk, +1)
    if chunk.chunk_id:
        kv._put("chunkids", chunk.chunk_id, u64(chunk.chunk_no))
    kv.adjust_counter(b"chunks", 1)


def more_refs(kv, chunk_no: int, delta: int) -> bool:
    """Add delta (> 0) to a stored chunk's refcount, its record otherwise
    untouched (the head every kind shares; no decode of the rest): a
    commit's split extents. False if there is no such record."""
    key = u64(chunk_no)
    raw = kv._get("chunks", key)
    if raw is None or len(raw) < _CHUNK_HEAD.size:
        return False
    kind, refcount, length = _CHUNK_HEAD.unpack_from(raw)
    if refcount + delta <= 0:
        return False            # a damaged count: the caller's full path decides
    kv._put("chunks", key, _CHUNK_HEAD.pack(kind, refcount + delta, length)
            + raw[_CHUNK_HEAD.size:])
    return True


def more_refs_many(index: "Index", deltas: list[tuple[int, int]]) -> list[int]:
    """`more_refs` of many chunks (chunk number, delta > 0; each chunk once),
    the layers looked up once and one put for all (a commit's split extents,
    one a rewrite). Returns the chunks it left unchanged (no record, or a
    damaged count): the caller's full path decides."""
    layers = index._lookup_layers("chunks")
    rtxn, db = index._rtxn, index._dbs["chunks"]
    head = _CHUNK_HEAD
    changed: list[tuple[bytes, Optional[bytes]]] = []
    missed: list[int] = []
    for chunk_no, delta in deltas:
        key = u64(chunk_no)
        for layer in layers:
            if key in layer:
                raw = layer[key]
                break
        else:
            raw = rtxn.get(key, db=db)
        if raw is None or len(raw) < head.size:
            missed.append(chunk_no)
            continue
        kind, refcount, length = head.unpack_from(raw)
        if refcount + delta <= 0:
            missed.append(chunk_no)
            continue
        changed.append((key, head.pack(kind, refcount + delta, length) + raw[head.size:]))
    index._put_many("chunks", changed)
    return missed


def put_chunk(kv, chunk: Chunk) -> None:
    """Update a chunk that is already stored (refcount, original names)."""
    kv._put("chunks", u64(chunk.chunk_no), chunk.encode())


def delete_chunk(kv, chunk: Chunk) -> None:
    kv._delete("chunks", u64(chunk.chunk_no))
    _count_chunk(kv, chunk, -1)
    # Only its own entry: a chunk stored without dedup and named when tiered
    # may share its id with a twin the table names.
    if chunk.chunk_id and kv._get("chunkids", chunk.chunk_id) == u64(chunk.chunk_no):
        kv._delete("chunkids", chunk.chunk_id)
    kv.adjust_counter(b"chunks", -1)


def move_chunk(kv, old: Chunk, new: Chunk) -> None:
    """The same chunk (number, id, refcount) now stored elsewhere: tiered (LOG
    to PACK: a copy, if it had one, becomes the chunk), or copied to a pack
    (LOG to LOG with `copied`)."""
    _count_chunk(kv, old, -1)
    kv._put("chunks", u64(new.chunk_no), new.encode())
    _count_chunk(kv, new, +1)


def copy_to_pack(kv, chunk: Chunk, pack_no: int, pack_off: int, stored_length: int,
                 codec: int, codec_param: int, payload_crc: int, chunk_id: bytes) -> Chunk:
    """A LOG chunk now also has a copy in a pack (published); it stays in the
    log. Returns the new record."""
    new = Chunk(chunk.chunk_no, CHUNK_LOG, chunk.refcount, chunk.length, log_off=chunk.log_off,
                crcs=chunk.crcs, chunk_id=chunk_id, copied=True, pack_no=pack_no,
                pack_off=pack_off, stored_length=stored_length, codec=codec,
                codec_param=codec_param, payload_crc=payload_crc)
    move_chunk(kv, chunk, new)
    return new


def drop_log_copy(kv, chunk: Chunk) -> Chunk:
    """A copied LOG chunk becomes a PACK chunk (tiered without writing a
    pack); its log space is the caller's to release once that is durable."""
    new = Chunk(chunk.chunk_no, CHUNK_PACK, chunk.refcount, chunk.length, pack_no=chunk.pack_no,
                pack_off=chunk.pack_off, stored_length=chunk.stored_length, codec=chunk.codec,
                codec_param=chunk.codec_param, payload_crc=chunk.payload_crc,
                chunk_id=chunk.chunk_id)
    move_chunk(kv, chunk, new)
    return new


def _count_pack(kv, chunk: Chunk, sign: int) -> None:
    pack = get_pack(kv, chunk.pack_no) or PackInfo(chunk.pack_no, 0, 0, 0)
    pack.live_chunks += sign
    pack.live_bytes += sign * chunk.stored_length
    put_pack(kv, pack)


def _count_chunk(kv, chunk: Chunk, sign: int) -> None:
    """Where a chunk lives, and the totals: one place for add, delete and move."""
    if chunk.kind == CHUNK_LOG:
        if sign > 0:
            kv._put("logmap", u64(chunk.log_off), u64(chunk.chunk_no))
        else:
            kv._delete("logmap", u64(chunk.log_off))
        kv.adjust_counter(b"stored_log_bytes", sign * chunk.length)
        if chunk.copied:
            kv.adjust_counter(b"copy_pack_bytes", sign * chunk.stored_length)
            kv.adjust_counter(b"copy_logical_bytes", sign * chunk.length)
            _count_pack(kv, chunk, sign)
        else:
            # Not in the store yet: publishing copies it (publish.py).
            if sign > 0:
                kv._put("unpublished", u64(chunk.chunk_no), b"")
            else:
                kv._delete("unpublished", u64(chunk.chunk_no))
            kv.adjust_counter(b"unpublished_bytes", sign * chunk.length)
    elif chunk.kind == CHUNK_PACK:
        kv.adjust_counter(b"stored_pack_bytes", sign * chunk.stored_length)
        kv.adjust_counter(b"pack_logical_bytes", sign * chunk.length)
        _count_pack(kv, chunk, sign)
    else:
        kv.adjust_counter(b"stored_source_bytes", sign * chunk.length)


@dataclass(slots=True)
class PackInfo:
    pack_no: int
    live_chunks: int
    live_bytes: int
    size_bytes: int


_INTENT = b"pack_intent/"


def put_pack_intent(kv, pack_no: int, now_ns: int) -> None:
    """Pack pack_no is about to be written (durable before its first byte)."""
    kv._put("meta", _INTENT + u64(pack_no), _LOGLOC.pack(now_ns))


def delete_pack_intent(kv, pack_no: int) -> None:
    kv._delete("meta", _INTENT + u64(pack_no))


def pack_intents(kv) -> list[int]:
    """Numbers of the packs being written, or left by an interrupted pass."""
    return [read_u64(k[len(_INTENT):])
            for k, _ in kv._items("meta", _INTENT, _INTENT[:-1] + b"0")]


_DEAD = b"pack_dead/"


def put_dead_pack(kv, pack_no: int, now_ns: int) -> None:
    """Pack pack_no has no live chunk left: its blob goes after the next snapshot."""
    kv._put("meta", _DEAD + u64(pack_no), _LOGLOC.pack(now_ns))


def delete_dead_pack(kv, pack_no: int) -> None:
    kv._delete("meta", _DEAD + u64(pack_no))


def dead_packs(kv) -> list[int]:
    """Numbers of dead packs whose blobs may still be in the store."""
    return [read_u64(k[len(_DEAD):]) for k, _ in kv._items("meta", _DEAD, _DEAD[:-1] + b"0")]


def get_pack(kv, pack_no: int) -> Optional[PackInfo]:
    raw = kv._get("packs", u64(pack_no))
    if raw is None:
        return None
    try:
        return PackInfo(pack_no, *_PACK.unpack(raw))
    except struct.error:
        raise FormatError(f"pack {pack_no}: damaged record ({len(raw)} bytes)") from None


def put_pack(kv, pack: PackInfo) -> None:
    kv._put("packs", u64(pack.pack_no), _PACK.pack(pack.live_chunks, pack.live_bytes,
                                                  pack.size_bytes))


def delete_pack(kv, pack_no: int) -> None:
    kv._delete("packs", u64(pack_no))


def iter_extents(kv: "Index", ino: int, start: int = 0, end: int = 1 << 63) -> Iterator[Extent]:
    """Extents of ino that overlap [start, end), in file order."""
    lo, hi = prefix_range(ino)
    # The extent that starts before `start` may still reach into the range.
    if start > 0:
        for k, v in kv._items("extents", lo, extent_key(ino, start), reverse=True):
            e = extent_decode(k, v)
            if e.end > start:
                yield e
            break
    for k, v in kv._items("extents", extent_key(ino, start), hi):
        e = extent_decode(k, v)
        if e.file_off >= end:
            return
        yield e


class ExtentFinder:
    """Look-ups of the extents holding given bytes of one file (the live
    index only), many with one set of layers and one cursor: valid before
    the next await and the next change to the file's map."""

    __slots__ = ("_ino", "_hi", "_floor")

    def __init__(self, index: "Index", ino: int) -> None:
        lo, self._hi = prefix_range(ino)
        self._ino = ino
        self._floor = index.floor_finder("extents", lo)

    def at(self, off: int) -> Optional[Extent]:
        """The extent holding byte off, if one does."""
        found = self._floor(extent_key(self._ino, off + 1))
        if found is None:
            return None
        e = extent_decode(*found)
        return e if e.end > off else None

    def any(self) -> bool:
        """Whether the file has any extent."""
        return self._floor(self._hi) is not None


def extent_at(index: "Index", ino: int, off: int) -> Optional[Extent]:
    """The extent of ino holding byte off, if one does (the live index only)."""
    return ExtentFinder(index, ino).at(off)


def has_extents(index: "Index", ino: int) -> bool:
    """Whether ino has any extent (the live index only)."""
    return ExtentFinder(index, ino).any()


@dataclass(slots=True)
class WindowRecords:
    """The committed extents of a stretch of a file and their chunks'
    records, as LMDB stores them (`window_records`)."""
    count: int
    keys: bytes              # count extent keys (16 bytes each), joined
    vals: bytes              # their values (24 bytes each), joined
    recs: bytes              # their chunks' records, joined in extent order
    rec_lens: bytes          # each record's length, native uint32s
    offs: tuple[int, ...]    # each extent's file offset, length, chunk number
    lens: tuple[int, ...]    # and chunk offset, as `Extent` has them
    chunk_nos: tuple[int, ...]
    chunk_offs: tuple[int, ...]


def window_records(index: "Index", ino: int, start: int, end: int) -> Optional[WindowRecords]:
    """The extents of ino that overlap [start, end) (as `iter_extents`
    yields them) with their chunk records, read from LMDB with no Python
    object per extent but its key, value and record: the read windows'
    loader (chunkread.py), which builds its rows from them in C. None
    when LMDB alone is not the live map of them: a pending or journaled
    layer holds an extent of ino or one of their chunks, or a record is
    missing or not the size of one (the decoding path says what is wrong)."""
    lo, hi = prefix_range(ino)
    for layer in index._layers("extents"):
        if next(iter(layer.irange(lo, hi, inclusive=(True, False))), None) is not None:
            return None
    cur = index._rtxn.cursor(index._dbs["extents"])
    keys: list[bytes] = []
    vals: list[bytes] = []
    start_key, end_key = extent_key(ino, start), extent_key(ino, min(end, MAX_OFF_T))
    if start > 0 and (cur.prev() if cur.set_range(start_key) else cur.last()):
        # The extent that starts before `start` may still reach into the range.
        k, v = cur.item()
        if k >= lo:
            if len(k) != _U64x2.size or len(v) != _EXTENT.size:
                return None
            if _U64x2.unpack(k)[1] + _EXTENT.unpack(v)[2] > start:
                keys.append(k)
                vals.append(v)
    if cur.set_range(start_key):
        append_k, append_v = keys.append, vals.append
        for k, v in cur:
            if k >= end_key:
                break
            append_k(k)
            append_v(v)
    n = len(keys)
    kb, vb = b"".join(keys), b"".join(vals)
    if n and (set(map(len, keys)) != {_U64x2.size} or set(map(len, vals)) != {_EXTENT.size}):
        return None                     # a damaged record: the decoding path raises
    ext = struct.unpack(f"<{3 * n}Q", vb)
    chunk_nos = ext[0::3]
    chunk_keys = list(map(_U64.pack, chunk_nos))
    for layer in index._lookup_layers("chunks"):
        if any(map(layer.__contains__, chunk_keys)):
            return None
    get = partial(index._rtxn.get, db=index._dbs["chunks"])
    recs = list(map(get, chunk_keys))
    if None in recs:
        return None
    rec_lens = array("I", map(len, recs)).tobytes()
    return WindowRecords(n, kb, vb, b"".join(recs), rec_lens,
                         struct.unpack(f">{2 * n}Q", kb)[1::2], ext[2::3], chunk_nos, ext[1::3])


def window_chunks(recs: WindowRecords, known: dict[int, Chunk]) -> Optional[list[Chunk]]:
    """The chunk records of `window_records`' extents, decoded from its
    bytes as `window_chunk` decodes them, for a window none of whose chunks
    has a log location (a cold file's: packs): the read windows' loader
    (chunkread.py) builds such a window from them with no LMDB lookup or
    extent decode per extent. A record in known (decoded ahead from the live
    index by the cold look-ahead) is taken from there, and removed. None if
    a record has a log location (the C table or the decoding loader reads
    those) or is damaged (the decoding loader says what is wrong); known may
    have lost some entries then."""
    lens = array("I")
    lens.frombytes(recs.rec_lens)
    raw_all = memoryview(recs.recs)
    out: list[Chunk] = []
    pos = 0
    pop = known.pop
    for chunk_no, n in zip(recs.chunk_nos, lens):
        raw = bytes(raw_all[pos:pos + n])
        pos += n
        if _log_location(raw) is not None:
            return None
        chunk = pop(chunk_no, None)
        if chunk is None:
            try:
                chunk = Chunk.decode(chunk_no, raw)
            except CkptfsError:
                return None
        out.append(chunk)
    return out


def touch_map(view: "ReadView", ino: int, start: int, end: int) -> int:
    """Read the pages that hold ino's extents starting in [start, end) and
    their chunk records, decoding nothing: a worker thread brings them into
    memory before the trio thread's read window (chunkread.py) needs them
    (after a cache drop each page is a disk read). The number of extents
    seen. May block."""
    cur = view.txn.cursor(view.dbs["extents"])
    if not cur.set_range(extent_key(ino, start)):
        return 0
    hi = extent_key(ino, end)
    chunks_db = view.dbs["chunks"]
    get, chunk_no_of, key_of = view.txn.get, _LOGLOC.unpack_from, _U64.pack
    n = 0
    for k, v in cur:
        if k >= hi:
            break
        if len(v) == _EXTENT.size:      # a damaged one: the window's load says so
            get(key_of(chunk_no_of(v)[0]), db=chunks_db)
        n += 1
    return n


def _upgrade_chunk_ids(txn: "DirectTxn") -> None:
    """Format 1 -> 2: LOG chunks get an all-zero id; the chunk totals are counted.
    Format 1 predates tiering too: no packs, no pack counters (they read as 0)."""
    totals = dict.fromkeys(STAT_COUNTERS, 0)
    for k, raw in list(txn._items("chunks", u64(0), u64((1 << 64) - 1))):
        kind, refcount, length = _CHUNK_HEAD.unpack_from(raw)
        rest = raw[_CHUNK_HEAD.size:]
        if kind == CHUNK_LOG:
            chunk = Chunk(read_u64(k), kind, refcount, length,
                          log_off=_LOGLOC.unpack_from(rest)[0], crcs=bytes(rest[_LOGLOC.size:]))
            txn._put("chunks", k, chunk.encode())
            totals[b"stored_log_bytes"] += length
        else:
            totals[b"stored_source_bytes"] += length
        totals[b"chunks"] += 1
    for name, value in totals.items():
        txn._put("meta", name, _LOGLOC.pack(value))


def has_log_chunks(kv) -> bool:
    """Whether any chunk lives in the log (the log map is not empty)."""
    return next(kv._items("logmap", u64(0), u64((1 << 64) - 1)), None) is not None


def used_log_space(kv, start: int, end: int, damaged: list[str]) -> list[tuple[int, int]]:
    """The log space [start, end) that LOG chunks hold, as sorted disjoint
    (offset, length) ranges: what the allocator must never hand out.

    Damage never stops a mount here: a log map entry whose record cannot be
    decoded, is missing or is not a LOG chunk holds nothing; a record longer
    than MAX_CHUNK_BYTES holds that much; ranges are clipped to the log and
    overlapping ones merged (which of two overlapping records is damaged is
    not known: both keep their space). Each oddity is described in `damaged`
    (fsck reports the same records; their reads give EIO).
    """
    ranges: list[tuple[int, int]] = []
    for k, v in kv._items("logmap", u64(0), u64((1 << 64) - 1)):
        off = read_u64(k)
        try:
            chunk = get_chunk(kv, read_u64(v)) if len(v) == 8 else None
        except FormatError as e:
            damaged.append(f"log map entry at {off}: {e}")
            continue
        if chunk is None or chunk.kind != CHUNK_LOG or chunk.log_off != off:
            damaged.append(f"log map entry at {off} names no LOG chunk there")
            continue
        why = chunk_record_problem(chunk)
        if why is not None:
            damaged.append(f"chunk {chunk.chunk_no}: damaged record: {why}")
        a, b = max(off, start), min(off + min(chunk.length, MAX_CHUNK_BYTES), end)
        if a >= b:
            if chunk.length:
                damaged.append(f"chunk {chunk.chunk_no} at log offset {off} is outside the log")
            continue
        if ranges and a <= ranges[-1][0] + ranges[-1][1]:
            if a < ranges[-1][0] + ranges[-1][1]:
                damaged.append(f"chunk {chunk.chunk_no} at log offset {off} overlaps another")
            prev_off, prev_len = ranges[-1]
            ranges[-1] = (prev_off, max(prev_off + prev_len, b) - prev_off)
        else:
            ranges.append((a, b - a))
    return ranges


# ------------------------------------------------------------------- tables
# Typed operations on every sub-database: the only way other modules read or
# write the index. Each takes `kv`: the live Index (trio thread; writes go to
# the open batch), a DirectTxn (a durable write transaction at start-up, in
# fsck repairs and recover) or, for reads, a ReadView (one read transaction,
# any one thread). The raw `_get/_put/_delete/_items` behind them are private
# to this module. Scans (`scan_*`) read a whole table in key order; they pass
# records that cannot be decoded to `damaged(description)` and go on, so fsck
# reads every table through them and never slices a key itself.

_U64_MAX = (1 << 64) - 1
_ALL = (u64(0), u64(_U64_MAX))
Damaged = Callable[[str], None]


def _raise_damaged(why: str) -> None:
    raise FormatError(why)


# -- meta: counters and settings

def read_counters(kv, names: Iterator[bytes] | tuple[bytes, ...]) -> dict[bytes, int]:
    """The stored values of these counters (0 when never written)."""
    return {name: read_counter(kv, name) for name in names}


def write_counters(kv, counters: dict[bytes, int]) -> None:
    """Store counter values (id counters, chunk totals) as they are given."""
    for name, value in counters.items():
        kv._put("meta", name, u64_le(value))


def mark_clean(kv, clean: bool) -> None:
    kv._put("meta", b"clean", b"1" if clean else b"0")


# -- inodes

def delete_inode(kv, ino: int) -> None:
    """Drop an inode's record with its symlink target, orphan mark and xattrs
    (its extents are the caller's: they hold chunk references)."""
    key = ino_key(ino)
    delete_inode_record(kv, ino)            # keeps the file totals
    kv._delete("symlinks", key)
    kv._delete("orphans", key)
    lo, hi = prefix_range(ino)
    for k, _ in list(kv._items("xattrs", lo, hi)):
        kv._delete("xattrs", k)


def scan_inodes(kv, damaged: Damaged = _raise_damaged) -> Iterator[Inode]:
    for k, v in kv._items("inodes", *_ALL):
        ino = read_u64(k)
        try:
            yield Inode.decode(ino, v)
        except FormatError as e:
            damaged(str(e))


def scan_inode_numbers(kv) -> Iterator[int]:
    """Every inode number with a record, decodable or not."""
    for k, _ in kv._items("inodes", *_ALL):
        yield read_u64(k)


# -- directory entries (dirents: parent + name -> ino + cookie; dirlist: parent + cookie -> name)

def lookup_entry(kv, parent: int, name: bytes) -> Optional[tuple[int, int]]:
    """(ino, cookie) of name in directory parent, if there is such an entry."""
    raw = kv._get("dirents", dirent_key(parent, name))
    return None if raw is None else dirent_decode(raw)


def has_entry(kv, parent: int, name: bytes) -> bool:
    return kv._get("dirents", dirent_key(parent, name)) is not None


def add_entry(kv, parent: int, name: bytes, ino: int, cookie: int) -> None:
    """A new entry and its place in the listing (cookie from `next_cookie`)."""
    kv._put("dirents", dirent_key(parent, name), dirent_value(ino, cookie))
    kv._put("dirlist", dirlist_key(parent, cookie), name)


def retarget_entry(kv, parent: int, name: bytes, ino: int) -> None:
    """The existing entry name now names ino; it keeps its place in the listing."""
    _, cookie = dirent_decode(kv._get("dirents", dirent_key(parent, name)))
    kv._put("dirents", dirent_key(parent, name), dirent_value(ino, cookie))


def remove_entry(kv, parent: int, name: bytes, cookie: int) -> None:
    kv._delete("dirents", dirent_key(parent, name))
    kv._delete("dirlist", dirlist_key(parent, cookie))


def has_entries(kv, parent: int) -> bool:
    lo, hi = prefix_range(parent)
    return next(kv._items("dirlist", lo, hi), None) is not None


def list_entries(kv, parent: int, after_cookie: int = 0) -> Iterator[tuple[bytes, int, int]]:
    """(name, ino, cookie) of parent's entries in listing order, after a cookie."""
    _, hi = prefix_range(parent)
    for k, name in kv._items("dirlist", dirlist_key(parent, after_cookie + 1), hi):
        raw = kv._get("dirents", dirent_key(parent, name))
        if raw is not None:
            yield name, dirent_decode(raw)[0], dirlist_cookie(k)


def scan_entries(kv, damaged: Damaged = _raise_damaged
                 ) -> Iterator[tuple[int, bytes, int, int]]:
    """(parent, name, ino, cookie) of every directory entry, in key order."""
    for k, v in kv._items("dirents", *_ALL):
        parent, name = read_u64(k[:8]), bytes(k[8:])
        try:
            ino, cookie = dirent_decode(v)
        except FormatError as e:
            damaged(f"entry {name!r} in {parent}: {e}")
            continue
        yield parent, name, ino, cookie


def listing_name(kv, parent: int, cookie: int) -> Optional[bytes]:
    """The name the listing of parent has at cookie, if any."""
    return kv._get("dirlist", dirlist_key(parent, cookie))


def put_listing(kv, parent: int, cookie: int, name: bytes) -> None:
    """The listing row alone (fsck: an entry missing from the listing order)."""
    kv._put("dirlist", dirlist_key(parent, cookie), name)


def delete_listing(kv, parent: int, cookie: int) -> None:
    """The listing row alone (fsck: a row with no entry, or a second one)."""
    kv._delete("dirlist", dirlist_key(parent, cookie))


def scan_listing(kv) -> Iterator[tuple[int, int, bytes]]:
    """(parent, cookie, name) of every listing row, in key order."""
    for k, name in kv._items("dirlist", *_ALL):
        parent, cookie = _U64x2.unpack(k)
        yield parent, cookie, bytes(name)


# -- symlinks

def get_symlink(kv, ino: int) -> Optional[bytes]:
    return kv._get("symlinks", ino_key(ino))


def put_symlink(kv, ino: int, target: bytes) -> None:
    kv._put("symlinks", ino_key(ino), target)


def delete_symlink(kv, ino: int) -> None:
    kv._delete("symlinks", ino_key(ino))


def scan_symlink_inos(kv) -> Iterator[int]:
    for k, _ in kv._items("symlinks", *_ALL):
        yield read_u64(k[:8])


# -- xattrs

def get_xattr(kv, ino: int, name: bytes) -> Optional[bytes]:
    return kv._get("xattrs", xattr_key(ino, name))


def put_xattr(kv, ino: int, name: bytes, value: bytes) -> None:
    kv._put("xattrs", xattr_key(ino, name), value)


def delete_xattr(kv, ino: int, name: bytes) -> None:
    kv._delete("xattrs", xattr_key(ino, name))


def xattrs_of(kv, ino: int) -> Iterator[tuple[bytes, bytes]]:
    """(name, value) of ino's xattrs, in name order."""
    lo, hi = prefix_range(ino)
    for k, v in kv._items("xattrs", lo, hi):
        yield bytes(k[8:]), v


def delete_xattrs(kv, ino: int) -> None:
    lo, hi = prefix_range(ino)
    for k, _ in list(kv._items("xattrs", lo, hi)):
        kv._delete("xattrs", k)


def scan_xattr_inos(kv) -> Iterator[tuple[int, bytes]]:
    """(ino, name) of every xattr."""
    for k, _ in kv._items("xattrs", *_ALL):
        yield read_u64(k[:8]), bytes(k[8:])


# -- orphans (inodes unlinked while open)

def add_orphan(kv, ino: int) -> None:
    kv._put("orphans", ino_key(ino), b"")


def remove_orphan(kv, ino: int) -> None:
    kv._delete("orphans", ino_key(ino))


def orphans(kv) -> list[int]:
    return [read_u64(k) for k, _ in kv._items("orphans", *_ALL)]


# -- extents

def put_extent(kv, ino: int, e: Extent) -> None:
    kv._put("extents", extent_key(ino, e.file_off), extent_encode(e))


def put_extents(kv, ino: int, extents: list[Extent]) -> None:
    """`put_extent` of many extents of one file at once."""
    # As `extent_key` and `extent_encode`, the packers bound once: a big
    # file's commit puts ~16 extents per MiB.
    key, value = _U64x2.pack, _EXTENT.pack
    kv._put_many("extents", [(key(ino, e.file_off), value(e.chunk_no, e.chunk_off, e.length))
                             for e in extents], numbers=(ino,))


def delete_extent(kv, ino: int, file_off: int) -> None:
    kv._delete("extents", extent_key(ino, file_off))


def replace_extents(index: "Index", ino: int, deleted: Iterable[int], put: list[Extent]) -> None:
    """Delete the extents of ino starting at the offsets `deleted`, then put
    `put` (which may start where a deleted one did), in one step."""
    index._put_many("extents", [(extent_key(ino, off), None) for off in deleted]
                    + [(extent_key(ino, e.file_off), extent_encode(e)) for e in put])


def first_extent(kv, ino: int) -> Optional[Extent]:
    """The extent at offset 0, if the file has one (an adopted file's only extent)."""
    raw = kv._get("extents", extent_key(ino, 0))
    return None if raw is None else extent_decode(extent_key(ino, 0), raw)


def scan_extents(kv, damaged: Damaged = _raise_damaged) -> Iterator[tuple[int, Extent]]:
    """(ino, extent) of every extent, in key order."""
    for k, v in kv._items("extents", *_ALL):
        try:
            yield read_u64(k[:8]), extent_decode(k, v)
        except FormatError as e:
            damaged(f"inode {read_u64(k[:8])}: {e}")


# -- chunks, chunk ids, the log map, packs

def scan_chunks(kv, damaged: Damaged = _raise_damaged) -> Iterator[Chunk]:
    for k, v in kv._items("chunks", *_ALL):
        try:
            yield Chunk.decode(read_u64(k), v)
        except FormatError as e:
            damaged(str(e))


def name_chunk(kv, chunk_id: bytes, chunk_no: int) -> None:
    """The id table names chunk_no for chunk_id (tiering names a chunk stored
    without dedup; fsck mends a missing entry)."""
    kv._put("chunkids", chunk_id, u64(chunk_no))


def unname_chunk(kv, chunk_id: bytes) -> None:
    kv._delete("chunkids", chunk_id)


def scan_chunk_ids(kv) -> Iterator[tuple[bytes, int]]:
    """(chunk id, chunk no) of every entry of the id table."""
    for k, v in kv._items("chunkids", bytes(CHUNK_ID_BYTES), b"\xff" * (CHUNK_ID_BYTES + 1)):
        yield bytes(k), read_u64(v)


def map_log(kv, log_off: int, chunk_no: int) -> None:
    kv._put("logmap", u64(log_off), u64(chunk_no))


def unmap_log(kv, log_off: int) -> None:
    kv._delete("logmap", u64(log_off))


def scan_log_map(kv) -> Iterator[tuple[int, int]]:
    """(log offset, chunk no) of every log map entry."""
    for k, v in kv._items("logmap", *_ALL):
        yield read_u64(k), read_u64(v)


def scan_pack_numbers(kv) -> Iterator[int]:
    """Every pack number with a record, decodable or not (`get_pack` decodes)."""
    for k, _ in kv._items("packs", *_ALL):
        yield read_u64(k)


def scan_packs(kv, damaged: Damaged = _raise_damaged) -> Iterator[PackInfo]:
    for pack_no in scan_pack_numbers(kv):
        try:
            yield get_pack(kv, pack_no)
        except FormatError as e:
            damaged(str(e))


def entries_by_name(kv, parent: int) -> Iterator[tuple[bytes, Optional[int], Optional[str]]]:
    """(name, ino, None) of parent's entries in name order; (name, None, why) for
    an entry whose record cannot be decoded (a snapshot names it as damage)."""
    lo, hi = prefix_range(parent)
    for k, v in kv._items("dirents", lo, hi):
        try:
            yield bytes(k[8:]), dirent_decode(v)[0], None
        except FormatError as e:
            yield bytes(k[8:]), None, str(e)


def inode_record(kv, ino: int) -> Optional[bytes]:
    """The inode's stored record as it is: equal records mean an unchanged inode
    (a snapshot reuses what it made of it)."""
    raw = kv._get("inodes", ino_key(ino))
    return None if raw is None else bytes(raw)


# ---------------------------------------------------------------- publishing

def scan_unpublished(kv, after: int = -1, limit: int = 1 << 62) -> list[int]:
    """Numbers of LOG chunks not yet copied to the store, in order, after `after`."""
    out = []
    for k, _ in kv._items("unpublished", u64(after + 1), u64((1 << 64) - 1)):
        out.append(read_u64(k))
        if len(out) >= limit:
            break
    return out


def set_unpublished(kv, chunk_no: int, listed: bool) -> None:
    """List (or not) a chunk as unpublished: fsck's repair; the chunk
    operations keep the table by themselves."""
    if listed:
        kv._put("unpublished", u64(chunk_no), b"")
    else:
        kv._delete("unpublished", u64(chunk_no))


@dataclass
class VolumeRecord:
    """What the index knows of its volume (docs/STORE.md, "Volumes").

    `gen`: the lease generation this filesystem holds (or, while `takeover`
    is set, the newest one recover saw). `base`: the head (gen, seq) its state
    started from (recover), None for a volume it made. `takeover`: recovered
    from the store; the next mount takes the volume over (a lease gen + 1),
    unless the volume's newest valid head is no longer `seen`, the newest
    one when recover ran (`base` itself, unless recover was told --head)."""

    name: str
    gen: int
    base: Optional[tuple[int, int]] = None
    takeover: bool = False
    seen: Optional[tuple[int, int]] = None

    def encode(self) -> bytes:
        return json.dumps({"name": self.name, "gen": self.gen, "takeover": self.takeover,
                           "base": list(self.base) if self.base else None,
                           "seen": list(self.seen) if self.seen else None},
                          sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "VolumeRecord":
        try:
            doc = json.loads(raw)
            base, seen = doc["base"], doc.get("seen")
            return cls(str(doc["name"]), int(doc["gen"]),
                       (int(base[0]), int(base[1])) if base else None, bool(doc["takeover"]),
                       (int(seen[0]), int(seen[1])) if seen else None)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise FormatError(f"the index's volume record is damaged ({e})") from None


def get_volume(kv) -> Optional[VolumeRecord]:
    raw = kv._get("meta", b"volume")
    return None if raw is None else VolumeRecord.decode(bytes(raw))


def set_volume(kv, record: VolumeRecord) -> None:
    kv._put("meta", b"volume", record.encode())


def scan_log_redo(kv, damaged: Damaged = _raise_damaged
                  ) -> Iterator[tuple[int, int, int, int, memoryview]]:
    """Every chunk the `logredo` records carry: (record no, log offset, length,
    chunk no, its bytes), oldest record first."""
    for k, raw in kv._items("logredo", u64(0), u64((1 << 64) - 1)):
        no, view = read_u64(k), memoryview(bytes(raw))
        try:
            (count,) = _REDO_COUNT.unpack_from(view)
            entries = [_REDO_ENTRY.unpack_from(view, _REDO_COUNT.size + i * _REDO_ENTRY.size)
                       for i in range(count)]
            pos = _REDO_COUNT.size + count * _REDO_ENTRY.size
            if pos + sum(length for _, length, _ in entries) != len(view):
                raise struct.error("lengths do not add up")
        except struct.error as e:
            damaged(f"logredo record {no}: {e}")
            continue
        for off, length, chunk_no in entries:
            yield no, off, length, chunk_no, view[pos:pos + length]
            pos += length


def clear_log_redo(kv) -> None:
    """Drop every `logredo` record (their bytes are in the log, persisted)."""
    for k, _ in list(kv._items("logredo", u64(0), u64((1 << 64) - 1))):
        kv._delete("logredo", k)


def _upgrade_unpublished(txn: "DirectTxn") -> None:
    """Format 4 -> 5: every LOG chunk is unpublished (no copies existed)."""
    total = 0
    for _, v in list(txn._items("logmap", u64(0), u64((1 << 64) - 1))):
        chunk = get_chunk(txn, read_u64(v)) if len(v) == 8 else None
        if chunk is None or chunk.kind != CHUNK_LOG:
            continue                    # damaged: fsck reports it
        txn._put("unpublished", u64(chunk.chunk_no), b"")
        total += chunk.length
    for name in (b"copy_pack_bytes", b"copy_logical_bytes"):
        txn._put("meta", name, _LOGLOC.pack(0))
    txn._put("meta", b"unpublished_bytes", _LOGLOC.pack(total))
