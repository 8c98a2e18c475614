"""The peer view: other volumes' published files, read from the store.

Several nodes share one store, each publishing its own volume
(`volumes.py`). A job that saves a sharded checkpoint from ranks on several
nodes (torch.distributed.checkpoint, Megatron, DeepSpeed) leaves each rank's
shard in its own node's mount; a load on any node needs them all. With
`-o peers=all` (or `peers=NAME:NAME`) a mount shows, below its own files,
what the other volumes of its store published: one read-only tree, merged by
path (docs/OPERATIONS.md, "Running on a cluster": the semantics; merged.py:
how the mount's own namespace is laid over it).

This module reads the store only. A `ViewTree` is one immutable picture of
the peers: for every volume its newest valid head (`volumes.VolumeState`:
heads the fencing rule invalidates never show), each head's namespace
objects (cached by id across refreshes: an unchanged directory or file costs
nothing), merged into one tree of `VNode`s:

- directories of several volumes at one path merge into one directory;
- a directory beats a non-directory at the same path;
- among non-directories the newest (mtime) wins, then the volume whose name
  sorts first;
- a file not wholly in the store (its head says some bytes are still only in
  its node's log) is left out until a head names all of it, so a file shown
  is always whole.

Where chunks are comes from the pack trailers of the store (each pack read
once: packs are immutable). File extents are read when a file is first read
(`extents`), kept for a few files, and chunks are fetched, checked (CRC,
BLAKE3) and cached by `coldstore.ColdStore`.

Which functions may block: `refresh_blocking`, `extents`, `read_blocking`
(run them on worker threads); `ViewTree` lookups never do.
"""

from __future__ import annotations

import bisect
import logging
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Optional

from . import packs
from . import snapshot_format as sf
from . import volumes
from .backing.base import Backend
from .errors import BlobMissing, CkptfsError, DamagedData
from .index import CHUNK_PACK, Chunk

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 2.0          # peer_refresh: how often the store is looked at
CHUNK_CACHE_BYTES = 64 << 20     # peers' chunk bytes kept in memory
EXTENT_CACHE_FILES = 16          # files whose extent lists are kept

Path = tuple[bytes, ...]


@dataclass
class VNode:
    """One name of the merged peer tree."""

    kind: str                             # "d" directory, "f" regular file, "n" other
    attrs: sf.Attrs
    volume: str                           # the volume it comes from (first one, for "d")
    obj: bytes = b""                      # "f": the file object
    peer_ino: int = 0                     # "f", "n": its inode number in the peer
    nlink: int = 1
    children: dict[bytes, "VNode"] = field(default_factory=dict)     # "d"

    @property
    def key(self) -> tuple:
        """What a stable inode number of the view stands for (merged.py): a
        directory is its path; a file its content in its volume."""
        if self.kind == "f":
            return ("f", self.volume, self.peer_ino, self.obj)
        return ("n", self.volume, self.peer_ino, sf.fragment(sf.encode_attrs(self.attrs)))


@dataclass
class ViewTree:
    """The merged peer tree at one refresh."""

    root: Optional[VNode]
    heads: dict[str, volumes.HeadKey]     # the head each volume shows
    made_at: float = 0.0                  # time.monotonic() of the refresh

    def node(self, path: Path) -> Optional[VNode]:
        n = self.root
        for name in path:
            if n is None or n.kind != "d":
                return None
            n = n.children.get(name)
        return n


@dataclass
class _FileInfo:
    attrs: sf.Attrs
    whole: bool                           # every extent's bytes are in the store


class PeerView:
    """The peers of one mount: what they published, refreshed from the store."""

    def __init__(self, backend: Backend, own_volume: Optional[str],
                 peers: Optional[list[str]], refresh_s: float = DEFAULT_REFRESH_S) -> None:
        from .coldstore import ColdStore   # compression libraries only with a store
        self.backend = backend
        self.own_volume = own_volume
        self.peers = peers                 # None: every other volume of the store
        self.refresh_s = refresh_s
        self.tree = ViewTree(None, {})
        self.cold = ColdStore(backend, CHUNK_CACHE_BYTES)
        self.last_error: Optional[str] = None
        self.refreshes = 0
        # Worker-thread state (refresh_blocking runs one at a time).
        self._packs: dict[str, list[packs.PackEntry]] = {}
        self._dirs: dict[bytes, tuple[sf.Attrs, list[sf.Entry]]] = {}
        self._files: dict[bytes, _FileInfo] = {}
        self._heads: dict[str, tuple[volumes.HeadKey, sf.Head]] = {}
        # Readers' state (any thread).
        self._lock = threading.Lock()
        self._where: dict[bytes, Chunk] = {}
        self._extents: OrderedDict[bytes, tuple[list[int], list[sf.Extent]]] = OrderedDict()

    # ------------------------------------------------------------ refreshing

    def volume_names(self) -> list[str]:
        """The volumes shown. May block."""
        names = volumes.volume_names(self.backend)
        if self.peers is not None:
            names = [n for n in names if n in self.peers]
        return [n for n in names if n != self.own_volume]

    def refresh_blocking(self) -> ViewTree:
        """A new picture of the peers (reads only what changed). May block.
        A volume that cannot be read keeps showing what it showed before."""
        self._refresh_packs()
        heads: dict[str, tuple[volumes.HeadKey, sf.Head]] = {}
        for name in self.volume_names():
            try:
                state = volumes.read_state(self.backend, name)
                newest = state.newest_valid()
                if newest is None:
                    continue
                old = self._heads.get(name)
                if old is not None and old[0] == newest:
                    heads[name] = old
                    continue
                hname = volumes.head_name(*newest)
                view = volumes.scope(self.backend, name)
                head = sf.decode_volume_head(hname, name, newest, _read_blob(
                    view, hname, sf.MAX_HEAD_BYTES))
                heads[name] = (newest, head)
            except (CkptfsError, OSError) as e:
                log.warning("peer volume %s: %s (showing what it showed before)", name, e)
                self.last_error = f"volume {name}: {e}"
                if name in self._heads:
                    heads[name] = self._heads[name]
        changed = {n: k for n, (k, _) in heads.items()} != self.tree.heads
        self._heads = heads
        if not changed and self.tree.root is not None:
            return ViewTree(self.tree.root, self.tree.heads, time.monotonic())
        used_dirs: set[bytes] = set()
        used_files: set[bytes] = set()
        root: Optional[VNode] = None
        for name in sorted(heads):
            key, head = heads[name]
            try:
                tree = self._volume_tree(name, head.root, used_dirs, used_files)
            except (CkptfsError, OSError) as e:
                log.warning("peer volume %s, head %s: %s", name, key, e)
                self.last_error = f"volume {name}: {e}"
                continue
            root = tree if root is None else _merge(root, tree)
        # Objects no picture names any more are forgotten (bounded memory).
        self._dirs = {k: v for k, v in self._dirs.items() if k in used_dirs}
        self._files = {k: v for k, v in self._files.items() if k in used_files}
        return ViewTree(root, {n: k for n, (k, _) in heads.items()}, time.monotonic())

    def _refresh_packs(self) -> None:
        """Chunk locations from the trailers of packs not read before."""
        names = set(self.backend.list(packs.PACK_PREFIX))
        gone = [n for n in self._packs if n not in names]
        new: dict[str, list[packs.PackEntry]] = {}
        for name in sorted(names - self._packs.keys()):
            pack_no = packs.pack_number(name)
            if pack_no is None:
                continue
            try:
                new[name] = packs.read_pack_index(self.backend, name)
            except BlobMissing:
                continue                   # deleted since the listing
            except CkptfsError as e:
                log.warning("peer view: pack %s is unreadable: %s", name, e)
                new[name] = []             # not read again
        with self._lock:
            for name in gone:
                for e in self._packs.pop(name):
                    c = self._where.get(e.chunk_id)
                    if c is not None and packs.pack_name(c.pack_no) == name:
                        del self._where[e.chunk_id]
            for name, entries in new.items():
                self._packs[name] = entries
                pack_no = packs.pack_number(name)
                for e in entries:
                    self._where.setdefault(e.chunk_id, Chunk(
                        0, CHUNK_PACK, 1, e.length, chunk_id=e.chunk_id, pack_no=pack_no,
                        pack_off=e.offset, stored_length=e.stored_length, codec=e.codec,
                        codec_param=e.param, payload_crc=e.crc))

    def _volume_tree(self, volume: str, root_obj: bytes, used_dirs: set[bytes],
                     used_files: set[bytes]) -> VNode:
        """One volume's head as VNodes (objects read only if not cached). May block."""
        objects = volumes.scope(self.backend, volume)
        attrs, entries = self._dir(objects, root_obj)
        used_dirs.add(root_obj)
        root = VNode("d", attrs, volume)
        links: dict[int, list[VNode]] = {}
        stack: list[tuple[VNode, list[sf.Entry], Path]] = [(root, entries, ())]
        while stack:
            node, entries, path = stack.pop()
            for e in entries:
                if not isinstance(e, sf.Entry) or sf.check_name(e.name) is not None:
                    continue
                if not path and e.name == b".ckptfs":
                    continue
                if e.kind == "d":
                    try:
                        a, sub = self._dir(objects, e.obj)
                    except (BlobMissing, sf.BadObject) as err:
                        log.warning("peer volume %s: %s unusable: %s", volume,
                                    b"/".join(path + (e.name,)), err)
                        continue
                    used_dirs.add(e.obj)
                    child = VNode("d", a, volume)
                    node.children[e.name] = child
                    stack.append((child, sub, path + (e.name,)))
                elif e.kind == "f":
                    info = self._file(objects, e.obj)
                    used_files.add(e.obj)
                    if info is None or not info.whole:
                        continue           # not (wholly) in the store yet: not shown
                    child = VNode("f", info.attrs, volume, obj=e.obj, peer_ino=e.ino)
                    node.children[e.name] = child
                    links.setdefault(e.ino, []).append(child)
                elif e.kind == "n" and e.attrs is not None:
                    child = VNode("n", e.attrs, volume, peer_ino=e.ino)
                    node.children[e.name] = child
                    links.setdefault(e.ino, []).append(child)
        for names in links.values():
            for n in names:
                n.nlink = len(names)
        return root

    def _dir(self, objects: Backend, oid: bytes) -> tuple[sf.Attrs, list[sf.Entry]]:
        cached = self._dirs.get(oid)
        if cached is None:
            d = sf.decode_dir(oid, _read_blob(objects, sf.object_name(oid),
                                              sf.MAX_OBJECT_BYTES))
            entries = list(d.entries)
            for page in d.pages:
                entries.extend(sf.decode_dir_page(page, _read_blob(
                    objects, sf.object_name(page), sf.MAX_OBJECT_BYTES)))
            cached = self._dirs[oid] = (d.attrs, entries)
        return cached

    def _file(self, objects: Backend, oid: bytes) -> Optional[_FileInfo]:
        if oid in self._files:
            return self._files[oid]
        try:
            f = sf.decode_file(oid, _read_blob(objects, sf.object_name(oid),
                                               sf.MAX_OBJECT_BYTES))
            whole = all(x.chunk_id is not None for x in _all_extents(objects, f))
            info = _FileInfo(f.attrs, whole)
        except (BlobMissing, sf.BadObject) as e:
            log.warning("peer file object %s unusable: %s", oid.hex()[:16], e)
            info = _FileInfo(sf.Attrs(stat.S_IFREG, 0, 0, 0, 0, 0), False)
        self._files[oid] = info
        return info

    # --------------------------------------------------------------- reading

    def extents(self, node: VNode) -> tuple[list[int], list[sf.Extent]]:
        """A shown file's extents (and their offsets, for bisect). May block."""
        with self._lock:
            got = self._extents.get(node.obj)
            if got is not None:
                self._extents.move_to_end(node.obj)
                return got
        objects = volumes.scope(self.backend, node.volume)
        f = sf.decode_file(node.obj, _read_blob(objects, sf.object_name(node.obj),
                                                sf.MAX_OBJECT_BYTES))
        check = sf.ExtentCheck(f.attrs.size)
        xs = []
        for x in _all_extents(objects, f):
            check.add(x)
            xs.append(x)
        got = ([x.file_off for x in xs], xs)
        with self._lock:
            self._extents[node.obj] = got
            while len(self._extents) > EXTENT_CACHE_FILES:
                self._extents.popitem(last=False)
        return got

    def read_blocking(self, node: VNode, off: int, size: int) -> bytes:
        """Bytes [off, off + size) of a shown file (holes read as zeros). May block."""
        end = min(off + size, node.attrs.size)
        if off >= end:
            return b""
        offsets, xs = self.extents(node)
        out = bytearray(end - off)
        view = memoryview(out)
        i = max(0, bisect.bisect_right(offsets, off) - 1)
        while i < len(xs) and xs[i].file_off < end:
            x = xs[i]
            i += 1
            lo, hi = max(off, x.file_off), min(end, x.file_off + x.length)
            if lo >= hi:
                continue
            with self._lock:
                chunk = self._where.get(x.chunk_id)
            if chunk is None:
                raise DamagedData(f"peer volume {node.volume}: chunk {x.chunk_id.hex()[:16]} "
                                  "is in no pack of the store (deleted by its node's gc?)")
            self.cold.read_into(view[lo - off:hi - off], chunk, x.chunk_off + lo - x.file_off)
        return bytes(out)

    def stats(self) -> dict[str, object]:
        tree = self.tree
        return {"peer_volumes": {n: f"{k[0]}-{k[1]}" for n, k in tree.heads.items()},
                "peer_view_age_s": round(time.monotonic() - tree.made_at, 3)
                if tree.made_at else None,
                "peer_last_error": self.last_error,
                "peer_chunks_known": len(self._where)}


def _merge(a: VNode, b: VNode) -> VNode:
    """Volume b's tree laid into the merged tree a (module docstring's rules)."""
    for name, nb in b.children.items():
        na = a.children.get(name)
        if na is None:
            a.children[name] = nb
        elif na.kind == "d" and nb.kind == "d":
            _merge(na, nb)
        elif na.kind == "d" or nb.kind == "d":
            if nb.kind == "d":
                a.children[name] = nb
        elif nb.attrs.mtime_ns > na.attrs.mtime_ns:
            a.children[name] = nb          # volumes come in name order: ties keep the first
    if b.attrs.mtime_ns > a.attrs.mtime_ns:
        a.attrs = b.attrs
    return a


def _all_extents(objects: Backend, f: sf.FileObject) -> Iterable[sf.Extent]:
    yield from f.extents
    for page in f.pages:
        yield from sf.decode_extent_page(page, _read_blob(objects, sf.object_name(page),
                                                          sf.MAX_OBJECT_BYTES))


def _read_blob(backend: Backend, name: str, limit: int) -> bytes:
    size = backend.size(name)
    if size > limit:
        raise sf.BadObject(f"{name}: {size} bytes, more than the {limit} it may have")
    return backend.read(name, 0, size)
