"""fsck: check an unmounted ckptfs, index against log, and mend what can be mended.

Each `check_*` method looks at one invariant of the schema in `index.py` and
records findings; a finding with a repair is mended under `--repair`, in one
transaction after all checks ran. What cannot be mended (damaged or missing
data) is reported and left: reads of it give EIO, never wrong bytes.

fsck never calls clean what it did not check: the log is the one given with
`-o pmem=`, else the one the index remembers from the last mount; a missing
log while the index names hot chunks, or an unreachable backing store while
it names cold ones, is a finding ("not checked: ...") and exit 4.

Exit codes (errors.ExitCode): 0 clean, 3 problems found and all repaired,
4 problems left, 1 fsck could not run (the filesystem is mounted, SOURCE holds no
ckptfs, the index cannot be opened).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import uuid as uuidlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from tqdm import tqdm

from . import index as ix
from .errors import (BackingReadOnly, BlobMissing, CkptfsError, DamagedData, ExitCode,
                     FormatError, OperationFailed)
from .statedir import backing_root, lock_source, log_path, refuse_if_mounted
from . import packs
from .backing.base import Backend
from .backing import open_backend
from .index import (CHUNK_LOG, CHUNK_PACK, CHUNK_SOURCE, ROOT_INO, Chunk, DirectTxn, Extent,
                    Index, Inode)
from . import snapshot_format as sf
from . import volumes
from .namespace import STATE_DIR_NAME
from .options import parse_options
from .chunker import chunk_id
from .files import MAX_FILE_BYTES
from .sources import SourceFiles
from .pmemlog import SUPERBLOCK_BYTES, PmemLog

log = logging.getLogger(__name__)

Repair = Callable[[DirectTxn], None]


@dataclass
class Finding:
    check: str
    message: str
    repair: Optional[Repair] = None


@dataclass
class Fsck:
    index: Index
    plog: Optional[PmemLog]
    source_fd: int
    verify_data: bool = True
    backend: Optional[Backend] = None
    log_problem: Optional[str] = None      # why the log could not be opened, if so
    store_problem: Optional[str] = None    # why the backing store is not reachable, if so
    findings: list[Finding] = field(default_factory=list)
    blobs_to_delete: list[str] = field(default_factory=list)   # after a snapshot (repair)
    publish_needed: bool = False                               # a snapshot after the repair
    # What the scans saw, shared by the checks.
    inodes: dict[int, Inode] = field(default_factory=dict)
    chunks: dict[int, Chunk] = field(default_factory=dict)
    extents: dict[int, list[Extent]] = field(default_factory=lambda: defaultdict(list))
    links: Counter = field(default_factory=Counter)        # ino -> dirents naming it
    subdirs: Counter = field(default_factory=Counter)      # dir ino -> child dirs
    named_in: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # ino -> a (parent, name)
    _users: Optional[dict[int, set[int]]] = None          # chunk -> inodes (damage reports)
    orphans: set[int] = field(default_factory=set)
    unreferenced: set[int] = field(default_factory=set)    # chunks no extent names
    bad_records: set[int] = field(default_factory=set)     # chunks whose record is damaged
    bad_inodes: set[int] = field(default_factory=set)      # inodes whose record is damaged
    twins: int = 0                                         # chunks whose bytes another holds
    notes: list[str] = field(default_factory=list)         # said, but not problems
    view: Optional[ix.ReadView] = None                     # what the checks read, while they run
    volume_state: Optional[volumes.VolumeState] = None     # its volume, as the store shows it

    def problem(self, check: str, message: str, repair: Optional[Repair] = None) -> None:
        self.findings.append(Finding(check, message, repair))

    def run(self) -> None:
        with self.index.read_view() as self.view:
            self._run()
        self.view = None

    def _run(self) -> None:
        self.load()
        for check in (self.check_reachable, self.check_root, self.check_dirents,
                      self.check_link_counts, self.check_chunk_records, self.check_extents,
                      self.check_refcounts, self.check_logmap,
                      self.check_chunk_ids, self.check_snapshots, self.check_packs,
                      self.check_unpublished, self.check_side_tables,
                      self.check_counters, self.check_data):
            check()

    # ------------------------------------------------------------------ scan

    def load(self) -> None:
        kv = self.view
        for inode in ix.scan_inodes(kv, damaged=lambda why: self.problem(
                "inodes", f"{why} (the file gives EIO)")):
            self.inodes[inode.ino] = inode
        # A damaged inode is reported once; nothing else is repaired for it.
        self.bad_inodes = set(ix.scan_inode_numbers(kv)) - self.inodes.keys()
        for chunk in ix.scan_chunks(kv, damaged=lambda why: self.problem("chunks", why)):
            self.chunks[chunk.chunk_no] = chunk
        for ino, e in ix.scan_extents(kv, damaged=lambda why: self.problem(
                "extents", f"{why} (reads of it give EIO)")):
            self.extents[ino].append(e)
        self.orphans = set(ix.orphans(kv))

    # ---------------------------------------------------------------- checks

    def check_reachable(self) -> None:
        """The log and the backing store the index names are there to be checked:
        what fsck cannot read it must not call clean (one line each)."""
        hot = [c for c in self.chunks.values() if c.kind == CHUNK_LOG]
        if hot and self.log_problem is not None:
            self.problem("log", f"not checked: {len(hot)} chunks ({sum(c.length for c in hot)} "
                         f"bytes) in the log: {self.log_problem} (reads of them give EIO; "
                         "give the log with -o pmem=PATH)")
        cold = [c for c in self.chunks.values() if c.kind == CHUNK_PACK]
        if cold and self.backend is None:
            why = self.store_problem or "the index names no backing store"
            self.problem("packs", f"not checked: {len(cold)} cold chunks "
                         f"({sum(c.length for c in cold)} bytes): {why} (reads of them give "
                         "EIO; give the store with -o backing=DIR)")

    def check_root(self) -> None:
        root = self.inodes.get(ROOT_INO)
        if root is None or not stat.S_ISDIR(root.mode):
            self.problem("root", "root directory is missing or not a directory")

    def check_dirents(self) -> None:
        """Entries name existing inodes from existing directories, with possible
        names; a directory has exactly one entry, its parent pointer agrees, and
        following parents from any directory reaches the root (no cycles).

        Entries that are wrong are not counted as links, so the link-count check
        that follows sends an inode left in no directory to /lost+found."""
        kv = self.view
        cookies: dict[tuple[int, int], bytes] = {}
        dir_entries: dict[int, list[tuple[int, bytes, int]]] = defaultdict(list)
        for parent, name, ino, cookie in ix.scan_entries(
                kv, damaged=lambda why: self.problem("dirents", why)):
            pdir = self.inodes.get(parent)
            child = self.inodes.get(ino)
            if ino in self.bad_inodes or parent in self.bad_inodes:
                continue
            if pdir is None or not stat.S_ISDIR(pdir.mode) or child is None:
                what = "missing parent" if pdir is None else (
                    "parent not a directory" if not stat.S_ISDIR(pdir.mode) else
                    f"missing inode {ino}")
                self.problem("dirents", f"entry {name!r} in {parent}: {what}",
                             _delete_entry(parent, name, cookie))
                continue
            cookies[(parent, cookie)] = name
            self.named_in.setdefault(ino, (parent, name))
            if ix.listing_name(kv, parent, cookie) != name:
                self.problem("dirents", f"entry {name!r} in {parent} is missing from the "
                             "listing order", _put_listing(parent, cookie, name))
            bad = _bad_name(parent, name)
            if bad is not None:
                self.problem("names", f"entry {name!r} in directory {parent} {bad}: removed "
                             "(an inode left in no directory goes to /lost+found)",
                             _delete_entry(parent, name, cookie))
                continue
            if ino == ROOT_INO:
                self.problem("tree", f"entry {name!r} in directory {parent} names the root "
                             "directory", _delete_entry(parent, name, cookie))
                continue
            if stat.S_ISDIR(child.mode):
                dir_entries[ino].append((parent, name, cookie))
                continue
            self.links[ino] += 1
        for parent, cookie, name in ix.scan_listing(kv):
            if (parent, cookie) in cookies:
                continue
            if ix.has_entry(kv, parent, name):
                self.problem("dirents", f"listing of {parent} names {name!r} twice",
                             _delete_listing(parent, cookie))
            else:
                self.problem("dirents", f"listing of {parent} names {name!r}, which has no "
                             "entry", _delete_listing(parent, cookie))
        self._check_tree(dir_entries)

    def _check_tree(self, dir_entries: dict[int, list[tuple[int, bytes, int]]]) -> None:
        parent_of: dict[int, int] = {}
        kept: dict[int, tuple[int, bytes, int]] = {}
        for ino, entries in dir_entries.items():
            child = self.inodes[ino]
            # The entry its parent pointer agrees with (the oldest), else the oldest.
            keep = min(entries, key=lambda e: (e[0] != child.parent, e[2]))
            for e in entries:
                if e is not keep:
                    self.problem("tree", f"directory {ino} is named twice: {e[1]!r} in "
                                 f"{e[0]} and {keep[1]!r} in {keep[0]}; removed {e[1]!r}",
                                 _delete_entry(*e))
            kept[ino] = keep
            parent_of[ino] = keep[0]
            if child.parent != keep[0]:
                self.problem("dirents", f"directory {ino} is in {keep[0]} but records "
                             f"parent {child.parent}", _set_inode(ino, parent=keep[0]))
        # Every directory's chain of parents must end at the root: walk each chain
        # once (no recursion), remembering where it was seen.
        done: set[int] = {ROOT_INO}
        for start in list(parent_of):
            chain: list[int] = []
            on_chain: set[int] = set()
            cur = start
            while cur not in done and cur in parent_of and cur not in on_chain:
                chain.append(cur)
                on_chain.add(cur)
                cur = parent_of[cur]
            if cur in on_chain:
                cycle = chain[chain.index(cur):]
                cut = min(cycle)
                parent, name, cookie = kept[cut]
                self.problem("tree", f"directories {sorted(cycle)} form a cycle the root does "
                             f"not reach: {name!r} in {parent} removed, directory {cut} goes "
                             "to /lost+found", _delete_entry(parent, name, cookie))
                del parent_of[cut]
            done.update(chain)
        for ino, (parent, _, _) in kept.items():
            if ino in parent_of:
                self.links[ino] += 1
                self.subdirs[parent] += 1

    def check_link_counts(self) -> None:
        for ino, inode in self.inodes.items():
            if ino == ROOT_INO:
                want = 2 + self.subdirs[ino]
            elif stat.S_ISDIR(inode.mode):
                want = (2 + self.subdirs[ino]) if self.links[ino] else 0
            else:
                want = self.links[ino]
            if want == 0 and ino != ROOT_INO:
                if ino in self.orphans:
                    self.problem("orphans", f"inode {ino} was unlinked while open and not "
                                 "purged (crash)", _purge(ino, self))
                else:
                    self.problem("link counts", f"inode {ino} is in no directory",
                                 _to_lost_found(ino, self))
                continue
            if inode.nlink != want:
                self.problem("link counts", f"inode {ino} has nlink {inode.nlink}, "
                             f"directories say {want}", _set_inode(ino, nlink=want))
            if ino in self.orphans:
                self.problem("orphans", f"inode {ino} is listed as orphan but still linked",
                             lambda txn, ino=ino: ix.remove_orphan(txn, ino))

    def check_chunk_records(self) -> None:
        """Every LOG and PACK record is one ckptfs could have written (lengths
        within MAX_CHUNK_BYTES, one CRC per block, a payload no longer than its
        chunk): the data check reads nothing by a damaged record's lengths."""
        for chunk_no, chunk in self.chunks.items():
            why = ix.chunk_record_problem(chunk)
            if why is not None:
                self.bad_records.add(chunk_no)
                self.problem("chunks", f"chunk {chunk_no}: damaged record: {why} (reads of it "
                             "give EIO)")

    def check_extents(self) -> None:
        for ino, extents in self.extents.items():
            inode = self.inodes.get(ino)
            if ino in self.bad_inodes:
                continue
            if inode is None or not stat.S_ISREG(inode.mode):
                self.problem("extents", f"extents of {'missing' if inode is None else 'non-file'}"
                             f" inode {ino}", _drop_extents(ino, self))
                continue
            end = 0
            total = 0
            for e in extents:
                if e.file_off < end:
                    self.problem("extents", f"inode {ino}: extents overlap at {e.file_off}")
                end = e.end
                total += e.length
                chunk = self.chunks.get(e.chunk_no)
                if chunk is None:
                    self.problem("extents", f"inode {ino} at {e.file_off}: chunk {e.chunk_no} "
                                 "is missing (reads give EIO)")
                elif e.chunk_off + e.length > chunk.length:
                    self.problem("extents", f"inode {ino} at {e.file_off}: reaches past the end "
                                 f"of chunk {e.chunk_no}")
            if inode.size > MAX_FILE_BYTES:
                self.problem("extents", f"inode {ino}: size {inode.size} is over the largest "
                             f"file ({MAX_FILE_BYTES} bytes)",
                             _set_inode(ino, size=end) if end <= MAX_FILE_BYTES else None)
            elif end > inode.size:
                self.problem("extents", f"inode {ino}: data reaches {end}, past its size "
                             f"{inode.size}", _set_inode(ino, size=end))
            if inode.data_bytes != total:
                self.problem("extents", f"inode {ino}: data_bytes {inode.data_bytes}, "
                             f"extents hold {total}", _set_inode(ino, data_bytes=total))

    def check_refcounts(self) -> None:
        refs: Counter = Counter()
        for extents in self.extents.values():
            for e in extents:
                refs[e.chunk_no] += 1
        for chunk_no, chunk in self.chunks.items():
            if chunk.refcount != refs[chunk_no]:
                fix = _set_refcount(chunk, refs[chunk_no])
                if refs[chunk_no] == 0:
                    self.unreferenced.add(chunk_no)
                    self.problem("refcounts", f"chunk {chunk_no} is referenced by nothing "
                                 f"(refcount {chunk.refcount}): leaked space", fix)
                else:
                    self.problem("refcounts", f"chunk {chunk_no} has refcount {chunk.refcount},"
                                 f" extents say {refs[chunk_no]}", fix)

    def check_logmap(self) -> None:
        logmap = dict(ix.scan_log_map(self.view))
        size = self.plog.size_bytes if self.plog else 1 << 64
        end = SUPERBLOCK_BYTES
        for chunk_no, chunk in sorted(self.chunks.items(), key=lambda kv: kv[1].log_off):
            if chunk.kind != CHUNK_LOG:
                continue
            if logmap.pop(chunk.log_off, None) != chunk_no:
                self.problem("logmap", f"chunk {chunk_no} is missing from the log map",
                             lambda txn, off=chunk.log_off, no=chunk_no: ix.map_log(txn, off, no))
            if chunk.log_off < end or chunk.log_off + chunk.length > size:
                self.problem("logmap", f"chunk {chunk_no} at log offset {chunk.log_off} "
                             "overlaps another record or the end of the log")
            end = max(end, chunk.log_off + chunk.length)
        for off, chunk_no in logmap.items():
            self.problem("logmap", f"log map names chunk {chunk_no} at {off}, which does not "
                         "exist", lambda txn, off=off: ix.unmap_log(txn, off))

    def check_chunk_ids(self) -> None:
        """Every chunk with an id is found by it, and the id table names nothing else."""
        by_id: dict[bytes, int] = {}
        twins = 0
        for chunk_no, chunk in self.chunks.items():
            if not chunk.chunk_id:
                continue
            if chunk.chunk_id in by_id:
                # Bytes stored twice: data written with dedup=off gets its ids only
                # when tiered. Harmless (the id table names one of them), not a fault.
                if ix.find_chunk_no(self.view, chunk.chunk_id) not in (chunk_no,
                                                                       by_id[chunk.chunk_id]):
                    self.problem("chunk ids", f"chunks {by_id[chunk.chunk_id]} and {chunk_no} "
                                 "hold the same bytes and the id table names neither")
                twins += 1
                continue
            by_id[chunk.chunk_id] = chunk_no
        self.twins = twins
        for k, chunk_no in ix.scan_chunk_ids(self.view):
            if by_id.get(k) == chunk_no or (k in by_id and self.chunks.get(chunk_no) is not None
                                            and self.chunks[chunk_no].chunk_id == k):
                del by_id[k]
            else:
                self.problem("chunk ids", f"id {k.hex()[:16]}.. names chunk {chunk_no}, which "
                             "does not hold it", lambda txn, k=k: ix.unname_chunk(txn, k))
        for cid, chunk_no in by_id.items():
            self.problem("chunk ids", f"chunk {chunk_no} is missing from the id table",
                         lambda txn, cid=cid, no=chunk_no: ix.name_chunk(txn, cid, no))

    def check_packs(self) -> None:
        """Pack records count exactly the chunks in them; every pack they name is
        in the backing store. A pack no record names is a leftover of an
        interrupted tiering pass when an intent names it (a note: the next mount
        deletes it), a dead pack awaiting the next snapshot when marked so (a
        note), else a pack nothing explains (a problem: gc's to delete)."""
        live: Counter = Counter()
        live_bytes: Counter = Counter()
        in_pack: dict[int, list[Chunk]] = defaultdict(list)
        for chunk in self.chunks.values():
            if chunk.in_store:              # cold, or a hot chunk's published copy
                live[chunk.pack_no] += 1
                live_bytes[chunk.pack_no] += chunk.stored_length
                in_pack[chunk.pack_no].append(chunk)
        recorded = {}
        for pack_no in ix.scan_pack_numbers(self.view):
            try:
                pack = ix.get_pack(self.view, pack_no)
            except FormatError as e:
                self.problem("packs", str(e), _put_pack(ix.PackInfo(
                    pack_no, live.get(pack_no, 0), live_bytes[pack_no], 0)))
                recorded[pack_no] = None
                continue
            recorded[pack.pack_no] = pack
            if (pack.live_chunks, pack.live_bytes) != (live[pack.pack_no],
                                                       live_bytes[pack.pack_no]):
                self.problem("packs", f"pack {pack.pack_no} records {pack.live_chunks} live "
                             f"chunks, the chunk table has {live[pack.pack_no]}",
                             _put_pack(ix.PackInfo(pack.pack_no, live[pack.pack_no],
                                                   live_bytes[pack.pack_no], pack.size_bytes)))
        for pack_no in live.keys() - recorded.keys():
            self.problem("packs", f"chunks name pack {pack_no}, which has no record",
                         _put_pack(ix.PackInfo(pack_no, live[pack_no], live_bytes[pack_no], 0)))
        intents = set(ix.pack_intents(self.index))
        for pack_no in sorted(intents & (recorded.keys() | live.keys())):
            self.problem("packs", f"pack {pack_no} is recorded and still marked as being "
                         "written", _delete_intent(pack_no))
        intents -= recorded.keys() | live.keys()
        dead = set(ix.dead_packs(self.index))
        for pack_no in sorted(dead & (recorded.keys() | live.keys())):
            self.problem("packs", f"pack {pack_no} is recorded and also marked dead",
                         _delete_dead_mark(pack_no))
        dead -= recorded.keys() | live.keys()
        if self.backend is None:
            return                      # check_reachable said what was not checked
        try:
            blobs = set(self.backend.list("packs/"))
        except CkptfsError as e:
            self.problem("packs", f"cannot list the backing store: {e}")
            return
        for pack_no in live:
            if packs.pack_name(pack_no) not in blobs:
                self.problem("packs", f"pack {pack_no} is missing from {self.backend.url} "
                             f"({live[pack_no]} chunks: reads of them give EIO)")
            elif self.verify_data:
                self._check_trailer(pack_no, in_pack[pack_no])
        # Pack numbers of this volume's own space (other volumes number theirs).
        counter = self.index.counters.get(b"next_pack", 0)
        in_store = [n for n in map(packs.pack_number, blobs)
                    if n is not None and volumes.pack_space(n) == volumes.pack_space(counter)]
        if in_store and counter <= max(in_store):
            self.problem("packs", f"next_pack is {counter} but the store holds pack "
                         f"{max(in_store)}: the index is older than the store (restored from "
                         "a copy?) or another filesystem writes packs there; until --repair "
                         "raises it, tiering writes no pack",
                         _set_counter(b"next_pack", max(in_store) + 1))
        named = {packs.pack_name(n) for n in recorded} | {packs.pack_name(n) for n in live}
        # Packs of other volumes sharing the store are theirs: only this
        # volume's pack spaces are looked at for packs nothing names.
        spaces = self._own_spaces()
        for blob in sorted(b for b in blobs - named if packs.pack_number(b) is None
                           or volumes.pack_space(packs.pack_number(b)) in spaces):
            if packs.pack_number(blob) in intents:
                self.notes.append(f"{blob} was left by an interrupted tiering pass; removed at "
                                  "the next mount or by ckptfs gc")
            elif packs.pack_number(blob) in dead:
                self.notes.append(f"{blob} holds no live chunk; deleted once the next snapshot "
                                  "is published (after the next mount's first pass, or by "
                                  "ckptfs gc)")
            else:
                previous = self._previous_holder(blob)
                self.problem("packs", f"{blob} is named by nothing (dead pack"
                             + (f"; {previous}, the volume's holder before, may have written "
                                "it after it was taken over" if previous else "") + ")",
                             self._delete_blob_later(blob))
        for pack_no in sorted(intents):
            if packs.pack_name(pack_no) not in blobs:
                self.notes.append(f"pack {pack_no} was being written when a tiering pass was "
                                  "interrupted (never committed); the next mount or ckptfs gc "
                                  "removes what is left of it")

    def _previous_holder(self, blob: str) -> str:
        """'node N, generation G' if the pack is in the space of an older lease
        of this volume (a holder that wrote on in the moment before it found
        it had been taken over), else ''."""
        n = packs.pack_number(blob)
        record = ix.get_volume(self.index)
        if n is None or self.volume_state is None or record is None:
            return ""
        for lease in self.volume_state.leases:
            if lease.gen < record.gen and lease.space == volumes.pack_space(n):
                return f"node {lease.node}, generation {lease.gen}"
        return ""

    def _own_spaces(self) -> set[int]:
        """The pack-number spaces of this filesystem's volume (its leases'), and
        of its pack counter."""
        spaces = {volumes.pack_space(self.index.counters.get(b"next_pack", 0))}
        if self.volume_state is not None:
            spaces |= self.volume_state.spaces
        return spaces

    def check_snapshots(self) -> None:
        """The newest valid snapshot head of the volume reads and names a readable
        root directory (the rest of its tree is recover's to check), and the
        index's head counter is above every head: else the next snapshot would
        sort before an older one and recover would take the older. A newer
        lease than the index's says the volume was taken over (a finding:
        this filesystem may not publish any more)."""
        if self.backend is None:
            return                      # check_reachable said what was not checked
        record = ix.get_volume(self.index)
        if record is None:
            return                      # never attached to a volume: nothing published
        try:
            state = self.volume_state = volumes.read_state(self.backend, record.name)
        except CkptfsError as e:
            self.problem("snapshots", f"not checked: cannot list volume {record.name}: {e}")
            return
        if not record.takeover and state.generation > record.gen:
            self.problem("volume", f"volume {record.name} was taken over "
                         f"({volumes.describe(state.holder)}); this filesystem holds "
                         f"generation {record.gen}: it is read-only when mounted")
            return                      # it publishes nothing more: its heads are not its
        if not state.heads:
            return                      # none published yet: nothing to check
        counter = self.index.counters.get(b"next_head", 0)
        top = max(h[1] for h in state.heads)
        if counter <= top:
            self.problem("snapshots", f"next_head is {counter} but the store holds snapshot "
                         f"{top}: the index is older than the store (restored from a "
                         "copy?); until --repair raises it, mounts publish no snapshot and "
                         "delete no pack (ckptfs recover rebuilds the newer state instead)",
                         _set_counter(b"next_head", top + 1))
        key = state.newest_valid()
        if key is None:
            return
        scope = volumes.scope(self.backend, record.name)
        name = volumes.head_name(*key)
        try:
            head = sf.decode_volume_head(name, record.name, key,
                                         _read_limited(scope, name, sf.MAX_HEAD_BYTES))
            root = sf.object_name(head.root)
            sf.decode_dir(head.root, _read_limited(scope, root, sf.MAX_OBJECT_BYTES))
        except (BlobMissing, sf.BadObject) as e:
            self.problem("snapshots", f"the newest snapshot ({key[0]}-{key[1]}) of volume "
                         f"{record.name} is unusable: {e} (recover would build nothing; "
                         "--repair publishes a new one)", self._publish_after_repair())

    def _publish_after_repair(self) -> Repair:
        def fix(txn: DirectTxn) -> None:
            self.publish_needed = True
        return fix

    def _delete_blob_later(self, name: str) -> Repair:
        """A pack no index record names may still be named by the newest snapshot
        head: it is deleted after the repair, once a new snapshot is published."""
        def fix(txn: DirectTxn) -> None:
            self.blobs_to_delete.append(name)
        return fix

    def _check_trailer(self, pack_no: int, chunks: list[Chunk]) -> None:
        """A pack's trailer is intact (recover rebuilds from it) and lists each of
        its chunks where, and as, the chunk table says."""
        name = packs.pack_name(pack_no)
        try:
            entries = {e.offset: e for e in packs.read_pack_index(self.backend, name)}
        except CkptfsError as e:
            self.problem("packs", f"{e} (recover cannot use this pack)")
            return
        for chunk in chunks:
            if chunk.chunk_no in self.bad_records:
                continue
            e = entries.get(chunk.pack_off)
            if e is None or (e.chunk_id, e.stored_length, e.length, e.codec, e.param, e.crc) \
                    != (chunk.chunk_id, chunk.stored_length, chunk.length, chunk.codec,
                        chunk.codec_param, chunk.payload_crc):
                self.problem("packs", f"chunk {chunk.chunk_no}: its record does not match "
                             f"the trailer of {name} at offset {chunk.pack_off}")

    def check_side_tables(self) -> None:
        def missing(ino: int) -> bool:
            return ino not in self.inodes and ino not in self.bad_inodes

        for ino, name in ix.scan_xattr_inos(self.view):
            if missing(ino):
                self.problem("xattrs", f"xattrs entry for missing inode {ino}",
                             lambda txn, ino=ino, name=name: ix.delete_xattr(txn, ino, name))
        for ino in ix.scan_symlink_inos(self.view):
            if missing(ino):
                self.problem("symlinks", f"symlinks entry for missing inode {ino}",
                             lambda txn, ino=ino: ix.delete_symlink(txn, ino))
        for ino, inode in self.inodes.items():
            if stat.S_ISLNK(inode.mode) and ix.get_symlink(self.view, ino) is None:
                self.problem("symlinks", f"symlink {ino} has no target")

    def check_counters(self) -> None:
        for name, seen in ((b"next_ino", max(self.inodes, default=0)),
                           (b"next_chunk", max(self.chunks, default=0)),
                           (b"next_cookie", max((cookie for _, cookie, _ in
                                                 ix.scan_listing(self.view)), default=0))):
            value = self.index.counters.get(name, 0)
            if value <= seen:
                self.problem("counters", f"{name.decode()} is {value} but {seen} is in use",
                             _set_counter(name, seen + 1))
        # The chunk totals `ckptfs stat` shows, recounted (a leaked chunk's
        # repair takes it out of them itself).
        kept = list(self.chunks.values())
        packed = [c for c in kept if c.kind == CHUNK_PACK]
        copied = [c for c in kept if c.kind == CHUNK_LOG and c.copied]
        waiting = [c for c in kept if c.kind == CHUNK_LOG and not c.copied]
        for name, want in ((b"stored_pack_bytes", sum(c.stored_length for c in packed)),
                           (b"pack_logical_bytes", sum(c.length for c in packed)),
                           (b"copy_pack_bytes", sum(c.stored_length for c in copied)),
                           (b"copy_logical_bytes", sum(c.length for c in copied)),
                           (b"unpublished_bytes", sum(c.length for c in waiting)),
                           (b"chunks", len(kept)),
                           (b"stored_log_bytes", sum(c.length for c in kept
                                                     if c.kind == CHUNK_LOG)),
                           (b"stored_source_bytes", sum(c.length for c in kept
                                                        if c.kind == CHUNK_SOURCE))):
            value = self.index.counters.get(name, 0)
            if value != want:
                self.problem("counters", f"{name.decode()} is {value}, the chunk table "
                             f"holds {want}", _set_counter(name, want))
        # The file totals, recounted over the inode table. Repaired by the
        # difference: a purge in the same repair keeps them itself.
        for name, want in ix.count_files(self.index).items():
            value = self.index.counters.get(name, 0)
            if value != want:
                self.problem("counters", f"{name.decode()} is {value}, the inode table "
                             f"holds {want}", _adjust_counter(name, want - value))

    def check_unpublished(self) -> None:
        """The unpublished table lists exactly the LOG chunks without a copy in
        a pack (what publishing still has to copy)."""
        listed = set(ix.scan_unpublished(self.view))
        want = {c.chunk_no for c in self.chunks.values() if c.kind == CHUNK_LOG and not c.copied}
        for no in sorted(listed - want):
            self.problem("unpublished", f"chunk {no} is listed as unpublished but is not a "
                         "log chunk without a copy",
                         lambda txn, no=no: ix.set_unpublished(txn, no, False))
        for no in sorted(want - listed):
            self.problem("unpublished", f"log chunk {no} has no copy in the store and is not "
                         "listed as unpublished (it would never be published)",
                         lambda txn, no=no: ix.set_unpublished(txn, no, True))

    def check_data(self) -> None:
        """Read every stored byte and verify its checksum (the slow part)."""
        if not self.verify_data:
            return
        # A leaked chunk's bytes do not matter: repair deletes it. A damaged
        # record is reported already, and its lengths are not to be trusted.
        chunks = [c for c in self.chunks.values()
                  if c.chunk_no not in self.unreferenced and c.chunk_no not in self.bad_records]
        total = sum(c.length for c in chunks)
        # Chunks a crash left in the index for the log (`logredo`): the next
        # mount writes them back, so their bytes there are what counts.
        redo = {chunk_no: (off, data) for _, off, _, chunk_no, data
                in ix.scan_log_redo(self.view, lambda why: self.problem("logredo", why))}
        if redo:
            self.notes.append(f"{len(redo)} log chunks wait in the index to be written back "
                              "to the log (the next mount does)")
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="verifying data",
                   disable=not sys.stderr.isatty(), file=sys.stderr)
        sources = SourceFiles(self.source_fd)
        with bar, contextlib.closing(sources):
            for chunk in chunks:
                try:
                    if chunk.kind == CHUNK_PACK:
                        if self.backend is None:
                            continue            # reported by check_packs
                        from .coldstore import ColdStore  # compression only for cold data
                        ColdStore(self.backend, 0).get(chunk)
                    elif chunk.kind == CHUNK_LOG and self.plog is not None:
                        off, data = redo.get(chunk.chunk_no, (None, b""))
                        if (off == chunk.log_off and len(data) == chunk.length
                                and PmemLog.crcs_of(data) == chunk.crcs):
                            buf = data
                        else:
                            buf = memoryview(bytearray(chunk.length))
                            self.plog.read_into(buf, chunk.log_off, chunk.length, chunk.crcs, 0)
                        if chunk.chunk_id and chunk_id(buf) != chunk.chunk_id:
                            raise DamagedData("bytes do not match the chunk id")
                    if chunk.kind == CHUNK_LOG and chunk.copied and self.backend is not None:
                        # Its published copy is what another node restores: check it too.
                        from .tier import ColdStore
                        ColdStore(self.backend, 0).get(Chunk(
                            chunk.chunk_no, CHUNK_PACK, chunk.refcount, chunk.length,
                            pack_no=chunk.pack_no, pack_off=chunk.pack_off,
                            stored_length=chunk.stored_length, codec=chunk.codec,
                            codec_param=chunk.codec_param, payload_crc=chunk.payload_crc,
                            chunk_id=chunk.chunk_id))
                    elif chunk.kind == CHUNK_SOURCE:
                        # Reached and checked as the daemon reaches it: never
                        # through a symlink, only the file adopted.
                        path = chunk.source_paths[0]
                        st = sources.stat(chunk)
                        if st.st_size < chunk.length:
                            raise DamagedData(f"pre-existing file {path!r} shrank "
                                              f"to {st.st_size} bytes")
                except (CkptfsError, OSError) as e:
                    self.problem("data", f"chunk {chunk.chunk_no}: {e} (reads of it give EIO"
                                 f"{self._files_of(chunk.chunk_no)})")
                bar.update(chunk.length)

    def _files_of(self, chunk_no: int, most: int = 3) -> str:
        """'; in /a, /b and N more': the files whose extents name the chunk."""
        if self._users is None:     # built once, at the first damaged chunk
            self._users = defaultdict(set)
            for ino, exts in self.extents.items():
                for e in exts:
                    self._users[e.chunk_no].add(ino)
        inos = sorted(self._users.get(chunk_no, ()))
        if not inos:
            return ""
        paths = [self._path(ino) for ino in inos[:most]]
        more = f" and {len(inos) - most} more" if len(inos) > most else ""
        return f"; in {', '.join(paths)}{more}"

    def _path(self, ino: int) -> str:
        """A path of ino from the root, as the entries fsck read name it."""
        parts: list[str] = []
        seen: set[int] = set()
        while ino != ROOT_INO:
            if ino in seen or ino not in self.named_in:
                return f"inode {ino}" if not parts else f"(no path)/{'/'.join(reversed(parts))}"
            seen.add(ino)
            ino, name = self.named_in[ino]
            parts.append(name.decode("utf-8", "backslashreplace"))
        return "/" + "/".join(reversed(parts))


def _bad_name(parent: int, name: bytes) -> Optional[str]:
    """Why a directory entry's name is impossible, or None (a snapshot's
    rules, and the state directory's name at the top)."""
    why = sf.check_name(name)
    if why is None and parent == ROOT_INO and name == STATE_DIR_NAME:
        return "is reserved for the state directory"
    return why


# ---------------------------------------------------------------- repairs

def _set_counter(name: bytes, value: int) -> Repair:
    return lambda txn: ix.write_counters(txn, {name: value})


def _put_listing(parent: int, cookie: int, name: bytes) -> Repair:
    return lambda txn: ix.put_listing(txn, parent, cookie, name)


def _delete_listing(parent: int, cookie: int) -> Repair:
    return lambda txn: ix.delete_listing(txn, parent, cookie)


def _put_pack(pack: ix.PackInfo) -> Repair:
    return lambda txn: ix.put_pack(txn, pack)


def _delete_intent(pack_no: int) -> Repair:
    return lambda txn: ix.delete_pack_intent(txn, pack_no)


def _delete_dead_mark(pack_no: int) -> Repair:
    return lambda txn: ix.delete_dead_pack(txn, pack_no)


def _adjust_counter(name: bytes, delta: int) -> Repair:
    def fix(txn: DirectTxn) -> None:
        txn.adjust_counter(name, delta)
    return fix


def _delete_entry(parent: int, name: bytes, cookie: int) -> Repair:
    return lambda txn: ix.remove_entry(txn, parent, name, cookie)


def _set_inode(ino: int, **fields: int) -> Repair:
    def fix(txn: DirectTxn) -> None:
        inode = ix.get_inode(txn, ino)
        if inode is not None:
            for k, v in fields.items():
                setattr(inode, k, v)
            ix.put_inode(txn, inode)
    return fix


def _set_refcount(chunk: Chunk, refcount: int) -> Repair:
    def fix(txn: DirectTxn) -> None:
        if refcount == 0:
            ix.delete_chunk(txn, chunk)      # its log space is free from the next mount on
        else:
            chunk.refcount = refcount
            ix.put_chunk(txn, chunk)
    return fix


def _drop_extents(ino: int, f: Fsck) -> Repair:
    def fix(txn: DirectTxn) -> None:
        for e in f.extents[ino]:
            ix.delete_extent(txn, ino, e.file_off)
            chunk = ix.get_chunk(txn, e.chunk_no)
            if chunk is not None:
                _set_refcount(chunk, chunk.refcount - 1)(txn)
    return fix


def _purge(ino: int, f: Fsck) -> Repair:
    def fix(txn: DirectTxn) -> None:
        _drop_extents(ino, f)(txn)
        ix.delete_inode(txn, ino)
    return fix


def _to_lost_found(ino: int, f: Fsck) -> Repair:
    """Link an unreachable inode into /lost+found as #INO (like e2fsck)."""
    def fix(txn: DirectTxn) -> None:
        counters = ix.read_counters(txn, (b"next_ino", b"next_cookie"))
        found = ix.lookup_entry(txn, ROOT_INO, b"lost+found")
        root = ix.get_inode(txn, ROOT_INO)
        if found is None:
            lf_ino = counters[b"next_ino"]
            counters[b"next_ino"] += 1
            lf = Inode(lf_ino, 0o40700, 2, 0, 0, mtime_ns=root.mtime_ns, ctime_ns=root.ctime_ns,
                       atime_ns=root.atime_ns, parent=ROOT_INO)
            ix.put_inode(txn, lf)
            _link(txn, root, b"lost+found", lf_ino, counters)
            root.nlink += 1
            ix.put_inode(txn, root)
        else:
            lf_ino = found[0]
        lf = ix.get_inode(txn, lf_ino)
        inode = ix.get_inode(txn, ino)
        name, n = f"#{ino}".encode(), 1
        while ix.has_entry(txn, lf_ino, name):
            n += 1
            name = f"#{ino}.{n}".encode()
        _link(txn, lf, name, ino, counters)
        if stat.S_ISDIR(inode.mode):
            inode.parent = lf_ino
            inode.nlink = 2 + f.subdirs[ino]
            lf.nlink += 1
            ix.put_inode(txn, lf)
        else:
            inode.nlink = 1
        ix.put_inode(txn, inode)
        ix.write_counters(txn, counters)
    return fix


def _link(txn: DirectTxn, pdir: Inode, name: bytes, ino: int, counters: dict) -> None:
    cookie = counters[b"next_cookie"]
    counters[b"next_cookie"] += 1
    ix.add_entry(txn, pdir.ino, name, ino, cookie)


# ------------------------------------------------------------------ command

def _delete_after_snapshot(index: Index, backend: Backend, fs_uuid: bytes, names: list[str],
                           out) -> int:
    """Publish a snapshot of the repaired index, then delete packs nothing names
    (the older snapshot heads may name them: docs/STORE.md). Returns how many
    deletions did not happen."""
    from .snapshots import publish_offline
    try:
        done = publish_offline(index, backend)
        print(f"published snapshot {done.seq} of the repaired index", file=out)
        for name in names:
            backend.delete(name)
    except CkptfsError as e:
        print(f"problem [snapshots] no snapshot could be published: {e}"
              + (f" ({len(names)} packs nothing names are not deleted)" if names else ""),
              file=out)
        return max(len(names), 1)
    return 0


def _read_limited(backend: Backend, name: str, limit: int) -> bytes:
    size = backend.size(name)
    if size > limit:
        raise sf.BadObject(f"{name}: {size} bytes, more than the {limit} it may have")
    return backend.read(name, 0, size)


def run_fsck(source: str, option_strings: Iterable[str], repair: bool = False,
             verify_data: bool = True, out=None) -> int:
    """`ckptfs fsck SOURCE`: returns the exit code (see module docstring)."""
    out = out or sys.stdout
    opts = parse_options(source, source, list(option_strings))
    refuse_if_mounted(opts.source, " (fsck checks an unmounted ckptfs)")
    if not os.path.isdir(opts.index_dir):
        raise OperationFailed(f"{opts.source} holds no ckptfs (no {opts.index_dir})")
    lock_fd = lock_source(opts.state_dir)     # refuses while mounted
    source_fd = os.open(opts.source, os.O_RDONLY | os.O_DIRECTORY)
    index = Index(opts.index_dir)
    plog = None
    backend = None
    try:
        fs_uuid = index.check_format()
        pmem_path = log_path(opts, index)
        log_problem = store_problem = None
        if not os.path.exists(pmem_path):
            log_problem = f"the log {pmem_path} is missing"
        else:
            try:
                plog = PmemLog.open(pmem_path, None, fs_uuid, allow_short=True)
            except CkptfsError as e:
                log_problem = f"the log {pmem_path} cannot be used: {e}"
        store_uuid = ix.get_store_uuid(index)
        if store_uuid is not None:
            backend = open_backend(backing_root(opts, index), uuidlib.UUID(bytes=store_uuid),
                                   profile=opts.aws_profile)
            try:
                backend.check()
            except BackingReadOnly:
                pass                    # reads work: everything can be checked
            except CkptfsError as e:
                store_problem = f"{e}"
                backend.close()
                backend = None
        checker = Fsck(index, plog, source_fd, verify_data=verify_data, backend=backend,
                       log_problem=log_problem, store_problem=store_problem)
        checker.run()
        if plog is not None and plog.cut_to is not None:
            checker.problem("log", f"the log {pmem_path} was cut short outside ckptfs: "
                            f"{plog.cut_to} of its {plog.size_bytes} bytes are left, the "
                            "chunks past its end are lost (listed as data problems)")
        for f in checker.findings:
            print(f"problem [{f.check}] {f.message}", file=out)
        if checker.twins:
            print(f"note: {checker.twins} chunks hold bytes another chunk holds too (data "
                  "written with dedup=off)", file=out)
        for note in checker.notes:
            print(f"note: {note}", file=out)
        if not checker.findings:
            unread = "" if verify_data else "; data not read: --no-data"
            print(f"{opts.source}: clean ({len(checker.inodes)} inodes, "
                  f"{len(checker.chunks)} chunks{unread})", file=out)
            return ExitCode.OK
        fixable = [f for f in checker.findings if f.repair is not None]
        if repair and fixable:
            index.write_direct(lambda txn: [f.repair(txn) for f in fixable])
            repaired = len(fixable)
            if checker.blobs_to_delete or checker.publish_needed:
                repaired -= _delete_after_snapshot(index, backend, fs_uuid,
                                                   checker.blobs_to_delete, out)
            print(f"repaired {repaired} of {len(checker.findings)} problems", file=out)
            return ExitCode.REPAIRED if repaired == len(checker.findings) else ExitCode.UNCORRECTED
        print(f"{len(checker.findings)} problems ({len(fixable)} repairable with --repair)",
              file=out)
        return ExitCode.UNCORRECTED
    finally:
        if backend is not None:
            backend.close()
        if plog is not None:
            plog.close()
        index.close()
        os.close(source_fd)
        os.close(lock_fd)
