"""The cold store: chunks in backing-store packs, read back verified; and the
prefetcher that reads them ahead of a sequential reader.

`ColdStore` reads a cold chunk's payload range from its pack, checks its
CRC, decompresses it (`codec`) and verifies its BLAKE3 id before a byte is
used; decoded chunks stay in a bounded LRU cache, and a chunk being fetched
by one thread is waited for, not fetched again, by the others. Neighbours in
a pack come with one read, and one native call checks the ids of the raw
ones and the CRCs of the others (GIL released: a raw payload's id over all
its bytes proves them, its CRC would add nothing); a raw chunk is cached as a view of
that read, whose buffer is used again once no view of it is left. A long run
is read into a page-aligned buffer with room at both ends
(`Backend.read_span_into`: a local store reads it there with O_DIRECT,
rounded out to whole blocks; from 1 MiB on, whole transparent huge pages, so
the disk gets one request per read), so what is checked and served is the
daemon's own copy, made once. It
is thread-safe; `get`, `get_many` and `read_into` may block (worker threads
only). It may not write to the store nor touch the index: the records it is
given say where each chunk is.

`Prefetcher` fetches chunks into the cache in the background, at most
2 MiB of pack bytes at a time (one huge page), in the order asked, on fetch
threads of its own that run while `run` does (started by whoever
supervises the mount's background tasks); asked before it runs, or after, it
does nothing. A fetch thread never waits for the trio thread: it tells it
what it fetched (for the READs answered in C) and takes the next batch. `prefetch` and what it is told run on the trio
thread.
"""

from __future__ import annotations

import logging
import mmap
import sys
import threading
import time
from collections import OrderedDict, deque
from typing import Callable, Iterable, Optional

import trio

from . import codec
from . import index as ix
from . import native, packs
from .backing.base import SPAN_ALIGN, Backend
from .chunker import chunk_id
from .errors import CkptfsError, DamagedData
from .index import CHUNK_PACK, Chunk

log = logging.getLogger(__name__)

# Pack bytes per fetch, at most: a batch's run of neighbours, rounded out to
# SPAN_ALIGN at both ends, fits one huge page (`_buffer`), so the disk gets
# it as one request (session 21).
PREFETCH_BATCH_BYTES = (2 << 20) - 2 * SPAN_ALIGN
# Fetch threads: 8 keep more pack reads in flight than 4; the reader catches
# up with the fetches less often, so more READs are answered in C (session 14).
PREFETCH_THREADS = 8
# A reader whose last look-ahead is older than this no longer shares the cache.
READER_IDLE_S = 2.0
MIN_DEPTH_BYTES = 4 << 20        # the least a reader is read ahead, however many share

# The native check hashes raw payloads itself when the module has BLAKE3;
# an all-zero id in its input means "not this one".
_NATIVE_IDS = native.chunk_feed_hashes()
_NO_ID = bytes(32)

# A run of neighbours in a pack is read at most this much at a time.
SPAN_BYTES = 4 << 20
# Runs this long or longer are read into buffers of whole SPAN_CLASS_BYTES
# (page-aligned anonymous mappings, SPAN_ALIGN spare at each end: the store
# may read whole blocks straight into them, `Backend.read_span_into`), used
# again once no chunk in them is cached or being copied: no fresh pages
# (faults, zeroing) per read. Shorter ones are read into new bytes.
SPAN_CLASS_BYTES = 256 << 10
IDLE_SPAN_BYTES = 32 << 20      # buffers kept for reuse, at most
# Runs whose buffer needs this much or more get whole huge pages instead
# (transparent, MADV_HUGEPAGE, 2 MiB-aligned): an O_DIRECT read into 4 KiB
# pages reaches the disk as requests of at most max_segments pages (254
# here: 1 MiB reads went out as ~2 requests of ~0.5 MiB), into a huge page
# as one; this VM's disk gave 8 reads of 1 MiB in flight 1.39-1.46 GB/s into
# 4 KiB pages, 1.70-1.89 into huge pages, and of 2 MiB 2.56-2.91 (session 21).
HUGE_BYTES = 2 << 20
HUGE_FROM_BYTES = 1 << 20


class _Span:
    """Bytes read or decoded at once, of which cached chunks are views: the
    cache counts all of it while any of them is cached (its true memory)."""

    __slots__ = ("size", "live", "buf")

    def __init__(self, size: int, buf: Optional[mmap.mmap] = None) -> None:
        self.size = size
        self.live = 0               # cached chunks that are views of it
        self.buf = buf              # a reusable buffer, or None


class ColdStore:
    """Cold chunk bytes: fetched from packs, verified, cached. Thread-safe."""

    def __init__(self, backend: Backend, cache_bytes: int) -> None:
        self.backend = backend
        self.cache_limit = cache_bytes
        # chunk id -> its verified bytes (a view of what was read), their span
        # and their address (for the FUSE fast path: `cached_run`)
        self._cache: OrderedDict[bytes, tuple[memoryview, _Span, int]] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._fetching: dict[bytes, threading.Event] = {}
        self._idle: dict[int, list[mmap.mmap]] = {}     # size -> buffers to reuse
        self._idle_bytes = 0
        self.buffers_reused = 0
        self.fetches = 0
        self.fetched_bytes = 0
        self.hits = 0

    def read_into(self, out: memoryview, chunk: Chunk, chunk_off: int) -> None:
        """Fill out with chunk bytes from chunk_off. May block."""
        if chunk_off + len(out) > chunk.length:
            raise DamagedData(f"cold chunk {chunk.chunk_no}: an extent reaches byte "
                              f"{chunk_off + len(out)} of a {chunk.length}-byte chunk")
        data = self.get(chunk)
        if len(data) != chunk.length:       # cached under its id by a record that differs
            raise DamagedData(f"cold chunk {chunk.chunk_no}: its record says {chunk.length} "
                              f"bytes, its id names {len(data)}")
        out[:] = data[chunk_off:chunk_off + len(out)]

    def read_cached_into(self, out: memoryview, chunk: Chunk, chunk_off: int) -> bool:
        """Like `read_into` if the chunk is in the cache (a copy: the trio
        thread may call it); False, touching nothing, if it is not."""
        if chunk_off + len(out) > chunk.length:
            raise DamagedData(f"cold chunk {chunk.chunk_no}: an extent reaches byte "
                              f"{chunk_off + len(out)} of a {chunk.length}-byte chunk")
        with self._lock:
            entry = self._cache.get(chunk.chunk_id)
            if entry is None:
                return False
            self._cache.move_to_end(chunk.chunk_id)
            self.hits += 1
        data = entry[0]
        if len(data) != chunk.length:
            raise DamagedData(f"cold chunk {chunk.chunk_no}: its record says {chunk.length} "
                              f"bytes, its id names {len(data)}")
        out[:] = data[chunk_off:chunk_off + len(out)]
        return True

    def cached_run(self, chunks: Iterable[tuple[int, Chunk]]
                   ) -> list[tuple[int, memoryview, int]]:
        """Each (key, chunk)'s verified bytes (read-only) and their address,
        in turn, under one lock, up to the first not in the cache or not as
        long as its record says (the daemon's read of it says what is
        wrong): (key, bytes, address) of those before it. The trio thread
        may call it; chunks is read with the lock held. Whoever keeps a view
        keeps the memory at its address as it is: the cache may evict the
        chunk, never reuse that memory."""
        out = []
        with self._lock:
            cache = self._cache
            for key, chunk in chunks:
                entry = cache.get(chunk.chunk_id)
                if entry is None or len(entry[0]) != chunk.length:
                    break
                cache.move_to_end(chunk.chunk_id)
                out.append((key, entry[0], entry[2]))
        return out

    def cached(self, chunk: Chunk) -> bool:
        with self._lock:
            return chunk.chunk_id in self._cache or chunk.chunk_id in self._fetching

    def get(self, chunk: Chunk) -> memoryview:
        """The chunk's bytes, verified (read-only). May block."""
        while True:
            key = chunk.chunk_id
            with self._lock:
                entry = self._cache.get(key)
                if entry is not None:
                    self._cache.move_to_end(key)
                    self.hits += 1
                    return entry[0]
                waiting = self._fetching.get(key)
                if waiting is None:
                    self._fetching[key] = threading.Event()
            if waiting is not None:
                waiting.wait()      # another thread is fetching it: use its result
                continue
            return self._fetch_claimed([chunk])[0]

    def get_many(self, chunks: list[Chunk]) -> None:
        """Fetch chunks into the cache, neighbours in a pack with one read. May block."""
        done = threading.Event()    # one for all the chunks this call fetches
        mine = []
        with self._lock:
            for c in chunks:
                if c.chunk_id not in self._cache and c.chunk_id not in self._fetching:
                    self._fetching[c.chunk_id] = done
                    mine.append(c)
        if mine:
            self._fetch_claimed(mine)

    def will_read(self, chunks: list[Chunk]) -> None:
        """Tell the store which pack bytes these chunks will be read from (a
        run of neighbours in a pack at once): a local store reads them in the
        background, so the fetches that follow find them in the page cache
        rather than each wait for the disk in turn. May block briefly."""
        i = 0
        while i < len(chunks):
            first = chunks[i]
            end = first.pack_off + first.stored_length
            i += 1
            while (i < len(chunks) and chunks[i].pack_no == first.pack_no
                   and chunks[i].pack_off == end):
                end += chunks[i].stored_length
                i += 1
            self.backend.will_read(packs.pack_name(first.pack_no), first.pack_off,
                                   end - first.pack_off)

    def _fetch_claimed(self, chunks: list[Chunk]) -> list[memoryview]:
        """Fetch chunks this thread claimed, cache them, wake who waits. May block."""
        try:
            got = self._verified(chunks)
            with self._lock:
                for chunk, (data, span, address) in zip(chunks, got):
                    if chunk.chunk_id not in self._cache and span.size <= self.cache_limit:
                        self._cache[chunk.chunk_id] = (data, span, address)
                        if span.live == 0:
                            self._cached_bytes += span.size
                        span.live += 1
                while self._cached_bytes > self.cache_limit and self._cache:
                    _, (_, old, _) = self._cache.popitem(last=False)
                    old.live -= 1
                    if old.live == 0:
                        self._cached_bytes -= old.size
                        if old.buf is not None and self._idle_bytes < IDLE_SPAN_BYTES:
                            self._idle.setdefault(old.size, []).append(old.buf)
                            self._idle_bytes += old.size
                        old.buf = None
            return [data for data, _, _ in got]
        finally:
            # get_many claims all its chunks with one event: each is set once.
            events = set()
            with self._lock:
                for chunk in chunks:
                    ev = self._fetching.pop(chunk.chunk_id, None)
                    if ev is not None:
                        events.add(ev)
            for ev in events:
                ev.set()

    def _verified(self, chunks: list[Chunk]) -> list[tuple[memoryview, _Span, int]]:
        """The chunks' bytes, checked, each with the span it is a view of and
        its address:
        each raw payload's BLAKE3 id; each encoded one's CRC, then decoded
        and its id. A run of neighbours in one pack is one read and one native
        call that checks the id of every raw payload (the chunk's bytes: its
        view is used as it is, no copy; the id over all of them proves them,
        so their CRC is not computed) and the CRC of every other, GIL
        released; encoded chunks are decoded and their ids checked here.

        Records are checked first (kind, lengths within MAX_CHUNK_BYTES): a
        damaged one is DamagedData before anything is read or allocated."""
        for c in chunks:
            if c.kind != CHUNK_PACK:
                raise DamagedData(f"chunk {c.chunk_no} is not a cold chunk (kind {c.kind})")
            ix.check_chunk_record(c)
        out: list[tuple[memoryview, _Span, int]] = []
        i = 0
        while i < len(chunks):
            j = i + 1
            while (j < len(chunks) and chunks[j].pack_no == chunks[i].pack_no
                   and chunks[j].pack_off == chunks[j - 1].pack_off + chunks[j - 1].stored_length
                   and chunks[j].pack_off + chunks[j].stored_length - chunks[i].pack_off
                   <= SPAN_BYTES):
                j += 1
            first, last = chunks[i], chunks[j - 1]
            name = packs.pack_name(first.pack_no)
            size = last.pack_off + last.stored_length - first.pack_off
            buf = self._buffer(size) if size >= SPAN_CLASS_BYTES else None
            try:
                if buf is None:
                    read = self.backend.read(name, first.pack_off, size)
                else:
                    start = self.backend.read_span_into(name, first.pack_off, size,
                                                        memoryview(buf))
                    read = memoryview(buf)[start:start + size]
            except CkptfsError as e:
                raise DamagedData(f"cold chunk {first.chunk_no} in {name}: {e}") from e
            run = chunks[i:j]
            offs = [c.pack_off - first.pack_off for c in run]
            # Ids the native call checks: raw payloads' (zeros: checked after decoding).
            raw = [_NATIVE_IDS and c.codec == codec.CODEC_RAW and c.chunk_id != _NO_ID
                   for c in run]
            ids = b"".join(c.chunk_id if r else _NO_ID for c, r in zip(run, raw)) \
                if _NATIVE_IDS else None
            k, what = native.verify_payloads(read, offs, [c.stored_length for c in run],
                                             [c.payload_crc for c in run], ids)
            if k < len(run):
                bad = run[k]
                if what == native.VERIFY_ID:
                    raise DamagedData(f"cold chunk {bad.chunk_no} in {name}: bytes do not match "
                                      "the chunk id")
                raise DamagedData(f"cold chunk {bad.chunk_no} in {name}: payload checksum "
                                  "mismatch")
            span = _Span(len(buf), buf) if buf is not None else _Span(size)
            view = memoryview(read).toreadonly()
            base = native.address_of(view)
            for c, off, checked in zip(run, offs, raw):
                payload = view[off:off + c.stored_length]
                if not checked:
                    data = self._decode(c, payload)
                    out.append((memoryview(data), _Span(len(data)), native.address_of(data)))
                elif c.codec_param != 0 or c.stored_length != c.length:
                    raise DamagedData(f"cold chunk {c.chunk_no} in {name}: a raw payload of "
                                      f"{c.stored_length} bytes (param {c.codec_param}) "
                                      f"for a {c.length}-byte chunk")
                else:
                    out.append((payload, span, base + off))
            i = j
        self.fetches += len(chunks)
        self.fetched_bytes += sum(c.stored_length for c in chunks)
        return out

    def _buffer(self, size: int) -> mmap.mmap:
        """A buffer for a run of size bytes and SPAN_ALIGN at each end: an
        idle one that nothing holds a view of any more, else a new one
        (whole SPAN_CLASS_BYTES, page-aligned; from HUGE_FROM_BYTES whole
        huge pages)."""
        size += 2 * SPAN_ALIGN
        huge = size >= HUGE_FROM_BYTES
        unit = HUGE_BYTES if huge else SPAN_CLASS_BYTES
        size = -(-size // unit) * unit
        with self._lock:
            idle = self._idle.get(size, [])
            for k in range(len(idle)):
                # References: the list and getrefcount's argument; a view a
                # reader still copies from is one more.
                if sys.getrefcount(idle[k]) == 2:
                    self._idle_bytes -= size
                    self.buffers_reused += 1
                    return idle.pop(k)
        # private: anonymous pages (not shmem), the daemon's own
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            # Recent Linux (6.18 here) places a mapping whose length is a
            # whole number of huge pages on a huge-page boundary; an older
            # kernel may give it fewer or none of them: only slower.
            try:
                buf.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError):
                pass
        return buf

    def _decode(self, chunk: Chunk, payload) -> bytes:
        name = packs.pack_name(chunk.pack_no)
        try:
            data = codec.decode_chunk(chunk.codec, chunk.codec_param, payload, chunk.length)
        except CkptfsError as e:
            raise DamagedData(f"cold chunk {chunk.chunk_no} in {name}: {e}") from e
        if chunk_id(data) != chunk.chunk_id:
            raise DamagedData(f"cold chunk {chunk.chunk_no} in {name}: bytes do not match "
                              "the chunk id")
        return data


class Prefetcher:
    """Cold chunks into the cold store's cache, ahead of readers, in the background."""

    def __init__(self, cold: ColdStore, depth_bytes: int) -> None:
        self.cold = cold
        # File bytes read ahead of a sequential reader: more than the kernel's
        # own read-ahead (16 MiB), so its READs find their chunks decoded.
        self.depth_bytes = depth_bytes
        self._readers: dict[int, float] = {}    # ino -> when it last looked ahead
        # What the fetch threads do next, oldest first: (hint only?, chunks,
        # called on the trio thread once fetched). Under _cond.
        self._cond = threading.Condition()
        self._queue: deque[tuple[bool, list[Chunk], Optional[Callable[[], None]]]] = deque()
        self._running = False
        self._done: list[Callable[[], None]] = []   # to call on the trio thread
        self._threads: list[threading.Thread] = []
        self._token: Optional[trio.lowlevel.TrioToken] = None

    def depth_for(self, ino: int) -> int:
        """How far ahead of ino's reader to fetch: depth_bytes, less when
        several readers share the cache, so that together they look ahead
        at most half of it; the cache (and the daemon's memory) stays within
        its bound, and no reader's chunks are evicted before it reads them."""
        now = time.monotonic()
        self._readers[ino] = now
        if len(self._readers) > 1:
            for other, seen in list(self._readers.items()):
                if now - seen > READER_IDLE_S:
                    del self._readers[other]
        share = self.cold.cache_limit // (2 * len(self._readers))
        return max(MIN_DEPTH_BYTES, min(self.depth_bytes, share))

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the fetch threads until cancelled (the fetches in flight end
        first; those not started are dropped)."""
        self._token = trio.lowlevel.current_trio_token()
        with self._cond:
            self._running = True
        threads = [threading.Thread(target=self._work, name=f"ckptfs-prefetch-{k}", daemon=True)
                   for k in range(PREFETCH_THREADS)]
        self._threads = threads
        for t in threads:
            t.start()
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            with self._cond:
                self._running = False
                self._queue.clear()
                self._cond.notify_all()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(lambda: [t.join() for t in threads])

    def prefetch(self, chunks: list[Chunk], fetched: Optional[Callable[[], None]] = None
                 ) -> None:
        """Fetch these cold chunks into the cache in the background, in this
        order, about PREFETCH_BATCH_BYTES per fetch (neighbours in a pack
        come with one read), by the fetch threads; fetched (if given) is
        called on the trio thread after fetches that went without an error
        (once for several done meanwhile). The store is first told what will
        be read (`ColdStore.will_read`). Trio thread."""
        if not self._running:
            return
        items: list[tuple[bool, list[Chunk], Optional[Callable[[], None]]]] = []
        batch: list[Chunk] = []
        wanted: list[Chunk] = []
        size = 0
        for c in chunks:
            if self.cold.cached(c):
                continue
            wanted.append(c)
            if batch and size + c.stored_length > PREFETCH_BATCH_BYTES:
                items.append((False, batch, fetched))
                batch, size = [], 0
            batch.append(c)
            size += c.stored_length
        if batch:
            items.append((False, batch, fetched))
        if not items:
            return
        with self._cond:
            self._queue.append((True, wanted, None))
            self._queue.extend(items)
            self._cond.notify(len(items) + 1)

    def _work(self) -> None:
        """A fetch thread: the oldest item first, so a pack is read forward
        (the kernel reads ahead of it) and the fetched prefix that READs are
        answered from in C grows with every batch. It never waits for the
        trio thread (which serves the READs meanwhile): it tells it what was
        fetched and goes on. May block."""
        while True:
            with self._cond:
                while self._running and not self._queue:
                    self._cond.wait()
                if not self._running:
                    return
                hint, chunks, fetched = self._queue.popleft()
            try:
                if hint:
                    self.cold.will_read(chunks)
                    continue
                self.cold.get_many(chunks)
            except CkptfsError:
                continue            # the read that needs it reports the error
            except Exception:       # a bug: said, and this thread goes on
                log.exception("cold prefetch of %d chunks failed", len(chunks))
                continue
            if fetched is None:
                continue
            with self._cond:
                first = not self._done
                self._done.append(fetched)
            if first:
                try:
                    self._token.run_sync_soon(self._deliver)
                except trio.RunFinishedError:
                    pass

    def _deliver(self) -> None:
        """On the trio thread: call what the fetch threads asked for, each once."""
        with self._cond:
            done, self._done = self._done, []
        seen: set[int] = set()
        for fetched in done:
            if id(fetched) in seen:
                continue
            seen.add(id(fetched))
            try:
                fetched()
            except CkptfsError:
                pass        # the read that needs it reports the error
            except Exception:
                log.exception("after a cold prefetch")
