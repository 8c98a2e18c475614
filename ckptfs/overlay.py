"""Overlay: an open file's uncommitted extents, as pure data.

Sorted, non-overlapping `Extent`s (file range -> bytes of a chunk: a stored
chunk, a new chunk of this file, or a staged record), with how many extents
name each chunk. A later write covers an earlier one (`put` cuts the range
out first), truncation cuts the tail (`cut`), settling a staged range points
it at a chunk (`retarget`). The owner learns when a chunk gains its first
extent and loses its last one (`on_first_ref`, `on_last_ref`): that is when
a stored chunk is pinned and unpinned, or a new chunk's space is given back.
Chunk number ZERO_CHUNK (0) is a hole and is never counted.

No I/O, no trio, no index: runs on whatever thread owns the file, and is
unit tested against a byte-by-byte model (tests/unit/test_overlay.py).
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Callable, Iterator, Optional

from .index import Extent

ZERO_CHUNK = 0          # an all-zero range: stored nowhere, a hole


def _ignore(chunk_no: int) -> None:
    pass


class Overlay:
    """Sorted, non-overlapping extents with a reference count per chunk."""

    __slots__ = ("extents", "starts", "refs", "_on_first", "_on_last")

    def __init__(self, on_first_ref: Callable[[int], None] = _ignore,
                 on_last_ref: Callable[[int], None] = _ignore) -> None:
        self.extents: list[Extent] = []
        self.starts: list[int] = []          # file_off of each extent, for bisect
        self.refs: Counter = Counter()       # chunk no -> extents naming it
        self._on_first = on_first_ref
        self._on_last = on_last_ref

    def __bool__(self) -> bool:
        return bool(self.extents)

    def __iter__(self) -> Iterator[Extent]:
        return iter(self.extents)

    def __len__(self) -> int:
        return len(self.extents)

    @property
    def end(self) -> int:
        """Where the last extent ends (0 when empty)."""
        return self.extents[-1].end if self.extents else 0

    def index_at(self, off: int) -> Optional[int]:
        """Index of the extent holding byte off, if one does."""
        i = bisect.bisect_right(self.starts, off) - 1
        if i >= 0 and self.extents[i].end > off:
            return i
        return None

    def within(self, a: int, b: int) -> list[Extent]:
        """Extents that overlap [a, b), in file order (not clipped)."""
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        out = []
        while i < len(self.extents) and self.extents[i].file_off < b:
            e = self.extents[i]
            if e.end > a:
                out.append(e)
            i += 1
        return out

    def put(self, e: Extent) -> None:
        """e covers whatever the overlay had in its range."""
        self.cut(e.file_off, e.end)
        i = bisect.bisect_left(self.starts, e.file_off)
        self.extents.insert(i, e)
        self.starts.insert(i, e.file_off)
        self._add_ref(e.chunk_no, 1)

    def cut(self, a: int, b: int) -> None:
        """Remove [a, b), trimming extents that straddle it."""
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        while i < len(self.extents):
            e = self.extents[i]
            if e.file_off >= b:
                break
            if e.end <= a:
                i += 1
                continue
            keep = []
            if e.file_off < a:
                keep.append(Extent(e.file_off, a - e.file_off, e.chunk_no, e.chunk_off))
            if e.end > b:
                keep.append(Extent(b, e.end - b, e.chunk_no, e.chunk_off + (b - e.file_off)))
            self.extents[i:i + 1] = keep
            self.starts[i:i + 1] = [k.file_off for k in keep]
            self._add_ref(e.chunk_no, len(keep) - 1)
            i += len(keep)

    def retarget(self, i: int, a: int, b: int, target: int) -> None:
        """Extent i holds [a, b): that part now names chunk `target` from its
        offset 0 (a staged range settled into a chunk)."""
        e = self.extents[i]
        new = []
        if e.file_off < a:
            new.append(Extent(e.file_off, a - e.file_off, e.chunk_no, e.chunk_off))
        new.append(Extent(a, b - a, target, 0))
        if e.end > b:
            new.append(Extent(b, e.end - b, e.chunk_no, e.chunk_off + (b - e.file_off)))
        self.extents[i:i + 1] = new
        self.starts[i:i + 1] = [x.file_off for x in new]
        self._add_ref(target, 1)
        self._add_ref(e.chunk_no, len(new) - 2)

    def retarget_run(self, i: int, run: list[tuple[int, int, int]]) -> None:
        """`retarget` of several ranges of extent i at once, one splice:
        run holds (a, b, target), ascending and disjoint, inside extent i."""
        e = self.extents[i]
        new = []
        cur = e.file_off
        for a, b, target in run:
            if a > cur:
                new.append(Extent(cur, a - cur, e.chunk_no, e.chunk_off + (cur - e.file_off)))
            new.append(Extent(a, b - a, target, 0))
            cur = b
        if e.end > cur:
            new.append(Extent(cur, e.end - cur, e.chunk_no, e.chunk_off + (cur - e.file_off)))
        self.extents[i:i + 1] = new
        self.starts[i:i + 1] = [x.file_off for x in new]
        for _a, _b, target in run:
            self._add_ref(target, 1)
        self._add_ref(e.chunk_no, len(new) - len(run) - 1)

    def clear(self) -> None:
        """Remove everything, telling the owner of each chunk's last extent."""
        self.cut(0, 1 << 64)

    def hand_over(self) -> None:
        """Remove everything without telling the owner: whoever folded the
        extents in (a commit) took over their references."""
        self.extents.clear()
        self.starts.clear()
        self.refs.clear()

    def _add_ref(self, chunk_no: int, delta: int) -> None:
        if chunk_no == ZERO_CHUNK or delta == 0:
            return
        before = self.refs[chunk_no]
        after = before + delta
        if after > 0:
            self.refs[chunk_no] = after
            if before == 0:
                self._on_first(chunk_no)
            return
        del self.refs[chunk_no]
        self._on_last(chunk_no)
