"""`ckptfs recover`: rebuild a lost index from the backing store alone.

The store describes the namespace as snapshots (docs/STORE.md). Recover takes
the newest head of this filesystem (or the one `--head SEQ` names) and
restores exactly the state it describes: every directory with its mode,
owner, times and xattrs (empty ones too), every file whose bytes are all in
the store (hard links as links), symlinks, device nodes and FIFOs. A path
deleted before that snapshot stays deleted; a file whose newest version is
not wholly in the store (still in the log when the index was lost) is named
and left out, never replaced by an older version.

Every field is checked before it is used (`snapshot_format`, and here against
the packs' trailers: chunk ids present, extents inside their chunk): what is
bad is named and left out with everything below it, exit 4, never a
traceback. The walk keeps its own stack (any depth). The new index is built
in `index.recover-tmp`, a transaction every COMMIT_EVERY entries, and renamed
into place only once complete: an interrupted or failed recover leaves no
index behind, and a rerun starts afresh.

A store written before snapshots holds per-file manifests instead; recover
reads them only when the store has no head of this filesystem, oldest to
newest (a newer manifest of a path replaces an older one), and says what
they cannot tell. Runs offline, as `ckptfs fsck` does; progress bars on a
terminal.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Union

from tqdm import tqdm

from . import chunkindex
from . import index as ix
from . import packs
from . import snapshot_format as sf
from . import volumes
from .backing import open_backend
from .backing.base import Backend
from .errors import BlobMissing, CkptfsError, ExitCode, OperationFailed
from .index import CHUNK_PACK, ROOT_INO, Chunk, DirectTxn, Extent, Index, Inode
from .namespace import STATE_DIR_NAME, SYSTEM_PREFIX, XATTR_INODE_MAX_BYTES
from .options import parse_options
from .statedir import index_exists, lock_source, refuse_if_mounted

log = logging.getLogger(__name__)

RECOVER_DIR = "index.recover-tmp"
COMMIT_EVERY = 20000          # entries restored per LMDB transaction


@dataclass
class Report:
    head: Optional[int] = None
    dirs: int = 0
    files: int = 0
    nodes: int = 0                 # symlinks, devices, FIFOs, sockets
    extra_links: int = 0           # names beyond an inode's first
    bytes: int = 0
    chunks: int = 0
    skipped: list[str] = field(default_factory=list)     # "PATH: why", one per item
    notes: list[str] = field(default_factory=list)

    def skip(self, path: bytes, why: str) -> None:
        self.skipped.append(f"{_show(path)}: {why}")


def _join(path: bytes, name: bytes) -> bytes:
    return path + b"/" + name if path else name


def _show(path: bytes) -> str:
    return (path or b"/").decode("utf-8", "backslashreplace")


class HeadUnusable(CkptfsError):
    """The snapshot to restore cannot be used at all (its head or root)."""


# ------------------------------------------------------------------ command

def run_recover(source: str, option_strings: Iterable[str], out=None,
                head: Optional[int] = None) -> int:
    """Rebuild SOURCE's index from its backing store; returns the exit code."""
    out = out or sys.stdout
    opts = parse_options(source, source, list(option_strings))
    refuse_if_mounted(opts.source)
    os.makedirs(opts.state_dir, mode=0o700, exist_ok=True)
    lock_fd = lock_source(opts.state_dir)
    try:
        if index_exists(opts.index_dir):
            raise OperationFailed(f"{opts.index_dir} holds an index: recover rebuilds a "
                                  "lost one (move it aside first if it is damaged beyond "
                                  "fsck)")
        backend = open_backend(opts.backing_dir, must_exist=True,   # the marker must be there
                               profile=opts.aws_profile)
        try:
            return _recover(opts, backend, out, head)
        finally:
            backend.close()
    finally:
        os.close(lock_fd)


def _recover(opts, backend: Backend, out, want_head: Optional[int]) -> int:
    tmp = os.path.join(opts.state_dir, RECOVER_DIR)
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)              # an interrupted recover's: we hold the lock
    source = _choose_source(opts, backend, out)
    seqs = source.seqs
    manifests = backend.list(sf.manifests_prefix(source.fs_uuid)) \
        if not seqs and source.volume is None else []
    if want_head is not None and want_head not in seqs:
        raise OperationFailed(f"{source.where} holds no snapshot {want_head} "
                              f"(it holds {_seq_list(seqs) or 'none'})")
    if not seqs and not manifests:
        raise OperationFailed(f"{source.where} holds no snapshot"
                              + (f" of filesystem {source.fs_uuid.hex()}" if source.volume is None
                                 else "") + ": nothing to recover from")
    report = Report()
    # Other volumes' packs this one names chunks of (dedup across volumes):
    # its refs say which (chunkindex.py).
    shared = set(chunkindex.referenced_packs(backend, source.volume)) \
        if source.volume is not None else set()
    where, more, pack_sizes = _read_packs(backend, out, source.spaces, shared)
    st = os.stat(opts.source)
    index = Index(tmp)
    unusable: Optional[str] = None
    try:
        try:
            index.format(source.fs_uuid if source.volume is None else ix.new_fs_uuid(),
                         time.time_ns(), st.st_uid, st.st_gid)
            builder = Builder(index, where, report, backend, more)
            record = None
            if seqs:
                seq = want_head if want_head is not None else seqs[-1]
                try:
                    head = source.read_head(seq)
                    report.head = seq
                    print(f"recovering snapshot {seq} of {_when(head.time_ns)} from "
                          f"{source.where}: {head.entries} entries, {head.files} files "
                          f"({head.incomplete_files} not wholly in the store)", file=out)
                    SnapshotWalk(source.objects, head, builder).run(index)
                    if source.volume is not None:
                        # The next mount takes the volume over from this head.
                        record = ix.VolumeRecord(source.volume, source.state.generation,
                                                 (head.gen, head.seq), takeover=True,
                                                 seen=source.state.newest_valid())
                except HeadUnusable as e:
                    unusable = f"cannot recover snapshot {seq}: {e}"
            else:
                _from_manifests(backend, source.fs_uuid, manifests, builder, st, report)
            if unusable is None:
                builder.finish(backend, pack_sizes, source.all_seqs, record)
        finally:
            index.close()
        if unusable is None:
            _move_into_place(tmp, opts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if unusable is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        print(unusable, file=out)
        older = [s for s in seqs if s < seq]
        if older:
            print(f"older snapshots in the store: {_seq_list(older)}; `ckptfs recover "
                  "--head SEQ` restores one of them (a state older than the newest "
                  "published)", file=out)
        print("no index was built", file=out)
        return ExitCode.UNCORRECTED
    print(f"recovered {report.files} files ({report.bytes} bytes in {report.chunks} chunks), "
          f"{report.dirs} directories, {report.nodes} symlinks and other nodes, "
          f"{report.extra_links} further hard links from {backend.url}", file=out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    for why in report.skipped:
        print(f"not recovered: {why}", file=out)
    return ExitCode.OK if not report.skipped else ExitCode.UNCORRECTED


def _seq_list(seqs: list[int]) -> str:
    return ", ".join(str(s) for s in reversed(seqs[-10:])) + (" ..." if len(seqs) > 10 else "")


def _when(time_ns: int) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time_ns / 1e9))
    except (OverflowError, OSError, ValueError):
        return f"time {time_ns}"


def _move_into_place(tmp: str, opts) -> None:
    """The complete index becomes SOURCE's, in one rename."""
    if os.path.lexists(opts.index_dir):
        shutil.rmtree(opts.index_dir)       # checked above: no formatted index in it
    os.rename(tmp, opts.index_dir)
    fd = os.open(opts.state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Copy = tuple[int, packs.PackEntry]          # a pack number and its trailer's entry


def _read_packs(backend: Backend, out, spaces: Optional[set[int]], shared: set[int] = frozenset()
                ) -> tuple[dict[bytes, Copy], dict[bytes, list[Copy]], dict[int, Optional[int]]]:
    """Where every chunk is, from the trailers of the packs in these pack
    spaces (None: all, a store before volumes); a damaged pack is named.
    Returns the first pack listing each chunk id, the further ones for ids
    several packs list, and the sizes of the readable packs (a damaged one's
    number maps to None: its name stays taken, the pack counter passes it).
    Other volumes' packs are named only where this volume holds a ref to them
    (`shared`: chunks it took from them, chunkindex.py)."""
    where: dict[bytes, Copy] = {}
    more: dict[bytes, list[Copy]] = {}
    sizes: dict[int, Optional[int]] = {}
    names = [n for n in backend.list(packs.PACK_PREFIX)
             if spaces is None or packs.pack_number(n) is None
             or volumes.pack_space(packs.pack_number(n)) in spaces
             or packs.pack_number(n) in shared]
    for name in tqdm(names, desc="reading packs", unit="pack", disable=not sys.stderr.isatty(),
                     file=sys.stderr):
        pack_no = packs.pack_number(name)
        try:
            if pack_no is None:
                raise ValueError("not a pack name")
            size = backend.size(name)
            entries = packs.read_pack_index(backend, name, size)
        except (ValueError, CkptfsError) as e:
            print(f"skipping pack {name}: {e}", file=out)
            if pack_no is not None:
                sizes[pack_no] = None
            continue
        sizes[pack_no] = size
        for entry in entries:
            if entry.chunk_id in where:
                more.setdefault(entry.chunk_id, []).append((pack_no, entry))
            else:
                where[entry.chunk_id] = (pack_no, entry)
    return where, more, sizes


def _read_blob(backend: Backend, name: str, limit: int) -> bytes:
    size = backend.size(name)
    if size > limit:
        raise sf.BadObject(f"{name}: {size} bytes, more than the {limit} it may have")
    return backend.read(name, 0, size)


@dataclass
class _Source:
    """Where recover reads a snapshot from: a volume (its scope of the store)
    or, for a store before volumes, the store's root."""

    backend: Backend
    objects: Backend                  # where heads and objects are
    where: str                        # for messages
    fs_uuid: bytes
    volume: Optional[str] = None
    state: Optional[volumes.VolumeState] = None
    keys: dict[int, tuple[int, int]] = field(default_factory=dict)    # seq -> valid head
    _legacy: list[int] = field(default_factory=list)     # head numbers before volumes

    @property
    def seqs(self) -> list[int]:
        """Sequence numbers of the heads to choose from (valid ones), in order."""
        return sorted(self.keys) if self.volume is not None else self._legacy

    @property
    def all_seqs(self) -> list[int]:
        """Every head's number, valid or not: the index's counter goes above all."""
        if self.volume is None:
            return self._legacy
        return [h[1] for h in self.state.heads]

    @property
    def spaces(self) -> Optional[set[int]]:
        return None if self.state is None else self.state.spaces

    def read_head(self, seq: int) -> sf.Head:
        if self.volume is None:
            return _read_head(self.backend, self.fs_uuid, seq)
        key = self.keys[seq]
        name = volumes.head_name(*key)
        try:
            return sf.decode_volume_head(name, self.volume, key,
                                         _read_blob(self.objects, name, sf.MAX_HEAD_BYTES))
        except (BlobMissing, sf.BadObject) as e:
            raise HeadUnusable(str(e)) from None


def _choose_source(opts, backend: Backend, out) -> _Source:
    """The volume to restore: `-o volume=NAME`, else the one named after this
    host, else the only one; a store before volumes: the filesystem its marker
    names."""
    fs_uuid = backend.store_uuid.bytes
    names = volumes.volume_names(backend)
    name = opts.volume
    if name is None and names:
        default = volumes.default_name()
        if default in names:
            name = default
        elif len(names) == 1:
            name = names[0]
            print(f"the store holds one volume, {name}: recovering it", file=out)
        else:
            raise OperationFailed(f"{backend.url} holds volumes {', '.join(names[:20])}: "
                                  "name the one to recover with -o volume=NAME")
    if name is None:
        legacy = sorted(s for s in (sf.head_seq_from_name(n)
                                    for n in backend.list(sf.heads_prefix(fs_uuid)))
                        if s is not None)
        return _Source(backend, backend, backend.url, fs_uuid, _legacy=legacy)
    if name not in names:
        raise OperationFailed(f"{backend.url} holds no volume {name} (it holds "
                              f"{', '.join(names[:20]) or 'none'})")
    state = volumes.read_state(backend, name)
    for why in state.damaged:
        print(f"note: {why}", file=out)
    keys = {h[1]: h for h in state.valid_heads()}
    fenced = [h for h in state.heads if not state.valid(h)]
    if fenced:
        print(f"note: {len(fenced)} head(s) of volume {name} are fenced (published by a "
              "node after it lost the volume) and are ignored", file=out)
    return _Source(backend, volumes.scope(backend, name), f"volume {name} of {backend.url}",
                   fs_uuid, name, state, keys)


def _read_head(backend: Backend, fs_uuid: bytes, seq: int) -> sf.Head:
    name = sf.head_name(fs_uuid, seq)
    try:
        return sf.decode_head(name, fs_uuid, _read_blob(backend, name, sf.MAX_HEAD_BYTES))
    except (BlobMissing, sf.BadObject) as e:
        raise HeadUnusable(str(e)) from None


# ------------------------------------------------------------------ building

class Builder:
    """Writes recovered inodes, entries, extents and chunks into the new index.

    `txn` is set by the caller to the open write transaction; ids come from the
    builder's own counters, written back by `finish`."""

    def __init__(self, index: Index, where: dict[bytes, Copy], report: Report,
                 backend: Backend, more: Optional[dict[bytes, list[Copy]]] = None) -> None:
        self.index = index
        self.where = where
        self.more = more or {}
        self._chosen: dict[bytes, Copy] = {}
        self.backend = backend
        self.report = report
        self.txn: Optional[DirectTxn] = None
        self.counters = {n: index.counters[n] for n in ix.ID_COUNTERS}
        self.links: dict[int, Union[tuple[int, bytes], str]] = {}   # old ino -> (new, key) | why

    def _locate(self, cid: bytes) -> Optional[Copy]:
        """The pack copy of chunk `cid` to restore from (None: no pack lists
        it). When several packs list it (a pass interrupted and redone, a
        crafted or damaged pack), the first whose bytes match the id, read and
        decoded within the chunk limit; decided once per id. May block."""
        first = self.where.get(cid)
        others = self.more.get(cid)
        if first is None or not others:
            return first
        if cid in self._chosen:
            return self._chosen[cid]
        chosen = next((c for c in (first, *others) if self._holds(cid, *c)), first)
        if chosen is not first:
            self.report.notes.append(
                f"chunk {cid.hex()[:16]}..: {packs.pack_name(first[0])} lists it but does "
                f"not hold its bytes (damaged or crafted); restored from "
                f"{packs.pack_name(chosen[0])}")
        self._chosen[cid] = chosen
        return chosen

    def _holds(self, cid: bytes, pack_no: int, e: packs.PackEntry) -> bool:
        from .coldstore import ColdStore     # decoding only when ids are listed twice
        try:
            ColdStore(self.backend, 0).get(Chunk(
                0, CHUNK_PACK, 1, e.length, pack_no=pack_no, pack_off=e.offset,
                stored_length=e.stored_length, codec=e.codec, codec_param=e.param,
                payload_crc=e.crc, chunk_id=cid))
        except CkptfsError:
            return False
        return True

    def _next(self, name: bytes) -> int:
        self.counters[name] += 1
        return self.counters[name] - 1

    def _link(self, parent: int, name: bytes, ino: int) -> None:
        cookie = self._next(b"next_cookie")
        ix.add_entry(self.txn, parent, name, ino, cookie)

    def _xattrs(self, ino: int, xattrs: list[tuple[bytes, bytes]], path: bytes) -> None:
        """Restore what the namespace would have accepted; name what it would not."""
        used = 0
        for k, v in xattrs:
            used += len(k) + len(v)
            if k.startswith(SYSTEM_PREFIX):
                self.report.skip(path, f"xattr {_show(k)}: ckptfs keeps no system.* xattrs")
            elif used > XATTR_INODE_MAX_BYTES:
                self.report.skip(path, f"xattr {_show(k)}: beyond the {XATTR_INODE_MAX_BYTES} "
                                       "bytes of xattrs an inode may have")
            else:
                ix.put_xattr(self.txn, ino, k, v)

    def make_dir(self, parent: int, name: bytes, attrs: sf.Attrs) -> int:
        """A new directory in parent; its nlink and times are set by finish_dir."""
        ino = self._next(b"next_ino")
        self._link(parent, name, ino)
        self.report.dirs += 1
        return ino

    def finish_dir(self, ino: int, parent: int, attrs: sf.Attrs, subdirs: int,
                   path: bytes) -> None:
        ix.put_inode(self.txn, Inode(ino, attrs.mode, 2 + subdirs, attrs.uid, attrs.gid,
                                     atime_ns=attrs.atime_ns, mtime_ns=attrs.mtime_ns,
                                     ctime_ns=attrs.ctime_ns, parent=parent))
        self._xattrs(ino, attrs.xattrs, path)

    def another_link(self, parent: int, name: bytes, path: bytes, old_ino: int,
                     key: bytes) -> bool:
        """A further name of an inode restored (or refused) already: True if handled."""
        known = self.links.get(old_ino)
        if known is None:
            return False
        if isinstance(known, str):
            self.report.skip(path, f"hard link of a file not recovered ({known})")
            return True
        new_ino, first_key = known
        if first_key != key:
            self.report.skip(path, f"inode {old_ino} is described twice, differently")
            return True
        inode = ix.get_inode(self.txn, new_ino)
        inode.nlink += 1
        ix.put_inode(self.txn, inode)
        self._link(parent, name, new_ino)
        self.report.extra_links += 1
        return True

    def refuse(self, path: bytes, old_ino: int, why: str) -> None:
        self.report.skip(path, why)
        if old_ino:
            self.links[old_ino] = why

    def check_extents(self, size: int, extents: Iterable[sf.Extent]) -> Optional[str]:
        """Why the file cannot be restored from these extents, or None."""
        order = sf.ExtentCheck(size)
        try:
            for x in extents:
                order.add(x)
                if x.chunk_id is None:
                    return ("not wholly in the store (bytes at offset "
                            f"{x.file_off} were still in the log or in SOURCE)")
                found = self._locate(x.chunk_id)
                if found is None:
                    return f"chunk {x.chunk_id.hex()[:16]}.. at offset {x.file_off} is in no pack"
                if x.chunk_off + x.length > found[1].length:
                    return (f"extent at offset {x.file_off} reaches past the end of chunk "
                            f"{x.chunk_id.hex()[:16]}..")
        except sf.BadObject as e:
            return str(e)
        return None

    def add_file(self, parent: int, name: bytes, path: bytes, old_ino: int, key: bytes,
                 attrs: sf.Attrs, extents: Iterable[sf.Extent]) -> None:
        """A regular file whose extents `check_extents` accepted."""
        ino = self._next(b"next_ino")
        data_bytes = 0
        for x in extents:
            chunk = ix.find_chunk(self.txn, x.chunk_id)
            if chunk is None:
                pack_no, e = self._locate(x.chunk_id)
                chunk = Chunk(self._next(b"next_chunk"), CHUNK_PACK, 1, e.length,
                              pack_no=pack_no, pack_off=e.offset, stored_length=e.stored_length,
                              codec=e.codec, codec_param=e.param, payload_crc=e.crc,
                              chunk_id=x.chunk_id)
                ix.add_chunk(self.txn, chunk)
                self.report.chunks += 1
            else:
                chunk.refcount += 1
                ix.put_chunk(self.txn, chunk)
            ix.put_extent(self.txn, ino, Extent(x.file_off, x.length, chunk.chunk_no,
                                                x.chunk_off))
            data_bytes += x.length
        ix.put_inode(self.txn, Inode(ino, attrs.mode, 1, attrs.uid, attrs.gid, size=attrs.size,
                                     atime_ns=attrs.atime_ns, mtime_ns=attrs.mtime_ns,
                                     ctime_ns=attrs.ctime_ns, data_bytes=data_bytes))
        self._xattrs(ino, attrs.xattrs, path)
        self._link(parent, name, ino)
        self.links[old_ino] = (ino, key)
        self.report.files += 1
        self.report.bytes += attrs.size

    def add_node(self, parent: int, name: bytes, path: bytes, old_ino: int,
                 attrs: sf.Attrs) -> None:
        ino = self._next(b"next_ino")
        ix.put_inode(self.txn, Inode(ino, attrs.mode, 1, attrs.uid, attrs.gid, rdev=attrs.rdev,
                                     size=attrs.size, atime_ns=attrs.atime_ns,
                                     mtime_ns=attrs.mtime_ns, ctime_ns=attrs.ctime_ns))
        if stat.S_ISLNK(attrs.mode):
            ix.put_symlink(self.txn, ino, attrs.target)
        self._xattrs(ino, attrs.xattrs, path)
        self._link(parent, name, ino)
        self.links[old_ino] = (ino, sf.fragment(sf.encode_attrs(attrs)))
        self.report.nodes += 1

    def finish(self, backend: Backend, pack_sizes: dict[int, Optional[int]],
               head_seqs: list[int], volume: Optional[ix.VolumeRecord] = None) -> None:
        """Counters (never below what the store already used), the store, clean;
        the volume to take over. A volume's next pack number comes from the
        space of the lease the takeover takes (volumes.attach)."""
        if volume is None:
            self.counters[b"next_pack"] = max([self.counters[b"next_pack"],
                                               *(n + 1 for n in pack_sizes)])
        # A later snapshot must sort after every head already in the store.
        self.counters[b"next_head"] = max([self.counters[b"next_head"],
                                           *(s + 1 for s in head_seqs)])

        def write(txn: DirectTxn) -> None:
            # Every readable pack gets a record, those no restored file uses with no
            # live chunks: the first mount's collection deletes them like any dead
            # pack, after publishing a snapshot (until then `--head` can still
            # restore an older snapshot that uses them).
            for pack_no, size in pack_sizes.items():
                if size is None:
                    continue            # damaged: fsck names it, gc or --repair deletes it
                pack = ix.get_pack(txn, pack_no) or ix.PackInfo(pack_no, 0, 0, 0)
                pack.size_bytes = size
                ix.put_pack(txn, pack)
            ix.write_counters(txn, self.counters)
            if volume is not None:
                ix.set_volume(txn, volume)
            ix.set_store(txn, backend.store_uuid.bytes, backend.location.encode())
            ix.mark_clean(txn, True)

        self.index.write_direct(write)


# ------------------------------------------------------------ snapshot walk

@dataclass
class _Frame:
    ino: int                        # in the new index
    parent: int
    path: bytes
    attrs: sf.Attrs
    entries: list                   # the current page's entries
    pos: int = 0
    pages: list[bytes] = field(default_factory=list)    # still to read
    last_name: Optional[bytes] = None
    subdirs: int = 0


class SnapshotWalk:
    """Restore one head's tree: depth first with an explicit stack (any depth),
    every object checked before use, COMMIT_EVERY entries per transaction."""

    def __init__(self, backend: Backend, head: sf.Head, builder: Builder) -> None:
        self.backend = backend
        self.head = head
        self.b = builder
        self.report = builder.report
        self.stack: list[_Frame] = []
        self.seen = 0
        self.bar = tqdm(total=head.entries, unit="entry", desc="restoring",
                        disable=not sys.stderr.isatty(), file=sys.stderr)

    def _object(self, oid: bytes, decode: Callable[[bytes, bytes], object]):
        """A namespace object, checked; BadObject (or BlobMissing) if it is not usable."""
        return decode(oid, _read_blob(self.backend, sf.object_name(oid), sf.MAX_OBJECT_BYTES))

    def run(self, index: Index) -> None:
        try:
            root = self._object(self.head.root, sf.decode_dir)
        except (BlobMissing, sf.BadObject) as e:
            raise HeadUnusable(f"its root directory object is unusable: {e}") from None
        self.stack.append(_Frame(ROOT_INO, ROOT_INO, b"", root.attrs, root.entries,
                                 pages=list(root.pages)))
        with self.bar:
            while self.stack:
                index.write_direct(self._steps)

    def _steps(self, txn: DirectTxn) -> None:
        self.b.txn = txn
        for _ in range(COMMIT_EVERY):
            if not self.stack:
                return
            self._step()

    def _step(self) -> None:
        top = self.stack[-1]
        if top.pos == len(top.entries):
            if top.pages:
                oid = top.pages.pop(0)
                try:
                    top.entries, top.pos = self._object(oid, sf.decode_dir_page), 0
                except (BlobMissing, sf.BadObject) as e:
                    top.entries, top.pos = [], 0
                    self.report.skip(top.path, f"a page of its entries is unusable ({e}): "
                                               "the entries on it are not recovered")
                return
            self.stack.pop()
            self.b.finish_dir(top.ino, top.parent, top.attrs, top.subdirs, top.path)
            return
        entry = top.entries[top.pos]
        top.pos += 1
        self.seen += 1
        self.bar.update(1)
        if self.seen > self.head.entries:
            raise HeadUnusable(f"its tree holds more than the {self.head.entries} entries its "
                               "head says (damaged or crafted)")
        if isinstance(entry, sf.BadEntry):
            self.report.skip(_join(top.path, os.fsencode(entry.name)), entry.why)
            return
        path = _join(top.path, entry.name)
        if top.last_name is not None and entry.name <= top.last_name:
            self.report.skip(path, "listed twice or out of order in its directory")
            return
        top.last_name = entry.name
        if top.ino == ROOT_INO and entry.name == STATE_DIR_NAME:
            self.report.skip(path, "the name is reserved for the state directory")
            return
        if entry.kind == "d":
            try:
                d = self._object(entry.obj, sf.decode_dir)
            except (BlobMissing, sf.BadObject) as e:
                self.report.skip(path, f"directory unusable ({e}): nothing below it is "
                                       "recovered")
                return
            ino = self.b.make_dir(top.ino, entry.name, d.attrs)
            top.subdirs += 1
            self.stack.append(_Frame(ino, top.ino, path, d.attrs, d.entries,
                                     pages=list(d.pages)))
        elif entry.kind == "f":
            self._file(top, path, entry)
        else:
            if not self.b.another_link(top.ino, entry.name, path, entry.ino,
                                       sf.fragment(sf.encode_attrs(entry.attrs))):
                self.b.add_node(top.ino, entry.name, path, entry.ino, entry.attrs)

    def _extents(self, f: sf.FileObject) -> Iterator[sf.Extent]:
        yield from f.extents
        for oid in f.pages:
            yield from self._object(oid, sf.decode_extent_page)

    def _file(self, top: _Frame, path: bytes, entry: sf.Entry) -> None:
        if self.b.another_link(top.ino, entry.name, path, entry.ino, entry.obj):
            return
        try:
            f = self._object(entry.obj, sf.decode_file)
            why = self.b.check_extents(f.attrs.size, self._extents(f))
        except (BlobMissing, sf.BadObject) as e:
            why = f"file object unusable: {e}"
        if why is not None:
            self.b.refuse(path, entry.ino, why)
            return
        self.b.add_file(top.ino, entry.name, path, entry.ino, entry.obj, f.attrs,
                        self._extents(f))


# ---------------------------------------------------------------- manifests

def _from_manifests(backend: Backend, fs_uuid: bytes, names: list[str], builder: Builder,
                    st: os.stat_result, report: Report) -> None:
    """A store from before snapshots: per-file manifests, oldest to newest."""
    docs: list[sf.Manifest] = []
    for name in tqdm(names, desc="reading manifests", unit="file",
                     disable=not sys.stderr.isatty(), file=sys.stderr):
        try:
            docs.append(sf.decode_manifest(name, _read_blob(backend, name, sf.MAX_OBJECT_BYTES)))
        except (BlobMissing, sf.BadObject) as e:
            report.skipped.append(f"{name}: {e}")
    report.notes.append(
        f"the store holds no snapshot, only {len(names)} per-file manifests written by an "
        "older ckptfs: they know nothing of deletions and renames made after a file was "
        "tiered (a file deleted since may be back, under an old name), nor of directories "
        "(given mode 0755 and SOURCE's owner), empty directories, symlinks, device nodes "
        "or files never tiered; check the result")
    # The newest manifest of each inode; then oldest first, so that a newer
    # manifest of a path (a file replaced by rename) takes it over.
    newest: dict[int, sf.Manifest] = {}
    for m in docs:
        if m.ino not in newest or newest[m.ino].attrs.mtime_ns < m.attrs.mtime_ns:
            newest[m.ino] = m
    docs = sorted(newest.values(), key=lambda m: (m.attrs.mtime_ns, m.ino))
    claims: dict[bytes, sf.Manifest] = {}
    for m in docs:
        for p in m.paths:
            claims[p] = m
    now = time.time_ns()
    dir_attrs = sf.Attrs(0o40755, st.st_uid, st.st_gid, now, now, now)
    dirs: dict[bytes, int] = {b"": ROOT_INO}
    subdirs: dict[int, int] = {ROOT_INO: 0}
    parent_of: dict[int, int] = {ROOT_INO: ROOT_INO}
    taken: set[bytes] = set()

    def build(txn: DirectTxn) -> None:
        builder.txn = txn
        for path in sorted(claims):
            m = claims[path]
            head, _, name = path.rpartition(b"/")
            parts = head.split(b"/") if head else []
            if parts and parts[0] == STATE_DIR_NAME or (not parts and name == STATE_DIR_NAME):
                report.skip(path, "the name is reserved for the state directory")
                continue
            parent, so_far, ok = ROOT_INO, b"", True
            for part in parts:
                so_far = so_far + b"/" + part if so_far else part
                if so_far in taken:
                    report.skip(path, f"{_show(so_far)} is a file")
                    ok = False
                    break
                if so_far not in dirs:
                    ino = builder.make_dir(parent, part, dir_attrs)
                    dirs[so_far], subdirs[ino], parent_of[ino] = ino, 0, parent
                    subdirs[parent] += 1
                parent = dirs[so_far]
            if not ok:
                continue
            if path in dirs:
                report.skip(path, "a directory has that name")
                continue
            taken.add(path)
            if builder.another_link(parent, name, path, m.ino, b"%d" % id(m)):
                continue
            why = builder.check_extents(m.attrs.size, m.extents)
            if why is not None:
                builder.refuse(path, m.ino, why)
                continue
            builder.add_file(parent, name, path, m.ino, b"%d" % id(m), m.attrs, m.extents)
        root = ix.get_inode(txn, ROOT_INO)
        for ino, n in subdirs.items():
            attrs = dir_attrs if ino != ROOT_INO else sf.Attrs(
                root.mode, root.uid, root.gid, root.atime_ns, root.mtime_ns, root.ctime_ns)
            builder.finish_dir(ino, parent_of[ino], attrs, n, b"")

    builder.index.write_direct(build)
