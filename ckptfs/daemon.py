"""Daemon lifecycle: open the state, mount, serve, commit, unmount.

`mount` (used by `mount.ckptfs` and `ckptfs mount`) validates the options,
then starts the daemon as a fresh process (the same Python, importing the
very `ckptfs` package the caller imported, in `/`) and waits on a pipe until
the daemon reports that the mount is live, or why it is not: so the command
returns 0 only for a live mount and prints one clear line otherwise (and,
before that, one line per note: a new log's size, a backing store that
cannot be reached). No fork
inside trio, no double fork: the daemon is a new session started by
subprocess.

Order at start (all before the mount hides SOURCE): state dir, lock, index
(format and adopt the existing tree on first use), log, recovery; then
pyfuse3.init, then the trio loop. At the end: every open file committed,
orphans purged, the index marked clean and synced, then unmount.

A mount that fails before it is live removes exactly what its attempt
created (`Attempt`): a failed first mount leaves SOURCE as it found it, and an
S3 store it created as it found it (its marker deleted). A
first mount cut off by a kill leaves only `index.creating` or
`pmem.log.creating`, which the next mount removes and makes again.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import gc
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid as uuidlib
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

# Before pyfuse3, so that the FUSE channel fast path can stand in for
# libfuse's fuse_session_mount (ckptfs/fastpath.py).
from . import fastpath  # isort: skip
import pyfuse3
import trio

from . import adopt, control
from . import index as ix
from .core import CommitPolicy, Filesystem
from .errors import (AlreadyExists, BackingCredentials, CkptfsError, FormatError,
                     OperationFailed, UsageError, one_line)
from .sources import SourceFiles
from .tierplan import TierPolicy, TierSetup
from .fuse_ops import CkptfsOperations
from .index import Index
from .options import MountOptions, parse_options
from .backing import is_url, open_backend
from .backing.base import MARKER_NAME, Backend
from .backing.fdroot import FdRootBackend
from .backing.local import LocalBackend
from .errors import ExitCode
from .mounts import fsname_encode, mount_device
from .statedir import backing_root, index_exists, lock_source, log_path, remember_log_path
from .pmemlog import CREATING_SUFFIX, PmemLog
from .volumes import Attached

if TYPE_CHECKING:
    from .chunkindex import SharedChunks

log = logging.getLogger("ckptfs.daemon")

READ_AHEAD_KB = 16384      # the most the kernel reads ahead: keeps several 1 MiB reads in flight


@dataclass
class State:
    """Everything opened before the mount; closed after it."""

    opts: MountOptions
    lock_fd: int
    source_fd: int
    index: Index
    log: PmemLog
    sources: SourceFiles
    backend: Optional[Backend]
    fs_uuid: bytes
    attached: Optional["Attached"] = None      # the volume, when there is a store

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
        self.sources.close()
        self.log.close()
        self.index.close()
        os.close(self.source_fd)
        os.close(self.lock_fd)


@dataclass
class Attempt:
    """One mount attempt: what it created, and notes for the mount command.

    If the mount never goes live, `finish` removes exactly what was created,
    in reverse order. Files and trees only while this attempt holds SOURCE's
    lock (otherwise another daemon may own them); directories it made only
    if they are empty again.
    """

    created: list[tuple[str, bool]] = field(default_factory=list)   # (path, whole tree)
    undo: list[Callable[[], None]] = field(default_factory=list)    # what is not a path
    notes: list[str] = field(default_factory=list)
    live: bool = False
    lock_fd: Optional[int] = None     # a dup: the lock outlives State.close until finish

    def made(self, path: str, tree: bool = False) -> None:
        self.created.append((path, tree))

    def make_dir(self, path: str) -> None:
        if not os.path.isdir(path):
            os.mkdir(path, 0o700)
            self.made(path)

    def hold_lock(self, lock_fd: int) -> None:
        self.lock_fd = os.dup(lock_fd)

    def finish(self) -> None:
        try:
            if not self.live:
                for fn in reversed(self.undo):
                    try:
                        fn()
                    except (CkptfsError, OSError) as e:
                        log.warning("after the failed mount: %s", e)
                for path, tree in reversed(self.created):
                    self._remove(path, tree)
        finally:
            if self.lock_fd is not None:
                os.close(self.lock_fd)
                self.lock_fd = None

    def _remove(self, path: str, tree: bool) -> None:
        try:
            if tree and self.lock_fd is not None:
                shutil.rmtree(path)
            elif os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            elif self.lock_fd is not None:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:      # a directory now holds what others made
                log.warning("left %s after the failed mount: %s", path, e.strerror)


def open_state(opts: MountOptions, attempt: Optional[Attempt] = None) -> State:
    """Lock SOURCE and open (or create) its index and log. May block.

    With an attempt, what this creates is recorded in it, and it holds the
    lock until its `finish`.
    """
    holds_lock = attempt is not None
    attempt = attempt or Attempt()
    os.makedirs(opts.state_dir, mode=0o700, exist_ok=True)
    with ExitStack() as undo:
        lock_path = os.path.join(opts.state_dir, "lock")
        new_lock = not os.path.exists(lock_path)
        lock_fd = lock_source(opts.state_dir)
        undo.callback(os.close, lock_fd)
        if holds_lock:
            attempt.hold_lock(lock_fd)
        if new_lock:
            attempt.made(lock_path)
        source_fd = os.open(opts.source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        undo.callback(os.close, source_fd)
        if not index_exists(opts.index_dir):
            create_index(opts, source_fd, attempt)
        index = Index(opts.index_dir)
        undo.callback(index.close)
        sources = SourceFiles(source_fd)
        undo.callback(sources.close)
        index.upgrade_format(source_identity=sources.identify)
        fs_uuid = index.check_format()
        opts.pmem = log_path(opts, index)
        has_hot_data = ix.has_log_chunks(index)
        plog = open_log(opts, fs_uuid, has_hot_data, attempt)
        undo.callback(plog.close)
        remember_log_path(index, opts)
        index.keep_reserve()
        index.start_journal()
        backend = open_backing(opts, index, fs_uuid, attempt) if opts.tiering else None
        attached = None
        if backend is not None:
            undo.callback(backend.close)
            attached = attach_volume(opts, index, backend, fs_uuid, attempt)
        undo.pop_all()
    return State(opts, lock_fd, source_fd, index, plog, sources, backend, fs_uuid, attached)


def attach_volume(opts: MountOptions, index: Index, backend: Backend, fs_uuid: bytes,
                  attempt: Attempt) -> Optional["Attached"]:
    """The filesystem's volume in its store (`volumes.attach`): made, taken
    over, or found fenced. A read-only mount takes nothing. May block."""
    from . import volumes
    if opts.read_only:
        record = ix.get_volume(index)
        if record is None or record.takeover:
            return None
        return volumes.Attached(volumes.Volume(backend, record.name, record.gen, fs_uuid))
    new = ix.get_volume(index) is None
    attached = volumes.attach(backend, index, opts.volume, fs_uuid)
    if new:
        # A first mount that fails must leave the name (and its pack space) free again.
        for blob in attached.undo_blobs():
            attempt.undo.append(lambda blob=blob: backend.delete(blob))
    for note in attached.notes:
        log.info("%s", note)
    if attached.fenced is not None:
        log.error("%s", attached.fenced)
        attempt.notes.append(f"warning: {attached.fenced}")
    return attached


def create_index(opts: MountOptions, source_fd: int, attempt: Attempt) -> None:
    """Format a new index and adopt SOURCE's tree into it. May block.

    Built in index.creating and renamed into place once durable: a first
    mount cut off anywhere leaves no half-made index that a later mount
    would take for a filesystem (one without the adopted files).
    """
    tmp = opts.index_dir + CREATING_SUFFIX
    for leftover in (tmp, opts.index_dir):
        if os.path.lexists(leftover):
            log.warning("removing %s: a first mount was cut off while making it", leftover)
            shutil.rmtree(leftover)
    attempt.made(tmp, tree=True)
    index = Index(tmp)
    try:
        st = os.fstat(source_fd)
        index.format(ix.new_fs_uuid(), time.time_ns(), st.st_uid, st.st_gid)
        counters = {name: index.counters[name] for name in ix.ID_COUNTERS}
        adopted = [0]
        index.write_direct(lambda txn: adopted.__setitem__(
            0, adopt.adopt_tree(txn, source_fd, counters)))
    finally:
        index.close()
    os.rename(tmp, opts.index_dir)
    attempt.made(opts.index_dir, tree=True)
    _fsync_dir(opts.state_dir)
    log.info("new ckptfs over %s; adopted %d existing entries", opts.source, adopted[0])


def open_log(opts: MountOptions, fs_uuid: bytes, has_hot_data: bool,
             attempt: Attempt) -> PmemLog:
    """Open the log, or create it (with the default size unless pmem_size=). May block."""
    path = opts.pmem_path
    at_default_place = os.path.abspath(path) == os.path.join(opts.state_dir, "pmem.log")
    if (not has_hot_data and at_default_place and os.path.isfile(path)
            and PmemLog.is_blank(path)):
        # Only an older ckptfs made a log in place here: blank means its creation was cut off.
        log.warning("removing %s: its creation was cut off (blank superblock)", path)
        os.unlink(path)
    if os.path.exists(path):
        return PmemLog.open(path, opts.pmem_size, fs_uuid, format_blank=not has_hot_data)
    if has_hot_data:
        raise FormatError(f"log {path} is missing but the index names data in it (restore "
                          "it, or mount with pmem= naming where it is)")
    size = opts.pmem_size
    if size is None:
        size = opts.default_pmem_size()
        shown = f"{size / (1 << 30):.1f} GiB" if size >= 1 << 30 else f"{size >> 20} MiB"
        note = (f"new log {path} reserves {shown} of disk now (default: a quarter of the "
                "free space, 256 MiB to 8 GiB; -o pmem_size= sets it)")
        log.info("%s", note)
        attempt.notes.append(note)
    plog = PmemLog.create(path, size, fs_uuid)
    attempt.made(path)
    return plog


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_backing(opts: MountOptions, index: Index, fs_uuid: bytes,
                 attempt: Optional[Attempt] = None) -> Optional[Backend]:
    """The backing store: created on first use, after that only ever checked.

    A store that was attached before and cannot be reached now (an NFS mount
    gone, an S3 endpoint down) is not recreated: the mount goes ahead, hot
    data works, tiering retries and cold reads give EIO until it is back; the
    reason is logged and noted for the mount command. Credentials an S3 store
    refuses (or none at all) fail the mount: configuration, not an outage.
    May block.
    """
    root = backing_root(opts, index)
    known = ix.get_store_uuid(index)
    store_kw = {"profile": opts.aws_profile}
    # A store other filesystems use already is joined (each is a volume of it).
    if known is None and is_url(root):
        try:
            backend = open_backend(root, uuidlib.UUID(bytes=fs_uuid), create=True, **store_kw)
        except AlreadyExists as e:
            if "already holds ckptfs store" not in str(e):
                raise
            backend = open_backend(root, None, create=True, **store_kw)
        if attempt is not None and backend.created:
            attempt.undo.append(backend.remove_if_empty)
        index.write_direct(lambda txn: ix.set_store(txn, backend.store_uuid.bytes,
                                                    root.encode()))
        log.info("backing store %s %s", backend.url,
                 "created" if backend.created else "joined (it holds other volumes)")
        backend.close()
        known = backend.store_uuid.bytes
    elif known is None:
        missing = []            # what create makes: the directory and parents, or the marker
        path = os.path.abspath(root)
        while not os.path.lexists(path):
            missing.append(path)
            path = os.path.dirname(path)
        joined = os.path.lexists(os.path.join(root, MARKER_NAME))   # other volumes' store
        try:
            backend = LocalBackend.create(root, uuidlib.UUID(bytes=fs_uuid))
        except AlreadyExists as e:
            if "already holds ckptfs store" not in str(e):
                raise
            backend = LocalBackend.create(root)
        if attempt is not None and not joined:
            for made in reversed(missing[1:]):
                attempt.made(made)
            attempt.made(missing[0] if missing else os.path.join(root, MARKER_NAME),
                         tree=bool(missing))
        index.write_direct(lambda txn: ix.set_store(txn, backend.store_uuid.bytes,
                                                    os.path.abspath(root).encode()))
        log.info("backing store %s %s", backend.url,
                 "joined (it holds other volumes)" if joined else "created")
        backend.close()
        known = backend.store_uuid.bytes
    mountpoint = os.path.realpath(opts.mountpoint)
    if is_url(root):
        backend = open_backend(root, uuidlib.UUID(bytes=known), **store_kw)
    elif os.path.realpath(root).startswith(mountpoint + os.sep):
        # Below the mount (the default, SOURCE/.ckptfs/store): once mounted, its
        # path would lead through this very daemon. A directory fd opened now
        # reaches the real directory (FdRootBackend).
        try:
            backend = FdRootBackend.open_dir(root, uuidlib.UUID(bytes=known))
        except OSError as e:
            log.error("backing store %s is missing (%s): tiering is off and cold data "
                      "reads give EIO until it is back and ckptfs is mounted again",
                      root, e.strerror)
            return None
    else:
        backend = LocalBackend(root, uuidlib.UUID(bytes=known))
    try:
        backend.check()
    except BackingCredentials:
        backend.close()
        raise               # configuration, not an outage: the mount fails with one line
    except CkptfsError as e:
        log.warning("%s; hot data works, cold reads give EIO until it is back", e)
        if attempt is not None:
            attempt.notes.append(f"warning: {e}: mounted anyway; hot data works, tiering "
                                 "retries and cold reads give EIO until the store is back")
    return backend


def _close_log_file() -> None:
    root = logging.getLogger("ckptfs")
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()


def setup_logging(opts: MountOptions, foreground: bool) -> None:
    level = logging.DEBUG if opts.debug else logging.INFO
    if foreground:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        # Opened before the mount, so it stays writable when SOURCE is hidden.
        handler = logging.FileHandler(os.path.join(opts.state_dir, "daemon.log"))
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    root = logging.getLogger("ckptfs")
    root.handlers[:] = [handler]
    root.setLevel(level)
    if not opts.debug:
        # pyfuse3 logs each failed request at debug only; keep it quiet.
        logging.getLogger("pyfuse3").setLevel(logging.WARNING)


def fuse_options(opts: MountOptions) -> set[str]:
    options = set(pyfuse3.default_options) | {f"fsname={fsname_encode(opts.source)}",
                                              "subtype=ckptfs"}
    options.add("default_permissions")      # the kernel checks modes: needed with allow_other
    if opts.allow_other:
        options.add("allow_other")
    if opts.read_only:
        options.add("ro")
    options.update(opts.kernel_flags)
    return options


def build_filesystem(state: State) -> Filesystem:
    """The Filesystem the daemon serves, with its tiering when a backing store is
    attached; the handler-level tests build theirs here too (tests/inproc.py)."""
    opts = state.opts
    tiering = None
    if state.backend is not None:
        tiering = TierSetup(state.backend, TierPolicy(hot_versions=opts.hot_versions),
                            volume=None if state.attached is None else state.attached.volume,
                            publish_delay_s=publish_delay(opts, state.index),
                            read_only=opts.read_only,
                            shared=shared_chunks(state)
                            if state.attached is not None and not opts.read_only and opts.dedup
                            else None)
    return Filesystem(state.index, state.log, state.sources,
                      CommitPolicy(sync=opts.sync, lazy_max_delay_s=opts.lazy_delay_s),
                      dedup=opts.dedup, tiering=tiering)


def shared_chunks(state: State) -> "SharedChunks":
    """Dedup across the volumes of the store (chunkindex.py). Which pack spaces
    are this volume's comes from its leases; a store that cannot be read now
    leaves the current one only (a former holder's packs are then let go as
    another volume's: kept in the store, never lost). May block."""
    from .chunkindex import SharedChunks
    from .volumes import pack_space
    volume = state.attached.volume
    spaces = {pack_space(state.index.counters[b"next_pack"])}
    try:
        spaces |= volume.state().spaces
    except (CkptfsError, OSError) as e:
        log.warning("the pack spaces of volume %s were not read (%s): only the current one "
                    "counts as its own", volume.name, e)
    return SharedChunks(state.backend, volume.name, spaces)


def build_merged(state: State, fs: Filesystem) -> Optional["MergedFilesystem"]:
    """With -o peers=: the filesystem the adapter serves, the mount's own
    namespace over the peers' published files (merged.py); else None."""
    opts = state.opts
    if opts.peers is None:
        return None
    if state.backend is None:
        raise UsageError("peers= needs a backing store shared with the peers (and tiering=on)")
    from .merged import MergedFilesystem
    from .peerview import PeerView
    own = state.attached.volume.name if state.attached is not None else None
    view = PeerView(state.backend, own, opts.peers or None, opts.peer_refresh_s)
    return MergedFilesystem(fs, view)


# Python's cyclic collector runs a young collection per 700 new container
# objects by default. A big file's commit makes ~7 per new chunk (16 chunks per
# MiB: records, keys, their tuples) that live until its batch is durable: a
# 2 GiB fsync ran ~350 young, 32 middle and 2 full collections that found
# nothing, 69-88 ms of the writer's wait. Requests and commits make little
# cyclic garbage; one collection per 50,000 objects holds at most a few MB more.
GC_YOUNG_OBJECTS = 50_000


def quiet_collector() -> None:
    """Set the cyclic collector's young threshold for the daemon's bursts."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_OBJECTS, middle, old)


def serve(opts: MountOptions, ready_fd: Optional[int] = None) -> int:
    """Run the daemon in this process until unmounted. Returns an exit code.

    A mount that fails before it is live removes what its attempt created.
    """
    opts.source = os.path.realpath(opts.source)
    opts.mountpoint = os.path.realpath(opts.mountpoint)
    attempt = Attempt()
    try:
        return _serve(opts, ready_fd, attempt)
    finally:
        if not attempt.live:
            _close_log_file()
        attempt.finish()


def _serve(opts: MountOptions, ready_fd: Optional[int], attempt: Attempt) -> int:
    try:
        attempt.make_dir(opts.state_dir)
    except OSError as e:
        _report(ready_fd, f"ckptfs: cannot create the state directory {opts.state_dir}: "
                          f"{e.strerror}")
        return ExitCode.FAILED
    daemon_log = os.path.join(opts.state_dir, "daemon.log")
    if ready_fd is not None and not os.path.exists(daemon_log):
        attempt.made(daemon_log)
    setup_logging(opts, foreground=ready_fd is None)
    try:
        state = open_state(opts, attempt)
    except (CkptfsError, OSError) as e:
        log.error("%s", e)
        _report(ready_fd, f"ckptfs: {e}")
        return ExitCode.FAILED
    fs = build_filesystem(state)
    try:
        merged = build_merged(state, fs)
    except CkptfsError as e:
        log.error("%s", e)
        _report(ready_fd, f"ckptfs: {e}")
        state.close()
        return ExitCode.USAGE
    metrics = metrics_server = None
    if opts.metrics_port is not None or opts.metrics_file:
        from .metrics import MountMetrics
        metrics = MountMetrics(opts.mountpoint)
        state.index.on_commit = metrics.commit_latency.observe
    mounted = False
    try:
        # Resolve every path now: once mounted, a stat of the mountpoint from
        # this process would wait for this very loop.
        sock_path = control.socket_path(opts.mountpoint)
        control.private_socket_dir(create=True)      # an unsafe one fails the mount
        if opts.metrics_port is not None:
            from .metrics import MetricsServer
            # Bound before the mount: a taken port fails the mount with one line.
            metrics_server = MetricsServer.start(metrics.registry, opts.metrics_port)
        purged = fs.recover()
        if purged:
            log.info("purged %d orphaned inodes", purged)
        publishing = None if fs.tierer is None else fs.tierer.publishing
        if state.attached is not None and state.attached.fenced is not None \
                and publishing is not None:
            publishing.fence(state.attached.fenced)     # read-only from here on
        fastpath.want(True)
        try:
            if merged is None:
                ops = CkptfsOperations(fs)
            else:       # failed lookups in merged directories: cached while the view is
                ops = CkptfsOperations(merged, negative_timeout_s=opts.peer_refresh_s)
            pyfuse3.init(ops, opts.mountpoint, fuse_options(opts))
        except RuntimeError as e:
            raise OperationFailed(f"cannot mount on {opts.mountpoint}: {e}") from None
        mounted = True
        if fastpath.missing:
            log.warning("%s; every request goes through pyfuse3", fastpath.missing)
        log.debug("FUSE channel fast path: %s", "on" if fastpath.hooked() else "off")
        if fastpath.hooked():
            fs.files.reader.publish_to(fastpath)     # READs of read windows answered in C
            if merged is None and fastpath.writes_wanted():
                # A stream's next WRITEs answered in C, folded in before any Python runs.
                fastpath.write_folder(lambda extents: fs.files.fold_written(extents, fs.now_ns))
                fs.files.stager.publish_windows(fastpath)
            if merged is None:
                # A RELEASE after a FLUSH that committed everything answered in C,
                # its handle's bookkeeping folded in before any Python runs.
                fastpath.release_folder(fs.fold_released)
                fs.watch_flushed(fastpath.release_quiet)
        quiet_collector()
        trio.run(_run, fs, opts, ready_fd, sock_path, attempt, metrics, merged, ops)
    except (CkptfsError, OSError) as e:
        log.error("%s", e)
        _report(ready_fd, f"ckptfs: {e}")
        return ExitCode.FAILED
    finally:
        if metrics_server is not None:
            metrics_server.stop()
        if mounted:
            pyfuse3.close(unmount=True)
        state.close()
        log.info("unmounted %s", opts.mountpoint)
    return ExitCode.OK


async def _run(fs: Filesystem, opts: MountOptions, ready_fd: Optional[int],
               sock_path: str, attempt: Attempt, metrics=None, merged=None,
               ops: Optional[CkptfsOperations] = None) -> None:
    async with trio.open_nursery() as outer:
        outer.start_soon(fs.run_committer)
        async with trio.open_nursery() as inner:
            await inner.start(control.serve, sock_path, _control_handlers(merged or fs))
            inner.start_soon(_watch_signals)
            await inner.start(fs.files.reader.serve_warms)
            if not fastpath.hooked():
                inner.start_soon(trio.to_thread.run_sync, _raise_read_ahead, opts.mountpoint)
            elif ops is not None:
                # READs the fast path's read pool could not answer (a failed check).
                inner.start_soon(fastpath.serve_handbacks, ops.read_errno)
                # Releases answered in C whose file changed after all (not expected).
                inner.start_soon(fs.serve_owed_releases)
                # Read tables loaded ahead of sequential readers.
                inner.start_soon(fastpath.serve_read_ahead, fs.files.reader.load_ahead)
                # Cold look-aheads topped up for readers answered in C.
                inner.start_soon(fastpath.serve_cold_refills, fs.files.reader.cold_refill,
                                 fs.files.reader.warm_soon)
            if fs.tierer is not None:
                await inner.start(fs.tierer.run)
            if merged is not None:
                await inner.start(merged.run_refresh)
            if metrics is not None:
                from . import metrics as prom
                await inner.start(prom.refresh_periodically, metrics.snapshot, fs.stats)
                if opts.metrics_file:
                    inner.start_soon(prom.write_textfile_periodically, opts.metrics_file,
                                     metrics.registry)
            inner.start_soon(_report_ready, ready_fd, opts, attempt)
            try:
                await pyfuse3.main(min_tasks=4, max_tasks=64)
            finally:
                with trio.CancelScope(shield=True):
                    await shut_down(fs, opts.unmount_publish_timeout_s)
                inner.cancel_scope.cancel()


async def shut_down(fs: Filesystem, publish_timeout_s: float = 60.0) -> None:
    """A clean unmount's work, with the committer still running: stop the mover
    (and publishing), commit every closed file, then (publishing on) copy to
    the store what it lacks and publish a covering snapshot, within
    publish_timeout_s (unmount_publish_timeout), or (off) publish a snapshot;
    then end the committer."""
    try:
        if fs.tierer is not None:
            fs.tierer.unmounting(publish_timeout_s)
            await fs.tierer.stop()
        await fs.shutdown()
        if fs.tierer is not None:
            await fs.tierer.publish_at_unmount(publish_timeout_s)
    finally:
        if fs.tierer is not None:
            fs.tierer.mover.let_go()    # a pack write abandoned reads the log no more
        fs.index.stop()     # else the committer would wait forever


async def _report_ready(ready_fd: Optional[int], opts: MountOptions,
                        attempt: Attempt) -> None:
    await trio.sleep(0)      # pyfuse3.main is now reading requests
    if fastpath.hooked():
        # The kernel sets the read-ahead back while it handles the INIT reply:
        # raise it after that, and only then say the mount is live, so that
        # the first reader already gets it.
        with trio.move_on_after(5):
            while not fastpath.init_replied():
                await trio.sleep(0.001)
        await trio.to_thread.run_sync(_set_read_ahead, opts.mountpoint)
    log.info("mounted %s on %s (pid %d, sync=%s)", opts.source, opts.mountpoint,
             os.getpid(), opts.sync)
    attempt.live = True
    if ready_fd is not None:
        for note in attempt.notes:        # the mount command prints them (-f: the log did)
            _send(ready_fd, f"note: {note}")
    _report(ready_fd, "OK")


def publish_delay(opts: MountOptions, index: Index) -> Optional[float]:
    """Seconds within which commits are copied to the store, None for off.
    Default: on (DEFAULT_DELAY_S) for a store backing= names, which may survive
    the node; off for the default store inside SOURCE, which does not."""
    from .publish import DEFAULT_DELAY_S
    if opts.publish_delay_s is not None:
        return None if math.isinf(opts.publish_delay_s) else opts.publish_delay_s
    default_store = os.path.join(opts.state_dir, "store")
    root = backing_root(opts, index)
    return None if not is_url(root) and os.path.abspath(root) == default_store \
        else DEFAULT_DELAY_S


def _control_handlers(fs: Filesystem) -> dict:
    async def stat(_: dict) -> dict:
        return {**fs.stats(), **fastpath.stats()}

    async def sync(args: dict) -> dict:
        await fs.sync_all()
        if args.get("published"):
            publishing = None if fs.tierer is None else fs.tierer.publishing
            if publishing is None:
                raise OperationFailed("this mount publishes nothing (no backing store, "
                                      "tiering=off, or mounted read-only)")
            await publishing.wait_published(fs.index.durable_seq)
        return {"durable_seq": fs.index.durable_seq}

    async def ping(_: dict) -> dict:
        return {"pid": os.getpid()}

    async def tier(args: dict) -> dict:
        if fs.tierer is None:
            raise OperationFailed("tiering is off on this mount (-o tiering=off)")
        return fs.tierer.start_now(everything=bool(args.get("all")))

    async def tier_status(_: dict) -> dict:
        if fs.tierer is None or fs.tierer.progress is None:
            raise OperationFailed("no tiering pass was started")
        return dataclasses.asdict(fs.tierer.progress)

    async def gc(_: dict) -> dict:
        if fs.tierer is None:
            return {"dead_packs": 0, "stale_manifests": 0, "old_heads": 0, "objects": 0,
                    "temporary_files": 0, "snapshot": None}
        return await fs.tierer.gc()

    async def data_ranges(args: dict) -> dict:
        ino, start = int(args["ino"]), int(args.get("start", 0))
        max_ranges = min(max(int(args.get("max_ranges", 4096)), 1), 65536)
        if ino < 1 or start < 0:
            raise ValueError("data_ranges: ino >= 1 and start >= 0")
        return fs.data_ranges(ino, start, max_ranges)

    return {"stat": stat, "sync": sync, "ping": ping, "tier": tier, "tier_status": tier_status,
            "gc": gc, "data_ranges": data_ranges}


async def _watch_signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("got %s: committing and unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


def _set_read_ahead(mountpoint: str) -> None:
    """Best effort: bigger read requests (1 MiB) make sequential restores faster.

    Once the INIT reply is out (the kernel lowers the read-ahead while it
    handles it), once is enough."""
    dev = mount_device(mountpoint)
    if dev is None:
        return
    try:
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError as e:
        log.debug("could not raise read-ahead for %s: %s", mountpoint, e)


def _raise_read_ahead(mountpoint: str) -> None:
    """`_set_read_ahead` without the fast path, which alone says when INIT is
    answered: the kernel may set the value back when FUSE INIT completes,
    after this first ran, so look again for a few seconds and set it again."""
    dev = mount_device(mountpoint)
    if dev is None:
        return
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    for _ in range(5):
        try:
            with open(path) as f:
                current = int(f.read().strip() or 0)
            if current != READ_AHEAD_KB:
                with open(path, "w") as f:
                    f.write(str(READ_AHEAD_KB))
        except (OSError, ValueError) as e:
            log.debug("could not raise read-ahead for %s: %s", mountpoint, e)
            return
        time.sleep(1.0)


def _report(ready_fd: Optional[int], message: str) -> None:
    """The last word to the mount command: "OK", or why the mount failed."""
    message = one_line(message)
    if ready_fd is None:
        if message != "OK":
            print(message, file=sys.stderr)
        return
    _send(ready_fd, message)
    try:
        os.close(ready_fd)
    except OSError:
        pass


def _send(ready_fd: int, line: str) -> None:
    try:
        os.write(ready_fd, one_line(line).encode(errors="replace") + b"\n")
    except OSError:
        pass


# ----------------------------------------------------------------- spawning

def mount(opts: MountOptions) -> int:
    """Start a daemon for opts and wait until its mount is live. Returns an exit code."""
    if opts.foreground:
        return serve(opts)
    read_fd, write_fd = os.pipe()
    cmd = daemon_command() + ["--ready-fd", str(write_fd), opts.source, opts.mountpoint,
                              "-o", opts.to_option_string()]
    with open(os.devnull, "rb") as devnull_in, open(os.devnull, "wb") as devnull_out:
        # cwd /: the daemon keeps no directory of the caller's busy.
        proc = subprocess.Popen(cmd, stdin=devnull_in, stdout=devnull_out, stderr=subprocess.PIPE,
                                pass_fds=(write_fd,), start_new_session=True, cwd="/")
    os.close(write_fd)
    line = ""
    with os.fdopen(read_fd, "rb") as ready:
        for raw in ready:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("note: "):
                break
            print(f"ckptfs: {line[len('note: '):]}", file=sys.stderr)
            line = ""
    if line == "OK":
        proc.stderr.close()
        return ExitCode.OK
    _, err = proc.communicate()      # the daemon has removed what it made once it exited
    code = proc.returncode
    stderr = err.decode(errors="replace").strip().splitlines()
    message = line or (stderr[-1] if stderr else
                       f"ckptfs: daemon exited with code {code} before the mount was live")
    print(message if message.startswith("ckptfs:") else f"ckptfs: {message}", file=sys.stderr)
    return ExitCode.FAILED


# `python -m ckptfs.daemon` would put the current directory first on sys.path,
# and a `ckptfs/` folder there (the clone, where a user stands after `git
# clone`) would shadow the package. Instead the daemon drops the current
# directory and imports ckptfs from the directory the caller's package lies in.
_DAEMON_BOOT = ("import sys; "
                "sys.path[:] = [sys.argv.pop(1)] + [p for p in sys.path if p != '']; "
                "from ckptfs.daemon import daemon_main; sys.exit(daemon_main())")


def daemon_command() -> list[str]:
    """argv that starts a daemon running exactly this process's ckptfs package."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-c", _DAEMON_BOOT, package_parent]


def daemon_main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the daemon process (see `daemon_command`)."""
    try:
        return _daemon_main(argv)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def _daemon_main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="ckptfs.daemon")
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("-o", dest="options", action="append", default=[])
    args = p.parse_args(argv)
    os.set_inheritable(args.ready_fd, False)
    try:
        opts = parse_options(args.source, args.mountpoint, args.options)
    except CkptfsError as e:
        _report(args.ready_fd, f"ckptfs: {e}")
        return ExitCode.FAILED
    return serve(opts, args.ready_fd)


if __name__ == "__main__":
    sys.exit(daemon_main())
