"""DirtyFile's gate (ckptfs/dirtyfile.py): writes wait for a commit's cut,
reads and commits wait for writes, space given back waits for the I/O that may
still touch it, and entering an open gate never yields (writes keep their
arrival order)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ckptfs.dirtyfile import DirtyFile, FileRetired


def make() -> tuple[DirtyFile, list[tuple[int, int]]]:
    released: list[tuple[int, int]] = []
    df = DirtyFile(7, 0, lambda off, n: released.append((off, n)),
                   lambda df, no: None, lambda df, no: None)
    return df, released


def test_writes_wait_for_a_cut_and_a_dropped_file_is_retired():
    async def main():
        df, _ = make()
        order: list[str] = []

        async def writer() -> None:
            try:
                async with df.writing():
                    order.append("write")
            except FileRetired:
                order.append("retired")

        async with trio.open_nursery() as n:
            async with df.cutting():
                n.start_soon(writer)
                await trio.testing.wait_all_tasks_blocked()
                assert order == [] and not df.quiet
                order.append("cut")
            # A second writer, this time the file's changes are dropped under it.
        assert order == ["cut", "write"]
        async with trio.open_nursery() as n:
            async with df.cutting():
                n.start_soon(writer)
                await trio.testing.wait_all_tasks_blocked()
                df.retired = True
        assert order == ["cut", "write", "retired"]
    trio.run(main)


def test_quiesce_waits_for_writes_in_flight_and_for_a_cut():
    async def main():
        df, _ = make()
        done: list[str] = []
        go = trio.Event()

        async def writer() -> None:
            async with df.writing():
                await go.wait()
            done.append("write")

        async def reader() -> None:
            await df.quiesce()
            done.append("quiet")

        async with trio.open_nursery() as n:
            n.start_soon(writer)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert done == []
            go.set()
        assert done == ["write", "quiet"] and df.quiet
    trio.run(main)


def test_an_open_gate_never_yields():
    """Entering with nothing in flight must not let another task run first:
    overlapping writes put their extents in the order they arrived."""
    async def main():
        df, _ = make()
        with trio.testing.assert_no_checkpoints():
            async with df.writing():
                pass
            await df.quiesce()
    trio.run(main)


@pytest.mark.parametrize("written", [False, True])
def test_space_given_back_waits_for_the_io_that_may_touch_it(written):
    async def main():
        df, released = make()
        go = trio.Event()

        async def writer() -> None:
            async with df.writing():
                await go.wait()

        async with trio.open_nursery() as n:
            n.start_soon(writer)
            await trio.testing.wait_all_tasks_blocked()
            df.give_back(100, 10, written=written)
            # Bytes in place (written) need only wait for reads; others for the write too.
            assert released == ([(100, 10)] if written else [])
            with df.reading():
                df.give_back(200, 5, written=True)
                assert (200, 5) not in released
            go.set()
        assert sorted(released) == [(100, 10), (200, 5)]
    trio.run(main)


def test_quiesce_waits_for_every_feed_behind_the_writes():
    """A stream's feed runs after its writes were answered: the file is not
    quiet (no read, no commit) until the last feed running behind it ends,
    also when an ended stream's feed overlaps a new stream's."""
    async def main():
        df, _ = make()
        done: list[str] = []

        async def quiescer() -> None:
            await df.quiesce()
            done.append("quiet")

        df.feed_begins()
        df.feed_begins()            # a new stream's feed while the old one ends
        assert not df.quiet
        async with trio.open_nursery() as n:
            n.start_soon(quiescer)
            await trio.testing.wait_all_tasks_blocked()
            df.feed_ends()
            await trio.testing.wait_all_tasks_blocked()
            assert done == [] and not df.quiet
            df.feed_ends()
        assert done == ["quiet"] and df.quiet
    trio.run(main)
