"""The cold store: chunks in backing-store packs, read back verified; and the
prefetcher that reads them ahead of a sequential reader.

`ColdStore` reads a cold chunk's payload range from its pack, checks its
CRC, decompresses it (`codec`) and verifies its BLAKE3 id before a byte is
used; decoded chunks stay in a bounded LRU cache, and a chunk being fetched
by one thread is waited for, not fetched again, by the others. Neighbours in
a pack come with one read, into a buffer the thread keeps, and one native
call checks all their CRCs and the ids of the raw ones (GIL released). It
is thread-safe; `get`, `get_many` and `read_into` may block (worker threads
only). It may not write to the store nor touch the index: the records it is
given say where each chunk is.

`Prefetcher` fetches chunks into the cache in the background, about 2 MiB
per worker-thread call, at most two calls at a time, from a nursery it runs in
(`run`, started by whoever supervises the mount's background tasks); asked
before it runs, or after, it does nothing. It runs on the trio thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import trio

from . import codec
from . import index as ix
from . import native, packs
from .backing.base import Backend
from .chunker import chunk_id
from .errors import CkptfsError, DamagedData
from .index import CHUNK_PACK, Chunk

PREFETCH_BATCH_BYTES = 2 << 20   # cold chunk bytes per prefetch call
PREFETCH_THREADS = 2             # prefetch calls running at once

# The native check hashes raw payloads itself when the module has BLAKE3;
# an all-zero id in its input means "not this one".
_NATIVE_IDS = native.chunk_feed_hashes()
_NO_ID = bytes(32)

# A run of neighbours in a pack is read at most this much at a time, into a
# buffer each thread keeps: no fresh pages (faults, zeroing) per read.
SPAN_BYTES = 4 << 20
_spans = threading.local()


def _span_buffer(size: int) -> memoryview:
    """This thread's span buffer, size bytes of it (a chunk alone may be larger)."""
    buf = getattr(_spans, "buf", None)
    if size > SPAN_BYTES:
        return memoryview(bytearray(size))
    if buf is None:
        buf = _spans.buf = memoryview(bytearray(SPAN_BYTES))
    return buf[:size]


class ColdStore:
    """Cold chunk bytes: fetched from packs, verified, cached. Thread-safe."""

    def __init__(self, backend: Backend, cache_bytes: int) -> None:
        self.backend = backend
        self.cache_limit = cache_bytes
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()   # chunk id -> bytes
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._fetching: dict[bytes, threading.Event] = {}
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
        out[:] = memoryview(data)[chunk_off:chunk_off + len(out)]

    def read_cached_into(self, out: memoryview, chunk: Chunk, chunk_off: int) -> bool:
        """Like `read_into` if the chunk is in the cache (a copy: the trio
        thread may call it); False, touching nothing, if it is not."""
        if chunk_off + len(out) > chunk.length:
            raise DamagedData(f"cold chunk {chunk.chunk_no}: an extent reaches byte "
                              f"{chunk_off + len(out)} of a {chunk.length}-byte chunk")
        with self._lock:
            data = self._cache.get(chunk.chunk_id)
            if data is None:
                return False
            self._cache.move_to_end(chunk.chunk_id)
            self.hits += 1
        if len(data) != chunk.length:
            raise DamagedData(f"cold chunk {chunk.chunk_no}: its record says {chunk.length} "
                              f"bytes, its id names {len(data)}")
        out[:] = memoryview(data)[chunk_off:chunk_off + len(out)]
        return True

    def cached(self, chunk: Chunk) -> bool:
        with self._lock:
            return chunk.chunk_id in self._cache or chunk.chunk_id in self._fetching

    def get(self, chunk: Chunk) -> bytes:
        """The chunk's bytes, verified. May block."""
        while True:
            data = self._cached_or_claim(chunk)
            if isinstance(data, bytes):
                return data
            if data is not None:
                data.wait()         # another thread is fetching it: use its result
                continue
            self._fetch_claimed([chunk])
            data = self._cached_or_claim(chunk, claim=False)
            if isinstance(data, bytes):
                return data
            # Too big to cache (never for real chunks): fetch it for ourselves.
            return self._verified([chunk])[0]

    def get_many(self, chunks: list[Chunk]) -> None:
        """Fetch chunks into the cache, neighbours in a pack with one read. May block."""
        mine = [c for c in chunks if self._cached_or_claim(c) is None]
        if mine:
            self._fetch_claimed(mine)

    def _cached_or_claim(self, chunk: Chunk, claim: bool = True):
        """Cached bytes, or the Event of a fetch in flight, or None (now ours to fetch)."""
        key = chunk.chunk_id
        with self._lock:
            data = self._cache.get(key)
            if data is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return data
            waiting = self._fetching.get(key)
            if waiting is not None:
                return waiting
            if claim:
                self._fetching[key] = threading.Event()
            return None

    def _fetch_claimed(self, chunks: list[Chunk]) -> None:
        try:
            for chunk, data in zip(chunks, self._verified(chunks)):
                with self._lock:
                    if chunk.chunk_id not in self._cache and len(data) <= self.cache_limit:
                        self._cache[chunk.chunk_id] = data
                        self._cached_bytes += len(data)
                        while self._cached_bytes > self.cache_limit:
                            _, old = self._cache.popitem(last=False)
                            self._cached_bytes -= len(old)
                    self._fetching.pop(chunk.chunk_id).set()
        finally:
            with self._lock:
                for chunk in chunks:
                    ev = self._fetching.pop(chunk.chunk_id, None)
                    if ev is not None:
                        ev.set()

    def _verified(self, chunks: list[Chunk]) -> list[bytes]:
        """The chunks' bytes, checked: each payload's CRC, then decoded and
        its BLAKE3 id. A run of neighbours in one pack is one read and one
        native call that checks every payload's CRC, and the id of every raw
        one (a raw payload is the chunk's bytes), GIL released; encoded
        chunks are decoded and their ids checked here.

        Records are checked first (kind, lengths within MAX_CHUNK_BYTES): a
        damaged one is DamagedData before anything is read or allocated."""
        for c in chunks:
            if c.kind != CHUNK_PACK:
                raise DamagedData(f"chunk {c.chunk_no} is not a cold chunk (kind {c.kind})")
            ix.check_chunk_record(c)
        out: list[bytes] = []
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
            span = _span_buffer(last.pack_off + last.stored_length - first.pack_off)
            try:
                self.backend.read_into(name, first.pack_off, span)
            except CkptfsError as e:
                raise DamagedData(f"cold chunk {first.chunk_no} in {name}: {e}") from e
            run = chunks[i:j]
            offs = [c.pack_off - first.pack_off for c in run]
            # Ids the native call checks: raw payloads' (zeros: checked after decoding).
            raw = [_NATIVE_IDS and c.codec == codec.CODEC_RAW and c.chunk_id != _NO_ID
                   for c in run]
            ids = b"".join(c.chunk_id if r else _NO_ID for c, r in zip(run, raw)) \
                if _NATIVE_IDS else None
            k, what = native.verify_payloads(span, offs, [c.stored_length for c in run],
                                             [c.payload_crc for c in run], ids)
            if k < len(run):
                bad = run[k]
                if what == native.VERIFY_ID:
                    raise DamagedData(f"cold chunk {bad.chunk_no} in {name}: bytes do not match "
                                      "the chunk id")
                raise DamagedData(f"cold chunk {bad.chunk_no} in {name}: payload checksum "
                                  "mismatch")
            for c, off, checked in zip(run, offs, raw):
                payload = span[off:off + c.stored_length]
                if not checked:
                    out.append(self._decode(c, payload))
                elif c.codec_param != 0 or c.stored_length != c.length:
                    raise DamagedData(f"cold chunk {c.chunk_no} in {name}: a raw payload of "
                                      f"{c.stored_length} bytes (param {c.codec_param}) "
                                      f"for a {c.length}-byte chunk")
                else:
                    out.append(bytes(payload))
            i = j
        self.fetches += len(chunks)
        self.fetched_bytes += sum(c.stored_length for c in chunks)
        return out

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
        self._limiter = trio.CapacityLimiter(PREFETCH_THREADS)
        self._nursery: Optional[trio.Nursery] = None

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve prefetches until cancelled (the fetches in flight end with it)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def prefetch(self, chunks: list[Chunk]) -> None:
        """Fetch these cold chunks into the cache in the background, about
        PREFETCH_BATCH_BYTES per worker-thread call (neighbours in a pack
        come with one read)."""
        if self._nursery is None:
            return
        batch: list[Chunk] = []
        size = 0
        for c in chunks:
            if self.cold.cached(c):
                continue
            batch.append(c)
            size += c.length
            if size >= PREFETCH_BATCH_BYTES:
                self._nursery.start_soon(self._fetch, batch)
                batch, size = [], 0
        if batch:
            self._nursery.start_soon(self._fetch, batch)

    async def _fetch(self, chunks: list[Chunk]) -> None:
        try:
            await trio.to_thread.run_sync(self.cold.get_many, chunks, limiter=self._limiter)
        except CkptfsError:
            pass            # the read that needs it reports the error
