"""`ckptfs export PATH DEST`: copy files or whole trees out of a mounted ckptfs.

The copy is made of plain files, for someone without ckptfs. It keeps what
`cp -a` keeps: file modes (setuid/setgid/sticky included), owners (when run
as root), access and modification times to the nanosecond, symlinks as
symlinks, hard links within the exported tree as hard links, user.* xattrs,
FIFOs and device nodes. Holes stay holes.

Holes: FUSE offers no SEEK_DATA/SEEK_HOLE here, so export asks the daemon
for the file's data ranges over the control channel (by inode number) and
never reads a hole: an 8 EiB sparse file with a few bytes of data exports
in no time, and nothing is guessed. When the channel cannot be used (a
non-root user exporting from root's mount, an older daemon), every block is
read and all-zero 4 KiB blocks are skipped, as `cp --sparse=always` does;
st_blocks 0 (ckptfs counts only data) means there is nothing to read at all.
Zero blocks inside data ranges are skipped too, so the copy is as sparse as
`cp --sparse=always` would make it.

Where the copy goes follows `cp -a PATH DEST`: if DEST is an existing
directory the copy is DEST/<name of PATH>, otherwise DEST itself (its parent
must exist). Copying a directory into an existing one merges them; a file
replaces an existing file.

Every file (and symlink, hard link, special node) is made under a hidden
temporary name in its final directory, written with large reads (8 MiB, so
cold tiered data streams through the daemon's prefetch), given its xattrs,
owner, mode and times, fsync'ed, and only then renamed to its final name: an
interrupted export never leaves a half file under a final name. Directories
get their attributes after their contents (a read-only directory can be
filled first) and are fsync'ed so the renames in them are durable.

Runs as a client of the mount (ordinary reads): never inside the daemon.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import sys
from dataclasses import dataclass, field
from typing import Optional

from . import control
from .mounts import ckptfs_mounts
from .errors import CkptfsError, ExitCode, OperationFailed, UsageError

COPY_CHUNK_BYTES = 8 << 20
HOLE_BLOCK_BYTES = 4096         # zero blocks of this size (file-aligned) become holes
_ZERO_BLOCK = bytes(HOLE_BLOCK_BYTES)
TMP_PREFIX = ".ckptfs-export."
XATTR_NAMESPACES = ("user.",)


@dataclass
class ExportPlan:
    src: str            # absolute path of what is exported (not resolved if a symlink)
    target: str         # absolute path the copy gets
    mountpoint: str     # the ckptfs mount src lies in
    mount_dev: str      # its major:minor


@dataclass
class ExportResult:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    specials: int = 0
    bytes: int = 0
    warnings: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ planning

def _dev(st: os.stat_result) -> str:
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def plan_export(path: str, dest: str) -> ExportPlan:
    """Check PATH and DEST; where the copy goes. UsageError for user mistakes."""
    if not path or not dest:
        raise UsageError("export needs PATH and DEST")
    # A trailing slash (or . / ..) means the directory a symlink names, as with cp.
    follow = path.endswith(os.sep) or os.path.basename(path) in (".", "..")
    src = os.path.realpath(path) if follow else os.path.abspath(path)
    try:
        st = os.lstat(src)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file or directory") from None
    # Where src itself lies: its directory resolved, its own name kept (a symlink
    # is exported as a symlink, not as what it names).
    parent, name = os.path.split(src)
    real_src = os.path.join(os.path.realpath(parent), name) if name else src
    found = None
    for dev, point, _source in ckptfs_mounts():
        if dev == _dev(st) and _under(real_src, point):
            if found is None or len(point) > len(found[1]):
                found = (dev, point, _source)
    if found is None:
        raise UsageError(f"{path} is not inside a ckptfs mount (export copies out of a "
                         "mounted ckptfs; use cp for anything else)")
    mount_dev, mountpoint, source = found
    name = os.path.basename(real_src.rstrip(os.sep)) or os.path.basename(mountpoint)

    is_dir = stat.S_ISDIR(st.st_mode)
    dest_abs = os.path.abspath(dest)
    try:
        dst_st: Optional[os.stat_result] = os.stat(dest_abs)
    except FileNotFoundError:
        dst_st = None
    except NotADirectoryError:
        raise UsageError(f"{dest}: a component of the path is not a directory") from None
    if dst_st is not None and stat.S_ISDIR(dst_st.st_mode):
        target = os.path.join(dest_abs, name)
    elif dst_st is not None:
        if is_dir:
            raise UsageError(f"{dest} exists and is not a directory ({path} is a directory)")
        target = dest_abs
    else:
        if dest.endswith(os.sep):
            raise UsageError(f"{dest}: no such directory")
        if not os.path.isdir(os.path.dirname(dest_abs)):
            raise UsageError(f"{os.path.dirname(dest_abs)}: no such directory")
        target = dest_abs

    real_target = os.path.realpath(target)
    if (_under(real_target, mountpoint) or _under(real_target, source)
            or _dev(os.stat(_existing_ancestor(real_target))) == mount_dev):
        raise UsageError(f"{dest} is inside the ckptfs mount {mountpoint}: export copies out "
                         "of ckptfs (use cp to copy within it)")
    try:
        tst: Optional[os.stat_result] = os.lstat(target)
    except FileNotFoundError:
        tst = None
    if tst is not None:
        if is_dir and not stat.S_ISDIR(tst.st_mode):
            raise UsageError(f"cannot overwrite non-directory {target} with directory {path}")
        if not is_dir and stat.S_ISDIR(tst.st_mode):
            raise UsageError(f"cannot overwrite directory {target} with non-directory {path}")
    return ExportPlan(src=src, target=target, mountpoint=mountpoint, mount_dev=mount_dev)


def _existing_ancestor(path: str) -> str:
    while not os.path.lexists(path):
        up = os.path.dirname(path)
        if up == path:
            break
        path = up
    return path


def _scan(src: str, mount_dev: str, result: ExportResult) -> list[tuple[str, os.stat_result]]:
    """(relative path, lstat) of everything under src, parents before children.

    Another filesystem mounted inside the tree is skipped (with a warning).
    """
    root = os.lstat(src)
    entries = [("", root)]
    if not stat.S_ISDIR(root.st_mode):
        return entries
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(src, rel) if rel else src) as it:
            children = sorted(it, key=lambda e: e.name)
        subdirs = []
        for entry in children:
            child = os.path.join(rel, entry.name) if rel else entry.name
            st = entry.stat(follow_symlinks=False)
            if _dev(st) != mount_dev:
                result.warnings.append(f"skipped {os.path.join(src, child)}: another "
                                       "filesystem is mounted there")
                continue
            entries.append((child, st))
            if stat.S_ISDIR(st.st_mode):
                subdirs.append(child)
        stack.extend(reversed(subdirs))
    return entries


# ------------------------------------------------------------------- copying

class _Copier:
    def __init__(self, plan: ExportPlan, bar, result: ExportResult) -> None:
        self.plan = plan
        self.bar = bar
        self.result = result
        self.buf = bytearray(COPY_CHUNK_BYTES)
        self.as_root = os.geteuid() == 0
        self.links: dict[tuple[int, int], str] = {}
        self.xattr_warned = False
        self.ask_daemon = True      # until the control channel turns out unusable

    def tmp_name(self, final: str) -> str:
        return os.path.join(os.path.dirname(final), TMP_PREFIX + secrets.token_hex(6))

    # --- attributes
    def copy_xattrs(self, src_fd: int, dst_fd: int, where: str) -> None:
        for name in os.listxattr(src_fd):
            if not name.startswith(XATTR_NAMESPACES):
                continue
            try:
                value = os.getxattr(src_fd, name)
            except OSError as e:
                if e.errno == errno.ENODATA:
                    continue        # removed meanwhile
                raise
            try:
                os.setxattr(dst_fd, name, value)
            except OSError as e:
                if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise OSError(e.errno, e.strerror, where) from None
                if not self.xattr_warned:
                    self.xattr_warned = True
                    self.result.warnings.append(
                        f"xattrs not kept: the destination does not support them ({where})")

    def set_owner_mode_times(self, target, st: os.stat_result, *, symlink: bool = False) -> None:
        """target: an fd, or a path (symlinks and special nodes)."""
        follow = not symlink
        if self.as_root:
            os.chown(target, st.st_uid, st.st_gid, follow_symlinks=follow)
        if not symlink:         # chmod after chown: chown clears setuid/setgid
            os.chmod(target, stat.S_IMODE(st.st_mode))
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=follow)

    # --- entries
    def regular(self, src: str, dst: str) -> None:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            first = self.links.get(key) if st.st_nlink > 1 else None
            if first is not None:
                self.hardlink(first, dst)
                return
            tmp, out = self._create_tmp(dst)
            try:
                try:
                    self._copy_bytes(fd, out, st, src, tmp)
                    self.copy_xattrs(fd, out, dst)
                    self.set_owner_mode_times(out, st)
                    os.fsync(out)
                finally:
                    os.close(out)
                os.rename(tmp, dst)
            except BaseException:
                _unlink_quietly(tmp)
                raise
            if st.st_nlink > 1:
                self.links[key] = dst
            self.result.files += 1
        finally:
            os.close(fd)

    def _create_tmp(self, dst: str) -> tuple[str, int]:
        while True:
            tmp = self.tmp_name(dst)
            try:
                return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                    0o600)
            except FileExistsError:
                continue

    def _copy_bytes(self, src_fd: int, dst_fd: int, st: os.stat_result, src: str,
                    tmp: str) -> None:
        """Copy the data of src (st: its fstat) into the new file dst_fd, holes as holes."""
        done = 0
        for a, b in self._data_ranges(st):
            self.bar.update(a - done)            # a hole: nothing to read
            done = self._copy_range(src_fd, dst_fd, a, b, src, tmp)
            if done < b:
                break                            # the file shrank meanwhile
        self.bar.update(max(st.st_size - done, 0))
        try:
            os.ftruncate(dst_fd, st.st_size)     # a hole at the end, too
        except OSError as e:
            raise OSError(e.errno, e.strerror, tmp) from None

    def _data_ranges(self, st: os.stat_result) -> list[tuple[int, int]]:
        if st.st_size == 0 or st.st_blocks == 0:
            return []                           # ckptfs's st_blocks counts data only
        ranges = self._ask_daemon(st) if self.ask_daemon else None
        return [(0, st.st_size)] if ranges is None else ranges

    def _ask_daemon(self, st: os.stat_result) -> Optional[list[tuple[int, int]]]:
        """The file's data ranges from the daemon, or None (then read it all)."""
        ranges: list[tuple[int, int]] = []
        start: Optional[int] = 0
        try:
            while start is not None:
                reply = control.request(self.plan.mountpoint, "data_ranges", timeout_s=60,
                                        ino=st.st_ino, start=start)
                if reply["size"] != st.st_size:
                    return None                 # changing under us: read it all
                ranges.extend((int(a), int(b)) for a, b in reply["ranges"])
                start = reply["next"]
        except (OperationFailed, OSError):
            self.ask_daemon = False             # no channel (another user's mount): never mind
            return None
        except (CkptfsError, KeyError, TypeError, ValueError):
            return None                         # this file only (an older daemon, a race)
        return ranges

    def _copy_range(self, src_fd: int, dst_fd: int, a: int, b: int, src: str, tmp: str) -> int:
        """Copy [a, b); returns where it stopped (b, or earlier at end of file)."""
        view = memoryview(self.buf)
        off = a
        while off < b:
            try:
                n = os.preadv(src_fd, [view[:min(len(view), b - off)]], off)
            except OSError as e:
                raise OSError(e.errno, e.strerror, src) from None
            if n == 0:
                break
            try:
                _write_data(dst_fd, view[:n], off)
            except OSError as e:
                raise OSError(e.errno, e.strerror, tmp) from None
            off += n
            self.result.bytes += n
            self.bar.update(n)
        return off

    def hardlink(self, first: str, dst: str) -> None:
        tmp = self.tmp_name(dst)
        os.link(first, tmp)
        try:
            os.rename(tmp, dst)
        finally:
            # rename() of two names of one inode does nothing: tmp would stay.
            _unlink_quietly(tmp)
        self.result.hardlinks += 1

    def symlink(self, src: str, dst: str, st: os.stat_result) -> None:
        tmp = self.tmp_name(dst)
        os.symlink(os.readlink(src), tmp)
        try:
            self.set_owner_mode_times(tmp, st, symlink=True)
            os.rename(tmp, dst)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self.result.symlinks += 1

    def special(self, src: str, dst: str, st: os.stat_result) -> None:
        if stat.S_ISSOCK(st.st_mode):
            self.result.warnings.append(f"skipped socket {src}")
            return
        tmp = self.tmp_name(dst)
        os.mknod(tmp, stat.S_IFMT(st.st_mode) | 0o600, st.st_rdev)
        try:
            self.set_owner_mode_times(tmp, st)
            os.rename(tmp, dst)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self.result.specials += 1

    def make_dir(self, dst: str) -> None:
        try:
            os.mkdir(dst, 0o700)       # its own mode once its contents are in
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(dst).st_mode):
                raise OSError(errno.EEXIST, "cannot overwrite a non-directory with a "
                                            "directory", dst) from None
        self.result.dirs += 1

    def finish_dir(self, src: str, dst: str, st: os.stat_result) -> None:
        sfd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            dfd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self.copy_xattrs(sfd, dfd, dst)
                self.set_owner_mode_times(dfd, st)
                os.fsync(dfd)           # the renames into it are durable
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)


def _write_data(fd: int, data: memoryview, off: int) -> None:
    """pwrite data at off, leaving every all-zero file-aligned block a hole
    (the file is new: what is not written reads as zeros)."""
    run = None                                  # start of the pending non-zero run
    pos, n = 0, len(data)
    while pos < n:
        end = min(n, pos + HOLE_BLOCK_BYTES - (off + pos) % HOLE_BLOCK_BYTES)
        piece = data[pos:end].tobytes()
        if piece == (_ZERO_BLOCK if end - pos == HOLE_BLOCK_BYTES else bytes(end - pos)):
            if run is not None:
                _pwrite_all(fd, data[run:pos], off + run)
                run = None
        elif run is None:
            run = pos
        pos = end
    if run is not None:
        _pwrite_all(fd, data[run:], off + run)


def _pwrite_all(fd: int, data: memoryview, off: int) -> None:
    while data:
        n = os.pwrite(fd, data, off)
        data, off = data[n:], off + n


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_tree(plan: ExportPlan, *, progress: bool = False) -> ExportResult:
    """Copy plan.src to plan.target. Raises OSError/CkptfsError on the first failure."""
    from tqdm import tqdm

    result = ExportResult()
    entries = _scan(plan.src, plan.mount_dev, result)
    seen: set[tuple[int, int]] = set()
    total = 0
    for _, st in entries:
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="export",
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    with bar:
        copier = _Copier(plan, bar, result)
        dirs: list[tuple[str, str, os.stat_result]] = []
        for rel, st in entries:
            src = os.path.join(plan.src, rel) if rel else plan.src
            dst = os.path.join(plan.target, rel) if rel else plan.target
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                copier.make_dir(dst)
                dirs.append((src, dst, st))
            elif stat.S_ISREG(mode):
                copier.regular(src, dst)
            elif stat.S_ISLNK(mode):
                copier.symlink(src, dst, st)
            else:
                copier.special(src, dst, st)
        for src, dst, st in reversed(dirs):     # children first: a 0555 dir is filled by now
            copier.finish_dir(src, dst, st)
        _fsync_dir(os.path.dirname(plan.target))
    return result


def run_export(path: str, dest: str, *, progress: Optional[bool] = None) -> int:
    """`ckptfs export PATH DEST`. 0 on success; 1 with one line on stderr if the
    copy fails; UsageError (exit 2) for a bad PATH or DEST."""
    show = sys.stderr.isatty() if progress is None else progress
    try:
        plan = plan_export(path, dest)
        result = export_tree(plan, progress=show)
    except UsageError:
        raise
    except (OSError, CkptfsError) as e:
        print(f"ckptfs: export failed: {_describe(e)}", file=sys.stderr)
        return ExitCode.FAILED
    for warning in result.warnings:
        print(f"ckptfs: export: {warning}", file=sys.stderr)
    if show:
        print(f"exported {result.files} files ({_human(result.bytes)}), {result.dirs} "
              f"directories, {result.symlinks} symlinks, {result.hardlinks} hard links "
              f"to {plan.target}", file=sys.stderr)
    return ExitCode.OK


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
