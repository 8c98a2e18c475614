"""Tiering: cold chunks move, compressed, to backing storage; reads bring them back.

What is cold (`TierPolicy`, `Tierer.plan`): files are grouped into versions
(the files of one directory whose commits lie within `version_gap_s` of each
other; a file directly in the mount root is a version of its own). The
`hot_versions` newest versions stay in the log; every other version's chunks
are cold, unless a hot version or an open file shares them. When the log is
fuller than `high_watermark`, hot versions go too, oldest first, until the
plan brings it under `low_watermark`; writers that find the log full wait
(`make_room`) while that happens.

Moving (`Tierer.tier_once`): on the trio thread, plan, and make an intent
("pack N is being written") durable in the index; on a worker thread, read
each chunk from the log (verified), compress it (`codec`), append it to a
pack, commit the pack (temp name, fsync, rename, fsync dir: `backing`); back
on the trio thread, flip every chunk that is still where it was to its pack
location, record the pack and clear its intent, all in the open index batch.
A moved chunk's log space is released once that batch is durable and no
read that might still use it is in flight. A pack an interrupted pass left
(an intent, no record: a crash, a failed write) is deleted in the background
from the next mount on (`clean_leftovers`), once this mount has published a
snapshot (so the store's newest head names none of its chunks); the mount
never deletes a pack no intent of this filesystem names, and never writes a
pack whose name the store holds (an index older than the store: `StoreAhead`,
and tiering stops). After a pass (not one a waiting writer runs)
and at unmount, a snapshot of the whole namespace goes to the store
(`snapshots.Publisher`, docs/STORE.md), so `ckptfs recover` can rebuild the
newest state from the store alone. Packs whose last chunk went are deleted
only once a snapshot newer than that is published. Failures (store missing,
read-only, full, slow) leave hot data alone; the mover retries with backoff
and says why in the log and in `ckptfs stat`.

Reading cold chunks back is the cold store's (`coldstore.ColdStore`, with
its `Prefetcher`, which the mover's nursery runs); the mover shows its
figures in `stats`.

Which functions may block: every `*_blocking` function; everything else runs
on the trio thread.
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import outcome
import trio

from . import codec
from . import index as ix
from . import packs
from .backing.base import Backend
from .chunker import chunk_id
from .coldstore import ColdStore, Prefetcher
from .errors import (BackingFull, BlobMissing, CkptfsError, DamagedData, FormatError, NoSpace,
                     StoreAhead)
from .index import CHUNK_LOG, CHUNK_PACK, Chunk, Inode
from .snapshots import Published, Publisher

log = logging.getLogger(__name__)

# Test hook: CKPTFS_DEBUG_PAUSE="POINT:PATH". The first time the mover reaches
# POINT it creates PATH and waits there while PATH exists, so that crash tests
# kill the daemon exactly there instead of sleeping and hoping (or delete PATH
# to let it go on). Points: pack-begin (an intent durable, no byte of the pack
# written), pack-writing (a pack half written), pack-written (committed in the
# store, not yet named by the index), pass-done (a pass finished and durable),
# pack-dead (a pack that lost its last chunk left the index, its blob not yet
# deleted).
DEBUG_PAUSE = os.environ.get("CKPTFS_DEBUG_PAUSE", "")
_paused_once = False
# Room a pack leaves free in the backing store: file system blocks and
# directories, manifests, other writers. A store with less free space than a
# pack takes smaller packs; one with less than this margin, none (BackingFull).
STORE_MARGIN_BYTES = 2 << 20


@dataclass
class TierPolicy:
    hot_versions: int = 2
    high_watermark: float = 0.75     # log use that sends hot versions out too
    low_watermark: float = 0.5       # ... until the plan brings it below this
    interval_s: float = 5.0          # how often the mover looks
    pack_bytes: int = 64 << 20       # logical bytes per pack
    version_gap_s: float = 120.0     # commits of one directory this close are one version
    cache_bytes: int = 256 << 20     # decoded cold chunks kept for reads
    prefetch_chunks: int = 128       # chunks read ahead of a sequential cold read


@dataclass
class Version:
    """Files of one directory committed close together: one checkpoint."""

    parent: int
    newest_ns: int
    files: list[Inode] = field(default_factory=list)
    oldest_ns: int = 0

    @property
    def data_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)


# ------------------------------------------------------------------- moving

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
        with trio.CancelScope(shield=True):
            await done.wait()
        return box[0].unwrap()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)


@dataclass
class Progress:
    total_bytes: int = 0
    done_bytes: int = 0
    finished: bool = False
    error: Optional[str] = None


class Tierer:
    """The background mover, its policy, backpressure for writers, prefetch."""

    def __init__(self, fs, backend: Backend, policy: TierPolicy, fs_uuid: bytes,
                 cold: Optional[ColdStore] = None,
                 prefetcher: Optional[Prefetcher] = None) -> None:
        self.fs = fs
        self.index = fs.index
        self.files = fs.files
        self.reclaimer = fs.files.reclaimer
        self.log = fs.log
        self.backend = backend
        self.policy = policy
        self.fs_uuid = fs_uuid
        self.cold = cold                # for its figures in stats
        self.prefetcher = prefetcher    # runs in the mover's nursery
        self.limiter = trio.CapacityLimiter(1)          # one pack at a time
        self._wake = trio.Event()
        self._moved = trio.Event()        # set after every round: writers re-check room
        self._urgent = False
        self._running = False
        self._busy = trio.Lock()          # one pass or gc at a time
        self._publishing = trio.Lock()    # one snapshot (or gc) at a time
        self.publisher = Publisher(self.index, backend, fs_uuid, limiter=self.limiter)
        self._nursery: Optional[trio.Nursery] = None
        self.state = "idle"
        self.last_error: Optional[str] = None
        self.retry_at = 0.0
        self._backoff_s = 0.0
        self.backlog_bytes = 0
        self.moved_chunks = 0
        self.moved_bytes = 0
        self.packs_written = 0
        self.rounds = 0
        self.progress: Optional[Progress] = None
        self.longest_wait_s = 0.0
        self._planned_seq = -1
        self._nearly_full = False
        self._writers_waiting = 0
        self._mover_thread = BackgroundThread()
        self._writing: set[int] = set()   # packs this pass is writing (intents in flight)
        self._leftovers = trio.Event()    # a pack write failed: clean up after it
        self._damage_seen: set[str] = set()
        # Why this index is older than the store (StoreAhead), once seen: from
        # then on this mount publishes nothing and writes no pack (what a newer
        # head names must stay as it is until fsck --repair or recover).
        self._store_ahead: Optional[str] = None

    # ------------------------------------------------------------- the task

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The mover, until `stop`."""
        self._stopped = trio.Event()
        try:
            with trio.CancelScope() as self._scope:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    if self.prefetcher is not None:
                        await nursery.start(self.prefetcher.run)
                    self._resume_dead_pack_deletes()
                    nursery.start_soon(self._clean_leftovers_task)
                    task_status.started()
                    await self._loop()
        finally:
            self._nursery = None
            self._mover_thread.close()
            self._stopped.set()

    async def stop(self) -> None:
        """Cancel the mover and wait until it is gone (a pack in flight is
        finished but never named: its intent has the next mount delete it)."""
        self._scope.cancel()
        await self._stopped.wait()

    async def _loop(self) -> None:
        while True:
            with trio.move_on_after(self.policy.interval_s):
                await self._wake.wait()
            self._wake = trio.Event()
            self._watch_log_use()
            if time.monotonic() < self.retry_at and not self._urgent:
                continue
            if self.index.durable_seq == self._planned_seq and not self._urgent \
                    and self.last_error is None:
                continue            # nothing committed since the last plan: nothing new is cold
            try:
                await self.tier_once()
                await self._collect_garbage_and_publish()
            except (CkptfsError, OSError) as e:
                self._failed(e)
            except Exception as e:  # noqa: BLE001 - a bug must not take the mount down
                log.exception("tiering pass failed unexpectedly")
                self._failed(e)

    def start_now(self, everything: bool) -> dict:
        """`ckptfs tier --now`: a pass in the background; `progress` follows it."""
        if self._nursery is None:
            raise CkptfsError("the mover is not running")
        if self.progress is not None and not self.progress.finished:
            return {"started": False, "running": True}
        self.progress = Progress()
        self._nursery.start_soon(self._run_now, everything)
        return {"started": True}

    async def _run_now(self, everything: bool) -> None:
        progress = self.progress
        try:
            await self.tier_once(everything=everything, progress=progress, wait=True)
            await self._collect_garbage_and_publish()
        except (CkptfsError, OSError) as e:
            self._failed(e)
            progress.error = str(e)
        finally:
            progress.finished = True

    def _watch_log_use(self) -> None:
        """One log line when the log gets nearly full, one when it has room again."""
        use = self.log_use()
        if use > 0.9 and not self._nearly_full:
            self._nearly_full = True
            log.warning("log nearly full (%.0f%% of %d bytes in use): tiering moves hot "
                        "versions out; writers wait if it fills", use * 100, self.log.size_bytes)
        elif use < 0.8 and self._nearly_full:
            self._nearly_full = False
            log.info("log has room again (%.0f%% in use)", use * 100)

    def wake(self, urgent: bool = False) -> None:
        self._urgent = self._urgent or urgent
        self._wake.set()

    def _failed(self, e: BaseException) -> None:
        self._backoff_s = min(max(self._backoff_s * 2, 1.0), 60.0)
        self.retry_at = time.monotonic() + self._backoff_s
        message = f"{e}"
        if message != self.last_error:
            log.warning("tiering failed, retrying in %.0f s: %s", self._backoff_s, message)
        self.last_error = message
        self.state = "retrying"
        self._moved.set()
        self._moved = trio.Event()

    # ------------------------------------------------------------- the plan

    def log_use(self) -> float:
        return 1.0 - self.log.free_bytes / self.log.capacity_bytes

    def versions(self) -> tuple[list[Version], dict[int, list[bytes]]]:
        """Every version, newest first, and the paths of every file."""
        names: dict[int, tuple[int, bytes]] = {}
        paths: dict[int, list[bytes]] = {}
        by_parent: dict[int, list[Inode]] = {}
        for parent, name, ino, _cookie in ix.scan_entries(
                self.index, damaged=lambda why: self._damaged_record(FormatError(why))):
            try:
                inode = ix.get_inode(self.index, ino)
            except FormatError as e:
                self._damaged_record(e)
                continue
            names[ino] = (parent, name)
            if inode is not None and stat.S_ISREG(inode.mode):
                if ino not in paths:
                    by_parent.setdefault(parent, []).append(inode)
                paths.setdefault(ino, []).append(self._path(names, parent, name))
        versions: list[Version] = []
        gap_ns = int(self.policy.version_gap_s * 1e9)
        for parent, inodes in by_parent.items():
            inodes.sort(key=lambda i: i.mtime_ns)
            current: Optional[Version] = None
            for inode in inodes:
                alone = parent == ix.ROOT_INO
                # Measured from the version's first file, so saves every minute into
                # one directory still make a version per save, not one forever.
                if current is None or alone or inode.mtime_ns - current.oldest_ns > gap_ns:
                    current = Version(parent, inode.mtime_ns, oldest_ns=inode.mtime_ns)
                    versions.append(current)
                current.files.append(inode)
                current.newest_ns = inode.mtime_ns
        versions.sort(key=lambda v: v.newest_ns, reverse=True)
        return versions, paths

    @staticmethod
    def _path(names: dict[int, tuple[int, bytes]], parent: int, name: bytes) -> bytes:
        parts = [name]
        seen = 0
        while parent != ix.ROOT_INO and parent in names and seen < 4096:
            parent, up = names[parent]
            parts.append(up)
            seen += 1
        return b"/".join(reversed(parts))

    def plan(self, everything: bool = False) -> tuple[list[Chunk], list[Version], dict]:
        """Cold chunks still in the log, oldest versions' first."""
        versions, paths = self.versions()
        open_inos = set(self.fs.open_count) | self.files.open_inos()
        hot = [] if everything else versions[:self.policy.hot_versions]
        cold = [] if everything else versions[self.policy.hot_versions:]
        if everything:
            cold = versions
        keep: set[int] = set(self.reclaimer.pinned)
        for ino in open_inos:
            keep.update(e.chunk_no for e in ix.iter_extents(self.index, ino))
        hot_chunks: set[int] = set()
        for v in hot:
            for inode in v.files:
                hot_chunks.update(e.chunk_no for e in ix.iter_extents(self.index, inode.ino))
        chosen: dict[int, Chunk] = {}
        self._choose(cold, keep | hot_chunks, open_inos, chosen)
        # Over the high watermark: hot versions go too, oldest first, until what
        # this pass moves brings the log under the low watermark.
        if not everything and self.log_use() > self.policy.high_watermark:
            excess = (self.log_use() - self.policy.low_watermark) * self.log.capacity_bytes
            excess -= sum(c.length for c in chosen.values())
            while hot and excess > 0:
                v = hot.pop()
                cold.append(v)
                before = sum(c.length for c in chosen.values())
                hot_chunks = set()
                for other in hot:
                    for inode in other.files:
                        hot_chunks.update(e.chunk_no for e in ix.iter_extents(self.index,
                                                                              inode.ino))
                self._choose([v], keep | hot_chunks, open_inos, chosen)
                excess -= sum(c.length for c in chosen.values()) - before
        return list(chosen.values()), cold, paths

    def _choose(self, versions: list[Version], keep: set[int], open_inos: set[int],
                chosen: dict[int, Chunk]) -> None:
        """Add the chunks of these versions that are still in the log, oldest first."""
        for v in reversed(versions):
            for inode in v.files:
                if inode.ino in open_inos:
                    continue
                try:
                    for e in ix.iter_extents(self.index, inode.ino):
                        if e.chunk_no in keep or e.chunk_no in chosen:
                            continue
                        chunk = ix.get_chunk(self.index, e.chunk_no)
                        if chunk is not None and chunk.kind == CHUNK_LOG:
                            chosen[e.chunk_no] = ix.check_chunk_record(chunk)
                except (FormatError, DamagedData) as e:
                    self._damaged_record(e)     # the rest of this file stays hot

    def _damaged_record(self, e: CkptfsError) -> None:
        """Damaged index records stay where they are (fsck reports them); once per record."""
        if str(e) not in self._damage_seen:
            self._damage_seen.add(str(e))
            log.error("tiering skips a damaged index record: %s (run ckptfs fsck)", e)

    # ------------------------------------------------------------- a round

    async def tier_once(self, everything: bool = False,
                        progress: Optional[Progress] = None, wait: bool = False,
                        until_free: Optional[int] = None) -> int:
        """Move what the plan says is cold; return the logical bytes moved.

        One pass (or gc) at a time; a background pass finding one running skips.
        """
        if self._busy.locked() and not wait:
            return 0
        async with self._busy:
            self._running = True
            self.state = "moving"
            try:
                return await self._pass(everything, progress, until_free)
            finally:
                self._running = False
                self.state = "idle" if self.last_error is None else "retrying"
                self._moved.set()
                self._moved = trio.Event()

    async def _pass(self, everything: bool, progress: Optional[Progress],
                    until_free: Optional[int] = None) -> int:
        """One pass. until_free: a writer waits; stop once the log has that much
        free. A background pass stops early too when a writer waits for room."""
        self._urgent = False
        self._planned_seq = self.index.durable_seq
        chunks, cold, paths = self.plan(everything)
        self.backlog_bytes = sum(c.length for c in chunks)
        if progress is not None:
            progress.total_bytes += self.backlog_bytes
        moved = 0
        done = 0
        while done < len(chunks):
            batch = self._next_batch(chunks, done)
            taken, n = await self._move_batch(batch)
            moved += n
            done += taken
            self.backlog_bytes -= sum(c.length for c in batch[:taken])
            if progress is not None:
                progress.done_bytes += sum(c.length for c in batch[:taken])
            self._moved.set()
            self._moved = trio.Event()
            if until_free is not None:
                await self.index.wait_durable(self.index.current_seq())
                if self.log.free_bytes >= until_free:
                    break
            elif self._writers_waiting and progress is None:
                break               # let the waiting writer's pass have the lock
        if _pausing_at("pass-done"):
            await self.index.wait_durable(self.index.current_seq())
            await _pause("pass-done")
        self.rounds += 1
        self.last_error = None
        self._backoff_s = 0.0
        self.retry_at = 0.0
        return moved

    def _next_batch(self, chunks: list[Chunk], start: int) -> list[Chunk]:
        """The chunks for the next pack: pack_bytes of them (the writer may
        take fewer when the store has less room)."""
        size = 0
        end = start
        while end < len(chunks) and size < self.policy.pack_bytes \
                and end - start < packs.MAX_PACK_ENTRIES:
            size += chunks[end].length
            end += 1
        return chunks[start:end]

    async def _move_batch(self, batch: list[Chunk]) -> tuple[int, int]:
        """Pack a prefix of batch (all of it if the store has room); return how
        many chunks it took and the logical bytes moved."""
        if self._store_ahead is not None:
            raise StoreAhead(f"no pack is written: {self._store_ahead}")
        pack_no = self.index.allocate_id(b"next_pack")
        epoch = self.reclaimer.begin_read()  # the log bytes we read stay put meanwhile
        self._writing.add(pack_no)
        started = False
        try:
            # Durable before the pack's first byte: whatever happens from here
            # on, the next mount knows this pack as its own leftover.
            ix.put_pack_intent(self.index, pack_no, time.time_ns())
            await self.index.wait_durable(self.index.current_seq())
            started = True
            written = await self._mover_thread.run(self._write_pack_blocking, pack_no, batch)
        except StoreAhead as e:
            self._store_ahead = str(e)
            self._writing.discard(pack_no)
            if self.index.failure is None:
                ix.delete_pack_intent(self.index, pack_no)   # refused before its first byte
            raise
        except BaseException:
            self._writing.discard(pack_no)
            if started:
                self._leftovers.set()   # the pack may be there (a commit's outcome unknown)
            elif self.index.failure is None:
                ix.delete_pack_intent(self.index, pack_no)   # never begun (unmount)
            raise
        finally:
            self.reclaimer.end_read(epoch)
        entries, size = written
        self.packs_written += 1
        moved = self._flip(pack_no, size, batch, entries)     # names it, clears the intent
        self._writing.discard(pack_no)
        return len(entries), moved

    def _room_blocking(self) -> Optional[int]:
        """Bytes the next pack may take: the store's free space less a margin
        (None: the store cannot say)."""
        free = self.backend.free_bytes()
        if free is None:
            return None
        return free - STORE_MARGIN_BYTES

    def _write_pack_blocking(self, pack_no: int, batch: list[Chunk]
                             ) -> tuple[list[Optional[packs.PackEntry]], int]:
        """Read, compress and pack a prefix of the chunks (as many as the
        store has room for, at least one: BackingFull otherwise); commit the
        pack. Returns an entry (None: not moved) for each chunk taken. May block."""
        if _pausing_at("pack-begin"):
            _pause_blocking("pack-begin")
        name = packs.pack_name(pack_no)
        try:
            self.backend.size(name)
        except BlobMissing:
            pass
        else:
            # Pack numbers are never reused: this index is older than the store
            # (restored from a copy), or another filesystem writes packs there.
            raise StoreAhead(f"{self.backend.url}: {name} is in the store already: this "
                             "index is older than the store (restored from a copy?) or another "
                             "filesystem writes packs there; ckptfs fsck --repair raises its "
                             "counter")
        room = self._room_blocking()
        writer = packs.PackWriter.create(self.backend, name)
        out: list[Optional[packs.PackEntry]] = []
        by_id: dict[bytes, packs.PackEntry] = {}
        try:
            for chunk in batch:
                buf = memoryview(bytearray(chunk.length))
                try:
                    self.log.read_into(buf, chunk.log_off, chunk.length, chunk.crcs, 0)
                except DamagedData as e:
                    log.error("not tiering chunk %d: %s", chunk.chunk_no, e)
                    out.append(None)
                    continue
                cid = chunk.chunk_id or chunk_id(buf)
                if cid not in by_id:        # twins stored without dedup share one copy
                    enc = codec.encode_chunk(buf)
                    if room is not None and _pack_size(writer, len(enc.payload)) > room:
                        if not writer.entries:
                            raise BackingFull(f"{self.backend.url}: no space for another pack "
                                              f"({room + STORE_MARGIN_BYTES} bytes free, "
                                              f"{STORE_MARGIN_BYTES} kept free)")
                        break               # the pack ends here; the rest goes in the next
                    by_id[cid] = writer.add(cid, enc.codec, enc.param, enc.payload,
                                            chunk.length)
                    if len(writer) == 1 and _pausing_at("pack-writing"):
                        _pause_blocking("pack-writing")
                out.append(by_id[cid])
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        if _pausing_at("pack-written"):
            _pause_blocking("pack-written")
        return out, writer.bytes_written

    def _flip(self, pack_no: int, size: int, batch: list[Chunk],
              entries: list[Optional[packs.PackEntry]]) -> int:
        """Point every chunk that is still where we read it at its pack copy;
        record the pack and clear its intent (one batch)."""
        ix.put_pack(self.index, ix.PackInfo(pack_no, 0, 0, size))
        ix.delete_pack_intent(self.index, pack_no)
        moved = 0
        for old, entry in zip(batch, entries):
            if entry is None:
                continue
            cur = ix.get_chunk(self.index, old.chunk_no)
            if cur is None or cur.kind != CHUNK_LOG or cur.log_off != old.log_off:
                continue            # gone or changed meanwhile: its pack copy is dead
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
        self.moved_bytes += moved
        return moved

    # ------------------------------------------------------------ snapshots

    async def publish(self, force: bool = False) -> Optional[Published]:
        """A snapshot of the namespace to the store, unless nothing changed since
        the last one. Writers never wait for it (it has its own lock)."""
        async with self._publishing:
            return await self._publish_locked(force)

    async def _publish_locked(self, force: bool) -> Optional[Published]:
        """Publish (the caller holds the publish lock); the dead packs it deleted
        lose their marks in the index."""
        if self._store_ahead is not None:
            raise StoreAhead(self._store_ahead)
        deleting = list(self.publisher.pending_pack_deletes)
        try:
            done = await self.publisher.publish(force=force)
        except StoreAhead as e:
            self._store_ahead = str(e)
            raise
        if done is not None:
            for name in deleting:
                n = packs.pack_number(name)
                if n is not None:
                    ix.delete_dead_pack(self.index, n)
        return done

    async def _collect_garbage_and_publish(self) -> None:
        """After a pass: packs with no live chunk leave the index (marked dead),
        then a snapshot, which deletes their blobs."""
        died = self.collect_garbage()
        if died and _pausing_at("pack-dead"):
            await self.index.wait_durable(self.index.current_seq())
            await _pause("pack-dead")
        await self.publish()

    def _resume_dead_pack_deletes(self) -> None:
        """Dead packs a crash (or an unpublished snapshot) left: the next
        snapshot deletes them, as it would have before the crash."""
        pending = set(self.publisher.pending_pack_deletes)
        for n in ix.dead_packs(self.index):
            name = packs.pack_name(n)
            if name not in pending:
                self.publisher.pending_pack_deletes.append(name)

    async def publish_at_unmount(self) -> None:
        """The last snapshot, after the final commits (the mover is stopped)."""
        try:
            done = await self.publish()
        except StoreAhead as e:
            log.warning("no snapshot published at unmount: %s", e)
            return
        except (CkptfsError, OSError) as e:
            log.warning("no snapshot published at unmount: %s (ckptfs recover would "
                        "restore an older one)", e)
            return
        if done is not None:
            log.info("snapshot %d published: %d entries, %d files (%d not wholly in the "
                     "store)", done.seq, done.entries, done.files, done.incomplete_files)

    # --------------------------------------------------------------- cleanup

    def leftover_packs(self) -> list[int]:
        """Packs interrupted passes left: an intent, no pass writing it now."""
        return [n for n in ix.pack_intents(self.index) if n not in self._writing]

    async def _clean_leftovers_task(self) -> None:
        """From mount on: delete what interrupted passes left, in the background
        (a slow or absent store never holds up the mount), retrying with
        backoff until it is done; again whenever a pack write fails."""
        delay_s = 1.0
        said = None
        while True:
            try:
                await self.clean_leftovers()
            except (CkptfsError, OSError) as e:
                if str(e) != said:
                    said = str(e)
                    log.warning("could not remove packs left by an interrupted tiering pass "
                                "(retrying): %s", e)
                await trio.sleep(delay_s)
                delay_s = min(delay_s * 2, 60.0)
                continue
            delay_s, said = 1.0, None
            await self._leftovers.wait()
            self._leftovers = trio.Event()

    async def clean_leftovers(self) -> int:
        """Undo interrupted passes: delete each pack (and its temporary) that an
        intent names and no pack record does, then clear the intents. Only
        packs this filesystem's intents name are touched, and a committed one
        only once this mount has published a snapshot: then the newest head in
        the store is of this index (a publish below a newer head is refused),
        which names no chunk of a pack it has no record of; a head from an
        index newer than this one (restored from an older copy) may. Returns
        how many packs were deleted."""
        leftovers = self.leftover_packs()
        if not leftovers:
            return 0
        named = set()
        for n in leftovers:
            try:
                if ix.get_pack(self.index, n) is not None:
                    named.add(n)        # flipped after all: the pack is live
            except FormatError:
                named.add(n)            # damaged record: keep the pack (fsck reports it)
        gone = [n for n in leftovers if n not in named]
        if gone:
            committed = await trio.to_thread.run_sync(self._committed_blocking, gone,
                                                      limiter=self.limiter)
            if committed and self.publisher.last is None:
                await self.publish(force=True)      # StoreAhead: kept, retried later
            await trio.to_thread.run_sync(self._delete_leftovers_blocking, gone,
                                          limiter=self.limiter)
            if committed:
                log.info("removed %d packs left by an interrupted tiering pass", len(committed))
        for n in leftovers:
            if n not in self._writing:
                ix.delete_pack_intent(self.index, n)
        return len(committed) if gone else 0

    def _committed_blocking(self, pack_nos: list[int]) -> list[int]:
        """Those of these packs whose blob is in the store. May block."""
        out = []
        for n in pack_nos:
            try:
                self.backend.size(packs.pack_name(n))
            except BlobMissing:
                continue
            out.append(n)
        return out

    def _delete_leftovers_blocking(self, pack_nos: list[int]) -> None:
        for n in pack_nos:
            name = packs.pack_name(n)
            self.backend.delete(name)
            self.backend.remove_incomplete_of(name)

    def collect_garbage(self) -> int:
        """Packs whose every chunk is gone leave the index, marked dead in the same
        batch; their blobs go with the next snapshot. Returns how many."""
        zombie_packs = self.reclaimer.zombie_packs()
        died = 0
        for pack in list(ix.scan_packs(self.index)):
            if pack.live_chunks == 0 and pack.pack_no not in zombie_packs:
                ix.delete_pack(self.index, pack.pack_no)
                ix.put_dead_pack(self.index, pack.pack_no, time.time_ns())   # crash-proof
                died += 1
                name = packs.pack_name(pack.pack_no)
                # The newest snapshot may still name its chunks: the blob goes once
                # a snapshot of a state without them is published.
                self.index.after_durable(
                    lambda name=name: self.publisher.pending_pack_deletes.append(name))
        return died

    async def gc(self) -> dict[str, int]:
        """`ckptfs gc`: publish a snapshot, then delete dead packs (and packs a
        crash left unnamed), older snapshot heads and the objects only they
        reach, manifests of the format before snapshots, and leftovers of
        interrupted writes.

        Holds the pass lock throughout: a pack being written and not yet named
        by the index must not look like a stray; and the publish lock: a head
        being written must keep every object it names."""
        async with self._busy, self._publishing:
            dead = sum(1 for pack in ix.scan_packs(self.index) if pack.live_chunks == 0)
            self.collect_garbage()
            await self.index.wait_durable(self.index.current_seq())
            done = await self._publish_locked(force=True)
            named = {packs.pack_name(n) for n in done.packs_named}
            named |= {packs.pack_name(n) for n in ix.scan_pack_numbers(self.index)}
            stray, temp = await trio.to_thread.run_sync(self._gc_blocking, named,
                                                        limiter=self.limiter)
            # No pass runs (the lock): every intent is a leftover, every dead
            # pack unnamed by the snapshot: their blobs are gone now.
            for n in self.leftover_packs():
                ix.delete_pack_intent(self.index, n)
            for n in ix.dead_packs(self.index):
                if packs.pack_name(n) not in named:
                    ix.delete_dead_pack(self.index, n)
            await self.index.wait_durable(self.index.current_seq())
            return {"dead_packs": dead + stray, "stale_manifests": done.manifests_deleted,
                    "old_heads": done.heads_deleted, "objects": done.objects_deleted,
                    "temporary_files": temp, "snapshot": done.seq}

    def _gc_blocking(self, named: set[str]) -> tuple[int, int]:
        # Packs neither the index nor the snapshot just published names: written
        # but never flipped to (a crash, or a batch whose chunks all went
        # meanwhile), or dead before a crash. Only once no move runs.
        stray = [n for n in self.backend.list(packs.PACK_PREFIX) if n not in named]
        for name in stray:
            self.backend.delete(name)
        temp = self.backend.remove_incomplete(older_than=0)    # no write runs: see gc
        return len(stray), temp

    # ---------------------------------------------------------- backpressure

    async def make_room(self, nbytes: int, timeout_s: float = 600.0) -> None:
        """Wait while tiering frees log space for a writer; NoSpace if it cannot.

        The log is full, so the pass moves every committed file not open,
        the newest versions too, oldest first. Concurrent writers queue on
        the pass lock; one whose pass finds nothing left to move gives up.
        """
        started = time.monotonic()
        try:
            with trio.move_on_after(timeout_s):
                while self.log.free_bytes < nbytes + (1 << 20):
                    before = self.log.free_bytes
                    try:
                        self._writers_waiting += 1
                        try:
                            # Room for this write and a few like it, not a full pass.
                            moved = await self.tier_once(
                                everything=True, wait=True,
                                until_free=nbytes + self.policy.pack_bytes + (1 << 20))
                        finally:
                            self._writers_waiting -= 1
                    except (CkptfsError, OSError) as e:
                        self._failed(e)
                        # A pass that failed part way (the store filled up) may
                        # still have moved enough: its flips free room once durable.
                        await self.index.wait_durable(self.index.current_seq())
                        if self.log.free_bytes >= nbytes + (1 << 20):
                            return
                        raise NoSpace(f"log full and tiering fails: {e}") from e
                    # Moved chunks' space comes back once their flip is durable.
                    await self.index.wait_durable(self.index.current_seq())
                    if moved == 0 and self.log.free_bytes <= before:
                        raise NoSpace(f"log full ({self.log.free_bytes} bytes free) and "
                                      "nothing committed is left to move out")
                return
            raise NoSpace(f"log full: tiering freed too little in {timeout_s:.0f} s")
        finally:
            self.longest_wait_s = max(self.longest_wait_s, time.monotonic() - started)

    # ----------------------------------------------------------------- stats

    def stats(self) -> dict[str, object]:
        return {
            "tier_state": self.state,
            "tier_backlog_bytes": self.backlog_bytes,
            "tier_moved_bytes": self.moved_bytes,
            "tier_packs_written": self.packs_written,
            "tier_leftover_packs": len(self.leftover_packs()),
            "tier_last_error": self.last_error,
            "tier_longest_writer_wait_s": round(self.longest_wait_s, 3),
            "cold_cache_hits": 0 if self.cold is None else self.cold.hits,
            "cold_fetches": 0 if self.cold is None else self.cold.fetches,
            "backing": self.backend.url,
            "snapshot_seq": None if self.publisher.last is None else self.publisher.last.seq,
            "snapshot_age_s": None if self.publisher.last is None
            else round(time.time() - self.publisher.last_time, 1),
        }


def _pausing_at(point: str) -> bool:
    """The test hook (DEBUG_PAUSE) names this point and has not paused yet."""
    return not _paused_once and DEBUG_PAUSE.partition(":")[0] == point


def _pause_begins(point: str) -> str:
    global _paused_once
    _paused_once = True
    path = DEBUG_PAUSE.partition(":")[2]
    log.warning("debug pause at %s (CKPTFS_DEBUG_PAUSE) until %s is removed", point, path)
    with open(path, "w") as f:
        f.write(point)
    return path


def _pause_blocking(point: str) -> None:
    """The test hook reached its point on the mover's thread: say so with its
    file, wait while the file exists. Blocks."""
    path = _pause_begins(point)
    while os.path.exists(path):
        time.sleep(0.02)
    log.warning("debug pause at %s over", point)


async def _pause(point: str) -> None:
    """The same on the trio thread: only the mover's task waits."""
    path = _pause_begins(point)
    while os.path.exists(path):
        await trio.sleep(0.02)
    log.warning("debug pause at %s over", point)


def _pack_size(writer: packs.PackWriter, payload_bytes: int) -> int:
    """The pack's size once committed with one more payload of this size."""
    return (writer.bytes_written + payload_bytes
            + (len(writer) + 1) * packs.ENTRY_BYTES + packs.FOOTER_BYTES)

