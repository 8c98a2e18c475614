"""ckptfs runs as root over directories other users write into: attacks by
such a user, run as a real non-root user, must not reach anything the user
could not reach without ckptfs.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import CKPTFS, MOUNT_HELPER, REPO, is_mounted

from ckptfs import control


# ------------------------------------------------------------------ helpers

def unused_uid() -> int:
    """A uid no account and no leftover /tmp/ckptfs-UID belongs to: this test's own user."""
    taken = {p.pw_uid for p in pwd.getpwall()}
    for uid in range(61000 + os.getpid() % 500, 62000):
        if uid not in taken and not os.path.lexists(f"/tmp/ckptfs-{uid}"):
            return uid
    pytest.skip("no free uid")


def as_user(uid: int, argv: list[str], *, python_access: bool = False, env=None,
            timeout: float = 60) -> subprocess.CompletedProcess:
    """Run argv as uid:uid with no supplementary groups.

    python_access: keep CAP_DAC_READ_SEARCH (read and search only: no write, no
    ownership) so the user can run the test interpreter, which lives below
    root's 0700 home here. It changes no check ckptfs makes: those compare
    owners and modes, and connecting to or creating anything still needs write
    permission.
    """
    pre = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    if python_access:
        pre += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return subprocess.run(pre + argv, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]


# ------------------------------------------------- control socket directory

class FakeDaemon:
    """Another user's socket where a user's ckptfs looks for its daemon: it
    answers every request with made-up numbers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o666)
        self.sock.listen(4)
        self.answered = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                self.answered += 1
                conn.sendall(json.dumps({"v": 1, "ok": True,
                                         "result": {"pid": 4242, "forged": True}}).encode()
                             + b"\n")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def user_tmp():
    """(uid, its /tmp/ckptfs-UID path): removed afterwards, whoever made it."""
    uid = unused_uid()
    base = Path(f"/tmp/ckptfs-{uid}")
    yield uid, base
    if base.is_symlink():
        base.unlink()
    shutil.rmtree(base, ignore_errors=True)


def _plant(base: Path, owner: int, mode: int, mnt: Path) -> FakeDaemon:
    (base / "ckptfs").mkdir(parents=True)
    for d in (base, base / "ckptfs"):
        os.chown(d, owner, owner)
        os.chmod(d, mode)
    name = os.path.basename(control.socket_path(str(mnt)))
    return FakeDaemon(base / "ckptfs" / name)


@pytest.mark.parametrize("how", ["other_owner", "symlink", "group_open"])
def test_control_directory_another_user_controls_is_refused(user_tmp, tmp_path, how):
    """Without XDG_RUNTIME_DIR a user's control socket lives in /tmp/ckptfs-UID.
    Another user who made that directory first (or a symlink there, or one left
    open to others) could answer in the daemon's place: client and daemon refuse
    it with one line."""
    uid, base = user_tmp
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["PYTHONPATH"] = str(REPO)
    world = tmp_path / "w"
    world.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(world, 0o755)
    src = world / "src"
    src.mkdir()
    os.chown(src, uid, uid)
    if how == "other_owner":
        fake = _plant(base, 0, 0o755, src)             # made by root (another user)
    elif how == "symlink":
        real = tmp_path / "real"
        fake = _plant(real, uid, 0o700, src)           # the user's own, but reached by a symlink
        base.symlink_to(real)
    else:
        fake = _plant(base, uid, 0o755, src)           # the user's, but open to others
    try:
        res = as_user(uid, [sys.executable, "-m", "ckptfs.cli", "stat", str(src), "--json"],
                      python_access=True, env=env)
        assert "4242" not in res.stdout and fake.answered == 0, \
            f"the client took another user's answer: {res.stdout}"
        assert res.returncode == 1, res.stderr
        line = one_line(res.stderr)
        assert "control directory" in line and "refusing" in line, line
        # The daemon refuses it too, before anything is mounted.
        res = as_user(uid, [sys.executable, str(REPO / "mount.ckptfs"), str(src), str(src),
                            "-o", "pmem_size=64M"], python_access=True, env=env)
        assert res.returncode == 1, res.stderr
        assert "control directory" in one_line(res.stderr), res.stderr
        assert not is_mounted(src)
    finally:
        fake.close()


def test_control_directory_is_made_private_when_missing(user_tmp):
    uid, base = user_tmp
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["PYTHONPATH"] = str(REPO)
    res = as_user(uid, [sys.executable, "-c",
                        "from ckptfs import control; print(control.private_socket_dir(True))"],
                  python_access=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{base}/ckptfs"
    for d in (base, base / "ckptfs"):
        st = os.lstat(d)
        assert st.st_uid == uid and st.st_mode & 0o777 == 0o700, (d, oct(st.st_mode))
    # The client now finds the directory fine and says nobody answers.
    res = as_user(uid, [sys.executable, "-m", "ckptfs.cli", "stat", "/tmp"],
                  python_access=True, env=env)
    assert res.returncode == 1 and "no ckptfs daemon answers" in one_line(res.stderr)
