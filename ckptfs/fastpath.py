"""Typed wrapper over ``ckptfs._fusepath``: the FUSE channel fast path.

The daemon imports this module before pyfuse3, so that the C module (loaded
here with RTLD_GLOBAL) stands in for libfuse's ``fuse_session_mount`` and can
put itself between the kernel's FUSE fd and libfuse (native/ckptfs_fuse.h).
Once installed it answers the kernel's GETXATTR("security.capability") for
inodes `caps_absent` marked without entering the interpreter, counts every
request by opcode, and says when the INIT reply has gone out.

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
from typing import Optional

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
_N_COUNTERS = _N_OPCODES + 4


def want(on: bool = True) -> None:
    """Before pyfuse3.init: install the fast path when the session mounts
    (unless CKPTFS_NO_FASTPATH=1 is in the environment)."""
    if lib is not None:
        lib.ckptfs_fuse_want(1 if on and os.environ.get(DISABLE_ENV) != "1" else 0)


def hooked() -> bool:
    """Is the fast path between the kernel and libfuse on this mount?"""
    return lib is not None and bool(lib.ckptfs_fuse_hooked())


def caps_absent(ino: int) -> None:
    """ino has no security.capability: the kernel's question about it is answered in C."""
    if lib is not None:
        lib.ckptfs_fuse_caps_absent(ino)


def caps_unknown(ino: int) -> None:
    """ino may get security.capability: ask the daemon again. Call before setting it."""
    if lib is not None:
        lib.ckptfs_fuse_caps_unknown(ino)


def init_replied() -> bool:
    """Has libfuse answered the kernel's INIT (after which read-ahead may be raised)?"""
    return lib is not None and bool(lib.ckptfs_fuse_init_replied())


def stats() -> dict[str, object]:
    """For `ckptfs stat`: is the fast path on, the requests read from the kernel
    since the mount by name, WRITE payload bytes, and the GETXATTRs answered
    in C. Counted only while the fast path is on. Any thread."""
    if lib is None:
        return {"fuse_fastpath": False, "fuse_requests": {}, "fuse_write_bytes": 0,
                "fuse_getxattr_answered_in_c": 0}
    out = ffi.new("uint64_t[]", _N_COUNTERS)
    lib.ckptfs_fuse_counters(out, _N_COUNTERS)
    requests = {OPCODES.get(i, f"OP{i}"): int(out[i]) for i in range(_N_OPCODES) if out[i]}
    if out[_N_OPCODES]:
        requests["OTHER"] = int(out[_N_OPCODES])
    return {"fuse_fastpath": hooked(), "fuse_requests": requests,
            "fuse_write_bytes": int(out[_N_OPCODES + 1]),
            "fuse_getxattr_answered_in_c": int(out[_N_OPCODES + 2])}
