"""`ckptfs recover`: rebuild a lost index from the backing store alone.

The backing store is self-describing: every pack's trailer lists the chunks
in it (BLAKE3 id, where, how compressed), and every wholly cold file has a
manifest (`manifests/<fs uuid>/<ino>-<mtime>.json`: its paths, attributes,
xattrs and the chunk ids of its extents). Recovery reads them all and writes
a new index in one transaction: directories along every path, each file with
its names, attributes and extents, each chunk as a cold (`PACK`) chunk with
the exact refcount the extents give it. A file whose chunks are not all found
is left out and reported, never recreated with holes.

What the store never had is not recovered: files that were still hot (in the
log) when the index was lost, and names given since a file's manifest was
written. Runs offline, as `ckptfs fsck` does; shows progress on a terminal.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable

from tqdm import tqdm

from . import index as ix
from . import packs
from .backing import open_backend
from .backing.base import Backend
from .daemon import ckptfs_mounts, lock_source
from .errors import CkptfsError, OperationFailed
from .index import CHUNK_PACK, ROOT_INO, Chunk, DirectTxn, Extent, Index, Inode
from .options import parse_options

log = logging.getLogger(__name__)


@dataclass
class Recovered:
    files: int = 0
    bytes: int = 0
    chunks: int = 0
    skipped: list[str] = field(default_factory=list)


def run_recover(source: str, option_strings: Iterable[str], out=None) -> int:
    """Rebuild SOURCE's index from its backing store; returns the exit code."""
    out = out or sys.stdout
    opts = parse_options(source, source, list(option_strings))
    for _, point, mounted_source in ckptfs_mounts():
        if mounted_source == os.path.realpath(opts.source):
            raise OperationFailed(f"{opts.source} is mounted on {point}: unmount it first")
    os.makedirs(opts.state_dir, mode=0o700, exist_ok=True)
    lock_fd = lock_source(opts.state_dir)
    try:
        if os.path.exists(os.path.join(opts.index_dir, "data.mdb")):
            probe = Index(opts.index_dir)
            try:
                formatted = probe.is_formatted()
            finally:
                probe.close()
            if formatted:
                raise OperationFailed(f"{opts.index_dir} holds an index: recover rebuilds a lost "
                                 "one (move it aside first if it is damaged beyond fsck)")
        root = opts.backing_dir
        backend = open_backend(root, must_exist=True, profile=opts.aws_profile)
        try:
            result = _recover(opts, backend, out)
        finally:
            backend.close()
    finally:
        os.close(lock_fd)
    print(f"recovered {result.files} files ({result.bytes} bytes in {result.chunks} chunks) "
          f"from {root}", file=out)
    for why in result.skipped:
        print(f"not recovered: {why}", file=out)
    return 0 if not result.skipped else 4


def _recover(opts, backend: Backend, out) -> Recovered:
    fs_uuid = backend.store_uuid.bytes
    tty = sys.stderr.isatty()
    # Where every chunk is: the pack trailers.
    where: dict[bytes, tuple[int, packs.PackEntry]] = {}
    pack_sizes: dict[int, int] = {}
    names = backend.list(packs.PACK_PREFIX)
    for name in tqdm(names, desc="reading packs", unit="pack", disable=not tty,
                     file=sys.stderr):
        try:
            pack_no = int(posixpath.basename(name)[:-len(packs.PACK_SUFFIX)], 16)
            entries = packs.read_pack_index(backend, name)
        except (ValueError, CkptfsError) as e:
            print(f"skipping pack {name}: {e}", file=out)
            continue
        pack_sizes[pack_no] = backend.size(name)
        for entry in entries:
            where.setdefault(entry.chunk_id, (pack_no, entry))
    # The newest manifest of every inode.
    newest: dict[int, tuple[int, str]] = {}
    for name in backend.list(f"manifests/{fs_uuid.hex()}/"):
        stem = posixpath.basename(name)[:-len(".json")]
        try:
            ino_s, mtime_s = stem.split("-", 1)
            ino, mtime = int(ino_s), int(mtime_s)
        except ValueError:
            continue
        if ino not in newest or newest[ino][0] < mtime:
            newest[ino] = (mtime, name)
    docs = []
    for _, name in tqdm(list(newest.values()), desc="reading manifests", unit="file",
                        disable=not tty, file=sys.stderr):
        docs.append(json.loads(backend.read(name, 0, backend.size(name))))
    st = os.stat(opts.source)
    index = Index(opts.index_dir)
    result = Recovered()
    try:
        index.format(fs_uuid, time.time_ns(), st.st_uid, st.st_gid)
        index.write_direct(lambda txn: _build(txn, docs, where, pack_sizes, backend, result,
                                              st))
    finally:
        index.close()
    return result


def _build(txn: DirectTxn, docs: list[dict], where: dict, pack_sizes: dict[int, int],
           backend: Backend, result: Recovered, st: os.stat_result) -> None:
    counters = {n: ix.read_counter(txn, n) for n in ix.ID_COUNTERS}

    def next_id(name: bytes) -> int:
        counters[name] += 1
        return counters[name] - 1

    dirs: dict[bytes, int] = {b"": ROOT_INO}

    def link(parent: int, name: bytes, ino: int, is_dir: bool) -> None:
        cookie = next_id(b"next_cookie")
        txn.put("dirents", ix.dirent_key(parent, name), ix.dirent_value(ino, cookie))
        txn.put("dirlist", ix.dirlist_key(parent, cookie), name)
        if is_dir:
            pdir = ix.get_inode(txn, parent)
            pdir.nlink += 1
            ix.put_inode(txn, pdir)

    def directory(path: bytes) -> int:
        if path in dirs:
            return dirs[path]
        head, _, name = path.rpartition(b"/")
        parent = directory(head)
        ino = next_id(b"next_ino")
        now = time.time_ns()
        ix.put_inode(txn, Inode(ino, 0o40755, 2, st.st_uid, st.st_gid, atime_ns=now,
                                mtime_ns=now, ctime_ns=now, parent=parent))
        link(parent, name, ino, True)
        dirs[path] = ino
        return ino

    chunks: dict[bytes, Chunk] = {}
    for doc in sorted(docs, key=lambda d: d["paths"][0] if d["paths"] else ""):
        paths = [p.encode("utf-8", "surrogateescape") for p in doc["paths"]]
        missing = [e[2] for e in doc["extents"] if bytes.fromhex(e[2]) not in where]
        if not paths or missing:
            result.skipped.append(f"{(paths or [b'?'])[0].decode(errors='replace')}: "
                                  f"{len(missing)} chunks are in no pack")
            continue
        free = [p for p in paths if txn.get("dirents", ix.dirent_key(
            directory(p.rpartition(b"/")[0]), p.rpartition(b"/")[2])) is None]
        if not free:
            result.skipped.append(f"{paths[0].decode(errors='replace')}: name taken")
            continue
        ino = next_id(b"next_ino")
        data_bytes = 0
        for file_off, length, cid_hex, chunk_off in doc["extents"]:
            cid = bytes.fromhex(cid_hex)
            chunk = chunks.get(cid)
            if chunk is None:
                pack_no, e = where[cid]
                chunk = chunks[cid] = Chunk(next_id(b"next_chunk"), CHUNK_PACK, 0, e.length,
                                            pack_no=pack_no, pack_off=e.offset,
                                            stored_length=e.stored_length, codec=e.codec,
                                            codec_param=e.param, payload_crc=e.crc,
                                            chunk_id=cid)
            chunk.refcount += 1
            txn.put("extents", ix.extent_key(ino, file_off),
                    ix.extent_encode(Extent(file_off, length, chunk.chunk_no, chunk_off)))
            data_bytes += length
        ix.put_inode(txn, Inode(ino, doc["mode"], len(free), doc["uid"], doc["gid"],
                                size=doc["size"], atime_ns=doc["atime_ns"],
                                mtime_ns=doc["mtime_ns"], ctime_ns=doc["ctime_ns"],
                                data_bytes=data_bytes))
        for name_hex, value_hex in doc.get("xattrs", {}).items():
            txn.put("xattrs", ix.xattr_key(ino, bytes.fromhex(name_hex)),
                    bytes.fromhex(value_hex))
        for p in free:
            head, _, name = p.rpartition(b"/")
            link(directory(head), name, ino, False)
        result.files += 1
        result.bytes += doc["size"]
    for pack_no in {c.pack_no for c in chunks.values()}:
        ix.put_pack(txn, ix.PackInfo(pack_no, 0, 0, pack_sizes.get(pack_no, 0)))
    for chunk in chunks.values():
        ix.add_chunk(txn, chunk)
    result.chunks = len(chunks)
    counters[b"next_pack"] = max([counters[b"next_pack"], *(n + 1 for n in pack_sizes)])
    for name, value in counters.items():
        txn.put("meta", name, ix.u64_le(value))
    ix.set_store(txn, backend.store_uuid.bytes, backend.location.encode())
    txn.put("meta", b"clean", b"1")

