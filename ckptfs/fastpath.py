"""Typed wrapper over ``ckptfs._fusepath``: the FUSE channel fast path.

The daemon imports this module before pyfuse3, so that the C module (loaded
here with RTLD_GLOBAL) stands in for libfuse's ``fuse_session_mount`` and can
put itself between the kernel's FUSE fd and libfuse (native/ckptfs_fuse.h).
Once installed it answers the kernel's GETXATTR("security.capability") for
inodes `caps_absent` marked without entering the interpreter, counts every
request by opcode, and says when the INIT reply has gone out. It also
answers READs of files whose read table the reader published (`read_table`:
chunkread.py's window of a file with no uncommitted changes) without
entering the interpreter: from the page cache on the trio thread, else on
the C module's read pool threads, which hand a READ whose check fails back
to the daemon (`serve_handbacks`); and READs of cold chunks the cold store
has fetched and verified, from the cold table the reader publishes of them
(`cold_publish`: native/ckptfs_coldtable.h). A table's mark (`read_marks`)
tells the daemon when a sequential reader nears its end
(`serve_read_ahead`), so the next one is published before the reader
gets there. And it answers WRITEs of files whose write window the daemon opened (`write_window`: a file written front
to back, log space reserved for its next bytes): the payload goes into the
log from the request buffer, the extent is kept pending, and before the C
module returns to the interpreter it calls the daemon's folder
(`write_folder`), which takes them (`write_take`) into the files' changes;
the same for WRITEs at other offsets of a file rewritten out of order
(`rewrite_window`: log space reserved for its next rewrites).
A request it passes on closes the window of the inode it touches first.
It also answers the one GETATTR of a directory the kernel sends after a
create in it, with the attributes the adapter left for it (`attr_leave`),
which the adapter drops (`attr_drop`) as the index changes the inode.
And the RELEASE of a handle whose FLUSH left its file nothing to commit
(`release_quiet`, unless another request about the inode came since): the
handles are given to the daemon's release folder (`release_folder`) before
the C module returns, as the WRITEs are.

In a process that loaded pyfuse3 first (tests that import the adapter) the
fast path cannot install itself: `hooked()` stays False and every request
goes through pyfuse3 as before. The marks are then kept and never consulted.
The same holds when the module is not built (`missing` says why; the daemon
logs it): the fast path only saves time, nothing depends on it.
Every function here runs on the trio thread, except `stats`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Awaitable, Callable, Optional

import trio

if TYPE_CHECKING:
    from ckptfs.native import ExtentTable

missing: Optional[str] = None      # why the C module is not there, if it is not
_flags = sys.getdlopenflags()
sys.setdlopenflags(_flags | os.RTLD_GLOBAL)
try:
    from ckptfs._fusepath import ffi, lib
except ImportError as exc:  # depends on the build
    ffi = lib = None
    missing = (f"ckptfs._fusepath is not built ({exc}): run `python ckptfs/_native_build.py` "
               "or `pip install -e .`")
finally:
    sys.setdlopenflags(_flags)

CAPS_XATTR = b"security.capability"
DISABLE_ENV = "CKPTFS_NO_FASTPATH"     # "1": leave every request to pyfuse3 (A/B runs)
WRITES_DISABLE_ENV = "CKPTFS_NO_FAST_WRITES"   # "1": WRITEs to pyfuse3, the rest as above
SPLICE_DISABLE_ENV = "CKPTFS_NO_FUSE_SPLICE"   # "1": requests read(), never spliced (A/B runs)
# "1": READs answered in C copy the log's bytes into a reply buffer first,
# rather than checking and sending them from a mapping of the log (A/B runs).
MAPPED_DISABLE_ENV = "CKPTFS_NO_MAPPED_READS"
# Background requests (readahead READs, writeback WRITEs) the kernel keeps in
# flight: its default, 12, leaves the read pool's threads idle behind a
# reader whose READs miss the page cache. The INIT reply asks for this many.
MAX_BACKGROUND = 48
MAX_BACKGROUND_ENV = "CKPTFS_MAX_BACKGROUND"   # a number (A/B runs); 0: the kernel's default
# "1": the INIT reply does not ask for FUSE_HANDLE_KILLPRIV_V2, so the kernel
# asks GETXATTR("security.capability") before every write() again (A/B runs).
KILLPRIV_DISABLE_ENV = "CKPTFS_NO_KILLPRIV_V2"

# linux/fuse.h opcodes, for the counters' names.
OPCODES = {
    1: "LOOKUP", 2: "FORGET", 3: "GETATTR", 4: "SETATTR", 5: "READLINK", 6: "SYMLINK",
    8: "MKNOD", 9: "MKDIR", 10: "UNLINK", 11: "RMDIR", 12: "RENAME", 13: "LINK", 14: "OPEN",
    15: "READ", 16: "WRITE", 17: "STATFS", 18: "RELEASE", 20: "FSYNC", 21: "SETXATTR",
    22: "GETXATTR", 23: "LISTXATTR", 24: "REMOVEXATTR", 25: "FLUSH", 26: "INIT",
    27: "OPENDIR", 28: "READDIR", 29: "RELEASEDIR", 30: "FSYNCDIR", 31: "GETLK", 32: "SETLK",
    33: "SETLKW", 34: "ACCESS", 35: "CREATE", 36: "INTERRUPT", 37: "BMAP", 38: "DESTROY",
    39: "IOCTL", 40: "POLL", 41: "NOTIFY_REPLY", 42: "BATCH_FORGET", 43: "FALLOCATE",
    44: "READDIRPLUS", 45: "RENAME2", 46: "LSEEK", 47: "COPY_FILE_RANGE",
    48: "SETUPMAPPING", 49: "REMOVEMAPPING", 50: "SYNCFS", 51: "TMPFILE", 52: "STATX",
}
_N_OPCODES = 64
_N_COUNTERS = _N_OPCODES + 18


def want(on: bool = True) -> None:
    """Before pyfuse3.init: install the fast path when the session mounts
    (unless CKPTFS_NO_FASTPATH=1 is in the environment); requests spliced
    while a write window is open unless CKPTFS_NO_FUSE_SPLICE=1."""
    if lib is not None:
        lib.ckptfs_fuse_want(1 if on and os.environ.get(DISABLE_ENV) != "1" else 0)
        if hasattr(lib, "ckptfs_fuse_max_background"):
            lib.ckptfs_fuse_max_background(max_background())
        if hasattr(lib, "ckptfs_fuse_splice_writes"):
            lib.ckptfs_fuse_splice_writes(0 if os.environ.get(SPLICE_DISABLE_ENV) == "1" else 1)
        # The per-write() GETXATTR waited behind the WRITEs queued before it,
        # so the writer and the daemon took turns (seq17); with this flag the
        # daemon clears suid/sgid itself where the kernel says (kill_asked).
        lib.ckptfs_fuse_killpriv_v2(0 if os.environ.get(KILLPRIV_DISABLE_ENV) == "1" else 1)


def max_background() -> int:
    """What the INIT reply asks for (MAX_BACKGROUND, or CKPTFS_MAX_BACKGROUND)."""
    try:
        return max(0, min(int(os.environ.get(MAX_BACKGROUND_ENV, MAX_BACKGROUND)), 0xffff))
    except ValueError:
        return MAX_BACKGROUND


def hooked() -> bool:
    """Is the fast path between the kernel and libfuse on this mount?"""
    return lib is not None and bool(lib.ckptfs_fuse_hooked())


def killpriv_v2() -> bool:
    """Did this mount's INIT reply take FUSE_HANDLE_KILLPRIV_V2 (see `want`)?"""
    return lib is not None and bool(lib.ckptfs_fuse_killpriv_v2_on())


def kill_asked(ino: int) -> bool:
    """Did a request for ino passed on to the daemon (a WRITE, a SETATTR, an
    OPEN) carry the kernel's "clear suid/sgid" (FUSE_HANDLE_KILLPRIV_V2)?
    Each flag answers True once; call on the trio thread, in that request's
    handler, before it changes the file."""
    return lib is not None and bool(lib.ckptfs_fuse_kill_asked(ino))


def caps_absent(ino: int) -> None:
    """ino has no security.capability: the kernel's question about it is answered in C."""
    if lib is not None:
        lib.ckptfs_fuse_caps_absent(ino)


def caps_unknown(ino: int) -> None:
    """ino may get security.capability: ask the daemon again. Call before setting it."""
    if lib is not None:
        lib.ckptfs_fuse_caps_unknown(ino)


def attr_leave(ino: int, size: int, blocks: int, atime_ns: int, mtime_ns: int, ctime_ns: int,
               mode: int, nlink: int, uid: int, gid: int, rdev: int, blksize: int,
               attr_timeout: float) -> None:
    """The kernel's next GETATTR of ino is answered in C with these attributes
    (what the adapter's getattr would reply), once. `attr_drop(ino)` must
    follow every change of them before another request can see it."""
    if lib is not None:
        lib.ckptfs_fuse_attr_leave(ino, size, blocks, atime_ns, mtime_ns, ctime_ns, mode,
                                   nlink, uid, gid, rdev, blksize, attr_timeout)


def attr_drop(ino: int) -> None:
    """ino's attributes changed (or may have): its GETATTR goes to the daemon."""
    if lib is not None:
        lib.ckptfs_fuse_attr_drop(ino)


_executor_given = False


def _log_faults() -> int:
    """SIGBUS faults on the log's mappings this daemon survived (ckptfs_logfault.c)."""
    from ckptfs import native
    return native.log_faults()


def _give_executor() -> None:
    """The read executor's functions to the C module (which starts its read pool)."""
    global _executor_given
    if not _executor_given:
        from ckptfs import native
        if hasattr(lib, "ckptfs_fuse_log_faults"):
            lib.ckptfs_fuse_log_faults(native.log_fault_api_address())
        if hasattr(lib, "ckptfs_fuse_read_mapper"):
            lib.ckptfs_fuse_read_mapper(native.crc32c_address(),
                                        1 if os.environ.get(MAPPED_DISABLE_ENV) == "1" else 0)
        lib.ckptfs_fuse_read_executor(*native.read_executor_addresses())
        _executor_given = True


def read_table(ino: int, log_fd: int, table: "ExtentTable", start: int, end: int
               ) -> bool:
    """READs of ino within file bytes [start, end) (end <= its size) are
    answered in C from table (its extents all LOG chunks, the map as the
    index has it) until `read_forget(ino)`, which must come before the map,
    its chunks or the size change, and before table is dropped. False (and
    nothing registered) when the fast path is not on."""
    if not hooked() or not hasattr(lib, "ckptfs_fuse_read_table"):
        return False        # off, or a _fusepath built before READs were answered in C
    _give_executor()
    ext, count, crcs, n_crcs = table.addresses()
    return lib.ckptfs_fuse_read_table(ino, log_fd, ext, count, crcs, n_crcs, start, end) == 0


def read_marks(ino: int, next_at: Optional[int], end_is_eof: bool) -> None:
    """On ino's current table: once its sequential reader passes file offset
    next_at (None: never), `serve_read_ahead` is told (once), so the next
    table can be published before the reader gets there; end_is_eof: the
    table ends at the file's size, READs reaching past it are answered short
    there (the kernel asks for whole pages)."""
    if hasattr(lib, "ckptfs_fuse_read_marks"):
        lib.ckptfs_fuse_read_marks(ino, (1 << 64) - 1 if next_at is None else next_at,
                                   1 if end_is_eof else 0)


async def serve_read_ahead(load: Callable[[int, int], Awaitable[None]]) -> None:
    """Load and publish the next table of each reader that passed its table's
    `read_marks` mark: load(ino, offset the reader's run reached), each in
    a task of its own. Runs until cancelled; returns at once without the
    fast path."""
    if not hooked() or not hasattr(lib, "ckptfs_fuse_read_ahead_fd"):
        return
    wake_fd = lib.ckptfs_fuse_read_ahead_fd()
    if wake_fd < 0:
        return
    inos, read_to = ffi.new("uint64_t[]", 64), ffi.new("uint64_t[]", 64)
    async with trio.open_nursery() as nursery:
        while True:
            await trio.lowlevel.wait_readable(wake_fd)
            for k in range(lib.ckptfs_fuse_read_wanted(inos, read_to, 64)):
                nursery.start_soon(load, int(inos[k]), int(read_to[k]))


def read_forget(ino: int) -> None:
    """READs of ino go to the daemon again. Returns once no READ of ino is
    being read on the fast path's C threads (its retired tables' included):
    the file's map, chunks or size may then change."""
    if lib is not None and hasattr(lib, "ckptfs_fuse_read_forget"):
        lib.ckptfs_fuse_read_forget(ino)


def cold_publish(ino: int, offs: list[int], lens: list[int], addresses: list[int],
                 refill_at: int) -> int:
    """READs of ino may be answered in C from file bytes [offs[k], offs[k] +
    lens[k]), the verified cold chunk bytes at addresses[k], until
    `cold_forget(ino)` or `cold_trim` past them; pieces in file order. The
    caller keeps that memory alive and unchanged until then, and calls
    `cold_forget` before the file's map, its chunks or its size change.
    READs reaching past refill_at go to the daemon. Returns how many pieces
    were added (fewer when one is out of order or no table slot is free).
    Call it only when the fast path is on (`hooked`): a cffi call here
    releases and takes the GIL again, which costs while workers run."""
    if not hasattr(lib, "ckptfs_cold_publish"):
        return 0
    return lib.ckptfs_cold_publish(ino, ffi.new("uint64_t[]", offs), ffi.new("uint64_t[]", lens),
                                   ffi.new("uintptr_t[]", addresses), len(offs), refill_at)


def cold_mark(ino: int, wake_at: int) -> bool:
    """On ino's cold table: once a READ answered from it ends past file
    offset wake_at, `serve_cold_refills` is told (once), so the look-ahead
    is topped up and published further without a READ coming here for it.
    False: no table, or nothing serves the marks (the table's refill
    point is what brings READs here then)."""
    return lib is not None and hasattr(lib, "ckptfs_cold_mark") \
        and lib.ckptfs_cold_mark(ino, wake_at) == 1


async def serve_cold_refills(refill: Callable[[int, int], None],
                             warm: Optional[Callable[[int, int], None]] = None) -> None:
    """refill(ino, end of the furthest READ answered) for each cold reader
    that passed its table's `cold_mark`, on the trio thread; then warm(ino,
    the same), if given (it starts what the next refills will need, made
    ready off the trio thread). Runs until cancelled; returns at once
    without the fast path."""
    if not hooked() or not hasattr(lib, "ckptfs_cold_wake_fd"):
        return
    wake_fd = lib.ckptfs_cold_wake_fd()
    if wake_fd < 0:
        return
    inos, read_to = ffi.new("uint64_t[]", 64), ffi.new("uint64_t[]", 64)
    while True:
        await trio.lowlevel.wait_readable(wake_fd)
        for k in range(lib.ckptfs_cold_wanted(inos, read_to, 64)):
            ino, to = int(inos[k]), int(read_to[k])
            refill(ino, to)
            if warm is not None:
                warm(ino, to)


def cold_trim(ino: int, below: int) -> None:
    """Pieces of ino's cold table ending at or before below are dropped
    (their pins may go after this)."""
    if lib is not None and hasattr(lib, "ckptfs_cold_trim"):
        lib.ckptfs_cold_trim(ino, below)


def cold_trim_later(ino: int, below: int) -> int:
    """`cold_trim` without waiting for the replies in flight: the pins of
    the pieces dropped may go once `cold_drained(ino, e)` says so for the e
    returned and every e before it; -1: nothing dropped (they may go now)."""
    if lib is None or not hasattr(lib, "ckptfs_cold_trim_later"):
        cold_trim(ino, below)
        return -1
    return lib.ckptfs_cold_trim_later(ino, below)


def cold_drained(ino: int, epoch: int) -> bool:
    """Whether the replies of ino's cold table counted in epoch are written."""
    return lib is None or not hasattr(lib, "ckptfs_cold_drained") \
        or lib.ckptfs_cold_drained(ino, epoch) == 1


def cold_forget(ino: int) -> None:
    """ino's cold table is dropped: its READs go to the daemon again."""
    if lib is not None and hasattr(lib, "ckptfs_cold_forget"):
        lib.ckptfs_cold_forget(ino)


def _cold_counters() -> list[int]:
    if lib is None or not hasattr(lib, "ckptfs_cold_counters"):
        return [0, 0, 0, 0]
    out = ffi.new("uint64_t[]", 4)
    lib.ckptfs_cold_counters(out, 4)
    return [int(x) for x in out]


def read_retire(ino: int) -> None:
    """A reader of ino moved on past its table (nothing about the file
    changed): READs of ino go to the daemon until its next table. Does not
    wait for the READs of it in flight; `read_forget` does."""
    if lib is not None and hasattr(lib, "ckptfs_fuse_read_retire"):
        lib.ckptfs_fuse_read_retire(ino)
    else:
        read_forget(ino)


async def serve_handbacks(read: Callable[[int, int, int], Awaitable[tuple[int, bytes]]]
                          ) -> None:
    """Answer the READs the read pool handed back (a failed check or read on
    a C thread: native/ckptfs_readpool.h) through the daemon's read path,
    read(fh, off, size) -> (errno or 0, bytes), as if the fast path had never
    seen them. Runs until cancelled; returns at once without a pool."""
    if not hooked() or not hasattr(lib, "ckptfs_fuse_handback_fd"):
        return
    _give_executor()
    wake_fd = lib.ckptfs_fuse_handback_fd()
    if wake_fd < 0:
        return
    out = ffi.new("ckptfs_fuse_handback[]", 64)
    async with trio.open_nursery() as nursery:
        while True:
            await trio.lowlevel.wait_readable(wake_fd)
            for k in range(lib.ckptfs_fuse_handbacks(out, 64)):
                hb = out[k]
                nursery.start_soon(_answer_handback, read, int(hb.unique), int(hb.fh),
                                   int(hb.offset), int(hb.size))


async def _answer_handback(read: Callable[[int, int, int], Awaitable[tuple[int, bytes]]],
                           unique: int, fh: int, off: int, size: int) -> None:
    err, data = await read(fh, off, size)
    with ffi.from_buffer(data) as buf:
        lib.ckptfs_fuse_reply(unique, err, buf, 0 if err else len(data))


def writes_wanted() -> bool:
    """May WRITEs be answered in C (the fast path on, not turned off by
    CKPTFS_NO_FAST_WRITES=1)?"""
    return hooked() and hasattr(lib, "ckptfs_fuse_write_window") \
        and os.environ.get(WRITES_DISABLE_ENV) != "1"


def write_window(ino: int, log_fd: int, file_off: int, log_off: int, log_end: int) -> bool:
    """WRITEs of ino at file_off (then where each one ended) may be answered
    in C, their bytes written at log_off on (up to log_end) of log_fd, until
    the window closes: `write_close`, or a request about ino (or a rename,
    unlink, ... that could touch it) that the C module passes on. False (no
    window) when the fast path is off or every slot is taken."""
    if not hooked() or not hasattr(lib, "ckptfs_fuse_write_window"):
        return False
    return lib.ckptfs_fuse_write_window(ino, log_fd, file_off, log_off, log_end) == 0


def rewrite_window(ino: int, log_fd: int, stream_at: int, has_stream: bool, log_off: int,
                   log_end: int) -> bool:
    """WRITEs of ino at any offset may be answered in C, their bytes written
    one after another at log_off on (up to log_end) of log_fd, except those
    the daemon would cut as a stream (has_stream: one holding the byte at
    stream_at, the stream's next; else one starting at or past stream_at,
    where the file's changes end), until the window closes as
    `write_window`'s does. False as `write_window`."""
    if not hooked() or not hasattr(lib, "ckptfs_fuse_rewrite_window"):
        return False
    return lib.ckptfs_fuse_rewrite_window(ino, log_fd, stream_at, int(has_stream), log_off,
                                          log_end) == 0


def write_close(ino: int) -> None:
    """No more WRITEs of ino answered in C (those answered are taken by the folder)."""
    if lib is not None and hasattr(lib, "ckptfs_fuse_write_close"):
        lib.ckptfs_fuse_write_close(ino)


_folder = None          # the cffi callback: kept alive while the C module may call it


def write_folder(fold: Optional[Callable[[list[tuple[int, int, int, int]]], None]]) -> None:
    """fold(extents) is called with the WRITEs answered in C, (ino, file
    offset, log offset, length) in the order they were answered, before
    the C module returns to the interpreter (so nothing on the trio thread
    sees one not folded). It must not raise or block. None: no folder (and
    no window may be open then)."""
    global _folder
    if lib is None or not hasattr(lib, "ckptfs_fuse_write_folder"):
        return
    if fold is None:
        lib.ckptfs_fuse_write_folder(0)
        _folder = None
        return
    _folder = _draining_callback(
        lib.ckptfs_fuse_write_take, "ckptfs_fuse_wextent[]",
        lambda e: (int(e.ino), int(e.file_off), int(e.log_off), int(e.length)), fold)
    lib.ckptfs_fuse_write_folder(int(ffi.cast("uintptr_t", _folder)))


def release_quiet(fh: int, ino: int) -> None:
    """The RELEASE of handle fh (of ino) needs nothing but the handle's
    bookkeeping: answer it in C unless another request about ino comes
    first. Call it before the FLUSH that found so is answered."""
    if lib is not None and hasattr(lib, "ckptfs_fuse_release_quiet"):
        lib.ckptfs_fuse_release_quiet(fh, ino)


_release_folder = None      # the cffi callback: kept alive while the C module may call it


def release_folder(fold: Optional[Callable[[list[int]], None]]) -> None:
    """fold(fhs) is called with the handles whose RELEASE was answered in C,
    in the order they came, before the C module returns to the interpreter
    (after the WRITEs' folder). It must not raise or block. None: no folder
    (every RELEASE goes to the daemon then)."""
    global _release_folder
    if lib is None or not hasattr(lib, "ckptfs_fuse_release_folder"):
        return
    if fold is None:
        lib.ckptfs_fuse_release_folder(0)
        _release_folder = None
        return
    _release_folder = _draining_callback(lib.ckptfs_fuse_release_take, "uint64_t[]", int, fold)
    lib.ckptfs_fuse_release_folder(int(ffi.cast("uintptr_t", _release_folder)))


_TAKE_ROWS = 256


def _draining_callback(take_rows, row_array: str, row: Callable, fold: Callable[[list], None]):
    """The C module's folder callback: empties its queue through take_rows
    (the C `*_take`, _TAKE_ROWS at a time into one buffer of row_array),
    each row made a Python value by row, and gives them, in order, to fold
    in one call. The C module calls it before it returns to the interpreter
    (cffi takes the GIL for it)."""
    out = ffi.new(row_array, _TAKE_ROWS)

    def take() -> None:
        rows: list = []
        while True:
            k = take_rows(out, _TAKE_ROWS)
            rows.extend(row(out[i]) for i in range(k))
            if k < _TAKE_ROWS:
                break
        if rows:
            fold(rows)

    return ffi.callback("void(void)", take, onerror=_fold_failed)


def _fold_failed(exc_type, exc, tb) -> None:
    # The folder itself catches what a fold raises; this is the last resort.
    import logging
    logging.getLogger(__name__).error("folding requests answered in C failed: %r", exc)


def read_bytes() -> int:
    """File bytes the fast path has answered READs with (cold ones too). Any thread."""
    if lib is None:
        return 0
    out = ffi.new("uint64_t[]", _N_COUNTERS)
    lib.ckptfs_fuse_counters(out, _N_COUNTERS)
    return int(out[_N_OPCODES + 5]) + _cold_counters()[1]


def init_replied() -> bool:
    """Has libfuse answered the kernel's INIT (after which read-ahead may be raised)?"""
    return lib is not None and bool(lib.ckptfs_fuse_init_replied())


def stats() -> dict[str, object]:
    """For `ckptfs stat`: is the fast path on, the requests read from the kernel
    since the mount by name, WRITE payload bytes, the GETXATTRs and READs
    answered in C (of those, READs read on the pool's threads), READs passed
    on and handed back, withdrawals that waited for the pool, and the WRITEs
    answered in C, their bytes, WRITEs of a file with a window passed on, and of
    those answered, the ones whose payload was spliced into the log, READs
    answered from the log's mapping, the GETATTRs answered with the
    attributes the daemon left (`attr_leave`), and the RELEASEs answered in C
    (`release_quiet`). Counted
    only while the fast path is on. Any thread."""
    if lib is None:
        return {"fuse_fastpath": False, "fuse_requests": {}, "fuse_write_bytes": 0,
                "fuse_getxattr_answered_in_c": 0, "fuse_read_answered_in_c": 0,
                "fuse_read_bytes_in_c": 0, "fuse_read_passed_on": 0,
                "fuse_cold_read_answered_in_c": 0, "fuse_cold_read_bytes_in_c": 0,
                "fuse_cold_read_passed_on": 0, "fuse_cold_read_in_pool": 0,
                "fuse_read_waited_in_c": 0,
                "fuse_read_handed_back": 0, "fuse_read_withdrawals_waited": 0,
                "fuse_write_answered_in_c": 0, "fuse_write_bytes_in_c": 0,
                "fuse_write_passed_on": 0, "fuse_write_spliced": 0,
                "fuse_read_mapped": 0, "fuse_getattr_answered_in_c": 0,
                "fuse_release_answered_in_c": 0, "fuse_killpriv_v2": False,
                "log_faults": _log_faults()}
    cold = _cold_counters()
    out = ffi.new("uint64_t[]", _N_COUNTERS)
    lib.ckptfs_fuse_counters(out, _N_COUNTERS)
    requests = {OPCODES.get(i, f"OP{i}"): int(out[i]) for i in range(_N_OPCODES) if out[i]}
    if out[_N_OPCODES]:
        requests["OTHER"] = int(out[_N_OPCODES])
    return {"fuse_fastpath": hooked(), "fuse_requests": requests, "log_faults": _log_faults(),
            "fuse_killpriv_v2": killpriv_v2(),
            "fuse_write_bytes": int(out[_N_OPCODES + 1]),
            "fuse_getxattr_answered_in_c": int(out[_N_OPCODES + 2]),
            "fuse_read_answered_in_c": int(out[_N_OPCODES + 4]),
            "fuse_read_bytes_in_c": int(out[_N_OPCODES + 5]),
            "fuse_read_passed_on": int(out[_N_OPCODES + 6]),
            "fuse_cold_read_answered_in_c": cold[0], "fuse_cold_read_bytes_in_c": cold[1],
            "fuse_cold_read_passed_on": cold[2], "fuse_cold_read_in_pool": cold[3],
            "fuse_read_waited_in_c": int(out[_N_OPCODES + 7]),
            "fuse_read_handed_back": int(out[_N_OPCODES + 9]),
            "fuse_read_withdrawals_waited": int(out[_N_OPCODES + 10]),
            "fuse_write_answered_in_c": int(out[_N_OPCODES + 11]),
            "fuse_write_bytes_in_c": int(out[_N_OPCODES + 12]),
            "fuse_write_passed_on": int(out[_N_OPCODES + 13]),
            "fuse_write_spliced": int(out[_N_OPCODES + 14]),
            "fuse_read_mapped": int(out[_N_OPCODES + 15]),
            "fuse_getattr_answered_in_c": int(out[_N_OPCODES + 16]),
            "fuse_release_answered_in_c": int(out[_N_OPCODES + 17])}
