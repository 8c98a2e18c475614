"""Tiering's supervisor: cold chunks move, compressed, to backing storage.

`Tierer` runs the parts (each given what it needs in its constructor, built
here from the `TierSetup` the filesystem was made with) and says when:
- the planner (`tierplan.Planner`) says which chunks are cold;
- the mover (`mover.Mover`) packs them into the store and flips their records;
- the collector (`collector.Collector`) publishes snapshots and deletes what
  they let go (dead packs, leftovers of interrupted passes, old snapshots);
- publishing (`publish.PublishLoop`, with a volume) copies what commits add
  into packs (through the mover) and publishes within `publish_delay`;
- the prefetcher (`coldstore.Prefetcher`) runs in its nursery; reading cold
  chunks back is the cold store's (`coldstore.ColdStore`).

Fenced (another node took the volume over: `fence`): no pass runs, nothing
is written to or deleted from the store, for the rest of the mount.

When: a pass every `interval_s` once something was committed since the last
plan (sooner when woken), followed by garbage collection and a snapshot (a
pass that moved nothing and killed no pack publishes its snapshot once the
writers pause: `snapshot_may_wait`);
`ckptfs tier --now` starts one at once (`start_now`, followed by `progress`);
a writer that finds the log full waits while a pass moves everything
committed and not open, the newest versions too, until it has room
(`make_room`, backpressure). One pass (or gc) at a time. Failures (store
missing, read-only, full, slow) leave hot data alone; passes are retried with
backoff and say why in the log and in `ckptfs stat` (`stats`).

Everything here runs on the trio thread and never blocks (the parts offload).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import trio

from . import packs
from .coldstore import ColdStore, Prefetcher
from .collector import Collector
from .debugpause import pause, pausing_at
from .errors import CkptfsError, Fenced, NoSpace
from .index import Chunk, Index
from .mover import Mover, StoreAheadFence
from .pmemlog import PmemLog
from .publish import PublishLoop
from .reclaim import Reclaimer
from .snapshots import Publisher
from .tierplan import Planner, TierPolicy, TierSetup

log = logging.getLogger(__name__)

# A background pass that moved nothing publishes its snapshot once no commit
# came for SNAPSHOT_QUIET_S (the writers paused), at the latest
# SNAPSHOT_DEFER_MAX_S after it was due: the snapshot's walk and blob writes
# beside a burst of small files took ~25 % of the writer's rate on 2 cores
# (docs/BENCHMARKS.md, session 15).
SNAPSHOT_QUIET_S = 1.0
SNAPSHOT_DEFER_MAX_S = 30.0


def snapshot_may_wait(moved_bytes: int, now: float, last_commit_at: float,
                      owed_since: Optional[float]) -> bool:
    """Whether the snapshot after a background pass (or one such a pass left
    owed since owed_since) may wait for the writers to pause. Not when the
    pass moved chunks: its snapshot names their packs at once."""
    if moved_bytes or now - last_commit_at >= SNAPSHOT_QUIET_S:
        return False
    return owed_since is None or now - owed_since < SNAPSHOT_DEFER_MAX_S


@dataclass
class Progress:
    total_bytes: int = 0
    done_bytes: int = 0
    finished: bool = False
    error: Optional[str] = None


class Tierer:
    """Runs the planner, mover, collector and prefetcher; backpressure for writers."""

    def __init__(self, index: Index, plog: PmemLog, reclaimer: Reclaimer,
                 open_inos: Callable[[], Iterable[int]], setup: TierSetup,
                 cold: Optional[ColdStore] = None,
                 prefetcher: Optional[Prefetcher] = None) -> None:
        """open_inos(): files open or with uncommitted changes (they stay hot)."""
        self.index = index
        self.log = plog
        self.reclaimer = reclaimer
        self.open_inos = open_inos
        self.backend = setup.backend
        self.policy: TierPolicy = setup.policy
        self.cold = cold                # for its figures in stats
        self.prefetcher = prefetcher    # runs in the mover's nursery
        self.limiter = trio.CapacityLimiter(1)          # the store: one pack at a time
        fence = StoreAheadFence()
        self.planner = Planner(index, plog, setup.policy)
        # Dedup across volumes only for a mount that publishes (chunkindex.py).
        self.shared = setup.shared if setup.volume is not None and not setup.read_only \
            else None
        self.mover = Mover(index, plog, reclaimer, setup.backend, fence, self.shared)
        # Snapshots go to the filesystem's volume; a read-only mount of one
        # that has none publishes nothing.
        self.publisher = None if setup.volume is None else \
            Publisher(index, setup.backend, setup.volume, limiter=self.limiter,
                      shared=self.shared)
        self.collector = Collector(index, reclaimer, setup.backend, self.publisher, self.mover,
                                   fence, self.limiter, self.shared,
                                   setup.policy.pack_bytes)
        self.fenced: Optional[str] = None
        self.publishing: Optional[PublishLoop] = None
        if self.publisher is not None and not setup.read_only:
            self.publishing = PublishLoop(index, self, self.publisher, setup.publish_delay_s,
                                          setup.policy.pack_bytes)
        # A pass plans and packs under the publish lock: a chunk a round is
        # copying meanwhile would otherwise be packed twice, the second copy
        # dead weight in the store until gc (a small store filled with them).
        self._copying = self.publisher.lock if self.publishing is not None else trio.Lock()
        if setup.read_only:
            self.fence("mounted read-only")     # cold reads only: nothing is moved
        self._wake = trio.Event()
        self._moved = trio.Event()        # set after every round: writers re-check room
        self._urgent = False
        self._busy = trio.Lock()          # one pass or gc at a time
        self._nursery: Optional[trio.Nursery] = None
        self.state = "idle"
        self.last_error: Optional[str] = None
        self.retry_at = 0.0
        self._backoff_s = 0.0
        self.backlog_bytes = 0
        self.rounds = 0
        self.progress: Optional[Progress] = None
        self.longest_wait_s = 0.0
        self._planned_seq = -1
        self._nearly_full = False
        self._writers_waiting = 0
        self._last_commit_at = -math.inf        # a commit with changes became durable
        self._snapshot_owed_since: Optional[float] = None
        index.on_durable.append(self._committed)

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
                    self.collector.resume_dead_pack_deletes()
                    nursery.start_soon(self.collector.clean_leftovers_task)
                    if self.publishing is not None:
                        await nursery.start(self.publishing.run)
                    task_status.started()
                    await self._loop()
        finally:
            self._nursery = None
            self.mover.close()
            self._stopped.set()

    def unmounting(self, timeout_s: float) -> None:
        """A clean unmount begins (before `stop`): store calls in flight are
        not waited for once cancelled (a pack write gives up within timeout_s,
        `Mover.finish_by`; the lease and heads checks are abandoned), so that
        a store that is down or slow cannot hold the unmount up."""
        self.mover.finish_by(timeout_s)
        if self.publisher is not None:
            self.publisher.abandon_checks = True

    async def stop(self) -> None:
        """Cancel the mover and wait until it is gone (a pack in flight is
        finished but never named: its intent has the next mount delete it;
        after `unmounting`, not waited for)."""
        self._scope.cancel()
        await self._stopped.wait()

    async def _loop(self) -> None:
        pass_at = time.monotonic() + self.policy.interval_s
        while True:
            wait_s = pass_at - time.monotonic()
            if self._snapshot_owed_since is not None:
                wait_s = min(wait_s, SNAPSHOT_QUIET_S)      # look for the writers' pause
            with trio.move_on_after(max(wait_s, 0.0)):
                await self._wake.wait()
            woken, self._wake = self._wake.is_set(), trio.Event()
            if self.fenced is not None:
                pass_at = time.monotonic() + self.policy.interval_s
                continue            # another node holds the volume, or mounted read-only
            if not woken and time.monotonic() < pass_at:
                await self._publish_owed()
                continue
            pass_at = time.monotonic() + self.policy.interval_s
            self._watch_log_use()
            if time.monotonic() < self.retry_at and not self._urgent:
                continue
            if self.index.durable_seq == self._planned_seq and not self._urgent \
                    and self.last_error is None:
                await self._publish_owed()
                continue            # nothing committed since the last plan: nothing new is cold
            try:
                moved = await self.tier_once()
                may_wait = snapshot_may_wait(moved, time.monotonic(), self._last_commit_at,
                                             self._snapshot_owed_since)
                if await self.collector.collect_garbage_and_publish(may_defer=may_wait):
                    self._snapshot_owed_since = None
                elif self._snapshot_owed_since is None:
                    self._snapshot_owed_since = time.monotonic()
            except (CkptfsError, OSError) as e:
                self._failed(e)
            except Exception as e:  # noqa: BLE001 - a bug must not take the mount down
                log.exception("tiering pass failed unexpectedly")
                self._failed(e)

    def _committed(self, seq: int, opened_at: float) -> None:
        self._last_commit_at = time.monotonic()

    async def _publish_owed(self) -> None:
        """The snapshot a pass left owed, once the writers paused (or it has
        waited SNAPSHOT_DEFER_MAX_S)."""
        owed_since = self._snapshot_owed_since
        if owed_since is None or time.monotonic() < self.retry_at \
                or snapshot_may_wait(0, time.monotonic(), self._last_commit_at, owed_since):
            return      # none owed, backing off after a failure, or the writers busy
        try:
            await self.collector.publish()
            self._snapshot_owed_since = None
        except (CkptfsError, OSError) as e:
            self._failed(e)
        except Exception as e:  # noqa: BLE001 - a bug must not take the mount down
            log.exception("snapshot publish failed unexpectedly")
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
            await self.collector.collect_garbage_and_publish()
            self._snapshot_owed_since = None
        except (CkptfsError, OSError) as e:
            self._failed(e)
            progress.error = str(e)
        finally:
            progress.finished = True

    def _watch_log_use(self) -> None:
        """One log line when the log gets nearly full, one when it has room again."""
        use = self.planner.log_use()
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

    def fence(self, reason: str) -> None:
        """Another node holds the volume (or a read-only mount): no pass runs, no
        pack is written, nothing is published or deleted from now on."""
        self.fenced = self.mover.fenced = self.collector.fenced = reason

    def _failed(self, e: BaseException) -> None:
        if isinstance(e, Fenced) and self.publishing is not None:
            self.publishing.fence(str(e))       # the index turns read-only too
        self._backoff_s = min(max(self._backoff_s * 2, 1.0), 60.0)
        self.retry_at = time.monotonic() + self._backoff_s
        message = f"{e}"
        if message != self.last_error:
            log.warning("tiering failed, retrying in %.0f s: %s", self._backoff_s, message)
        self.last_error = message
        self.state = "retrying"
        self._moved.set()
        self._moved = trio.Event()

    # ------------------------------------------------------------- a round

    async def tier_once(self, everything: bool = False,
                        progress: Optional[Progress] = None, wait: bool = False,
                        until_free: Optional[int] = None) -> int:
        """Move what the plan says is cold; return the logical bytes moved.

        One pass (or gc) at a time; a background pass finding one running skips.
        """
        if self._busy.locked() and not wait:
            return 0
        if self.fenced is not None:
            raise Fenced(self.fenced)
        async with self._busy:
            self.state = "moving"
            try:
                return await self._pass(everything, progress, until_free)
            finally:
                self.state = "idle" if self.last_error is None else "retrying"
                self._moved.set()
                self._moved = trio.Event()

    async def _plan_and_move(self, everything: bool, progress: Optional[Progress],
                             until_free: Optional[int]) -> int:
        """The pass's plan and moves (the caller holds the publish lock)."""
        self._urgent = False
        self._planned_seq = self.index.durable_seq
        await self.planner.prepare()
        chunks = self.planner.plan(set(self.open_inos()), self.reclaimer.pinned,
                                   everything).chunks
        if progress is not None:
            progress.total_bytes += sum(c.length for c in chunks)
        # Published chunks have their copy in a pack already: only the log copy goes.
        moved = self.mover.drop_log_copies([c for c in chunks if c.copied])
        chunks = [c for c in chunks if not c.copied]
        self.backlog_bytes = sum(c.length for c in chunks)
        if progress is not None:
            progress.done_bytes += moved
        done = 0
        while done < len(chunks):
            batch = self._next_batch(chunks, done)
            taken, n = await self.mover.move_batch(batch)
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
        return moved

    async def _pass(self, everything: bool, progress: Optional[Progress],
                    until_free: Optional[int] = None) -> int:
        """One pass. until_free: a writer waits; stop once the log has that much
        free. A background pass stops early too when a writer waits for room."""
        async with self._copying:
            moved = await self._plan_and_move(everything, progress, until_free)
        if pausing_at("pass-done"):
            await self.index.wait_durable(self.index.current_seq())
            await pause("pass-done")
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

    # ------------------------------------------------------- snapshots, gc

    async def publish_at_unmount(self, timeout_s: float) -> None:
        """After the final commits (the mover and publishing stopped): with
        publishing on, its last round (every chunk not in the store yet copied,
        then a covering head) within timeout_s; else the last snapshot."""
        if self.publishing is not None and self.publishing.delay_s is not None:
            await self.publishing.round_at_unmount(timeout_s)
        else:
            await self.collector.publish_at_unmount()

    async def publish(self) -> None:
        """A snapshot now, unless nothing changed (publishing's rounds)."""
        await self.collector.publish()

    async def share_known_chunks(self) -> int:
        """Publishing's rounds: one copy of what two nodes packed at once
        (`Mover.share_known_chunks`); the caller holds the publish lock."""
        return await self.mover.share_known_chunks()

    async def copy_batch(self, batch: list[Chunk]) -> tuple[int, int]:
        """Publishing's copies (`Mover.copy_batch`); the caller holds the publish lock."""
        return await self.mover.copy_batch(batch)

    async def pack_source(self, chunk: Chunk, start: int, pack_bytes: int):
        """Publishing an adopted file's bytes (`Mover.pack_source`); the caller
        holds the publish lock and flips with `flip_source`."""
        return await self.mover.pack_source(self.reclaimer.sources, chunk, start, pack_bytes)

    def flip_source(self, *args) -> int:
        """`Mover.flip_source`."""
        return self.mover.flip_source(*args)

    async def gc(self) -> dict[str, int]:
        """`ckptfs gc` (`Collector.gc`), with no pass running meanwhile."""
        async with self._busy:
            return await self.collector.gc()

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
            "tier_moved_bytes": self.mover.moved_bytes,
            "tier_packs_written": self.mover.packs_written,
            "tier_leftover_packs": len(self.collector.leftover_packs()),
            "tier_last_error": self.last_error,
            "tier_longest_writer_wait_s": round(self.longest_wait_s, 3),
            "cold_cache_hits": 0 if self.cold is None else self.cold.hits,
            "cold_fetches": 0 if self.cold is None else self.cold.fetches,
            "backing": self.backend.url,
            "snapshot_seq": None if self.publisher is None or self.publisher.last is None
            else self.publisher.last.seq,
            "snapshot_age_s": None if self.publisher is None or self.publisher.last is None
            else round(time.time() - self.publisher.last_time, 1),
            "snapshot_owed_s": None if self._snapshot_owed_since is None
            else round(time.monotonic() - self._snapshot_owed_since, 1),
            **(self.publishing.stats() if self.publishing is not None else {}),
            **(self.shared.stats() if self.shared is not None else {}),
        }
