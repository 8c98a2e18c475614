"""ckptfs in this process, without FUSE: the harness of the handler-level tests.

`InProcess(source, options)` opens SOURCE as the daemon does before it mounts
(`daemon.open_state` with the options `mount.ckptfs -o` takes: lock, index,
log, backing store), builds the daemon's `Filesystem` (`daemon.build_filesystem`,
the tiering mover included when a backing store is attached) and runs mount-time
recovery. Tests drive it the way fuse_ops does, from trio tasks:

    fs = inproc(["pmem_size=64M"])              # the conftest fixture
    async def main(fs):
        await fs.write_file("d/a", b"...")      # lookup, create, writes, flush, release
        assert await fs.read_file("d/a") == b"..."
    fs.run(main)                                # the committer (and the mover) beside it

Each `run` is one trio run: the committer runs beside `main`, and the mover
too when there is a backing store (mover=False leaves it out); `tier_now` is
what `ckptfs tier --now` starts. `close()` leaves the state as a crash does
(LMDB keeps what it committed, nothing else is flushed); `shutdown()` is a
clean unmount (`daemon.shut_down`: final commits, snapshot, marked clean).
Once closed, `fsck()` runs the real `ckptfs fsck` on SOURCE; open SOURCE again
(a new InProcess) to see what survived.

What it is not: the kernel. No page cache or writeback cache, no request
splitting, no permission checks (default_permissions), no FUSE errno edge (the
handlers raise ckptfs's exceptions: DamagedData where a reader gets EIO), no
control socket. Tests of those mount the real daemon (the `make_mount` fixture).
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Awaitable, Callable, Optional, Sequence, TypeVar
from unittest import mock

import outcome
import trio

from ckptfs import daemon
from ckptfs.core import Attrs, Filesystem
from ckptfs.errors import CkptfsError, NotFound
from ckptfs.index import ROOT_INO
from ckptfs.options import parse_options
from mounting import run_ckptfs

T = TypeVar("T")
KiB, MiB = 1 << 10, 1 << 20
WRITE_PIECE_BYTES = 1 * MiB        # the kernel's largest write request (max_write)


class InProcess:
    """One opening of SOURCE in this process (one "mount" without the kernel)."""

    def __init__(self, source: Path, options: Sequence[str] = ("pmem_size=64M",),
                 log_class: Optional[type] = None) -> None:
        """options: as for mount.ckptfs -o (a list of NAME[=VALUE]). log_class
        replaces PmemLog (the power-loss tests' FaultLog)."""
        self.source = Path(os.path.realpath(source))
        self.opts = parse_options(str(self.source), str(self.source), list(options))
        if log_class is None:
            self.state = daemon.open_state(self.opts)
        else:
            with mock.patch.object(daemon, "PmemLog", log_class):
                self.state = daemon.open_state(self.opts)
        self.index = self.state.index
        self.log = self.state.log
        self.fs: Filesystem = daemon.build_filesystem(self.state)
        self.purged = self.fs.recover()
        self.closed = False

    # ------------------------------------------------------------ lifecycle

    def run(self, main: Callable[..., Awaitable[T]], *args, mover: bool = True) -> T:
        """trio.run(main(self, *args)) with the committer (and the mover, if any)
        running beside it; they are cancelled when main returns. What main
        raises comes out as it is (not in an exception group)."""
        async def body() -> outcome.Outcome:
            async with trio.open_nursery() as n:
                n.start_soon(self.fs.run_committer)
                if mover and self.fs.tierer is not None:
                    await n.start(self.fs.tierer.run)
                result = await outcome.acapture(main, self, *args)
                if mover and self.fs.tierer is not None:
                    await self.fs.tierer.stop()
                n.cancel_scope.cancel()
            return result
        return trio.run(body).unwrap()

    def shutdown(self) -> None:
        """A clean unmount (stop the mover, commit, publish, mark clean), then close.
        The mover is started first, as a daemon's always runs before its unmount."""
        async def body() -> None:
            async with trio.open_nursery() as n:
                n.start_soon(self.fs.run_committer)
                if self.fs.tierer is not None:
                    await n.start(self.fs.tierer.run)
                await daemon.shut_down(self.fs)
        trio.run(body)
        self.close()

    def close(self) -> None:
        """Close as it is: the index keeps what LMDB committed, nothing is flushed."""
        if not self.closed:
            self.closed = True
            self.state.close()

    def fsck(self, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
        """`ckptfs fsck SOURCE [ARGS]`, the command, once closed (as fsck needs a
        filesystem unmounted); never raises on its exit code."""
        assert self.closed, "fsck needs the filesystem closed"
        return run_ckptfs("fsck", str(self.source), *args, check=False, timeout=timeout_s)

    # ------------------------------------------------- requests, as the kernel sends them

    def lookup(self, path: str) -> Optional[int]:
        """The inode at path (relative to the root), or None. No lookup is counted."""
        ino = ROOT_INO
        for name in filter(None, path.split("/")):
            try:
                ino = self.fs.ns.lookup(ino, name.encode()).ino
            except NotFound:
                return None
        return ino

    def _parent(self, path: str) -> tuple[int, bytes]:
        head, _, name = path.rstrip("/").rpartition("/")
        parent = self.lookup(head)
        assert parent is not None, f"no directory {head!r}"
        return parent, name.encode()

    def mkdir(self, path: str, mode: int = 0o755) -> int:
        parent, name = self._parent(path)
        a = self.fs.make_node(parent, name, stat.S_IFDIR | mode, 0, 0)
        self.fs.forget(a.inode.ino, 1)
        return a.inode.ino

    def makedirs(self, path: str) -> int:
        done = ""
        for name in filter(None, path.split("/")):
            done = f"{done}/{name}" if done else name
            if self.lookup(done) is None:
                self.mkdir(done)
        return self.lookup(done) or ROOT_INO

    def symlink(self, target: str, path: str) -> int:
        parent, name = self._parent(path)
        a = self.fs.make_node(parent, name, 0o120777, 0, 0, target=target.encode())
        self.fs.forget(a.inode.ino, 1)
        return a.inode.ino

    def link(self, existing: str, path: str) -> None:
        ino = self.lookup(existing)
        assert ino is not None, existing
        parent, name = self._parent(path)
        self.fs.link(ino, parent, name)
        self.fs.forget(ino, 1)

    def unlink(self, path: str) -> None:
        self.fs.unlink(*self._parent(path))

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        self.fs.rename(*self._parent(old), *self._parent(new), flags)

    def setxattr(self, path: str, name: str, value: bytes) -> None:
        ino = self.lookup(path)
        assert ino is not None, path
        self.fs.ns.setxattr(ino, name.encode(), value, self.fs.now_ns(), 0)

    def listdir(self, path: str = "") -> list[str]:
        ino = self.lookup(path)
        assert ino is not None, path
        return sorted(name.decode() for name, _, _ in self.fs.ns.entries(ino, 0))

    def attrs(self, path: str) -> Attrs:
        """What getattr answers for path (the inode, its size and times)."""
        ino = self.lookup(path)
        assert ino is not None, path
        return self.fs.attrs(ino)

    def size(self, path: str) -> int:
        return self.attrs(path).size

    async def write_file(self, path: str, data: bytes, mode: int = 0o644,
                         piece_bytes: int = WRITE_PIECE_BYTES) -> int:
        """open(O_WRONLY|O_CREAT|O_TRUNC), write in pieces, close (flush, release).
        Returns the inode; the close commits (and waits for durability with
        sync=close)."""
        ino = self.lookup(path)
        if ino is None:
            parent, name = self._parent(path)
            fh, attrs = self.fs.create(parent, name, mode, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                       0, 0)
            ino, created = attrs.inode.ino, True
        else:
            fh, created = self.fs.open(ino, os.O_WRONLY | os.O_TRUNC), False
        try:
            for off in range(0, len(data), piece_bytes):
                await self.fs.write(fh, off, data[off:off + piece_bytes])
            await self.fs.flush(fh)
        finally:
            await self.fs.release(fh)
            if created:
                self.fs.forget(ino, 1)
        return ino

    async def read_file(self, path: str, piece_bytes: int = WRITE_PIECE_BYTES) -> bytes:
        ino = self.lookup(path)
        assert ino is not None, f"no file {path!r}"
        fh = self.fs.open(ino, os.O_RDONLY)
        try:
            size = self.fs.attrs(ino).size
            out = bytearray()
            while len(out) < size:
                got = await self.fs.read(fh, len(out), min(size - len(out), piece_bytes))
                assert got, f"{path}: short read at {len(out)} of {size}"
                out += got
            return bytes(out)
        finally:
            await self.fs.release(fh)

    async def tier_now(self, everything: bool = False) -> None:
        """`ckptfs tier --now [--all]`: the pass the control socket starts (tier,
        garbage collection, snapshot), followed to its end. Needs the mover
        (run with mover=True, the default)."""
        tierer = self.fs.tierer
        assert tierer is not None, "tiering is off (or no backing store)"
        tierer.start_now(everything=everything)
        while not tierer.progress.finished:
            await trio.sleep(0.02)
        if tierer.progress.error:
            raise CkptfsError(f"tiering failed: {tierer.progress.error}")

    def stats(self) -> dict:
        """What `ckptfs stat --json` would print."""
        return self.fs.stats()
