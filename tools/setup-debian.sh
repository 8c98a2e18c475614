#!/bin/sh
# Install ckptfs and everything it needs on a fresh Debian machine (run as root).
#
#   tools/setup-debian.sh                  install
#   tools/setup-debian.sh --mount DIR      install, then mount ckptfs over DIR
#   tools/setup-debian.sh --with-tests     install with the test extras (torch, numpy, ...)
#                                          and a one-node Ceph for the S3 tests (about
#                                          240 MB: tools/rgw.py runs its RADOS Gateway)
#   tools/setup-debian.sh --with-bench     also the benchmark baselines (bindfs; borg,
#                                          restic and casync for tools/bench_dedup.py)
set -eu

repo=$(cd "$(dirname "$0")/.." && pwd)
mount_dir=""
extras=""
apt_extra=""
apt_norec=""    # without Recommends: borgbackup's would add Debian's python3-pyfuse3 3.2
while [ $# -gt 0 ]; do
    case "$1" in
        --mount) mount_dir="$2"; shift 2 ;;
        --with-tests) extras="[test]"; apt_extra="$apt_extra attr rsync"
                      apt_norec="$apt_norec ceph-mon ceph-osd radosgw"; shift ;;
        --with-bench) apt_extra="$apt_extra bindfs"; apt_norec="$apt_norec borgbackup restic casync"; shift ;;
        *) echo "setup-debian.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

if [ "$(id -u)" -ne 0 ]; then
    echo "setup-debian.sh: run as root (it installs system packages)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
missing=""
for pkg in fuse3 libfuse3-dev pkg-config gcc $apt_extra; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
missing_norec=""
for pkg in $apt_norec; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing_norec="$missing_norec $pkg"
done
if [ -n "$missing$missing_norec" ]; then
    apt-get update -qq
fi
if [ -n "$missing" ]; then
    # shellcheck disable=SC2086
    apt-get install -y -qq $missing >/dev/null
fi
if [ -n "$missing_norec" ]; then
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing_norec >/dev/null
fi

python3 -m pip install -q --upgrade pip setuptools wheel cffi
# Editable, so the tests and tools in this checkout use exactly this code.
# torch is pinned to 2.13.0 in the test extras: the CPU build on local disk.
python3 -m pip install -q -e "$repo$extras"

# mount(8) looks for helpers in /sbin: make `mount -t ckptfs` and fstab work.
helper=$(python3 -c 'import shutil, sys; print(shutil.which("mount.ckptfs") or "")')
if [ -z "$helper" ]; then
    helper="$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/mount.ckptfs"
fi
ln -sf "$helper" /sbin/mount.ckptfs
# fusectl lets operators (and the tests' cleanup) abort a hung connection.
if [ -d /sys/fs/fuse/connections ] && ! mountpoint -q /sys/fs/fuse/connections; then
    mount -t fusectl none /sys/fs/fuse/connections 2>/dev/null || true
fi

echo "ckptfs installed: $(command -v ckptfs), /sbin/mount.ckptfs -> $helper"
if [ -n "$mount_dir" ]; then
    mkdir -p "$mount_dir"
    mount.ckptfs "$mount_dir" "$mount_dir"
    echo "ckptfs is mounted over $mount_dir (state in $mount_dir/.ckptfs)"
fi
