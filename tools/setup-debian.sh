#!/bin/sh
# Install ckptfs and everything it needs on a fresh Debian machine (run as root).
#
#   tools/setup-debian.sh                  install
#   tools/setup-debian.sh --mount DIR      install, then mount ckptfs over DIR
#   tools/setup-debian.sh --with-tests     install with the test extras (torch, numpy, ...)
#                                          and a one-node Ceph for the S3 tests (about
#                                          240 MB: tools/rgw.py runs its RADOS Gateway)
#   tools/setup-debian.sh --with-bench     also the benchmark baselines (bindfs; borg,
#                                          restic and casync for tools/bench_dedup.py;
#                                          stress-ng for bench_foundation's sync_file)
#
# ckptfs goes into a virtual environment of Debian's own python3 in this
# checkout (.venv, git-ignored), installed editable: the ckptfs and
# mount.ckptfs commands, the tests and the daemon all run this checkout's
# code. Keep the checkout where it is (or run this again after moving it).
# Debian's python3 refuses system-wide pip installs (PEP 668); a venv is what
# it asks for. Quiet unless something fails: then the failing step's output.
set -eu

# sudo's PATH, whoever calls: Debian's python3, never another one first on PATH.
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP PYTHONUSERBASE VIRTUAL_ENV 2>/dev/null || true

repo=$(cd "$(dirname "$0")/.." && pwd)
venv="$repo/.venv"
mount_dir=""
extras=""
apt_extra=""
apt_norec=""    # without Recommends: borgbackup's would add Debian's python3-pyfuse3 3.2
while [ $# -gt 0 ]; do
    case "$1" in
        --mount)
            [ $# -ge 2 ] || { echo "setup-debian.sh: --mount needs a directory" >&2; exit 2; }
            mount_dir="$2"; shift 2 ;;
        --with-tests) extras="[test]"; apt_extra="$apt_extra attr rsync strace"
                      apt_norec="$apt_norec ceph-mon ceph-osd radosgw"; shift ;;
        --with-bench) apt_extra="$apt_extra bindfs stress-ng"; apt_norec="$apt_norec borgbackup restic casync"; shift ;;
        *) echo "setup-debian.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

if [ "$(id -u)" -ne 0 ]; then
    echo "setup-debian.sh: run as root (it installs system packages): sudo $0" >&2
    exit 1
fi

out=$(mktemp)
trap 'rm -f "$out"' EXIT
# Run a step with its output kept aside; show it only if the step fails.
quietly() {
    if ! "$@" >"$out" 2>&1; then
        cat "$out" >&2
        echo "setup-debian.sh: failed: $*" >&2
        exit 1
    fi
}

export DEBIAN_FRONTEND=noninteractive
# python3-dev: Python.h for the native helpers (cffi compiles them with gcc).
# librust-blake3-dev: the BLAKE3 team's C implementation (Debian ships it as
# the C sources inside that package); the native write-path call names chunks
# with it (ckptfs/_native_build.py), one GIL release per write, not per chunk.
missing=""
for pkg in fuse3 libfuse3-dev pkg-config gcc python3 python3-venv python3-dev \
           librust-blake3-dev $apt_extra; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
missing_norec=""
for pkg in $apt_norec; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing_norec="$missing_norec $pkg"
done
if [ -n "$missing$missing_norec" ]; then
    quietly apt-get update
fi
if [ -n "$missing" ]; then
    # shellcheck disable=SC2086
    quietly apt-get install -y $missing
fi
if [ -n "$missing_norec" ]; then
    # shellcheck disable=SC2086
    quietly apt-get install -y --no-install-recommends $missing_norec
fi

# The venv, made once with Debian's python3 and reused; made again if it no
# longer runs (Debian's python3 upgraded to another minor version).
if ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$venv"
    quietly /usr/bin/python3 -m venv "$venv"
fi
# Editable: `import ckptfs` is this checkout (the native helpers are built in
# place), so tests, tools and the installed commands run the same code.
# torch is pinned to 2.13.0 in the test extras: the CPU build on local disk.
quietly "$venv/bin/python" -m pip install --disable-pip-version-check --no-input \
    -e "$repo$extras"
if [ -n "$extras" ]; then
    # Never a CUDA build of torch: the extras pin the CPU wheel pip finds on local disk.
    quietly "$venv/bin/python" -c '
import importlib.metadata as md, sys
torch = md.version("torch")
cuda = ", ".join(sorted(d.metadata["Name"] for d in md.distributions()
                        if (d.metadata["Name"] or "").lower().startswith("nvidia-")))
if not torch.startswith("2.13.0+cpu") or cuda:
    sys.exit(f"torch {torch} (CUDA packages: {cuda or None}): want the CPU build 2.13.0+cpu")
'
fi

# Where users (/usr/local/bin) and mount(8) (/sbin: `mount -t ckptfs`, fstab) find them.
ln -sf "$venv/bin/ckptfs" /usr/local/bin/ckptfs
ln -sf "$venv/bin/mount.ckptfs" /usr/local/bin/mount.ckptfs
ln -sf "$venv/bin/mount.ckptfs" /sbin/mount.ckptfs
# fusectl lets operators (and the tests' cleanup) abort a hung connection.
if [ -d /sys/fs/fuse/connections ] && ! mountpoint -q /sys/fs/fuse/connections; then
    mount -t fusectl none /sys/fs/fuse/connections 2>/dev/null || true
fi

echo "ckptfs installed in $venv: /usr/local/bin/ckptfs, /sbin/mount.ckptfs"
if [ -n "$mount_dir" ]; then
    mkdir -p "$mount_dir"
    if findmnt -rn -t fuse.ckptfs --mountpoint "$(realpath -m "$mount_dir")" >/dev/null; then
        echo "ckptfs is already mounted over $mount_dir"      # a second run
    else
        /sbin/mount.ckptfs "$mount_dir" "$mount_dir"
        echo "ckptfs is mounted over $mount_dir (state in $mount_dir/.ckptfs)"
    fi
fi
