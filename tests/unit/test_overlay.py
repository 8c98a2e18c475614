"""Overlay (ckptfs/overlay.py): an open file's uncommitted extents, as pure data.

Random puts, cuts and retargets against a model that keeps, byte by byte,
which chunk byte each file byte names; after every step the overlay must say
the same, keep its extents sorted, non-overlapping and merged with `starts`,
count each chunk's extents exactly, and have told its owner exactly when a
chunk gained its first extent and lost its last one.
"""

from __future__ import annotations

import random

import pytest

from ckptfs.index import Extent
from ckptfs.overlay import ZERO_CHUNK, Overlay

FILE_BYTES = 200


class Model:
    def __init__(self) -> None:
        self.bytes: dict[int, tuple[int, int]] = {}     # file off -> (chunk no, chunk off)

    def put(self, e: Extent) -> None:
        for k in range(e.length):
            self.bytes[e.file_off + k] = (e.chunk_no, e.chunk_off + k)

    def cut(self, a: int, b: int) -> None:
        for off in range(a, b):
            self.bytes.pop(off, None)


def _as_bytes(ov: Overlay) -> dict[int, tuple[int, int]]:
    out = {}
    for e in ov:
        for k in range(e.length):
            out[e.file_off + k] = (e.chunk_no, e.chunk_off + k)
    return out


def _check(ov: Overlay, model: Model, live: set[int]) -> None:
    assert _as_bytes(ov) == model.bytes
    assert ov.starts == [e.file_off for e in ov]
    assert all(e.length > 0 for e in ov)
    assert all(a.end <= b.file_off for a, b in zip(ov.extents, ov.extents[1:]))
    want = {}
    for e in ov:
        if e.chunk_no != ZERO_CHUNK:
            want[e.chunk_no] = want.get(e.chunk_no, 0) + 1
    assert dict(ov.refs) == want
    assert live == set(want), "first/last reference callbacks disagree with the extents"


@pytest.mark.parametrize("seed", range(40))
def test_overlay_matches_byte_model(seed):
    rng = random.Random(seed)
    live: set[int] = set()
    events: list[tuple[str, int]] = []

    def first(chunk_no: int) -> None:
        assert chunk_no not in live
        live.add(chunk_no)
        events.append(("first", chunk_no))

    def last(chunk_no: int) -> None:
        assert chunk_no in live
        live.discard(chunk_no)
        events.append(("last", chunk_no))

    ov, model = Overlay(first, last), Model()
    for _ in range(60):
        op = rng.random()
        a = rng.randrange(FILE_BYTES)
        b = rng.randrange(a + 1, FILE_BYTES + 1)
        if op < 0.55:
            e = Extent(a, b - a, rng.choice([ZERO_CHUNK, 1, 2, 3, -1, -2]), rng.randrange(50))
            ov.put(e)
            model.put(e)
        elif op < 0.8:
            ov.cut(a, b)
            model.cut(a, b)
        elif op < 0.9:
            i = ov.index_at(a)
            if i is None:
                continue
            e = ov.extents[i]
            b = min(b, e.end)
            target = rng.choice([ZERO_CHUNK, 7, 8])
            ov.retarget(i, a, b, target)
            model.put(Extent(a, b - a, target, 0))
        else:
            # Several ranges of one extent at once (a write's chunks settled).
            i = ov.index_at(a)
            if i is None:
                continue
            e = ov.extents[i]
            cuts = sorted(rng.sample(range(e.file_off, e.end + 1), min(6, e.length + 1)))
            run = [(x, y, rng.choice([ZERO_CHUNK, 7, 8, 9]))
                   for x, y in zip(cuts[::2], cuts[1::2]) if y > x]
            if not run:
                continue
            ov.retarget_run(i, run)
            for x, y, target in run:
                model.put(Extent(x, y - x, target, 0))
        _check(ov, model, live)
        lo, hi = sorted(rng.randrange(FILE_BYTES + 1) for _ in range(2))
        assert ov.within(lo, hi) == [e for e in ov if e.file_off < hi and e.end > lo]
        assert ov.end == max((e.end for e in ov), default=0)
    ov.clear()
    model.cut(0, FILE_BYTES)
    _check(ov, model, live)
    assert not ov and not live


def test_cut_inside_one_extent_keeps_both_sides_and_one_more_reference():
    firsts: list[int] = []
    ov = Overlay(firsts.append)
    ov.put(Extent(0, 100, 5, 10))
    ov.cut(40, 60)
    assert ov.extents == [Extent(0, 40, 5, 10), Extent(60, 40, 5, 70)]
    assert ov.refs[5] == 2 and firsts == [5]


def test_retarget_splits_the_staged_extent():
    lasts: list[int] = []
    ov = Overlay(on_last_ref=lasts.append)
    ov.put(Extent(0, 100, -1, 0))
    ov.retarget(0, 0, 100, 9)
    assert ov.extents == [Extent(0, 100, 9, 0)]
    assert lasts == [-1] and dict(ov.refs) == {9: 1}


def test_holes_are_not_counted():
    calls: list[int] = []
    ov = Overlay(calls.append, calls.append)
    ov.put(Extent(0, 10, ZERO_CHUNK, 0))
    ov.cut(0, 5)
    assert calls == [] and not ov.refs and ov.extents == [Extent(5, 5, ZERO_CHUNK, 5)]


def test_hand_over_drops_everything_without_telling_the_owner():
    calls: list[int] = []
    ov = Overlay(calls.append, calls.append)
    ov.put(Extent(0, 10, 4, 0))
    ov.put(Extent(10, 10, -3, 0))
    assert calls == [4, -3]
    ov.hand_over()
    assert calls == [4, -3] and not ov and not ov.refs and ov.starts == [] and ov.end == 0
    ov.put(Extent(0, 5, 4, 0))
    assert calls == [4, -3, 4]           # counted afresh after the hand-over
