"""Shared by the compatibility tests (tests/compat/test_compat_*.py, test_concurrency.py).

Byte-exact checks of whole trees: every regular file's sha256, every symlink's
target, modes, sizes, times, xattrs and hard-link structure, so a test can
say "this tree on ckptfs is exactly that tree" after a remount.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

HELPERS = Path(__file__).resolve().parent
STATE_DIR = ".ckptfs"


def skip_unless_installed(what: str, *modules: str) -> None:
    """Skip the calling test module unless every module can be imported; the
    reason names what to install (`what`) and how."""
    __tracebackhide__ = True        # pytest -ra names the calling module, not this line
    import importlib.util

    import pytest

    for name in modules:
        # find_spec of "a.b" imports "a", and raises when "a" is missing.
        parts = name.split(".")
        if any(importlib.util.find_spec(".".join(parts[:i])) is None
               for i in range(1, len(parts) + 1)):
            verb = "are" if " and " in what else "is"
            pytest.skip(f"{what} {verb} not installed (tools/setup-debian.sh --with-tests "
                        f"installs {'them' if verb == 'are' else 'it'})",
                        allow_module_level=True)


def sha256_file(path: os.PathLike | str, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(block)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def xattrs_of(path: str) -> dict[str, bytes]:
    """user.* xattrs (the ones cp -a, rsync -X and tar --xattrs carry)."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    return {n: os.getxattr(path, n, follow_symlinks=False)
            for n in sorted(names) if n.startswith("user.")}


def manifest(root: os.PathLike | str, *, times: bool = True, xattrs: bool = True,
             contents: bool = True) -> dict[str, tuple]:
    """relpath -> description of every entry below root (not root itself).

    Files: ("f", mode, size, sha256, mtime_ns, xattrs, link group). Hard links
    are described by the sorted relpaths sharing the inode, so the structure
    compares across filesystems. Skips ckptfs' hidden state dir at the top.
    """
    root = os.fspath(root)
    out: dict[str, tuple] = {}
    by_ino: dict[tuple[int, int], list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == root and STATE_DIR in dirnames:
            dirnames.remove(STATE_DIR)
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            st = os.lstat(full)
            mode = stat.S_IMODE(st.st_mode)
            mt = st.st_mtime_ns if times else 0
            xa = tuple(sorted(xattrs_of(full).items())) if xattrs else ()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", mode, xa)
            elif stat.S_ISREG(st.st_mode):
                digest = sha256_file(full) if contents else ""
                out[rel] = ["f", mode, st.st_size, digest, mt, xa]
                by_ino.setdefault((st.st_dev, st.st_ino), []).append(rel)
            else:
                out[rel] = ("o", stat.S_IFMT(st.st_mode), mode)
    for rels in by_ino.values():
        group = tuple(sorted(rels))
        for rel in rels:
            out[rel] = tuple(out[rel]) + (group if len(group) > 1 else (),)
    return out


def dir_mtimes(root: os.PathLike | str) -> dict[str, int]:
    root = os.fspath(root)
    out = {}
    for dirpath, dirnames, _ in os.walk(root):
        if dirpath == root and STATE_DIR in dirnames:
            dirnames.remove(STATE_DIR)
        out[os.path.relpath(dirpath, root)] = os.lstat(dirpath).st_mtime_ns
    return out


def assert_same(a: dict, b: dict, what: str = "") -> None:
    """Compare two manifests with a readable first difference."""
    if a == b:
        return
    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    diff = [k for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    lines = [f"trees differ {what}: only in first {only_a[:10]}, only in second {only_b[:10]}"]
    for k in diff[:10]:
        lines.append(f"  {k}: {a[k]!r} != {b[k]!r}")
    raise AssertionError("\n".join(lines))


def run(cmd: list[str], *, cwd: Optional[os.PathLike] = None, timeout: float = 300,
        check: bool = True, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    res = subprocess.run([os.fspath(c) for c in cmd], capture_output=True, text=True,
                         cwd=cwd, timeout=timeout, env=env)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {res.returncode}:\n"
                             f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return res


def run_helper(script: str, *args, timeout: float = 300, env: Optional[dict] = None,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run tests/compat/helpers/<script> with this interpreter."""
    return run([sys.executable, str(HELPERS / script), *map(str, args)], timeout=timeout,
               env=env, check=check)


def write_bytes(path: os.PathLike | str, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def run_ranks(cmds: list[list[str]], log_dir: Path, env: dict, timeout: float = 300,
              what: str = "") -> None:
    """Run one process per command (the ranks of a job) at once; each must exit 0.

    Every rank runs in a session of its own that is killed whole afterwards,
    whatever happened: a library's helper processes (multiprocessing managers,
    writer pools) must not outlive a rank that died, holding files on the
    mount busy. Output goes to log files under log_dir, shown on failure.
    """
    tag = os.urandom(4).hex()
    logs = [log_dir / f"rank{rank}-{tag}.log" for rank in range(len(cmds))]
    procs: list[subprocess.Popen] = []
    try:
        for cmd, log_path in zip(cmds, logs):
            with open(log_path, "w") as log:
                procs.append(subprocess.Popen([os.fspath(c) for c in cmd], stdout=log,
                                              stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, \
            f"rank {rank} failed {what}:\n{logs[rank].read_text()[-4000:]}"


def run_dcp_ranks(tmp_path: Path, *ops: str, world: int = 2, timeout: float = 300) -> None:
    """world ranks of compat_dcp_worker.py doing ops ("MODE:CKPT_DIR:STEP") in
    order, in one gloo process group; each must exit 0. A CKPT_DIR of
    "DIR0+DIR1" gives each rank its own directory (its node's mount)."""
    init = tmp_path / f"init-{os.urandom(4).hex()}"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    run_ranks([[sys.executable, HELPERS / "compat_dcp_worker.py", init, str(rank), str(world),
                *ops] for rank in range(world)], tmp_path, env, timeout=timeout,
              what=f"running {ops}")
