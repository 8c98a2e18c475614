"""Publishing snapshots of the namespace to the backing store (docs/STORE.md).

A snapshot describes the whole namespace of the index's durable state: every
directory (mode, owner, times, xattrs, entries), file (attributes, extents
and which chunk holds each range, or that the range is not in the store),
symlink, device node and hard link. `Publisher.publish` writes one:

1. trio thread: reserve the next head number (`next_head` in the index) and
   wait until that is durable, so no later head can get a smaller number,
   even after a crash; a number not above every head of this filesystem in
   the store is refused (`StoreAhead`: the index is older than the store),
   so the head a publish writes is always the newest, and what it lets go
   no newer head names;
2. worker thread: walk the durable state (one LMDB read transaction: a
   consistent commit, never a half-applied batch), depth first with an
   explicit stack, writing each namespace object that the store does not
   hold yet (content-addressed, so unchanged directories and files cost
   nothing but their hash), all of them into one batch of the store
   (`Backend.batch`) that is made durable at once when the walk is done (a
   directory store: one fsync per object and one per directory instead of
   two per object); until then a crash leaves none of them visible, or
   whole ones nothing durable names (a later publish that finds one in the
   store finds it whole: a batch renames a file into place after its fsync);
3. then the head, last: a head names only durable objects, and objects name
   only chunks in durable packs (a chunk counts as in the store only once
   its pack flip is durable); with dedup across volumes, the own packs it
   names get their chunk index objects first (chunkindex.py);
4. then what the new head made unnecessary goes: packs that died before the
   state it describes (shared: an own pack is condemned and deleted unless
   another volume holds a ref, another volume's loses this volume's ref),
   heads older than the newest KEEP_HEADS, objects no kept head reaches, and
   manifests of the format before snapshots.

Whether a chunk counts as in the store is a function given to the publisher
(`packed_chunk_id`: a chunk in a pack), so that publishing hot chunks too
(issue 13) changes that function, not the walk. The caller serialises
`publish` and anything else that deletes from the store (the tierer holds
its publish lock, and gc the pass lock too).

Which functions may block: `publish_blocking` and everything it calls (run
it on a worker thread); `publish` is async and offloads it.
"""

from __future__ import annotations

import logging
import stat
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import trio

from . import index as ix
from . import packs
from . import snapshot_format as sf
from .backing.base import Backend, BlobBatch
from .errors import BlobMissing, CkptfsError, FormatError, StoreAhead
from .index import ROOT_INO, Chunk, Index, Inode
from .volumes import HeadKey, Volume, head_name

if TYPE_CHECKING:
    from .chunkindex import SharedChunks

NO_HEAD: HeadKey = (0, 0)          # an object found in the store that no head marked yet

log = logging.getLogger(__name__)

KEEP_HEADS = 3          # the newest heads kept (with every object they reach)
# ... and every head that stopped being the newest less than this long ago, so
# that a restore elsewhere (recover, a takeover) reading it while this node
# publishes on finds its objects and packs (docs/STORE.md, "Collection").
RETENTION_S = 600.0
WRITES_IN_FLIGHT = 64   # objects (bytes) held while waiting for a writer
UNPUBLISHED_LISTED = 4096   # chunks still to copy a head remembers by number (publish.py)


def packed_chunk_id(chunk: Chunk) -> Optional[bytes]:
    """The chunk's id if its bytes are in the store (cold in a pack, or a hot
    chunk's published copy), else None."""
    return chunk.chunk_id if chunk.in_store and chunk.chunk_id else None


@dataclass
class Published:
    """What one publish did (for logs, stats and gc's report)."""

    seq: int
    key: HeadKey = (0, 0)                # (lease generation, seq): its place among heads
    root: bytes = b""
    entries: int = 0
    files: int = 0
    incomplete_files: int = 0
    skipped: int = 0                     # index damage the walk stepped over (fsck's)
    objects_written: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    packs_named: set[int] = field(default_factory=set)   # in the state it describes
    packs_deleted: int = 0
    deleted_packs: list[str] = field(default_factory=list)      # their names
    heads_deleted: int = 0
    objects_deleted: int = 0
    manifests_deleted: int = 0
    # LOG chunks without a copy in the state it describes (publish.py: a head
    # naming none but those it cannot copy covers its state); None: too many.
    unpublished: Optional[frozenset[int]] = frozenset()


@dataclass
class _CachedFile:
    raw_inode: bytes          # the inode record the object was made from
    store_state: bytes        # for a file not wholly in the store: what the store held
    obj: bytes
    pages: tuple[bytes, ...]
    walk: int


class _Pager:
    """Entries (or extents) of one object, closed into pages when too many."""

    def __init__(self, put: Callable[[bytes], bytes], limit: int, page: Callable) -> None:
        self.put = put
        self.limit = limit
        self.page = page
        self.parts: list[bytes] = []
        self.size = 0
        self.pages: list[bytes] = []

    def add(self, part: bytes) -> None:
        if self.parts and (len(self.parts) >= self.limit
                           or self.size + len(part) > sf.PAGE_BYTES):
            self.flush()
        self.parts.append(part)
        self.size += len(part)

    def flush(self) -> None:
        self.pages.append(self.put(self.page(self.parts)))
        self.parts, self.size = [], 0

    def finish(self) -> tuple[list[bytes], list[bytes]]:
        """(inline parts, []) if it all fits in one object, else ([], pages)."""
        if self.pages and self.parts:
            self.flush()
        return self.parts, self.pages


class _DirWalk:
    def __init__(self, ino: int, inode: Inode, name: bytes, items, pager: _Pager) -> None:
        self.ino = ino
        self.inode = inode
        self.name = name
        self.items = items
        self.pager = pager


class Publisher:
    """Snapshots of one filesystem's index, published to its volume in the store."""

    def __init__(self, index: Index, backend: Backend, volume: Volume,
                 in_store: Callable[[Chunk], Optional[bytes]] = packed_chunk_id,
                 limiter: Optional[trio.CapacityLimiter] = None,
                 shared: Optional["SharedChunks"] = None) -> None:
        """shared: dedup across the volumes of the store (chunkindex.py), or None."""
        self.index = index
        self.backend = backend                  # the store: packs
        self.volume = volume
        self.scope = volume.scope               # the volume's part: heads, objects
        self.in_store = in_store
        self.limiter = limiter
        # Object id -> the newest head (gen, seq) known to reach it; (0, 0) for
        # objects found in the store and not marked yet. None until listed.
        self.objects: Optional[dict[bytes, HeadKey]] = None
        self._marked_heads: set[HeadKey] = set()
        self._head_times: dict[HeadKey, int] = {}
        self._files: dict[int, _CachedFile] = {}
        self._walks = 0
        self._pool: Optional[ThreadPoolExecutor] = None
        self._writes: deque[Future] = deque()
        self._batch: Optional[BlobBatch] = None     # this publish's objects
        self._state_seq = -1
        self._legacy_gone = False
        # Packs whose last chunk went: deleted once a head no longer needs them.
        self.pending_pack_deletes: list[str] = []
        self.last: Optional[Published] = None
        self.last_time = 0.0
        self.last_error: Optional[str] = None
        self.published_seq = -1        # the durable index state (seq) the last head describes
        # Told the state (index seq) of every head published (publish.py's lag).
        self.on_published: list[Callable[[int], None]] = []
        self.lock = trio.Lock()        # callers serialise publishes and gc with it
        # A clean unmount's last round (publish.py): a cancelled publish stops
        # waiting for its check of the store's heads (store calls only).
        self.abandon_checks = False
        # Dedup across volumes (chunkindex.py): own packs get an index object
        # before a head names them; letting a pack go condemns it (own) or
        # drops this volume's ref (another's).
        self.shared = shared

    # ------------------------------------------------------------ trio side

    async def publish(self, force: bool = False, retention_s: float = RETENTION_S
                      ) -> Optional[Published]:
        """Publish a snapshot of the durable state; None if nothing changed since
        the last one (and force is not set). The caller serialises publishes.
        Fenced when another node took the volume over."""
        if not force and self.index.durable_seq == self._state_seq \
                and not self.pending_pack_deletes:
            return None
        # Checked before the number is reserved: a refused publish must not
        # consume numbers until one passes the store's newest head.
        await trio.to_thread.run_sync(self._check_newest, self.index.counters[b"next_head"],
                                      limiter=self.limiter,
                                      abandon_on_cancel=self.abandon_checks)
        seq = self.index.reserve_id(b"next_head")
        await self.index.wait_durable(self.index.current_seq())
        state_seq = self._state_seq = self.index.durable_seq
        deletes, self.pending_pack_deletes = self.pending_pack_deletes, []
        try:
            result = await trio.to_thread.run_sync(self.publish_blocking, seq, deletes,
                                                   retention_s, limiter=self.limiter)
        except BaseException as e:
            self.pending_pack_deletes[:0] = deletes
            self._state_seq = -1
            self.last_error = str(e)
            raise
        self.last_error = None
        self.published_seq = state_seq
        for fn in self.on_published:
            fn(state_seq)
        return result

    # ---------------------------------------------------------- worker side

    def publish_blocking(self, seq: int, pack_deletes: list[str] = (),
                         retention_s: float = RETENTION_S) -> Published:
        """Write snapshot `seq` (reserved durably by the caller), then delete what
        it made unnecessary. May block."""
        started = time.monotonic()
        self._check_newest(seq)
        if self.objects is None:
            self._marked_heads.clear()     # kept heads are marked again from the store
            self.objects = {}
            for name in self.scope.list(sf.OBJECT_PREFIX):
                oid = sf.object_id_from_name(name)
                if oid is not None:
                    self.objects[oid] = NO_HEAD
        key = (self.volume.gen, seq)
        result = Published(seq, key=key)
        batch = self.scope.batch()
        with self.index.read_view() as view, ThreadPoolExecutor(
                batch.put_threads, thread_name_prefix="ckptfs snapshot") as pool:
            self._pool, self._writes, self._batch = pool, deque(), batch
            try:
                self._walk(view, result)
                result.packs_named = set(ix.scan_pack_numbers(view))
                listed = ix.scan_unpublished(view, -1, UNPUBLISHED_LISTED + 1)
                result.unpublished = None if len(listed) > UNPUBLISHED_LISTED \
                    else frozenset(listed)
                while self._writes:
                    self._writes.popleft().result()
                self._batch.sync()                 # every object durable before the head
            except BaseException:
                for f in self._writes:
                    f.cancel()
                for f in self._writes:
                    if not f.cancelled():
                        f.exception()              # written or failed: then dropped
                self._batch.abort()
                self.objects = None        # some may be missing: list the store again
                raise
            finally:
                self._pool, self._batch = None, None
        now_ns = time.time_ns()
        head = sf.Head(self.volume.fs_uuid, seq, now_ns, result.root, result.entries,
                       result.files, result.incomplete_files, self.volume.name,
                       self.volume.gen)
        if self.shared is not None:
            self.shared.announce_blocking(result.packs_named)
        self.volume.fence()                # never a head once another node holds the volume
        if not self.scope.create_once(self.volume.head_name(seq), sf.encode_head(head)):
            raise CkptfsError(f"{self.scope.url}: snapshot head {key} exists already (two "
                              "filesystems holding one generation of the volume?)")
        self._marked_heads.add(key)
        self._head_times[key] = now_ns
        result.seconds = time.monotonic() - started
        self.last, self.last_time = result, time.time()
        log.debug("published snapshot %d: %d entries, %d objects written (%d bytes) in %.2f s",
                  seq, result.entries, result.objects_written, result.bytes_written,
                  result.seconds)
        # The head is durable: what only older states needed can go (packs
        # whose chunks died before it), never once another node holds the volume.
        self.volume.fence()
        for name in pack_deletes:
            self._delete_pack(name)
            result.packs_deleted += 1
            result.deleted_packs.append(name)
        self._collect(result, key, retention_s)
        return result

    def _delete_pack(self, name: str) -> None:
        """A pack no kept head names any more leaves the store (or, shared
        with other volumes, is condemned or released: chunkindex.py). May block."""
        pack_no = packs.pack_number(name)
        if self.shared is not None and pack_no is not None:
            self.shared.delete_pack_blocking(pack_no)
            return
        try:
            self.backend.delete(name)
        except BlobMissing:
            pass

    def _check_newest(self, seq: int) -> None:
        """StoreAhead unless `seq` is above every valid head of the volume in the
        store (heads the fencing rule invalidates, an old holder's after a
        takeover, do not count). A head numbered below one there would not be
        the newest (recover takes the other), and the packs it lets go the
        newer head may name. May block."""
        self.volume.fence()             # a newer holder is not "a newer index": Fenced
        state = self.volume.state()
        newest = max((h[1] for h in state.valid_heads()), default=None)
        if newest is not None and newest >= seq:
            raise StoreAhead(f"{self.backend.url} holds snapshot {newest} of this filesystem "
                             f"and this index would publish {seq}: the index is older than "
                             "the store (restored from a copy?); nothing is published "
                             "until ckptfs fsck --repair raises its counter (ckptfs recover "
                             "rebuilds the newer state instead)")

    def _put(self, data: bytes, result: Published) -> bytes:
        if len(data) > sf.MAX_OBJECT_BYTES:
            raise CkptfsError(f"a namespace object of {len(data)} bytes is larger than "
                              f"{sf.MAX_OBJECT_BYTES} (too many xattrs on one inode?)")
        oid = sf.object_id(data)
        if oid not in self.objects:
            if len(self._writes) >= WRITES_IN_FLIGHT:
                self._writes.popleft().result()
            self._writes.append(self._pool.submit(self._write_object, oid, data))
            result.objects_written += 1
            result.bytes_written += len(data)
        self.objects[oid] = result.key
        return oid

    def _write_object(self, oid: bytes, data: bytes) -> None:
        self._batch.put(sf.object_name(oid), data)

    def _dir_walk(self, view, ino: int, inode: Inode, name: bytes, result: Published
                  ) -> _DirWalk:
        pager = _Pager(lambda d: self._put(d, result), sf.PAGE_ENTRIES, sf.encode_dir_page)
        return _DirWalk(ino, inode, name, ix.entries_by_name(view, ino), pager)

    def _walk(self, view, result: Published) -> None:
        """Depth first over the durable namespace, no recursion (any depth)."""
        self._walks += 1
        root = ix.get_inode(view, ROOT_INO)
        if root is None:
            raise CkptfsError("the index has no root directory: nothing to publish")
        stack = [self._dir_walk(view, ROOT_INO, root, b"", result)]
        on_stack = {ROOT_INO}
        while stack:
            top = stack[-1]
            item = next(top.items, None)
            if item is None:
                stack.pop()
                on_stack.discard(top.ino)
                parts, pages = top.pager.finish()
                oid = self._put(sf.encode_dir(self._attrs(view, top.inode), parts, pages),
                                result)
                if stack:
                    stack[-1].pager.add(sf.fragment(sf.encode_entry(
                        sf.Entry(top.name, "d", obj=oid))))
                else:
                    result.root = oid
                continue
            name, ino, damage = item
            result.entries += 1
            try:
                if damage is not None:
                    raise FormatError(damage)
                child = ix.get_inode(view, ino)
                damage = ("no such inode" if child is None else sf.check_name(name) or (
                    "a directory inside itself" if ino in on_stack else None))
                if damage is None and stat.S_ISREG(child.mode):
                    oid, complete = self._file(view, child, result)
                    result.files += 1
                    result.incomplete_files += not complete
                    top.pager.add(sf.fragment(sf.encode_entry(sf.Entry(name, "f", ino, oid))))
                    continue
                if damage is None and not stat.S_ISDIR(child.mode):
                    top.pager.add(sf.fragment(sf.encode_entry(
                        sf.Entry(name, "n", ino, attrs=self._attrs(view, child)))))
                    continue
            except FormatError as e:
                damage = str(e)
            if damage is not None:
                # Index damage (fsck finds and mends it): described as such, so that
                # recover names it rather than taking it for deleted.
                result.skipped += 1
                log.warning("snapshot %d: entry %r of directory %d is damaged in the index "
                            "(%s): run ckptfs fsck", result.seq, name, top.ino, damage)
                top.pager.add(sf.fragment(sf.encode_entry(sf.Entry(name, "x", why=damage))))
                continue
            stack.append(self._dir_walk(view, ino, child, name, result))
            on_stack.add(ino)
        for ino in [i for i, c in self._files.items() if c.walk != self._walks]:
            del self._files[ino]             # deleted since: never asked for again

    def _file(self, view, inode: Inode, result: Published) -> tuple[bytes, bool]:
        """The file's object id and whether all its bytes are in the store."""
        raw = ix.inode_record(view, inode.ino)
        cached = self._files.get(inode.ino)
        # An unchanged inode record (extents change only with its times and size)
        # gives the same object: if all its bytes were in the store they still
        # are (chunks in packs stay while extents name them); if not, unless
        # anything moved into the store since.
        if cached is not None and cached.raw_inode == raw \
                and cached.store_state in (b"", self._store_state(view)) \
                and cached.obj in self.objects and all(p in self.objects for p in cached.pages):
            for oid in (cached.obj, *cached.pages):
                self.objects[oid] = result.key
            cached.walk = self._walks
            return cached.obj, not cached.store_state
        pager = _Pager(lambda d: self._put(d, result), sf.PAGE_EXTENTS, sf.encode_extent_page)
        complete = True
        if self.in_store is packed_chunk_id:
            # The records as stored, no Extent or Chunk decoded (a mount's
            # first walk does this for every extent, beside the first reads).
            fragment = sf.extent_fragment
            for file_off, length, cid, chunk_off in ix.extent_store_ids(view, inode.ino):
                complete = complete and cid is not None
                pager.add(fragment(file_off, length, cid, chunk_off))
        else:
            for e in ix.iter_extents(view, inode.ino):
                chunk = ix.get_chunk(view, e.chunk_no)
                cid = self.in_store(chunk) if chunk is not None else None
                complete = complete and cid is not None
                pager.add(sf.fragment(sf.encode_extent(sf.Extent(e.file_off, e.length, cid,
                                                                 e.chunk_off))))
        parts, pages = pager.finish()
        oid = self._put(sf.encode_file(self._attrs(view, inode), parts, pages), result)
        self._files[inode.ino] = _CachedFile(raw, b"" if complete else self._store_state(view),
                                             oid, tuple(pages), self._walks)
        return oid, complete

    @staticmethod
    def _store_state(view) -> bytes:
        """Changes whenever a chunk moves into the store (packs are numbered by a
        counter, and every flip changes the packed-bytes total)."""
        return b"%d/%d" % (ix.read_counter(view, b"next_pack"),
                           ix.read_counter(view, b"pack_logical_bytes"))

    @staticmethod
    def _attrs(view, inode: Inode) -> sf.Attrs:
        xattrs = [(k, bytes(v)) for k, v in ix.xattrs_of(view, inode.ino)]
        target = b""
        if stat.S_ISLNK(inode.mode):
            target = bytes(ix.get_symlink(view, inode.ino) or b"")
        return sf.Attrs(inode.mode, inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns,
                        inode.ctime_ns, size=inode.size, rdev=inode.rdev, target=target,
                        xattrs=xattrs)

    # ------------------------------------------------------------ collection

    def _collect(self, result: Published, newest: HeadKey, retention_s: float
                 ) -> Optional[HeadKey]:
        """Delete heads no longer kept, the objects no kept head reaches, and
        what volumes replaced (heads, objects and manifests of this filesystem
        at the store's root). Returns the oldest kept head. May block.

        Kept: the newest KEEP_HEADS valid heads, and every head that stopped
        being the newest less than `retention_s` ago. Heads the fencing rule
        invalidates (an old holder's, published after a takeover) go."""
        state = self.volume.state()
        heads = [h for h in state.heads if h <= newest]
        valid = [h for h in heads if state.valid(h)]
        keep = set(valid[-KEEP_HEADS:])
        now = time.time_ns()
        for older, newer in zip(valid, valid[1:]):
            if older not in keep and now - self._head_time(newer) < retention_s * 1e9:
                keep.add(older)
        for h in heads:
            if h not in keep:
                self.scope.delete(head_name(*h))
                self._head_times.pop(h, None)
                result.heads_deleted += 1
        if not keep:
            return None
        oldest = min(keep)
        for h in sorted(keep, reverse=True):
            if h not in self._marked_heads:
                self._mark_from_store(h, oldest)
        garbage = [oid for oid, h in self.objects.items() if h < oldest]
        for oid in garbage:
            self.scope.delete(sf.object_name(oid))
            del self.objects[oid]
        result.objects_deleted = len(garbage)
        if not self._legacy_gone:
            # Before volumes this filesystem owned the store's root: its heads,
            # objects and manifests there are superseded by the volume's head.
            fs_uuid = self.volume.fs_uuid
            for name in (self.backend.list(sf.heads_prefix(fs_uuid))
                         + self.backend.list(sf.manifests_prefix(fs_uuid))):
                self.backend.delete(name)
                result.manifests_deleted += name.startswith(sf.MANIFEST_DIR)
                result.heads_deleted += not name.startswith(sf.MANIFEST_DIR)
            if not self.backend.list(sf.HEAD_PREFIX):
                for name in self.backend.list(sf.OBJECT_PREFIX):
                    self.backend.delete(name)
                    result.objects_deleted += 1
            self._legacy_gone = True
        return oldest

    def _head_time(self, key: HeadKey) -> int:
        """When a head was written (from its document; 0 if unreadable)."""
        if key not in self._head_times:
            name = head_name(*key)
            try:
                head = sf.decode_volume_head(name, self.volume.name, key, self.scope.read(
                    name, 0, min(self.scope.size(name), sf.MAX_HEAD_BYTES + 1)))
                self._head_times[key] = head.time_ns
            except (BlobMissing, sf.BadObject):
                self._head_times[key] = 0
        return self._head_times[key]

    def _mark_from_store(self, key: HeadKey, oldest: HeadKey) -> None:
        """Mark every object a head written before this mount reaches. Objects
        already kept by a newer head are skipped with all they reach (a walk
        marks everything below what it marks). A damaged or missing object is
        left out; any other error (the store away) gives up this collection."""
        name = head_name(*key)
        try:
            head = sf.decode_volume_head(name, self.volume.name, key, self.scope.read(
                name, 0, min(self.scope.size(name), sf.MAX_HEAD_BYTES + 1)))
        except (BlobMissing, sf.BadObject) as e:
            log.warning("snapshot head %s is unreadable (%s): not kept", name, e)
            self._marked_heads.add(key)
            return
        todo: list[tuple[bytes, str]] = [(head.root, "dir")]
        while todo:
            oid, kind = todo.pop()
            if self.objects.get(oid, NO_HEAD) >= oldest:
                continue
            self.objects[oid] = max(self.objects.get(oid, NO_HEAD), key)
            if kind == "extpage":
                continue
            try:
                raw = self.scope.read(sf.object_name(oid), 0, min(
                    self.scope.size(sf.object_name(oid)), sf.MAX_OBJECT_BYTES + 1))
                if kind == "file":
                    todo.extend((p, "extpage") for p in sf.decode_file(oid, raw).pages)
                    continue
                if kind == "dir":
                    d = sf.decode_dir(oid, raw)
                    entries = d.entries
                    todo.extend((p, "dirpage") for p in d.pages)
                else:
                    entries = sf.decode_dir_page(oid, raw)
            except (BlobMissing, sf.BadObject):
                continue
            for e in entries:
                if isinstance(e, sf.Entry) and e.kind in ("d", "f"):
                    todo.append((e.obj, "dir" if e.kind == "d" else "file"))
        self._marked_heads.add(key)


def publish_offline(index: Index, backend: Backend, volume: Optional[Volume] = None
                    ) -> Published:
    """Publish a snapshot from an unmounted filesystem's index (fsck --repair,
    before it deletes packs an older head may name), to its volume (the one
    its index names when not given). May block."""
    if volume is None:
        record = ix.get_volume(index)
        if record is None or record.takeover:
            raise CkptfsError("the filesystem holds no volume of the store yet (mount it "
                              "once)")
        volume = Volume(backend, record.name, record.gen, index.check_format())
    publisher = Publisher(index, backend, volume)
    publisher._check_newest(index.counters[b"next_head"])      # before reserving it
    seq = [0]

    def reserve(txn: ix.DirectTxn) -> None:
        seq[0] = ix.read_counter(txn, b"next_head")
        ix.write_counters(txn, {b"next_head": seq[0] + 1})

    index.write_direct(reserve)
    return publisher.publish_blocking(seq[0])
