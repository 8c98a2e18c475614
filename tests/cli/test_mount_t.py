"""mount(8) finds the helper: `mount -t ckptfs` and an fstab line work, and umount(8) ends cleanly."""

from __future__ import annotations

import os
import subprocess

import pytest
from mounting import is_mounted

from ckptfs.proc import wait_exit

pytestmark = pytest.mark.skipif(not os.path.exists("/sbin/mount.ckptfs"),
                                reason="tools/setup-debian.sh links /sbin/mount.ckptfs")


def mount8(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=120)


def umount8_and_wait(m) -> None:
    pid = m.stat()["pid"]
    res = subprocess.run(["umount", str(m.path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert wait_exit(pid, 60), "daemon still running after umount(8)"
    m.pid = None


def test_mount_dash_t(make_mount):
    m = make_mount(start=False)
    res = mount8("-t", "ckptfs", str(m.source), str(m.path), "-o", "pmem_size=64M,sync=lazy")
    assert res.returncode == 0, res.stderr
    assert is_mounted(m.path)
    m.pid = m.stat()["pid"]
    assert m.stat()["sync"] == "lazy"
    (m.path / "f").write_bytes(b"through mount -t")
    umount8_and_wait(m)
    m.start()
    assert (m.path / "f").read_bytes() == b"through mount -t"


def test_fstab_line(make_mount, tmp_path):
    m = make_mount(start=False)
    fstab = tmp_path / "fstab"
    # What an operator writes: fstab-only options (noauto, nofail, x-systemd.*) are accepted.
    fstab.write_text(f"{m.source} {m.path} ckptfs "
                     "pmem_size=64M,noauto,nofail,x-systemd.requires=local-fs.target 0 0\n")
    res = mount8("-T", str(fstab), str(m.path))
    assert res.returncode == 0, res.stderr
    m.pid = m.stat()["pid"]
    (m.path / "g").write_bytes(b"from fstab")
    umount8_and_wait(m)
    res = mount8("-T", str(fstab), str(m.path))
    assert res.returncode == 0, res.stderr
    m.pid = m.stat()["pid"]
    assert (m.path / "g").read_bytes() == b"from fstab"


def test_mount_dash_t_bad_option_fails_cleanly(make_mount):
    m = make_mount(start=False)
    res = mount8("-t", "ckptfs", str(m.source), str(m.path), "-o", "pmem_size=64M,bogus=1")
    assert res.returncode != 0
    assert "unknown mount option 'bogus=1'" in res.stderr
    assert not is_mounted(m.path)
