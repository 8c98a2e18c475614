"""What the kernel says is mounted: /proc/self/mountinfo, read in one place.

`mountinfo()` parses every line (octal escapes undone); `ckptfs_mounts`,
`find_mount` and `mount_device` answer the questions the CLI, the daemon,
fsck, recover and export ask; `is_mountpoint` is for tests and tools.
`fsname_encode`/`fsname_decode` are how SOURCE travels as a mount's fsname.

Nothing here stats or opens a path below a mount: a daemon must not resolve
its own mountpoint (that would be a request to itself), so every function
that resolves a path says so and takes `resolve=False`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

MOUNTINFO = "/proc/self/mountinfo"
FSTYPE = "fuse.ckptfs"


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo; paths as os.fsdecode gives them (what realpath returns)."""

    device: str               # major:minor
    mountpoint: str
    mount_options: bytes      # per-mount options, as the kernel shows them
    fstype: str
    source_shown: bytes       # the source field as the kernel shows it (for ckptfs: the fsname)
    super_options: bytes


_OCTAL = re.compile(rb"\\([0-7]{3})")


def _unescape(field: bytes) -> bytes:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    return _OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), field)


def mountinfo() -> list[MountEntry]:
    """Every mount this process sees, in mount order (a later one covers an earlier one)."""
    entries = []
    with open(MOUNTINFO, "rb") as f:
        for line in f:
            fields = line.split()
            sep = fields.index(b"-")
            entries.append(MountEntry(
                device=fields[2].decode(), mountpoint=os.fsdecode(_unescape(fields[4])),
                mount_options=fields[5], fstype=fields[sep + 1].decode(errors="replace"),
                source_shown=_unescape(fields[sep + 2]),
                super_options=fields[sep + 3] if len(fields) > sep + 3 else b""))
    return entries


def mount_at(path: str, resolve: bool = True) -> Optional[MountEntry]:
    """The topmost mount at path (any filesystem), if path is a mountpoint."""
    target = os.path.realpath(path) if resolve else path
    found = None
    for entry in mountinfo():
        if entry.mountpoint == target:
            found = entry
    return found


def is_mountpoint(path: str) -> bool:
    """path (resolved) is a mountpoint of any filesystem, without a stat of it."""
    return mount_at(path) is not None


def ckptfs_mounts() -> list[tuple[str, str, str]]:
    """(major:minor, mountpoint, source) of every ckptfs mount; the source decoded
    from the fsname the daemon gave it (`fsname_encode`)."""
    return [(e.device, e.mountpoint, fsname_decode(e.source_shown.decode("ascii", "replace")))
            for e in mountinfo() if e.fstype == FSTYPE]


def find_mount(mountpoint: str, resolve: bool = True) -> Optional[tuple[str, str]]:
    """(major:minor, source) of the topmost ckptfs mount at mountpoint, if any.

    The daemon passes resolve=False: resolving its own mountpoint would be a
    request to itself.
    """
    target = os.path.realpath(mountpoint) if resolve else mountpoint
    found = None
    for dev, point, source in ckptfs_mounts():
        if point == target:
            found = (dev, source)
    return found


def mount_device(mountpoint: str) -> Optional[str]:
    """major:minor of the ckptfs mount at (already resolved) mountpoint."""
    entry = find_mount(mountpoint, resolve=False)
    return entry[0] if entry else None


def mounted_from(source: str) -> Optional[str]:
    """Where SOURCE (resolved) is mounted by ckptfs, if it is."""
    real = os.path.realpath(source)
    for _, point, mounted_source in ckptfs_mounts():
        if mounted_source == real:
            return point
    return None


# Bytes of SOURCE that go into the fsname as they are; every other byte is
# written %XX. The fsname travels through libfuse's comma-separated option
# list (',' separates, '\\' escapes), pyfuse3 (ASCII only) and mount(2), and
# shows in /proc/mounts, `df` and `findmnt`: with this alphabet nothing in a
# path can split off a mount option, any path can be mounted, and common
# paths read as themselves.
_FSNAME_KEEP = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                         b"/._-+~:@")
_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})")


def fsname_encode(source: str) -> str:
    """The fsname a mount of SOURCE gets: printable ASCII, no ',' '\\' or blanks."""
    return "".join(chr(b) if b in _FSNAME_KEEP else f"%{b:02X}" for b in os.fsencode(source))


def fsname_decode(fsname: str) -> str:
    """SOURCE back from fsname_encode's form (a path, as os.fsdecode gives it)."""
    raw = _PERCENT.sub(lambda m: bytes([int(m.group(1), 16)]), fsname.encode("ascii", "replace"))
    return os.fsdecode(raw)
