"""The tiering planner: which chunks are cold (docs/TIERING.md).

Files are grouped into versions (`Planner.versions`): the files of one
directory whose commits lie within `version_gap_s` of the version's first
one; a file directly in the mount root is a version of its own. The
`hot_versions` newest versions stay in the log; every other version's LOG
chunks are cold (`Planner.plan`), unless a hot version, an open file or an
open file's uncommitted changes (a pinned chunk) name them. When the log is
fuller than `high_watermark`, hot versions go too, oldest first, until the
plan brings it under `low_watermark`. A damaged index record leaves what it
covers hot (fsck reports it; the log says so once).

The planner reads the index and the log's fill level, nothing else: it moves
nothing and writes nothing. It runs on the trio thread. Its catalog of
versions (`VersionCatalog`) is kept from pass to pass and reads again only
what changed; a plan then reads the extents of the hot versions and of the
cold versions a walk could choose from, in one go,
so that what it sees is one state of the index.
"""

from __future__ import annotations

import logging
import stat
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Optional

import trio

from . import index as ix
from .backing.base import Backend
from .errors import CkptfsError, DamagedData, FormatError
from .index import CHUNK_LOG, Chunk, Index, Inode
from .pmemlog import PmemLog

if TYPE_CHECKING:
    from .volumes import Volume
    from .chunkindex import SharedChunks

log = logging.getLogger(__name__)


@dataclass
class TierPolicy:
    hot_versions: int = 2
    high_watermark: float = 0.75     # log use that sends hot versions out too
    low_watermark: float = 0.5       # ... until the plan brings it below this
    interval_s: float = 5.0          # how often the mover looks
    pack_bytes: int = 64 << 20       # logical bytes per pack
    version_gap_s: float = 120.0     # commits of one directory this close are one version
    # Decoded cold chunks kept for reads. With the daemon's ~100 MB besides
    # it and the cold store's idle read buffers (32 MiB), this keeps a
    # restoring daemon under 300 MB (256 MiB took it to 350-580 MB).
    cache_bytes: int = 128 << 20
    # File bytes read ahead of a sequential cold reader: half the cache (the
    # most `Prefetcher.depth_for` gives one reader); 32 MiB let the reader
    # catch up with the fetches more often (BENCHMARKS, session 6, coldp).
    prefetch_bytes: int = 64 << 20


@dataclass
class TierSetup:
    """What a mount with a backing store tiers to, and how: given to
    `core.Filesystem`, which builds the cold store, prefetcher and mover.
    `volume`: where its snapshots go (None: a read-only mount of a filesystem
    without one: nothing is published); `publish_delay_s`: publishing's bound
    (None: off, snapshots only after passes); `read_only`: move nothing;
    `shared`: dedup across the volumes of the store (chunkindex.py), or None."""

    backend: Backend
    policy: TierPolicy
    volume: Optional["Volume"] = None
    publish_delay_s: Optional[float] = None
    read_only: bool = False
    shared: Optional["SharedChunks"] = None


@dataclass
class Version:
    """Files of one directory committed close together: one checkpoint.
    `in_log`: the chunks of it that the last walk of all its files found in
    the log (None: not walked whole yet). Its files have not changed since: the
    catalog makes a new Version when one does, and a chunk never comes back
    to the log (new bytes get a new chunk number, so the extents change)."""

    parent: int
    newest_ns: int
    files: list[int] = field(default_factory=list)      # inode numbers
    oldest_ns: int = 0
    in_log: Optional[array] = None

    @property
    def settled(self) -> bool:
        """All of it is out of the log: no plan needs to walk it again."""
        return self.in_log is not None and len(self.in_log) == 0

    def held_by(self, keep: set[int]) -> bool:
        """Would a walk choose nothing, every chunk it has in the log being kept?"""
        return self.in_log is not None and all(c in keep for c in self.in_log)


@dataclass
class Plan:
    """What a pass moves: cold LOG chunks, oldest versions' first."""

    chunks: list[Chunk]
    cold: list[Version]


class VersionCatalog:
    """Regular files grouped into versions, kept from one pass to the next.

    The first plan reads every directory entry (`build`); after that a pass
    reads only what changed since the last one: a directory whose entries
    changed (Index.watch_entries) is read again, a file whose inode record or
    extents changed (Index.watch_maps) has its mtime read again. A pass that
    scanned every entry cost ~1 s of the trio thread per 100,000 files, after
    every commit.

    A file belongs to the first directory, in key order, that has an entry
    for it (a hard-linked file is grouped once). Memory: about two dict
    entries per regular file. Runs on the trio thread, except `scan`.
    """

    def __init__(self, index: Index, gap_ns: int, damaged: Callable[[CkptfsError], None]
                 ) -> None:
        self.index = index
        self.gap_ns = gap_ns
        self._damaged = damaged
        self._files: dict[int, dict[int, int]] = {}     # directory -> {ino: mtime_ns}
        self._dir_of: dict[int, int] = {}               # ino -> the directory it is in
        self._versions: dict[int, list[Version]] = {}   # directory -> its versions
        self._dirty_dirs: set[int] = set()
        self._dirty_inos: set[int] = set()
        self._built_at: Optional[int] = None            # index.direct_writes when built
        self._stale = False         # a file left where nothing says: build again
        # Watched from now on: whatever changes after this is read again.
        index.watch_maps(self._ino_changed)     # a chunk record changing moves no file
        index.watch_entries(self._dir_changed)

    def _ino_changed(self, ino: int) -> None:
        self._dirty_inos.add(ino)

    def _dir_changed(self, parent: int) -> None:
        self._dirty_dirs.add(parent)

    @property
    def built(self) -> bool:
        # Start-up work writes the index directly, past the watchers.
        return self._built_at == self.index.direct_writes

    async def prepare(self) -> None:
        """Build the catalog if it is not, in a worker thread: the first pass
        after a mount reads every directory entry (~10 s per million files)."""
        if self.built and not self._stale:
            return
        at = self.index.direct_writes
        # What is pending now may predate the watchers: make it durable, so the
        # read view below has it (what changes later is watched).
        await self.index.wait_durable(self.index.current_seq())
        view = self.index.read_view()
        try:
            files, dir_of = await trio.to_thread.run_sync(self.scan, view)
        finally:
            view.close()
        self._install(files, dir_of, at)

    def build_now(self) -> None:
        """`prepare` on the trio thread, from the live index (a plan asked for
        before any pass prepared one)."""
        at = self.index.direct_writes
        self._install(*self.scan(self.index), at)

    def scan(self, kv) -> tuple[dict[int, dict[int, int]], dict[int, int]]:
        """Every regular file's directory and mtime. May block (any thread)."""
        files: dict[int, dict[int, int]] = {}
        dir_of: dict[int, int] = {}
        for parent, _name, ino, _cookie in ix.scan_entries(
                kv, damaged=lambda why: self._damaged(FormatError(why))):
            if ino in dir_of:
                continue                # a second name of a file grouped already
            mtime_ns = self._file_mtime(kv, ino)
            if mtime_ns is not None:
                dir_of[ino] = parent
                files.setdefault(parent, {})[ino] = mtime_ns
        return files, dir_of

    def _install(self, files: dict[int, dict[int, int]], dir_of: dict[int, int],
                 at: int) -> None:
        self._files, self._dir_of = files, dir_of
        self._versions = {parent: self._group(parent, members, [])
                          for parent, members in files.items()}
        self._built_at = at
        self._stale = False

    def _file_mtime(self, kv, ino: int) -> Optional[int]:
        """The mtime of a regular file, None for anything else or a damaged record."""
        try:
            inode = ix.get_inode(kv, ino)
        except FormatError as e:
            self._damaged(e)
            return None
        if inode is None or not stat.S_ISREG(inode.mode):
            return None
        return inode.mtime_ns

    def versions(self) -> list[Version]:
        """Every version, newest first, once what changed is read again."""
        if not self.built:
            self.build_now()
        self._refresh()
        versions = [v for vs in self._versions.values() for v in vs]
        versions.sort(key=lambda v: (v.newest_ns, v.parent), reverse=True)
        return versions

    def _refresh(self) -> None:
        dirs, self._dirty_dirs = self._dirty_dirs, set()
        inos, self._dirty_inos = self._dirty_inos, set()
        regroup: set[int] = set()
        for ino in inos:
            parent = self._dir_of.get(ino)
            if parent is None or parent in dirs:
                continue                # not a file we group, or its directory is read anyway
            mtime_ns = self._file_mtime(self.index, ino)
            if mtime_ns is None:
                dirs.add(parent)        # gone or damaged: read its directory again
            else:
                self._files[parent][ino] = mtime_ns
                regroup.add(parent)
        vanished: set[int] = set()
        for parent in dirs:
            for ino in self._files.pop(parent, {}):
                if self._dir_of.get(ino) == parent:
                    del self._dir_of[ino]
                    vanished.add(ino)
        # In key order, so a file with entries in two directories read again
        # lands in the first, as `scan` puts it.
        for parent in sorted(dirs):
            members: dict[int, int] = {}
            for _name, ino, _cookie in ix.list_entries(self.index, parent):
                elsewhere = self._dir_of.get(ino)
                if elsewhere is not None and elsewhere != parent:
                    if elsewhere < parent:
                        continue
                    # Grouped in a later directory so far: it belongs here.
                    del self._files[elsewhere][ino]
                    regroup.add(elsewhere)
                mtime_ns = self._file_mtime(self.index, ino)
                if mtime_ns is not None:
                    members[ino] = mtime_ns
                    self._dir_of[ino] = parent
                    vanished.discard(ino)
            if members:
                self._files[parent] = members
            regroup.add(parent)
        for ino in vanished:
            inode = self._inode(ino)
            if inode is not None and inode.nlink > 0 and stat.S_ISREG(inode.mode):
                # Its entry here went, one elsewhere stays, in a directory
                # nothing told us about: until the next `prepare` reads
                # everything again (in a thread), plans go without it.
                self._stale = True
        for parent in regroup:
            members = self._files.get(parent)
            if not members:
                self._files.pop(parent, None)
                self._versions.pop(parent, None)
            else:
                self._versions[parent] = self._group(parent, members,
                                                     self._versions.get(parent, []), inos)

    def _inode(self, ino: int) -> Optional[Inode]:
        try:
            return ix.get_inode(self.index, ino)
        except FormatError:
            return None

    def _group(self, parent: int, members: dict[int, int], before: list[Version],
               changed: Iterable[int] = ()) -> list[Version]:
        """parent's files as versions. A version made of the same files as
        one before, none of them changed, keeps what its last walk found."""
        versions: list[Version] = []
        current: Optional[Version] = None
        alone = parent == ix.ROOT_INO       # a file in the root is a version of its own
        for ino, mtime_ns in sorted(members.items(), key=lambda item: item[1]):
            # Measured from the version's first file, so saves every minute into
            # one directory still make a version per save, not one forever.
            if current is None or alone or mtime_ns - current.oldest_ns > self.gap_ns:
                current = Version(parent, mtime_ns, oldest_ns=mtime_ns)
                versions.append(current)
            current.files.append(ino)
            current.newest_ns = mtime_ns
        walked = {tuple(v.files): v.in_log for v in before if v.in_log is not None}
        if walked:
            changed = set(changed)
            for v in versions:
                if changed.isdisjoint(v.files):
                    v.in_log = walked.get(tuple(v.files))
        return versions


class Planner:
    """Says which chunks are cold, from the catalog of versions."""

    def __init__(self, index: Index, plog: PmemLog, policy: TierPolicy) -> None:
        self.index = index
        self.log = plog
        self.policy = policy
        self._damage_seen: set[str] = set()
        self._hot_seen: tuple[list[Version], set[int]] = ([], set())
        self.catalog = VersionCatalog(index, int(policy.version_gap_s * 1e9),
                                      self.damaged_record)

    def log_use(self) -> float:
        return 1.0 - self.log.free_bytes / self.log.capacity_bytes

    async def prepare(self) -> None:
        """Before `plan`: the first one after a mount reads every entry, in a thread."""
        await self.catalog.prepare()

    def versions(self) -> list[Version]:
        """Every version, newest first."""
        return self.catalog.versions()

    def plan(self, open_inos: set[int], pinned: Iterable[int], everything: bool = False
             ) -> Plan:
        """Cold chunks still in the log, oldest versions' first. open_inos: files
        open or with uncommitted changes (theirs stay); pinned: stored chunks an
        uncommitted overlay names (they stay too). everything: every version is
        cold (`ckptfs tier --now --all`, a writer waiting for room)."""
        versions = self.versions()
        hot = [] if everything else versions[:self.policy.hot_versions]
        cold = versions if everything else versions[self.policy.hot_versions:]
        over_watermark = not everything and self.log_use() > self.policy.high_watermark
        if not over_watermark and all(v.settled for v in cold):
            # Nothing can be chosen, so the walk over every hot extent (which runs
            # on the trio thread, after every commit) would be wasted: a pass right
            # after a 2 GiB write walked 32,000 extents while the file was read.
            return Plan([], cold)
        keep: set[int] = set(pinned)
        for ino in open_inos:
            keep.update(e.chunk_no for e in ix.iter_extents(self.index, ino))
        chosen: dict[int, Chunk] = {}
        self._choose(cold, keep | self._hot_chunks(hot), open_inos, chosen)
        # Over the high watermark: hot versions go too, oldest first, until what
        # this pass moves brings the log under the low watermark.
        if over_watermark:
            excess = (self.log_use() - self.policy.low_watermark) * self.log.capacity_bytes
            excess -= sum(c.length for c in chosen.values())
            while hot and excess > 0:
                v = hot.pop()
                cold.append(v)
                before = sum(c.length for c in chosen.values())
                self._choose([v], keep | self._chunks_of(hot), open_inos, chosen)
                excess -= sum(c.length for c in chosen.values()) - before
        return Plan(list(chosen.values()), cold)

    def _hot_chunks(self, hot: list[Version]) -> set[int]:
        """The chunks the hot versions name; the last pass's set while the hot
        versions are the same objects (none of their files changed since)."""
        cached, chunks = self._hot_seen
        if len(cached) == len(hot) and all(a is b for a, b in zip(cached, hot)):
            return chunks
        chunks = self._chunks_of(hot)
        self._hot_seen = (list(hot), chunks)    # held: their ids stay theirs
        return chunks

    def _chunks_of(self, versions: list[Version]) -> set[int]:
        chunks: set[int] = set()
        for v in versions:
            for ino in v.files:
                chunks.update(e.chunk_no for e in ix.iter_extents(self.index, ino))
        return chunks

    def _choose(self, versions: list[Version], keep: set[int], open_inos: set[int],
                chosen: dict[int, Chunk]) -> None:
        """Add the chunks of these versions that are still in the log, oldest
        first. A version's walk records what of it is in the log (`in_log`):
        later passes skip it while all of that is kept (none: settled), until
        one of its files changes. With dedup, a cold version shares most of its
        chunks with the hot ones: it was walked, extent by extent, every pass."""
        for v in reversed(versions):
            if v.held_by(keep):
                continue
            in_log: Optional[list[int]] = []
            for ino in v.files:
                if ino in open_inos:
                    in_log = None           # not looked at: not known
                    continue
                try:
                    for e in ix.iter_extents(self.index, ino):
                        if e.chunk_no in chosen:
                            if in_log is not None:
                                in_log.append(e.chunk_no)
                            continue
                        chunk = ix.get_chunk(self.index, e.chunk_no)
                        if chunk is None or chunk.kind != CHUNK_LOG:
                            continue
                        if in_log is not None:
                            in_log.append(e.chunk_no)
                        if e.chunk_no not in keep:
                            chosen[e.chunk_no] = ix.check_chunk_record(chunk)
                except (FormatError, DamagedData) as e:
                    in_log = None
                    self.damaged_record(e)     # the rest of this file stays hot
            v.in_log = None if in_log is None else array("Q", sorted(set(in_log)))

    def damaged_record(self, e: CkptfsError) -> None:
        """Damaged index records stay where they are (fsck reports them); once per record."""
        if str(e) not in self._damage_seen:
            self._damage_seen.add(str(e))
            log.error("tiering skips a damaged index record: %s (run ckptfs fsck)", e)
