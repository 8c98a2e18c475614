"""Publishing: every committed version copied to the store within publish_delay.

A node's log is lost with the node. So that the newest checkpoint survives
it, every chunk a commit adds to the log is *copied* (not moved) to a pack
in the backing store within `publish_delay` seconds of the commit, and then
a snapshot head naming it is published (docs/STORE.md, "Publishing"). The
chunk stays hot: restarts on this node read it from the log at log speed;
tiering it later only drops its log copy (`ix.drop_log_copy`).

`PublishLoop` does it in rounds, on the trio thread except for the byte
work:

1. the index lists every LOG chunk without a copy (`unpublished`, kept in
   the same transactions as the chunks);
2. `Tierer.copy_batch`, the mover's own pack writing (a pack intent durable
   first, then on its worker thread: read from the log, verified, compress,
   write the pack: temp name, fsync, rename), a pack number from this
   volume's space;
3. trio thread: every chunk still where it was read gets its copy
   (`ix.copy_to_pack`) in the open index batch; that batch made durable;
4. a snapshot of the durable state (`snapshots.Publisher`, under its lock):
   it now names those chunks as in the store; the head goes last, and only
   while this node holds the volume (`volumes.Volume.fence`).

Writers never wait for any of it: the loop reads committed chunks only, and
their log bytes stay where they are (a read epoch keeps a chunk deleted
meanwhile from having its space reused under the copy). A store that fails
(down, full, throttling) makes the loop retry with backoff; the lag grows
and shows (`ckptfs stat`: publish_lag_s, publish_backlog_bytes,
publish_last_error) and everything is caught up once the store answers.

Lag: the age of the oldest durable change (any index batch) that no
covering head describes yet (`Lag`). A head *covers* the state it describes
when that state lists no chunk left to copy but those this loop could not
copy (damaged in the log): a head a tiering pass or gc publishes while
copies are still to be made describes the new files as not in the store,
and covers nothing. `ckptfs sync --published` waits until a covering head
describes every change durable when it was asked (`wait_published`).

A round that fails after a covering head of everything durable when it
began was published (by a tiering pass, gc, or a round) had nothing left to
do: its error is stale (the store answered since it began) and is not
recorded; a covering head of the state a failed round began at clears the
error it recorded.

Files adopted from SOURCE (there before the first mount) have no log
chunks: their bytes are in the original files, which die with the node too.
Each round also packs up to SOURCE_BYTES_PER_ROUND of them after the
copies (`Tierer.pack_source`: read beneath SOURCE with no symlink followed,
only from the file adopted; cut into chunks as writes are), and points the
files' extents at those chunks (`flip_source`): an adopted file then lives
in the store (its original is deleted; reads go through the cold cache).
Which files: found once per mount (a scan of the durable index on a worker
thread) when the index holds any. A file open meanwhile needs no care: its
reads find the original until they end, and an uncommitted overwrite
commits over whichever extents are committed then (a chunk it still names
is kept as a pinned zombie, `Reclaimer`). Until every one is packed, no
head covers its state (an original that
cannot be read as the file adopted counts as uncopyable, like a damaged log
chunk, and is logged).

Fenced (another node took the volume over): the loop stops for good, and
the index turns read-only with the reason (`Index.fence`). The loop also
looks for that every FENCE_POLL_S while idle, so a node that comes back
after a takeover learns it before its next save.

Which functions may block: none here; the byte work runs on worker threads.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import trio

from . import index as ix
from . import packs
from .debugpause import pause, pausing_at
from .errors import CkptfsError, DamagedData, Fenced, OperationFailed
from .index import CHUNK_LOG, CHUNK_SOURCE, Chunk, Index
from .snapshots import Publisher

if TYPE_CHECKING:
    from .tier import Tierer

log = logging.getLogger(__name__)

DEFAULT_DELAY_S = 5.0           # publish_delay when a store is given explicitly
FENCE_POLL_S = 30.0             # an idle loop checks its lease this often
COALESCE_S = 1.0                # lag entries closer than this are one (bounded memory)
BACKOFF_MAX_S = 60.0
SCAN_CHUNKS = 65536             # unpublished chunks looked at per scan
SOURCE_PACKS_PER_ROUND = 4      # adopted files' bytes packed per round, in packs


class Lag:
    """When the oldest durable change that no published head describes was made.

    Fed every durable batch (seq, when its first change arrived: monotonic)
    and every published state (the seq a head describes). Batches closer
    than COALESCE_S are kept as one entry (the oldest time wins, so the lag
    is never under-reported), so an outage of hours costs a few thousand
    entries."""

    def __init__(self) -> None:
        self._entries: deque[tuple[int, float]] = deque()     # (first seq, opened at)
        self._last_seq = 0

    def durable(self, seq: int, opened_at: float) -> None:
        self._last_seq = max(self._last_seq, seq)
        if self._entries and opened_at - self._entries[-1][1] < COALESCE_S:
            return
        self._entries.append((seq, opened_at))

    def seed(self, since: float) -> None:
        """Changes of unknown age are waiting (a mount): count from `since`."""
        self._entries.appendleft((0, since))

    def published(self, state_seq: int) -> None:
        while self._entries and self._entries[0][0] <= state_seq:
            _, opened_at = self._entries.popleft()
            nxt = self._entries[0][0] if self._entries else self._last_seq + 1
            if nxt > state_seq + 1 and self._last_seq > state_seq:
                # Batches after the published state were folded into this entry.
                self._entries.appendleft((state_seq + 1, opened_at))
                return

    def age_s(self, now: Optional[float] = None) -> float:
        if not self._entries:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self._entries[0][1])


@dataclass
class PublishStats:
    copied_bytes: int = 0
    packs_written: int = 0
    rounds: int = 0


class PublishLoop:
    """Copies what commits add to the log into the store and publishes heads
    (module docstring). `delay_s` None: publishing is off (snapshots are
    still published after tiering passes)."""

    def __init__(self, index: Index, tierer: "Tierer", publisher: Publisher,
                 delay_s: Optional[float], pack_bytes: int = 64 << 20) -> None:
        """tierer: whose mover writes the copies and whose collector publishes."""
        self.index = index
        self.tierer = tierer
        self.publisher = publisher
        self.delay_s = delay_s
        self.pack_bytes = pack_bytes
        self.gather_s = 0.0 if delay_s is None else min(1.0, delay_s / 4)
        self.lag = Lag()
        self.stats_ = PublishStats()
        self.state = "off" if delay_s is None else "idle"
        self.last_error: Optional[str] = None
        # The newest durable state (index seq) a covering head describes.
        self.covered_seq = -1
        # Chunks the last copy phase found and could not copy (damaged log
        # bytes, a damaged record): a head listing only these still covers.
        self._uncopyable: frozenset[int] = frozenset()
        self._round_begun_seq = 0          # what the round under way must publish
        self._error_begun_seq = 0          # ... and what the one that failed had to
        # Adopted files still to pack: [chunk number, inode, next offset]; None
        # until looked for.
        self._sources: Optional[list[list[int]]] = None
        # Heads cover their state only from this durable state on (every
        # adopted file packed, or found unreadable); 0: the index holds none.
        self._sources_done_seq = 0 if index.counters[b"stored_source_bytes"] == 0 \
            else float("inf")
        self.fenced: Optional[str] = None
        self._wake = trio.Event()
        self._urgent = False
        self._changed = trio.Event()       # set after every round, good or bad
        self._backoff_s = 0.0
        self.retry_at = 0.0
        self._last_fence_check = time.monotonic()
        self._scope: Optional[trio.CancelScope] = None
        self._stopped = trio.Event()
        self.index.on_durable.append(self._durable)
        publisher.on_published.append(self._head_published)
        if delay_s is not None:
            # What this mount found in the index has waited since an unknown
            # time: at least since now (the first round publishes it).
            self.lag.seed(time.monotonic())

    # ------------------------------------------------------------- the task

    def _durable(self, seq: int, opened_at: float) -> None:
        self.lag.durable(seq, opened_at)
        self._wake.set()

    def _head_published(self, state_seq: int) -> None:
        """A head was published by anyone (a round, a tiering pass, gc): it
        covers its state if that lists nothing to copy but what cannot be."""
        last = self.publisher.last
        if last is None or last.unpublished is None \
                or not last.unpublished <= self._uncopyable \
                or state_seq < self._sources_done_seq:
            return
        if state_seq <= self.covered_seq:
            return
        self.covered_seq = state_seq
        self.lag.published(state_seq)
        if self.last_error is not None and self.fenced is None \
                and state_seq >= self._error_begun_seq:
            self._clear_error()         # what the failed round had to publish is published

    def wake(self, urgent: bool = False) -> None:
        self._urgent = self._urgent or urgent
        self._wake.set()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Rounds until `stop`, or until fenced."""
        try:
            with trio.CancelScope() as self._scope:
                task_status.started()
                if self.delay_s is not None:
                    await self._loop()
                else:
                    await trio.sleep_forever()
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            await self._stopped.wait()

    def _work_waiting(self) -> bool:
        # Every chunk to copy came with a durable batch, which the lag counts
        # until a head describes it (chunks whose log bytes are damaged stay
        # in the backlog, but start no rounds of their own).
        return self.index.durable_seq > self.covered_seq or self.lag.age_s() > 0 \
            or bool(self._sources)

    async def _loop(self) -> None:
        while self.fenced is None:
            if not self._work_waiting() or time.monotonic() < self.retry_at:
                wait_s = FENCE_POLL_S if not self._work_waiting() else \
                    max(0.0, self.retry_at - time.monotonic())
                with trio.move_on_after(wait_s):
                    await self._wake.wait()
                self._wake = trio.Event()
                if not self._work_waiting() or (time.monotonic() < self.retry_at
                                                and not self._urgent):
                    if time.monotonic() - self._last_fence_check >= FENCE_POLL_S:
                        await self._check_fence()
                    continue
            if not self._urgent and self.gather_s:
                await trio.sleep(self.gather_s)        # a checkpoint's files close together
            self._urgent = False
            self._wake = trio.Event()
            try:
                await self.round()
                self._succeeded()
            except Fenced as e:
                self.fence(str(e))
            except (CkptfsError, OSError) as e:
                await self._round_failed(e)
            except Exception as e:  # noqa: BLE001 - a bug must not take the mount down
                log.exception("publishing failed unexpectedly")
                await self._round_failed(e)
            finally:
                self._changed.set()
                self._changed = trio.Event()

    async def _check_fence(self) -> None:
        self._last_fence_check = time.monotonic()
        try:
            await trio.to_thread.run_sync(self.publisher.volume.fence)
        except Fenced as e:
            self.fence(str(e))
        except CkptfsError as e:
            log.debug("lease check failed (the store is away?): %s", e)

    # ------------------------------------------------------------- a round

    async def round(self, sources: bool = True) -> None:
        """Copy every unpublished chunk into packs, then publish a snapshot.
        sources: also pack some of the files adopted from SOURCE."""
        tierer = self.tierer
        self._round_begun_seq = self.index.durable_seq
        # Nothing more goes to the store once another node holds the volume.
        # (At unmount a cancelled round stops waiting: a store call only.)
        await trio.to_thread.run_sync(self.publisher.volume.fence,
                                      abandon_on_cancel=self.publisher.abandon_checks)
        self.state = "copying"
        # Under the publish lock: gc (which holds it too) must never take a
        # copy being written for a stray, nor its intent for a leftover.
        async with self.publisher.lock:
            await tierer.share_known_chunks()       # copies other nodes stored too
            after = -1
            uncopyable: set[int] = set()
            while True:
                nos = ix.scan_unpublished(self.index, after, SCAN_CHUNKS)
                if not nos:
                    break
                after = nos[-1]
                chunks = []
                for no in nos:
                    chunk = ix.get_chunk(self.index, no)
                    if chunk is not None and chunk.kind == CHUNK_LOG and not chunk.copied:
                        if ix.chunk_record_problem(chunk) is None:
                            chunks.append(chunk)
                        else:
                            uncopyable.add(no)
                start = 0
                while start < len(chunks):
                    batch = self._next_batch(chunks, start)
                    taken, copied = await tierer.copy_batch(batch)
                    start += max(taken, 1)
                    self.stats_.packs_written += 1
                    self.stats_.copied_bytes += copied
                for chunk in chunks:
                    cur = ix.get_chunk(self.index, chunk.chunk_no)
                    if cur is not None and cur.kind == CHUNK_LOG and not cur.copied \
                            and cur.log_off == chunk.log_off:
                        uncopyable.add(chunk.chunk_no)      # its log bytes are damaged
            if sources:
                await self._pack_sources()
            await self.index.wait_durable(self.index.current_seq())
            self._uncopyable = frozenset(uncopyable)
            if self._sources == [] and self._sources_done_seq == float("inf"):
                self._sources_done_seq = self.index.durable_seq
                log.info("every file adopted from SOURCE is in the store")
        self.state = "publishing"
        await tierer.publish()
        self._last_fence_check = time.monotonic()
        # No head if nothing changed since the last one: it may cover now
        # (what it listed turned out uncopyable).
        if self.publisher.published_seq >= 0:
            self._head_published(self.publisher.published_seq)

    async def round_at_unmount(self, timeout_s: float) -> None:
        """A clean unmount's last round, after its final commits (the loop and
        the mover stopped: `daemon.shut_down`): every unpublished chunk copied,
        then a covering head, within `timeout_s` (unmount_publish_timeout).
        A store that is down, full or slow: one warning with the bytes only
        on this node (they stay in its log; the next mount publishes them).
        Adopted files still to pack wait for the next mount (they may be
        large). Never raises but on cancellation."""
        if self.delay_s is None or self.fenced is not None:
            return
        mover = self.tierer.mover
        why = None
        mover.finish_by(timeout_s)
        self.publisher.abandon_checks = True
        try:
            with trio.move_on_after(timeout_s) as scope:
                try:
                    await self.round(sources=False)
                    self._succeeded()
                except Fenced as e:
                    self.fence(str(e))
                    return
                except (CkptfsError, OSError) as e:
                    why = str(e)
                except Exception as e:  # noqa: BLE001 - the unmount goes on
                    log.exception("publishing at unmount failed unexpectedly")
                    why = str(e)
            if scope.cancelled_caught:
                why = f"not done within unmount_publish_timeout={timeout_s:g} s"
        finally:
            mover.let_go()
        left = self.index.counters[b"unpublished_bytes"]
        if why is None and self.covered_seq >= self._round_begun_seq:
            log.info("unmount: every committed byte is in the store %s (snapshot of state %d)",
                     self.publisher.backend.url, self.covered_seq)
            return
        if why is None:
            why = "the last snapshot does not cover everything" + \
                  ("" if self._sources_done_seq != float("inf")
                   else " (files adopted from SOURCE are still to be packed)")
        if left == 0:
            log.warning("unmount: every chunk is in the store %s but no snapshot there names "
                        "the last commits (%s); the next mount publishes one (ckptfs recover "
                        "meanwhile restores the previous one)", self.publisher.backend.url, why)
            return
        log.warning("unmount: %d bytes committed are only on this node, not in the store %s "
                    "(%s); they stay in the log and the next mount publishes them",
                    left, self.publisher.backend.url, why)

    async def _pack_sources(self) -> None:
        """Pack up to SOURCE_PACKS_PER_ROUND packs of adopted files' bytes and
        point their extents there (module docstring). The caller holds the
        publish lock."""
        if self._sources_done_seq != float("inf"):
            return
        if self._sources is None:
            self._sources = await trio.to_thread.run_sync(self._find_sources_blocking)
            log.info("%d files adopted from SOURCE are to be packed into the store",
                     len(self._sources))
        packs_left = SOURCE_PACKS_PER_ROUND
        while self._sources and packs_left > 0:
            item = self._sources[0]
            chunk_no, ino, start = item
            chunk = ix.get_chunk(self.index, chunk_no)
            if chunk is None or chunk.kind != CHUNK_SOURCE or start >= chunk.length:
                self._sources.pop(0)        # overwritten or deleted meanwhile, or done
                continue
            try:
                pack_no, size, end, pieces = await self.tierer.pack_source(
                    chunk, start, self.pack_bytes)
            except DamagedData as e:
                log.error("file adopted from SOURCE not published: %s", e)
                self._sources.pop(0)        # uncopyable: like a damaged log chunk
                continue
            packs_left -= 1
            self.stats_.packs_written += 1
            self.stats_.copied_bytes += self.tierer.flip_source(pack_no, size, chunk, ino,
                                                                start, end, pieces)
            item[2] = end

    def _find_sources_blocking(self) -> list[list[int]]:
        """[chunk number, inode, 0] of every adopted file in the durable index.
        May block (two scans)."""
        with self.index.read_view() as view:
            adopted = {c.chunk_no for c in ix.scan_chunks(view, damaged=lambda why: None)
                       if c.kind == CHUNK_SOURCE}
            found: dict[int, int] = {}
            if adopted:
                for ino, e in ix.scan_extents(view, damaged=lambda why: None):
                    if e.chunk_no in adopted:
                        found.setdefault(e.chunk_no, ino)
        return [[no, ino, 0] for no, ino in sorted(found.items())]

    def _next_batch(self, chunks: list[Chunk], start: int) -> list[Chunk]:
        """About pack_bytes of chunks for the next pack (the writer may take
        fewer when the store has less room)."""
        size = 0
        end = start
        while end < len(chunks) and size < self.pack_bytes \
                and end - start < packs.MAX_PACK_ENTRIES:
            size += chunks[end].length
            end += 1
        return chunks[start:end]

    # ---------------------------------------------------------- outcomes

    def _succeeded(self) -> None:
        self.stats_.rounds += 1
        self._clear_error()

    def _clear_error(self) -> None:
        if self.last_error is not None:
            log.info("publishing caught up (lag %.1f s)", self.lag.age_s())
        self.last_error = None
        self._backoff_s = 0.0
        self.retry_at = 0.0
        self.state = "idle"

    async def _round_failed(self, e: BaseException) -> None:
        if pausing_at("publish-failed"):
            await pause("publish-failed")
        if self.covered_seq >= self._round_begun_seq and self.fenced is None:
            # A covering head of everything this round had to publish came out
            # meanwhile (the store answered since it began): nothing failed.
            log.info("a publishing round that began before the newest covering snapshot "
                     "failed (%s); nothing of it is left to publish", e)
            if self.last_error is None:
                self.state = "idle"
            return
        self._error_begun_seq = self._round_begun_seq
        self._failed(e)

    def _failed(self, e: BaseException) -> None:
        cap = BACKOFF_MAX_S if self.delay_s is None else max(1.0, min(BACKOFF_MAX_S,
                                                                      self.delay_s))
        self._backoff_s = min(max(self._backoff_s * 2, 1.0), cap)
        self.retry_at = time.monotonic() + self._backoff_s
        message = str(e)
        if message != self.last_error:
            log.warning("publishing failed, retrying in %.0f s (lag %.1f s): %s",
                        self._backoff_s, self.lag.age_s(), message)
        self.last_error = message
        self.state = "retrying"

    def fence(self, reason: str) -> None:
        if self.fenced is not None:
            return
        self.fenced = reason
        self.state = "fenced"
        self.last_error = reason
        log.error("%s", reason)
        self.index.fence(reason)
        self.tierer.fence(reason)
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------ waiting

    async def wait_published(self, seq: int) -> None:
        """Until a published head describes the durable state `seq` (`ckptfs
        sync --published`). Fenced, or OperationFailed with publishing off."""
        if self.delay_s is None:
            raise OperationFailed("publishing is off on this mount (-o publish_delay=off): "
                                  "nothing is copied to the store until it is tiered")
        while self.covered_seq < seq:
            if self.fenced is not None:
                raise Fenced(self.fenced)
            self.wake(urgent=True)
            await self._changed.wait()

    # ------------------------------------------------------------- stats

    def stats(self) -> dict[str, object]:
        return {
            "publish_delay_s": self.delay_s,
            "publish_state": self.state,
            "publish_lag_s": round(self.lag.age_s(), 3),
            "publish_backlog_bytes": self.index.counters[b"unpublished_bytes"],
            "published_bytes": self.stats_.copied_bytes,
            "publish_packs_written": self.stats_.packs_written,
            "publish_last_error": self.last_error,
            "published_copy_bytes": self.index.counters[b"copy_pack_bytes"],
            "volume": self.publisher.volume.name,
            "volume_generation": self.publisher.volume.gen,
            "volume_fenced": self.fenced is not None,
        }
