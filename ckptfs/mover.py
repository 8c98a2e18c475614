"""The tiering mover: cold LOG chunks into a pack in the store, then one flip.

`Mover.move_batch`: on the trio thread, make an intent ("pack N is being
written") durable in the index; on the mover's own worker thread, read each
chunk from the log (verified), compress it (`codec`), append it to a pack,
commit the pack (temp name, fsync, rename, fsync dir: `backing`); back on the
trio thread, flip every chunk that is still where it was to its pack
location, record the pack and clear its intent, all in the open index batch.
A moved chunk's log space goes back through the reclaimer once that batch is
durable and no read that might still use it is in flight. A store with less
room than a pack takes a smaller one (`STORE_MARGIN_BYTES` kept free); none
at all is BackingFull.

It never writes a pack whose name the store holds: that store is ahead of
this index (restored from a copy, or another filesystem writes there).
`StoreAheadFence` remembers that for the mount: from then on no pack is
written and no snapshot published (the collector checks it too), until
fsck --repair or recover.

Publishing (publish.py) writes its copies the same way (`copy_batch`): only
the flip differs, giving each chunk a copy in the pack (`ix.copy_to_pack`)
while it stays in the log. A chunk that has a copy is tiered without any
pack written (`drop_log_copies`: it becomes a PACK chunk at its copy). Once
the volume is fenced (another node holds it), no pack is written.

Dedup across volumes (`shared`, chunkindex.py): before a pack is written,
other volumes' chunk index objects are looked at again if the last look is
older than WRITE_REFRESH_S; a chunk another volume stored is not written but
named in that volume's pack, once this volume holds a ref to it (`Adopted`).
Copies two nodes packed at once become one (`share_known_chunks`, each
publish round and gc): every volume renames its chunks to the copy in the
pack with the smallest number, so none keeps a ref to a copy the others
left. An adopted pack the flip then names nothing in is handed to the
collector (`on_unused_refs`), which drops the ref with the next head.
gc has chunks the collector chooses rewritten as stored into a new pack
(`repack`).

Publishing also packs the files adopted from SOURCE (`pack_source`): the
original's bytes, read beneath SOURCE with no symlink followed and only from
the file adopted (`sources.SourceFiles`), cut into chunks as writes are
(content-defined), packed the same way; `flip_source` then points the
file's extents at those chunks, so the adopted file lives in the store from
then on (its original goes once that is durable and no read uses it).

A write that fails after its intent was durable leaves the pack's fate
unknown: the collector is told (`failed_write`) and cleans up. The mover may
not delete anything from the store (making a ref, or deleting the one it
just made when the pack turns out unusable, is the protocol's taking step),
nor choose what is cold.

Blocks: `_write_pack_blocking`, `_repack_blocking` and the index object
refresh (its worker thread); the rest runs on the trio thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import outcome
import trio

from . import codec
from . import index as ix
from . import packs
from .backing.base import Backend
from .chunker import Chunker, chunk_id
from .debugpause import pause_blocking, pausing_at
from .errors import (BackingFull, BlobDamaged, BlobMissing, CkptfsError, DamagedData, Fenced,
                     OperationFailed, StoreAhead)
from .index import CHUNK_LOG, CHUNK_PACK, CHUNK_SOURCE, Chunk, Extent, Index
from .pmemlog import PmemLog
from .reclaim import Reclaimer

if TYPE_CHECKING:
    from .chunkindex import SharedChunks
    from .sources import SourceFiles

T = TypeVar("T")
log = logging.getLogger("ckptfs.tier")

# Room a pack leaves free in the backing store: file system blocks and
# directories, snapshots, other writers. A store with less free space than a
# pack takes smaller packs; one with less than this margin, none (BackingFull).
STORE_MARGIN_BYTES = 2 << 20
SOURCE_READ_BYTES = 1 << 20        # an adopted original is read this much at a time

# Before a pack is written, other volumes' chunk indexes are looked at again if
# the last look is older than this (one listing): chunks another node stored
# moments ago are taken, not stored twice.
WRITE_REFRESH_S = 1.0


@dataclass(frozen=True)
class Adopted:
    """A chunk another volume stored: named at its place in that volume's pack."""

    pack_no: int
    entry: packs.PackEntry


class BackgroundThread:
    """One long-lived worker thread for the mover's compression. `run` is
    awaited like trio.to_thread.run_sync (not cancellable while the job runs).

    Its priority stays normal (nice 0): at nice 10 the saves during a pass got
    faster, but a writer waiting for log room then waited on a starved mover
    (bench_tier (c): longest wait 15.9 s at nice 10, 0.0 s at nice 0)."""

    def __init__(self, nice: int = 0) -> None:
        self._nice = nice
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        # A clean unmount's last round (`Mover.finish_by`): a cancelled caller
        # stops waiting; the job runs on, the thread ends after it.
        self.abandon_on_cancel = False

    def _loop(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        except OSError as e:
            log.debug("could not lower the mover thread's priority: %s", e)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, token, deliver = job
            result = outcome.capture(fn, *args)
            try:
                token.run_sync_soon(deliver, result)
            except trio.RunFinishedError:
                pass

    async def run(self, fn, *args):
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ckptfs mover",
                                            daemon=True)
            self._thread.start()
        done = trio.Event()
        box: list = []

        def deliver(result) -> None:
            box.append(result)
            done.set()

        self._jobs.put((fn, args, trio.lowlevel.current_trio_token(), deliver))
        with trio.CancelScope(shield=not self.abandon_on_cancel):
            await done.wait()
        return box[0].unwrap()

    def close(self) -> None:
        """The thread ends after the job it runs, if any (a later `run` starts
        another: a clean unmount's last round comes after the mover stopped)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


class StoreAheadFence:
    """Why this index is older than its store (StoreAhead), once seen: from
    then on the mount publishes nothing and writes no pack (what a newer head
    names must stay as it is until fsck --repair or recover)."""

    def __init__(self) -> None:
        self.why: Optional[str] = None

    def check(self, doing: str = "") -> None:
        """StoreAhead if the fence is up."""
        if self.why is not None:
            raise StoreAhead(f"{doing}{self.why}")

    def close(self, e: StoreAhead) -> None:
        self.why = str(e)


class Mover:
    """Writes packs of cold chunks and flips the chunks' records to them."""

    def __init__(self, index: Index, plog: PmemLog, reclaimer: Reclaimer, backend: Backend,
                 fence: StoreAheadFence, shared: Optional["SharedChunks"] = None) -> None:
        """shared: other volumes' chunks this one may name instead of packing
        its own copy (chunkindex.py); None without dedup across volumes."""
        self.index = index
        self.log = plog
        self.reclaimer = reclaimer
        self.backend = backend
        self.fence = fence
        self.writing: set[int] = set()     # packs being written now (their intents are ours)
        self.moved_chunks = 0
        self.moved_bytes = 0
        self.packs_written = 0
        self.copied_bytes = 0              # copies for publishing (publish.py)
        self.copy_packs_written = 0
        self.repacked_chunks = 0           # gc's rewrites (`repack`)
        self.fenced: Optional[str] = None  # the volume went to another node: write nothing
        self._thread = BackgroundThread()
        # A clean unmount's deadline (time.monotonic) for pack writes, and the
        # lock every log read of a pack write holds: see `finish_by`.
        self._stop_at: Optional[float] = None
        self._log_reads = threading.Lock()
        self._failed_write = trio.Event()
        self.shared = shared
        # Adopted packs a flip left unnamed: the collector drops their refs.
        self.on_unused_refs: Callable[[set[int]], None] = lambda pack_nos: None
        if shared is not None:
            shared.no_adopt.update(ix.dead_packs(index))   # let go: never named again here

    def close(self) -> None:
        """The mover's thread ends (after the job it runs, if any)."""
        self._thread.close()

    def finish_by(self, timeout_s: float) -> None:
        """A clean unmount's last publishing round: a pack write still under
        way `timeout_s` from now gives up before its next chunk (OperationFailed;
        its intent has the next mount delete what it wrote), and a caller
        cancelled meanwhile stops waiting for it. Then `let_go`."""
        self._stop_at = time.monotonic() + timeout_s
        self._thread.abandon_on_cancel = True

    def let_go(self) -> None:
        """After the last round: no pack write reads the log from now on (a
        read under way ends first: the log may be closed next), the thread
        ends. Blocks for at most one chunk's read from the log."""
        self._stop_at = time.monotonic()
        with self._log_reads:
            pass
        self.close()

    def _read_for_pack_blocking(self, buf: memoryview, chunk: Chunk) -> None:
        """A chunk's log bytes for a pack, unless the unmount's deadline passed
        (`finish_by`). May block."""
        with self._log_reads:
            if self._stop_at is not None and time.monotonic() >= self._stop_at:
                raise OperationFailed("the unmount's time for publishing ran out "
                                      "(unmount_publish_timeout)")
            self.log.read_into(buf, chunk.log_off, chunk.length, chunk.crcs, 0)

    async def failed_write(self) -> None:
        """Wait until a pack write fails after its intent was durable."""
        await self._failed_write.wait()
        self._failed_write = trio.Event()

    async def copy_batch(self, batch: list[Chunk]) -> tuple[int, int]:
        """Publishing (publish.py): pack a prefix of these hot chunks and give
        each still in the log a copy there; they stay in the log. The same
        pack writing as a move (intent, StoreAhead, leftovers); returns how
        many chunks it took and the logical bytes copied."""
        return await self.move_batch(batch, copy=True)

    def drop_log_copies(self, chunks: list[Chunk]) -> int:
        """Tier chunks that have a published copy: they become PACK chunks at
        their copy, no pack is written; their log space is released once that
        is durable. Returns the logical bytes moved."""
        moved = 0
        for old in chunks:
            cur = ix.get_chunk(self.index, old.chunk_no)
            if cur is None or cur.kind != CHUNK_LOG or not cur.copied \
                    or cur.log_off != old.log_off:
                continue            # gone or changed meanwhile
            ix.drop_log_copy(self.index, cur)
            self.reclaimer.release_after_durable(cur.log_off, cur.length)
            moved += cur.length
            self.moved_chunks += 1
        self.moved_bytes += moved
        return moved

    async def _new_pack(self, write_blocking: Callable[..., T], *args) -> tuple[int, T]:
        """A new pack of this volume: its number, its intent durable, then
        `write_blocking(pack_no, *args)` on the mover's thread. Returns the
        number (still in `writing`: the caller's flip takes it out) and what
        the write returned. On failure the intent goes if no byte was begun;
        once begun, the pack may be in the store: a leftover for the collector."""
        if self.fenced is not None:
            raise Fenced(self.fenced)
        self.fence.check("no pack is written: ")
        pack_no = self.index.allocate_id(b"next_pack")
        self.writing.add(pack_no)
        started = False
        try:
            # Durable before the pack's first byte: whatever happens from here
            # on, the next mount knows this pack as its own leftover.
            ix.put_pack_intent(self.index, pack_no, time.time_ns())
            await self.index.wait_durable(self.index.current_seq())
            started = True
            return pack_no, await self._thread.run(write_blocking, pack_no, *args)
        except StoreAhead as e:
            self.fence.close(e)
            self.writing.discard(pack_no)
            if self.index.failure is None:
                ix.delete_pack_intent(self.index, pack_no)   # refused before its first byte
            raise
        except BaseException:
            self.writing.discard(pack_no)
            if started:
                self._failed_write.set()   # the pack may be there (a commit's outcome unknown)
            elif self.index.failure is None:
                ix.delete_pack_intent(self.index, pack_no)   # never begun (unmount)
            raise

    async def move_batch(self, batch: list[Chunk], copy: bool = False) -> tuple[int, int]:
        """Pack a prefix of batch (all of it if the store has room); return how
        many chunks it took and the logical bytes moved (copied: `copy`)."""
        epoch = self.reclaimer.begin_read()  # the log bytes we read stay put meanwhile
        try:
            pack_no, written = await self._new_pack(self._write_pack_blocking, batch)
        finally:
            self.reclaimer.end_read(epoch)
        entries, size = written
        if size == 0:
            pass                        # every chunk adopted: no pack written
        elif copy:
            self.copy_packs_written += 1
        else:
            self.packs_written += 1
        moved = self._flip(pack_no, size, batch, entries, copy)   # names it, clears the intent
        self.writing.discard(pack_no)
        return len(entries), moved

    async def pack_source(self, sources: "SourceFiles", chunk: Chunk, start: int,
                          pack_bytes: int) -> tuple[int, int, int, list[tuple[int, packs.PackEntry]]]:
        """Publishing an adopted file: its original's bytes from `start` on, cut
        into content-defined chunks, about pack_bytes of them into one pack
        (the same intent and leftovers as a move). Returns (pack number, pack
        size, where the packed bytes end in the original, [(offset in the
        original, entry)]); `flip_source` names them. DamagedData (SourceRefused
        included) when the original cannot be read as the file adopted."""
        pack_no, (pieces, end, size) = await self._new_pack(
            self._pack_source_blocking, sources, chunk, start, pack_bytes)
        self.copy_packs_written += 1
        return pack_no, size, end, pieces

    def _refuse_if_in_store_blocking(self, name: str) -> None:
        """StoreAhead if pack `name` is in the store already: pack numbers are
        never reused, so this index is older than the store (restored from a
        copy) or another filesystem writes packs there. May block."""
        try:
            self.backend.size(name)
        except BlobMissing:
            return
        raise StoreAhead(f"{self.backend.url}: {name} is in the store already: this "
                         "index is older than the store (restored from a copy?) or another "
                         "filesystem writes packs there; ckptfs fsck --repair raises its "
                         "counter")

    def _pack_source_blocking(self, pack_no: int, sources: "SourceFiles", chunk: Chunk,
                              start: int, pack_bytes: int
                              ) -> tuple[list[tuple[int, packs.PackEntry]], int, int]:
        """Read, cut, compress and pack the original from `start`; commit the
        pack. Returns the pieces, where they end, and the pack's size. May block."""
        name = packs.pack_name(pack_no)
        self._refuse_if_in_store_blocking(name)
        room = self._room_blocking()
        writer = packs.PackWriter.create(self.backend, name)
        chunker = Chunker()
        pending = bytearray()           # read, not cut yet; pending[0] is at `cut`
        cut = off = start
        pieces: list[tuple[int, packs.PackEntry]] = []
        by_id: dict[bytes, packs.PackEntry] = {}
        try:
            while off < chunk.length and writer.payload_bytes < pack_bytes:
                buf = memoryview(bytearray(min(SOURCE_READ_BYTES, chunk.length - off)))
                sources.read_into(buf, chunk, off)
                off += len(buf)
                pending += buf
                cuts = chunker.feed(buf)
                if off >= chunk.length:
                    cuts += chunker.finish()
                used = 0
                for c_off, c_len in cuts:
                    data = memoryview(pending)[start + c_off - cut:start + c_off - cut + c_len]
                    cid = chunk_id(data)
                    if cid not in by_id:
                        enc = codec.encode_chunk(data)
                        if self._pack_full(writer, room, len(enc.payload)):
                            data.release()
                            off = chunk.length          # the pack ends here
                            break
                        by_id[cid] = writer.add(cid, enc.codec, enc.param, enc.payload, c_len)
                    data.release()
                    pieces.append((start + c_off, by_id[cid]))
                    used = start + c_off + c_len - cut
                del pending[:used]
                cut += used
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        if self.shared is not None:
            self.shared.written(pack_no, writer.entries)   # its index object goes with the head
        return pieces, cut, writer.bytes_written

    def flip_source(self, pack_no: int, size: int, chunk: Chunk, ino: int, start: int,
                    end: int, pieces: list[tuple[int, packs.PackEntry]]) -> int:
        """Point the parts of `ino`'s extents that still name the adopted
        chunk's bytes [start, end) at the packed pieces (a piece whose id is
        stored already names that chunk); the chunk's references drop with
        them (its original goes once none is left: `Reclaimer`). Records the
        pack and clears its intent, all in the open batch. Returns the bytes
        that now live in the store."""
        ix.put_pack(self.index, ix.PackInfo(pack_no, 0, 0, size))
        ix.delete_pack_intent(self.index, pack_no)
        self.writing.discard(pack_no)
        cur = ix.get_chunk(self.index, chunk.chunk_no)
        if cur is None or cur.kind != CHUNK_SOURCE:
            return 0                    # gone meanwhile: the pack holds nothing live
        piece_nos: dict[int, int] = {}  # offset in the original -> chunk number
        refs: dict[int, int] = {}
        moved = 0
        for e in list(ix.iter_extents(self.index, ino)):
            if e.chunk_no != chunk.chunk_no:
                continue
            lo, hi = max(e.chunk_off, start), min(e.chunk_off + e.length, end)
            if lo >= hi:
                continue
            ix.delete_extent(self.index, ino, e.file_off)
            kept = 0
            if e.chunk_off < lo:
                ix.put_extent(self.index, ino, Extent(e.file_off, lo - e.chunk_off,
                                                      e.chunk_no, e.chunk_off))
                kept += 1
            if e.chunk_off + e.length > hi:
                ix.put_extent(self.index, ino, Extent(e.file_off + hi - e.chunk_off,
                                                      e.chunk_off + e.length - hi,
                                                      e.chunk_no, hi))
                kept += 1
            for p_off, entry in pieces:
                a, b = max(p_off, lo), min(p_off + entry.length, hi)
                if a >= b:
                    continue
                no = piece_nos.get(p_off)
                if no is None:
                    no = piece_nos[p_off] = self._piece_chunk(pack_no, entry)
                ix.put_extent(self.index, ino, Extent(e.file_off + a - e.chunk_off, b - a,
                                                      no, a - p_off))
                refs[no] = refs.get(no, 0) + 1
                moved += b - a
            self.reclaimer.add_refs(chunk.chunk_no, kept - 1)
        for no, n in refs.items():
            self.reclaimer.add_refs(no, n)
        self.copied_bytes += moved
        return moved

    def _piece_chunk(self, pack_no: int, entry: packs.PackEntry) -> int:
        """The chunk a packed piece of an original is: one stored already with
        its id, else a new PACK chunk at its entry (references added by the
        caller)."""
        known = ix.find_chunk_no(self.index, entry.chunk_id)
        if known is not None:
            return known
        no = self.index.allocate_id(b"next_chunk")
        ix.add_chunk(self.index, Chunk(no, CHUNK_PACK, 0, entry.length, pack_no=pack_no,
                                       pack_off=entry.offset, stored_length=entry.stored_length,
                                       codec=entry.codec, codec_param=entry.param,
                                       payload_crc=entry.crc, chunk_id=entry.chunk_id))
        ix.name_chunk(self.index, entry.chunk_id, no)
        return no

    def _room_blocking(self) -> Optional[int]:
        """Bytes the next pack may take: the store's free space less a margin
        (None: the store cannot say)."""
        free = self.backend.free_bytes()
        if free is None:
            return None
        return free - STORE_MARGIN_BYTES

    def _pack_full(self, writer: packs.PackWriter, room: Optional[int],
                   payload_bytes: int) -> bool:
        """True if a payload of this size does not fit in the pack being
        written (it ends before it); BackingFull if it would not fit in an
        empty one. room: from `_room_blocking`."""
        if room is None or _pack_size(writer, payload_bytes) <= room:
            return False
        if not writer.entries:
            raise BackingFull(f"{self.backend.url}: no space for another pack "
                              f"({room + STORE_MARGIN_BYTES} bytes free, "
                              f"{STORE_MARGIN_BYTES} kept free)")
        return True

    def _write_pack_blocking(self, pack_no: int, batch: list[Chunk]
                             ) -> tuple[list[Optional[packs.PackEntry]], int]:
        """Read, compress and pack a prefix of the chunks (as many as the
        store has room for, at least one: BackingFull otherwise); commit the
        pack. Returns an entry (None: not moved) for each chunk taken. May block."""
        if pausing_at("pack-begin"):
            pause_blocking("pack-begin")
        name = packs.pack_name(pack_no)
        self._refuse_if_in_store_blocking(name)
        room = self._room_blocking()
        shared = self.shared
        if shared is not None:
            try:
                shared.refresh_blocking(max_age_s=WRITE_REFRESH_S)
            except (CkptfsError, OSError) as e:
                log.debug("other volumes' chunk indexes not read: %s", e)
        writer = packs.PackWriter.create(self.backend, name)
        out: list = []
        by_id: dict[bytes, packs.PackEntry] = {}
        try:
            for chunk in batch:
                if shared is not None and chunk.chunk_id:
                    # Another volume stored these bytes: name its pack, once it
                    # holds a ref there (chunkindex.py), instead of a copy.
                    theirs = shared.lookup(chunk.chunk_id)
                    if theirs is not None and theirs[1].length == chunk.length \
                            and shared.adopt_blocking(theirs[0]):
                        out.append(Adopted(*theirs))
                        continue
                buf = memoryview(bytearray(chunk.length))
                try:
                    self._read_for_pack_blocking(buf, chunk)
                except DamagedData as e:
                    log.error("not tiering chunk %d: %s", chunk.chunk_no, e)
                    out.append(None)
                    continue
                cid = chunk.chunk_id or chunk_id(buf)
                if cid not in by_id:        # twins stored without dedup share one copy
                    enc = codec.encode_chunk(buf)
                    if self._pack_full(writer, room, len(enc.payload)):
                        break               # the pack ends here; the rest goes in the next
                    by_id[cid] = writer.add(cid, enc.codec, enc.param, enc.payload,
                                            chunk.length)
                    if len(writer) == 1 and pausing_at("pack-writing"):
                        pause_blocking("pack-writing")
                    if len(writer) == 1 and self._stop_at is not None \
                            and pausing_at("unmount-pack-writing"):
                        pause_blocking("unmount-pack-writing")
                out.append(by_id[cid])
            if not writer.entries:
                writer.abort()              # every chunk was another volume's already
                return out, 0
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        if pausing_at("pack-written"):
            pause_blocking("pack-written")
        if shared is not None:
            shared.written(pack_no, writer.entries)   # its index object goes with the head
        return out, writer.bytes_written

    def _flip(self, own_pack_no: int, size: int, batch: list[Chunk], entries: list,
              copy: bool = False) -> int:
        """Point every chunk that is still where we read it at its pack copy
        (`copy`: give it that copy, it stays in the log), or at another
        volume's copy it adopted; record the pack and clear its intent (one
        batch)."""
        if size:                        # nothing written when every chunk was adopted
            ix.put_pack(self.index, ix.PackInfo(own_pack_no, 0, 0, size))
        ix.delete_pack_intent(self.index, own_pack_no)
        moved = 0
        for old, entry in zip(batch, entries):
            if entry is None:
                continue
            pack_no = own_pack_no
            if isinstance(entry, Adopted):
                if entry.pack_no in self.shared.no_adopt:
                    continue            # let go meanwhile: the next round packs it
                pack_no, entry = entry.pack_no, entry.entry
            cur = ix.get_chunk(self.index, old.chunk_no)
            if cur is None or cur.kind != CHUNK_LOG or cur.log_off != old.log_off:
                continue            # gone or changed meanwhile: its pack copy is dead
            if copy:
                if cur.copied:
                    continue        # copied meanwhile: this copy is dead
                ix.copy_to_pack(self.index, cur, pack_no, entry.offset, entry.stored_length,
                                entry.codec, entry.param, entry.crc, entry.chunk_id)
                if not cur.chunk_id and ix.find_chunk_no(self.index, entry.chunk_id) is None:
                    ix.name_chunk(self.index, entry.chunk_id, cur.chunk_no)
                moved += cur.length
                self._count_adopted(pack_no, own_pack_no, cur.length)
                continue
            if cur.copied:          # published meanwhile: that copy stays, ours is dead
                ix.drop_log_copy(self.index, cur)
                self.reclaimer.release_after_durable(cur.log_off, cur.length)
                moved += cur.length
                self.moved_chunks += 1
                continue
            new = Chunk(cur.chunk_no, CHUNK_PACK, cur.refcount, cur.length, pack_no=pack_no,
                        pack_off=entry.offset, stored_length=entry.stored_length,
                        codec=entry.codec, codec_param=entry.param, payload_crc=entry.crc,
                        chunk_id=entry.chunk_id)
            ix.move_chunk(self.index, cur, new)
            if not cur.chunk_id and ix.find_chunk_no(self.index, entry.chunk_id) is None:
                ix.name_chunk(self.index, entry.chunk_id, cur.chunk_no)
            self.reclaimer.release_after_durable(cur.log_off, cur.length)
            moved += cur.length
            self.moved_chunks += 1
            self._count_adopted(pack_no, own_pack_no, cur.length)
        if copy:
            self.copied_bytes += moved
        else:
            self.moved_bytes += moved
        self._unused_refs({e.pack_no for e in entries if isinstance(e, Adopted)})
        return moved

    def _count_adopted(self, pack_no: int, own_pack_no: int, length: int) -> None:
        if pack_no != own_pack_no:
            self.shared.adopted_chunks += 1
            self.shared.adopted_bytes += length

    def _unused_refs(self, pack_nos: set[int]) -> None:
        """Other volumes' packs this volume made a ref to but names nothing in
        (its chunks went meanwhile) go to the collector, which drops the ref
        with the next head and never lets this mount take them again."""
        unused = {n for n in pack_nos if ix.get_pack(self.index, n) is None}
        if unused:
            self.on_unused_refs(unused)

    # ------------------------------------------------------------ repacking

    def _rename_to_entry(self, cur: Chunk, pack_no: int, e: "packs.PackEntry") -> None:
        """Point a chunk that has a store copy at entry `e` of pack `pack_no`
        instead: a LOG chunk's copy moves there (its log bytes stay), a PACK
        chunk moves there whole."""
        if cur.kind == CHUNK_LOG:
            ix.copy_to_pack(self.index, cur, pack_no, e.offset, e.stored_length, e.codec,
                            e.param, e.crc, e.chunk_id)
        else:
            ix.move_chunk(self.index, cur, Chunk(
                cur.chunk_no, CHUNK_PACK, cur.refcount, cur.length, pack_no=pack_no,
                pack_off=e.offset, stored_length=e.stored_length, codec=e.codec,
                codec_param=e.param, payload_crc=e.crc, chunk_id=cur.chunk_id))

    async def repack(self, batch: list[Chunk]) -> int:
        """gc: chunks in the store whose pack should not stay alive for them
        (an own pack mostly unused since its other chunks were renamed to
        another volume's copy, or another volume's pack its owner condemned)
        are written as they are stored (compressed payload, CRC checked) into
        a new pack of this volume and renamed there, a LOG chunk's copy as
        much as a PACK chunk; the packs they were in then die for this volume
        like any other. The same intent and flip as a move. Returns how many
        chunks moved."""
        pack_no, (entries, size) = await self._new_pack(self._repack_blocking, batch)
        if size:
            ix.put_pack(self.index, ix.PackInfo(pack_no, 0, 0, size))
        ix.delete_pack_intent(self.index, pack_no)
        moved = 0
        for old, e in zip(batch, entries):
            if e is None:
                continue
            cur = ix.get_chunk(self.index, old.chunk_no)
            if cur is None or not cur.in_store or cur.pack_no != old.pack_no \
                    or cur.pack_off != old.pack_off:
                continue                # gone or moved meanwhile: this copy is dead
            self._rename_to_entry(cur, pack_no, e)
            moved += 1
        self.writing.discard(pack_no)
        self.repacked_chunks += moved
        return moved

    def _repack_blocking(self, pack_no: int, batch: list[Chunk]
                         ) -> tuple[list[Optional[packs.PackEntry]], int]:
        """Read each chunk's stored payload (CRC checked) and pack it as it is;
        commit. A chunk that cannot be read stays where it is (None). May block."""
        name = packs.pack_name(pack_no)
        self._refuse_if_in_store_blocking(name)
        room = self._room_blocking()
        need = sum(c.stored_length + packs.ENTRY_BYTES for c in batch) + packs.FOOTER_BYTES
        if room is not None and need > room:
            raise BackingFull(f"{self.backend.url}: no space to repack ({need} bytes needed, "
                              f"{room + STORE_MARGIN_BYTES} free, {STORE_MARGIN_BYTES} kept free)")
        writer = packs.PackWriter.create(self.backend, name)
        out: list[Optional[packs.PackEntry]] = []
        by_id: dict[bytes, packs.PackEntry] = {}
        try:
            for chunk in batch:
                if chunk.chunk_id in by_id:
                    out.append(by_id[chunk.chunk_id])
                    continue
                where = packs.PackEntry(chunk.chunk_id, chunk.pack_off, chunk.stored_length,
                                        chunk.length, chunk.codec, chunk.codec_param,
                                        chunk.payload_crc)
                try:
                    payload = packs.read_payload(self.backend, packs.pack_name(chunk.pack_no),
                                                 where)
                except (BlobDamaged, BlobMissing) as e:
                    log.error("not repacking chunk %d: %s", chunk.chunk_no, e)
                    out.append(None)
                    continue
                by_id[chunk.chunk_id] = writer.add(chunk.chunk_id, chunk.codec,
                                                   chunk.codec_param, payload, chunk.length)
                out.append(by_id[chunk.chunk_id])
            if not writer.entries:
                writer.abort()
                return out, 0
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        if self.shared is not None:
            self.shared.written(pack_no, writer.entries)   # its index object goes with the head
        return out, writer.bytes_written

    # ------------------------------------------- copies two nodes made at once

    async def share_known_chunks(self, force: bool = False) -> int:
        """Two nodes that stored the same bytes at about the same time each
        packed them: of the copies, the one in the pack with the smallest
        number stays. Chunks of this volume that another volume's pack with a
        smaller number holds too are named there instead (a ref first), and
        the pack they were in (own, or another's this volume took them from)
        dies here once nothing else lives in it. `force`: read every index
        object again and look at every known chunk (gc). The caller holds the
        publish lock. Returns how many chunks moved."""
        shared = self.shared
        if shared is None or self.fenced is not None or self.fence.why is not None:
            return 0
        try:
            await self._thread.run(shared.refresh_blocking, force)
        except (CkptfsError, OSError) as e:
            # What is known already still counts; the copies say if the store is away.
            log.debug("other volumes' chunk indexes not read: %s", e)
        wanted: list[tuple[int, int, packs.PackEntry]] = []
        later = []
        for cid, pack_no, entry in shared.take_fresh(everything=force):
            cur = ix.find_chunk(self.index, cid)
            if cur is not None and not cur.in_store:
                later.append((cid, pack_no, entry))     # not published here yet
                continue
            # Own or another's: every volume moves to the smallest number, so
            # none holds a ref to a copy the others left.
            if cur is not None and cur.in_store and cur.pack_no > pack_no \
                    and cur.length == entry.length:
                wanted.append((cur.chunk_no, pack_no, entry))
        shared.keep_fresh(later)
        if not wanted:
            return 0
        usable = await self._thread.run(
            lambda: {p for p in {p for _, p, _ in wanted} if shared.adopt_blocking(p)})
        moved = 0
        for chunk_no, pack_no, e in wanted:
            cur = ix.get_chunk(self.index, chunk_no)
            if pack_no not in usable or pack_no in shared.no_adopt or cur is None \
                    or not cur.in_store or cur.pack_no <= pack_no:
                continue                # changed meanwhile
            self._rename_to_entry(cur, pack_no, e)
            moved += 1
            shared.adopted_chunks += 1
            shared.adopted_bytes += cur.length
        self._unused_refs(usable)
        if moved:
            log.info("%d chunks another volume stored too are now named in its packs", moved)
        return moved


def _pack_size(writer: packs.PackWriter, payload_bytes: int) -> int:
    """The pack's size once committed with one more payload of this size."""
    return (writer.bytes_written + payload_bytes
            + (len(writer) + 1) * packs.ENTRY_BYTES + packs.FOOTER_BYTES)

