"""The reclaimer: chunk references, and when log space may be used again.

A chunk's refcount in the index is the number of committed extents pointing
into it (`add_refs`). A chunk reaching zero is deleted in the same batch;
its log space is released once that batch is durable and no read that may
have planned with it is still running (`release_after_durable`), and a
pre-existing original it stood for is deleted then too.

A stored chunk an uncommitted overlay points at is *pinned* (`pin`,
`unpin`): if its last committed reference goes meanwhile, its record is
deleted as usual but its bytes stay (a *zombie*) until the overlay either
commits (the chunk is stored again, same number, same bytes) or lets go.

Readers of committed bytes (reads, the tiering mover) hold them with
`begin_read`/`end_read`: space freed while a read runs waits for every read
that started before it was freed.

Runs on the trio thread and never blocks, but for one thing: an adopted
original whose last reference went is deleted (`SourceFiles.remove`, a few
small file system calls) once the batch that dropped it is durable.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Optional

from . import index as ix
from .errors import DamagedData
from .index import CHUNK_LOG, CHUNK_SOURCE, Chunk, Index
from .pmemlog import PmemLog
from .sources import SourceFiles

log = logging.getLogger(__name__)


class Reclaimer:
    """Owns chunk refcounts, pins and zombies, and the release of log space."""

    def __init__(self, index: Index, plog: PmemLog, sources: SourceFiles) -> None:
        self.index = index
        self.log = plog
        self.sources = sources
        self.pinned: Counter = Counter()          # stored chunk no -> overlays naming it
        self.zombies: dict[int, Chunk] = {}       # pinned chunks deleted from the index
        # Reads in flight by the epoch they started in; space freed while they
        # run waits for every read that started before it was freed.
        self._epoch = 0
        self._reads: Counter = Counter()
        self._freed_during_reads: list[tuple[int, Callable[[], None]]] = []

    def chunk(self, chunk_no: int) -> Chunk:
        """The chunk an extent names: in the index, or a zombie an overlay keeps."""
        chunk = ix.get_chunk(self.index, chunk_no) or self.zombies.get(chunk_no)
        if chunk is None:
            raise DamagedData(f"extent names missing chunk {chunk_no}")
        return chunk

    def zombie_packs(self) -> set[int]:
        """Packs holding a zombie's bytes, cold or a published copy (an open file
        may still commit it)."""
        return {z.pack_no for z in self.zombies.values() if z.in_store}     # cold or a copy

    # ------------------------------------------------------------ pins

    def pin(self, chunk_no: int) -> None:
        """An overlay now names stored chunk chunk_no: keep its bytes."""
        self.pinned[chunk_no] += 1

    def unpin(self, chunk_no: int) -> None:
        self.pinned[chunk_no] -= 1
        if self.pinned[chunk_no] > 0:
            return
        del self.pinned[chunk_no]
        zombie = self.zombies.pop(chunk_no, None)
        if zombie is not None and zombie.kind == CHUNK_LOG:
            # Its deletion is in this batch or an earlier one: reuse after it is durable.
            self.release_after_durable(zombie.log_off, zombie.length)

    # --------------------------------------------------------- refcounts

    def add_refs_many(self, deltas: dict[int, int]) -> None:
        """`add_refs` of many chunks: those that only gain references in one
        step of the index (`ix.more_refs_many`), the others one by one."""
        gains: list[tuple[int, int]] = []
        others: list[tuple[int, int]] = []
        for chunk_no, delta in deltas.items():
            (gains if delta > 0 and chunk_no not in self.zombies else others).append(
                (chunk_no, delta))
        for chunk_no in ix.more_refs_many(self.index, gains) if gains else ():
            self.add_refs(chunk_no, deltas[chunk_no])   # no record, or a damaged count
        for chunk_no, delta in others:
            self.add_refs(chunk_no, delta)

    def add_refs(self, chunk_no: int, delta: int) -> None:
        """Committed extents naming chunk_no changed by delta, in the open batch."""
        if delta == 0:
            return
        zombie = self.zombies.pop(chunk_no, None)
        if zombie is not None:
            # A pinned chunk whose last reference went: stored again, same bytes.
            zombie.refcount = delta
            ix.add_chunk(self.index, zombie)
            return
        if delta > 0 and ix.more_refs(self.index, chunk_no, delta):
            return                  # more references: nothing else changes
        chunk = self.chunk(chunk_no)
        chunk.refcount += delta
        if chunk.refcount > 0:
            ix.put_chunk(self.index, chunk)
            return
        ix.delete_chunk(self.index, chunk)
        if self.pinned.get(chunk_no):
            self.zombies[chunk_no] = chunk       # an open file still points at it
            return
        if chunk.kind == CHUNK_LOG:
            why = ix.chunk_record_problem(chunk)
            if why is not None:
                # Its lengths cannot be trusted to give back only its own space:
                # leave it used (the next mount recomputes free space).
                log.error("chunk %d deleted with a damaged record (%s): its log space "
                          "stays used until the next mount", chunk_no, why)
                return
            self.release_after_durable(chunk.log_off, chunk.length)
        elif chunk.kind == CHUNK_SOURCE:
            # After reads that may have planned with it (publishing moves a
            # file being read into the store: those reads still find it).
            self.index.after_durable(
                lambda: self._after_reads(lambda: self.sources.remove(chunk)))

    # ------------------------------------------------------ log space

    def begin_read(self) -> int:
        """A read (or the mover) is about to use chunk bytes found in the index."""
        self._reads[self._epoch] += 1
        return self._epoch

    def end_read(self, epoch: int) -> None:
        self._reads[epoch] -= 1
        if self._reads[epoch] <= 0:
            del self._reads[epoch]
        oldest: Optional[int] = min(self._reads, default=None)
        while self._freed_during_reads and (oldest is None
                                            or self._freed_during_reads[0][0] < oldest):
            _, release = self._freed_during_reads.pop(0)
            release()

    def release_after_durable(self, off: int, length: int) -> None:
        """Committed space the open batch stops naming: reusable once that batch is
        durable and no read that may have planned with it is still running."""
        self.index.after_durable(lambda: self._after_reads(
            lambda: self.log.release(off, length)))

    def _after_reads(self, release: Callable[[], None]) -> None:
        """Run release now if no read is in flight, else once every read that
        started before now has ended."""
        if not self._reads:
            release()
            return
        self._freed_during_reads.append((self._epoch, release))
        self._epoch += 1
