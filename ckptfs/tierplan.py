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
nothing and writes nothing. It runs on the trio thread; a plan reads every
directory entry and every extent of the files it looks at, in one go, so
that what it sees is one state of the index.
"""

from __future__ import annotations

import logging
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional

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
    prefetch_bytes: int = 32 << 20   # file bytes read ahead of a sequential cold reader


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
    """Files of one directory committed close together: one checkpoint."""

    parent: int
    newest_ns: int
    files: list[Inode] = field(default_factory=list)
    oldest_ns: int = 0

    @property
    def data_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)


@dataclass
class Plan:
    """What a pass moves: cold LOG chunks, oldest versions' first."""

    chunks: list[Chunk]
    cold: list[Version]
    paths: dict[int, list[bytes]]          # ino -> its paths, for the log


class Planner:
    """Groups files into versions and says which chunks are cold."""

    def __init__(self, index: Index, plog: PmemLog, policy: TierPolicy) -> None:
        self.index = index
        self.log = plog
        self.policy = policy
        self._damage_seen: set[str] = set()

    def log_use(self) -> float:
        return 1.0 - self.log.free_bytes / self.log.capacity_bytes

    def versions(self) -> tuple[list[Version], dict[int, list[bytes]]]:
        """Every version, newest first, and the paths of every file."""
        names: dict[int, tuple[int, bytes]] = {}
        paths: dict[int, list[bytes]] = {}
        by_parent: dict[int, list[Inode]] = {}
        for parent, name, ino, _cookie in ix.scan_entries(
                self.index, damaged=lambda why: self.damaged_record(FormatError(why))):
            try:
                inode = ix.get_inode(self.index, ino)
            except FormatError as e:
                self.damaged_record(e)
                continue
            names[ino] = (parent, name)
            if inode is not None and stat.S_ISREG(inode.mode):
                if ino not in paths:
                    by_parent.setdefault(parent, []).append(inode)
                paths.setdefault(ino, []).append(self._path(names, parent, name))
        versions: list[Version] = []
        gap_ns = int(self.policy.version_gap_s * 1e9)
        for parent, inodes in by_parent.items():
            inodes.sort(key=lambda i: i.mtime_ns)
            current: Optional[Version] = None
            for inode in inodes:
                alone = parent == ix.ROOT_INO
                # Measured from the version's first file, so saves every minute into
                # one directory still make a version per save, not one forever.
                if current is None or alone or inode.mtime_ns - current.oldest_ns > gap_ns:
                    current = Version(parent, inode.mtime_ns, oldest_ns=inode.mtime_ns)
                    versions.append(current)
                current.files.append(inode)
                current.newest_ns = inode.mtime_ns
        versions.sort(key=lambda v: v.newest_ns, reverse=True)
        return versions, paths

    @staticmethod
    def _path(names: dict[int, tuple[int, bytes]], parent: int, name: bytes) -> bytes:
        parts = [name]
        seen = 0
        while parent != ix.ROOT_INO and parent in names and seen < 4096:
            parent, up = names[parent]
            parts.append(up)
            seen += 1
        return b"/".join(reversed(parts))

    def plan(self, open_inos: set[int], pinned: Iterable[int], everything: bool = False
             ) -> Plan:
        """Cold chunks still in the log, oldest versions' first. open_inos: files
        open or with uncommitted changes (theirs stay); pinned: stored chunks an
        uncommitted overlay names (they stay too). everything: every version is
        cold (`ckptfs tier --now --all`, a writer waiting for room)."""
        versions, paths = self.versions()
        hot = [] if everything else versions[:self.policy.hot_versions]
        cold = versions if everything else versions[self.policy.hot_versions:]
        over_watermark = not everything and self.log_use() > self.policy.high_watermark
        if not cold and not over_watermark:
            # Nothing can be chosen, so the walk over every hot extent (which runs
            # on the trio thread, after every commit) would be wasted: a pass right
            # after a 2 GiB write walked 32,000 extents while the file was read.
            return Plan([], cold, paths)
        keep: set[int] = set(pinned)
        for ino in open_inos:
            keep.update(e.chunk_no for e in ix.iter_extents(self.index, ino))
        hot_chunks: set[int] = set()
        for v in hot:
            for inode in v.files:
                hot_chunks.update(e.chunk_no for e in ix.iter_extents(self.index, inode.ino))
        chosen: dict[int, Chunk] = {}
        self._choose(cold, keep | hot_chunks, open_inos, chosen)
        # Over the high watermark: hot versions go too, oldest first, until what
        # this pass moves brings the log under the low watermark.
        if over_watermark:
            excess = (self.log_use() - self.policy.low_watermark) * self.log.capacity_bytes
            excess -= sum(c.length for c in chosen.values())
            while hot and excess > 0:
                v = hot.pop()
                cold.append(v)
                before = sum(c.length for c in chosen.values())
                hot_chunks = set()
                for other in hot:
                    for inode in other.files:
                        hot_chunks.update(e.chunk_no for e in ix.iter_extents(self.index,
                                                                              inode.ino))
                self._choose([v], keep | hot_chunks, open_inos, chosen)
                excess -= sum(c.length for c in chosen.values()) - before
        return Plan(list(chosen.values()), cold, paths)

    def _choose(self, versions: list[Version], keep: set[int], open_inos: set[int],
                chosen: dict[int, Chunk]) -> None:
        """Add the chunks of these versions that are still in the log, oldest first."""
        for v in reversed(versions):
            for inode in v.files:
                if inode.ino in open_inos:
                    continue
                try:
                    for e in ix.iter_extents(self.index, inode.ino):
                        if e.chunk_no in keep or e.chunk_no in chosen:
                            continue
                        chunk = ix.get_chunk(self.index, e.chunk_no)
                        if chunk is not None and chunk.kind == CHUNK_LOG:
                            chosen[e.chunk_no] = ix.check_chunk_record(chunk)
                except (FormatError, DamagedData) as e:
                    self.damaged_record(e)     # the rest of this file stays hot

    def damaged_record(self, e: CkptfsError) -> None:
        """Damaged index records stay where they are (fsck reports them); once per record."""
        if str(e) not in self._damage_seen:
            self._damage_seen.add(str(e))
            log.error("tiering skips a damaged index record: %s (run ckptfs fsck)", e)
