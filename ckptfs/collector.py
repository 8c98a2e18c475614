"""The tiering collector: snapshots to the store, and what they let go.

Publishing (`publish`): a snapshot of the whole namespace goes to the store
(`snapshots.Publisher`, docs/STORE.md) after a background pass and at
unmount, so `ckptfs recover` can rebuild the newest state from the store
alone; one at a time (its own lock: writers never wait for it), never at or
below a head the store already has (`StoreAhead`: the mover's fence goes up).

What goes, and when:
- Dead packs (`collect_garbage`): a pack whose every chunk is gone leaves the
  index, marked dead in the same batch; its blob is deleted once a snapshot
  newer than that is published (the newest head may still name its chunks).
  Marks a crash left are picked up at mount (`resume_dead_pack_deletes`).
- Leftovers of interrupted passes (`clean_leftovers`, a background task from
  mount on, retried with backoff, and again whenever a pack write fails): a
  pack an intent names and no record does is deleted (with its temporary),
  a committed one only once this mount has published a snapshot (so the
  store's newest head is of this index, which names none of its chunks).
  Only packs this filesystem's intents name are ever touched.
- `ckptfs gc` (`gc`, under the mover's pass lock): a snapshot, then dead and
  stray packs, older heads and what only they reach, legacy manifests,
  temporaries.
- Dedup across volumes (`shared`, chunkindex.py): a dead pack of this
  volume is condemned and deleted only if no other volume holds a ref to it;
  a dead pack of another volume loses this volume's ref. gc first moves
  chunks to the smallest-numbered copy (`Mover.share_known_chunks`), has
  the mover rewrite what is still used of own packs less than half used and
  of condemned packs of other volumes (`_repack`, `Mover.repack`: so copies
  two nodes packed beside chunks of their own still go), then sweeps: any condemned pack no volume holds a ref to any more is deleted,
  whoever condemned it. Safe while other nodes publish: no locks, no clocks.

It may not write packs or choose what is cold. Blocks: the `*_blocking`
functions (worker threads under the store limiter); the rest runs on the
trio thread.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

import trio

from . import index as ix
from . import packs
from .backing.base import Backend
from .debugpause import pause, pausing_at
from .errors import BlobMissing, CkptfsError, Fenced, FormatError, StoreAhead
from .index import Index
from .mover import Mover, StoreAheadFence
from .reclaim import Reclaimer
from .snapshots import RETENTION_S, Published, Publisher
from .volumes import SPACE_SHIFT

if TYPE_CHECKING:
    from .chunkindex import SharedChunks

log = logging.getLogger("ckptfs.tier")


class Collector:
    """Publishes snapshots; deletes dead packs, leftovers and old snapshots."""

    def __init__(self, index: Index, reclaimer: Reclaimer, backend: Backend,
                 publisher: Optional[Publisher], mover: Mover, fence: StoreAheadFence,
                 limiter: trio.CapacityLimiter,
                 shared: Optional["SharedChunks"] = None, pack_bytes: int = 64 << 20) -> None:
        """publisher: None for a read-only mount without a volume (it publishes
        and deletes nothing). shared: dedup across volumes (chunkindex.py)."""
        self.index = index
        self.reclaimer = reclaimer
        self.backend = backend
        self.publisher = publisher
        self.mover = mover
        self.fence = fence
        self.limiter = limiter                 # the store's: one pack (or delete) at a time
        # One snapshot, copy round (publish.py) or gc at a time: the publisher's lock.
        self._publishing = publisher.lock if publisher is not None else trio.Lock()
        self.fenced: Optional[str] = None      # the volume went to another node
        self.shared = shared
        self.swept = (0, 0)           # the last gc's condemned packs: deleted, still held
        self.pack_bytes = pack_bytes  # a repack's pack holds about this much
        mover.on_unused_refs = self.release_unused_refs

    # ------------------------------------------------------------ snapshots

    async def publish(self, force: bool = False) -> Optional[Published]:
        """A snapshot of the namespace to the store, unless nothing changed since
        the last one. Writers never wait for it (it has its own lock)."""
        if self.publisher is None:
            return None
        async with self._publishing:
            return await self._publish_locked(force)

    async def _publish_locked(self, force: bool, retention_s: float = RETENTION_S
                              ) -> Optional[Published]:
        """Publish (the caller holds the publish lock); the dead packs it deleted
        lose their marks in the index."""
        self.fence.check()
        if self.fenced is not None:
            raise Fenced(self.fenced)
        try:
            done = await self.publisher.publish(force=force, retention_s=retention_s)
        except StoreAhead as e:
            self.fence.close(e)
            raise
        if done is not None:
            for name in done.deleted_packs:
                n = packs.pack_number(name)
                if n is not None:
                    ix.delete_dead_pack(self.index, n)
        return done

    async def collect_garbage_and_publish(self, may_defer: bool = False) -> bool:
        """After a pass: packs with no live chunk leave the index (marked dead),
        then a snapshot, which deletes their blobs. may_defer: the snapshot
        may wait (the caller publishes it later) unless a pack died, whose
        blob only a snapshot deletes. True when the snapshot was published
        (or found nothing changed)."""
        died = self.collect_garbage()
        if died and pausing_at("pack-dead"):
            await self.index.wait_durable(self.index.current_seq())
            await pause("pack-dead")
        if may_defer and not died:
            return False
        await self.publish()
        return True

    def resume_dead_pack_deletes(self) -> None:
        """Dead packs a crash (or an unpublished snapshot) left: the next
        snapshot deletes them, as it would have before the crash."""
        if self.publisher is None:
            return
        pending = set(self.publisher.pending_pack_deletes)
        for n in ix.dead_packs(self.index):
            name = packs.pack_name(n)
            if name not in pending:
                self.publisher.pending_pack_deletes.append(name)

    async def publish_at_unmount(self) -> None:
        """The last snapshot, after the final commits (the mover is stopped)."""
        if self.fenced is not None:
            return
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
        return [n for n in ix.pack_intents(self.index) if n not in self.mover.writing]

    async def clean_leftovers_task(self) -> None:
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
            await self.mover.failed_write()

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
        if not leftovers or self.publisher is None or self.fenced is not None:
            return 0                    # a holder of the volume cleans up, no one else
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
            if n not in self.mover.writing:
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
        self.publisher.volume.fence()          # deletes only while this node holds it
        for n in pack_nos:
            name = packs.pack_name(n)
            self.backend.delete(name)
            self.backend.remove_incomplete_of(name)

    def collect_garbage(self) -> int:
        """Packs whose every chunk is gone leave the index, marked dead in the same
        batch; their blobs go with the next snapshot. Returns how many."""
        if self.publisher is None:
            return 0                    # no snapshots here: the blobs wait for a mount with one
        zombie_packs = self.reclaimer.zombie_packs()
        died = 0
        for pack in list(ix.scan_packs(self.index)):
            if pack.live_chunks == 0 and pack.pack_no not in zombie_packs:
                ix.delete_pack(self.index, pack.pack_no)
                ix.put_dead_pack(self.index, pack.pack_no, time.time_ns())   # crash-proof
                if self.shared is not None:
                    self.shared.no_adopt.add(pack.pack_no)     # never named again here
                died += 1
                name = packs.pack_name(pack.pack_no)
                # The newest snapshot may still name its chunks: the blob goes once
                # a snapshot of a state without them is published.
                self.index.after_durable(
                    lambda name=name: self.publisher.pending_pack_deletes.append(name))
        return died

    def release_unused_refs(self, pack_nos: set[int]) -> None:
        """Other volumes' packs the mover made a ref to and then named nothing
        in: the ref goes with the next head, and this mount never takes
        those packs again (so the ref is never dropped while it is needed)."""
        if self.publisher is None or self.shared is None:
            return
        for pack_no in pack_nos:
            self.shared.no_adopt.add(pack_no)
            self.publisher.pending_pack_deletes.append(packs.pack_name(pack_no))

    async def gc(self) -> dict[str, int]:
        """`ckptfs gc`: publish a snapshot, then delete dead packs (and packs a
        crash left unnamed), older snapshot heads and the objects only they
        reach, manifests of the format before snapshots, and leftovers of
        interrupted writes.

        The caller holds the mover's pass lock throughout (a pack being
        written and not yet named by the index must not look like a stray);
        this holds the publish lock (a head being written must keep every
        object it names)."""
        if self.publisher is None:
            raise CkptfsError("this mount has no volume to publish to (mounted read-only)")
        if self.fenced is not None:
            raise Fenced(self.fenced)
        async with self._publishing:
            await self.mover.share_known_chunks(force=True)    # one copy of what two stored
            repacked = await self._repack()
            dead = sum(1 for pack in ix.scan_packs(self.index) if pack.live_chunks == 0)
            self.collect_garbage()
            await self.index.wait_durable(self.index.current_seq())
            done = await self._publish_locked(force=True, retention_s=0)
            named = {packs.pack_name(n) for n in done.packs_named}
            named |= {packs.pack_name(n) for n in ix.scan_pack_numbers(self.index)}
            own_space = self.index.counters[b"next_pack"] >> SPACE_SHIFT
            stray, temp = await trio.to_thread.run_sync(self._gc_blocking, named, own_space,
                                                        limiter=self.limiter)
            # No pass runs (the lock): every intent is a leftover, every dead
            # pack unnamed by the snapshot: their blobs are gone now.
            for n in self.leftover_packs():
                ix.delete_pack_intent(self.index, n)
            for n in ix.dead_packs(self.index):
                if packs.pack_name(n) not in named:
                    ix.delete_dead_pack(self.index, n)
            await self.index.wait_durable(self.index.current_seq())
            return {"dead_packs": dead + stray, "repacked_chunks": repacked,
                    "condemned_deleted": self.swept[0],
                    "condemned_held": self.swept[1], "stale_manifests": done.manifests_deleted,
                    "old_heads": done.heads_deleted, "objects": done.objects_deleted,
                    "temporary_files": temp, "snapshot": done.seq}

    async def _repack(self) -> int:
        """gc, with dedup across volumes: what is still used of packs that
        should not stay alive for it is rewritten into new packs of this
        volume (`Mover.repack`), so those packs die here: own packs less than
        half used (their other chunks were renamed to another volume's copy,
        or died), and other volumes' packs their owner condemned (held alive
        by this volume's ref alone). Returns how many chunks moved."""
        shared = self.shared
        if shared is None or self.publisher is None:
            return 0
        condemned = set(await trio.to_thread.run_sync(shared.condemned_packs,
                                                      limiter=self.limiter))
        targets = set()
        for pack in ix.scan_packs(self.index):
            if pack.pack_no in self.mover.writing or pack.live_chunks == 0:
                continue
            if shared.is_own(pack.pack_no):
                if pack.size_bytes and pack.live_bytes * 2 < pack.size_bytes:
                    targets.add(pack.pack_no)
            elif pack.pack_no in condemned:
                targets.add(pack.pack_no)
        if not targets:
            return 0
        chunks = [c for c in ix.scan_chunks(self.index)
                  if c.in_store and c.pack_no in targets and c.chunk_id
                  and c.chunk_id != ix.NO_CHUNK_ID]
        chunks.sort(key=lambda c: (c.pack_no, c.pack_off))
        moved = 0
        start = 0
        while start < len(chunks):
            size = 0
            end = start
            while end < len(chunks) and size < self.pack_bytes \
                    and end - start < packs.MAX_PACK_ENTRIES:
                size += chunks[end].stored_length
                end += 1
            try:
                moved += await self.mover.repack(chunks[start:end])
            except (Fenced, StoreAhead):
                raise
            except (CkptfsError, OSError) as e:
                # A full or failing store: gc still deletes what it can (that
                # is what a full store needs); the rest is repacked next time.
                log.warning("gc could not repack (%s); the packs stay as they are", e)
                break
            start = end
        if moved:
            log.info("gc rewrote %d chunks out of %d packs that should not stay for them",
                     moved, len(targets))
        return moved

    def _gc_blocking(self, named: set[str], own_space: int) -> tuple[int, int]:
        # Packs neither the index nor the snapshot just published names: written
        # but never flipped to (a crash, or a batch whose chunks all went
        # meanwhile), or dead before a crash. Only once no move runs, and only in
        # this volume's pack spaces: other volumes' packs are theirs.
        self.publisher.volume.fence()          # deletes only while this node holds it
        spaces = self.publisher.volume.state().spaces | {own_space}
        stray = [n for n in self.backend.list(packs.PACK_PREFIX)
                 if n not in named and (packs.pack_number(n) is None       # no one's
                                        or packs.pack_number(n) >> SPACE_SHIFT in spaces)]
        shared = self.shared
        if shared is not None:
            # Condemned and kept for another volume's ref: the sweep's business.
            condemned = {packs.pack_name(n) for n in shared.condemned_packs()}
            stray = [n for n in stray if n not in condemned]
        for name in stray:
            n = packs.pack_number(name)
            if shared is not None and n is not None:
                shared.delete_pack_blocking(n)      # announced? another volume may name it
            else:
                self.backend.delete(name)
        if shared is not None:
            self.swept = shared.sweep_blocking()    # other nodes publish meanwhile: safe
        temp = self.backend.remove_incomplete(older_than=0)    # no write runs: see gc
        return len(stray), temp
