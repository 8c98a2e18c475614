#!/usr/bin/env python3
"""A real S3 server for the tests: Ceph's RADOS Gateway on a one-node Ceph.

    python3 tools/rgw.py start [--dir DIR] [--bucket NAME]   prints shell exports
    python3 tools/rgw.py status DIR
    python3 tools/rgw.py stop DIR [--keep]

or, from Python (tests/store/conftest.py):

    with RGW.start(state_dir) as rgw:
        rgw.endpoint_url, rgw.access_key, rgw.secret_key, rgw.env()
        rgw.stop_gateway(); rgw.start_gateway()     # the endpoint down, then back
        rgw.pause(); rgw.resume()                   # SIGSTOP: requests time out
        rgw.admin("quota", ...)                     # radosgw-admin on this cluster

Needs Debian's `ceph-mon ceph-osd radosgw` (tools/setup-debian.sh --with-tests
installs them). Everything lives in the state directory (config, mon store,
logs, sockets) and in RAM: one monitor with `auth none`, one OSD on memstore
(data in memory, `memstore_bytes` at most), radosgw with the beast frontend on
127.0.0.1, and one S3 user with fixed keys. No daemon of the system's Ceph is
touched (no /etc/ceph, no /var/lib/ceph, no /var/log/ceph).

The settings that make it start in about a second, each learnt the hard way:

- every `ms_*_mode` is `crc`: with `auth none` the default `secure crc` modes
  make radosgw wait 300 s for a session it can never get;
- `mon_data_avail_warn/crit = -1`: the monitor refuses to start on a disk
  under 5% free otherwise;
- `paxos_propose_interval` 0.01 s: each monitor command waits a full second
  otherwise (start-up 11 s instead of 1 s);
- `rgw_gc_obj_min_wait = 0`: deleted data would stay in RAM for 2 hours;
- `osd_pool_default_pg_num = 8`: radosgw makes 7 pools, at the default 32 PGs
  each they pass the per-OSD PG limit and pool creation fails;
- the ports are picked free at start and checked again just before each
  daemon binds, and the daemons are told apart from strangers by the
  cluster's fsid: a stale server left on a port must never answer for us.

Stop order: radosgw, then the OSD, then the monitor (an OSD or gateway without
its monitor waits for it instead of exiting). When started with
`bound_to_parent` (the tests do), each daemon also gets SIGTERM when the
process that started it dies, so a killed pytest leaves no daemon behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ACCESS_KEY = "CKPTFSTESTACCESSKEY0"
SECRET_KEY = "ckptfs-rgw-test-secret-0000000000000000"
# A second key pair of the same user that may only read (a read-only store).
READ_ONLY_ACCESS_KEY = "CKPTFSTESTREADONLY00"
READ_ONLY_SECRET_KEY = "ckptfs-rgw-test-readonly-000000000000000"
USER = "ckptfs"
REGION = "us-east-1"           # RGW's default zonegroup answers to any region; this one is AWS's default
BINARIES = ("monmaptool", "ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph")
STATE_FILE = "rgw.json"
DEFAULT_MEMSTORE_BYTES = 4 << 30
STOP_ORDER = ("rgw", "osd", "mon")

PR_SET_PDEATHSIG = 1


class RGWError(RuntimeError):
    """The gateway could not be started or stopped; the message says why."""


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_answers(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the thread that started it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:                                    # a zombie child is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class RGW:
    """A running (or stopped) one-node Ceph with a gateway, described by the
    JSON file in its state directory."""

    state_dir: str
    fsid: str = ""
    mon_port: int = 0
    rgw_port: int = 0
    memstore_bytes: int = DEFAULT_MEMSTORE_BYTES
    pids: dict = field(default_factory=dict)      # "mon" | "osd" | "rgw" -> pid
    started_s: float = 0.0                        # wall time start() took
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    read_only_access_key: str = READ_ONLY_ACCESS_KEY
    read_only_secret_key: str = READ_ONLY_SECRET_KEY
    region: str = REGION

    def __post_init__(self) -> None:
        self._procs: dict[str, subprocess.Popen] = {}    # the daemons this process started

    # -- what clients need ----------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    def env(self, read_only: bool = False) -> dict[str, str]:
        """Environment variables that point an AWS client (boto3, the aws CLI,
        ckptfs) at this gateway, the standard AWS way."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.read_only_access_key if read_only else self.access_key,
            "AWS_SECRET_ACCESS_KEY": (self.read_only_secret_key if read_only
                                      else self.secret_key),
            "AWS_DEFAULT_REGION": self.region,
        }

    def write_aws_files(self, directory: Optional[str] = None) -> tuple[str, str]:
        """A shared config and credentials file with profiles `ckptfs-rgw`
        and `ckptfs-rgw-ro` (read-only keys); returns their paths."""
        d = Path(directory or self.state_dir)
        config, creds = d / "aws-config", d / "aws-credentials"
        lines_c, lines_k = [], []
        for profile, ro in (("ckptfs-rgw", False), ("ckptfs-rgw-ro", True)):
            e = self.env(read_only=ro)
            lines_c += [f"[profile {profile}]", f"region = {self.region}",
                        f"endpoint_url = {self.endpoint_url}", ""]
            lines_k += [f"[{profile}]", f"aws_access_key_id = {e['AWS_ACCESS_KEY_ID']}",
                        f"aws_secret_access_key = {e['AWS_SECRET_ACCESS_KEY']}", ""]
        config.write_text("\n".join(lines_c))
        creds.write_text("\n".join(lines_k))
        creds.chmod(0o600)
        return str(config), str(creds)

    # -- paths ------------------------------------------------------------------------

    @property
    def conf_path(self) -> str:
        return os.path.join(self.state_dir, "ceph.conf")

    def _p(self, *parts: str) -> str:
        return os.path.join(self.state_dir, *parts)

    def _save(self) -> None:
        tmp = self._p(STATE_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(asdict(self), f, indent=1)
        os.replace(tmp, self._p(STATE_FILE))

    @classmethod
    def load(cls, state_dir: str) -> "RGW":
        try:
            with open(os.path.join(state_dir, STATE_FILE)) as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise RGWError(f"{state_dir}: no gateway state ({STATE_FILE}) there") from None
        doc["state_dir"] = state_dir
        return cls(**doc)

    # -- starting ---------------------------------------------------------------------

    @classmethod
    def start(cls, state_dir: Optional[str] = None, *, memstore_bytes: int = DEFAULT_MEMSTORE_BYTES,
              bound_to_parent: bool = False, timeout_s: float = 60.0) -> "RGW":
        """Make and start a new cluster in `state_dir` (a new temp dir when
        None; it must be empty). On failure everything started is stopped."""
        missing = missing_binaries()
        if missing:
            raise RGWError("Ceph is not installed (missing " + ", ".join(missing) + "): "
                           "run tools/setup-debian.sh --with-tests, or apt-get install "
                           "--no-install-recommends ceph-mon ceph-osd radosgw")
        if state_dir is None:
            state_dir = tempfile.mkdtemp(prefix="ckptfs-rgw-")
        state_dir = os.path.abspath(state_dir)
        os.makedirs(state_dir, exist_ok=True)
        if os.listdir(state_dir):
            raise RGWError(f"{state_dir} is not empty: give the gateway a fresh directory")
        rgw = cls(state_dir, fsid=str(uuid.uuid4()), memstore_bytes=memstore_bytes)
        t0 = time.monotonic()
        try:
            rgw._start(bound_to_parent, time.monotonic() + timeout_s)
        except BaseException:
            rgw.stop()
            raise
        rgw.started_s = round(time.monotonic() - t0, 3)
        rgw._save()
        return rgw

    def _config(self) -> str:
        d = self.state_dir
        return f"""\
[global]
fsid = {self.fsid}
mon host = v2:127.0.0.1:{self.mon_port}
mon initial members = a
public addr = 127.0.0.1
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
mon warn on insecure global id reclaim allowed = false
ms client mode = crc
ms service mode = crc
ms cluster mode = crc
ms mon client mode = crc
ms mon service mode = crc
ms mon cluster mode = crc
keyring = /dev/null
run dir = {d}/run
admin socket = {d}/run/$name.asok
pid file = {d}/run/$name.pid
log file = {d}/log/$name.log
log to stderr = false
mon cluster log file = default={d}/log/ceph.$channel.log cluster={d}/log/ceph.log
mon data = {d}/mon
mon data avail warn = -1
mon data avail crit = -1
paxos propose interval = 0.01
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd data = {d}/osd
osd objectstore = memstore
memstore device bytes = {self.memstore_bytes}
osd crush chassis type = 0

[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{self.rgw_port} tcp_nodelay=1
rgw data = {d}/rgw
rgw gc obj min wait = 0
rgw gc processor period = 60
# the tests' multipart uploads use 64 KiB parts (AWS's minimum is 5 MiB)
rgw multipart min part size = 65536
# quota checks see new usage at once (a "full store" is a small bucket quota): the
# bucket quota cache keeps nothing. The user-quota sync threads run every second,
# not back to back: at interval 0 they spin and keep a core busy (RGW 55% and the
# OSD 44% of a CPU while idle), which slowed every test that ran after the gateway.
rgw bucket quota ttl = 0
rgw user quota bucket sync interval = 1
rgw user quota sync interval = 1
"""

    def _run(self, args: list[str], deadline: float, what: str) -> str:
        try:
            res = subprocess.run(args, capture_output=True, text=True,
                                 timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RGWError(f"{what} timed out (logs in {self._p('log')})") from None
        if res.returncode != 0:
            err = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
            raise RGWError(f"{what} failed: {err} (logs in {self._p('log')})")
        return res.stdout

    def _ceph(self, *args: str, deadline: float) -> str:
        return self._run(["ceph", "-c", self.conf_path, "--connect-timeout",
                          str(max(1, int(deadline - time.monotonic()))), *args],
                         deadline, "ceph " + " ".join(args))

    def _spawn(self, role: str, args: list[str], bound_to_parent: bool) -> None:
        out = open(self._p("log", f"{role}.out"), "ab")
        try:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True,
                                    preexec_fn=_die_with_parent if bound_to_parent else None)
        finally:
            out.close()
        self.pids[role] = proc.pid
        self._procs[role] = proc
        self._save()

    def _check_alive(self, role: str) -> None:
        proc = self._procs[role]
        if proc.poll() is not None:
            tail = ""
            try:
                with open(self._p("log", f"{role}.out")) as f:
                    lines = [ln.strip() for ln in f if ln.strip()]
                tail = f": {lines[-1]}" if lines else ""
            except OSError:
                pass
            raise RGWError(f"{role} exited with {proc.returncode}{tail} "
                           f"(logs in {self._p('log')})")

    def _start(self, bound_to_parent: bool, deadline: float) -> None:
        for sub in ("run", "log", "mon", "osd", "rgw"):
            os.makedirs(self._p(sub), exist_ok=True)
        self.mon_port, self.rgw_port = _free_port(), _free_port()
        while self.rgw_port == self.mon_port:
            self.rgw_port = _free_port()
        for port in (self.mon_port, self.rgw_port):
            if _port_answers(port):
                raise RGWError(f"port {port} was taken meanwhile: try again")
        with open(self.conf_path, "w") as f:
            f.write(self._config())
        self._save()
        conf = ["-c", self.conf_path]

        # Monitor.
        self._run(["monmaptool", "--create", "--add", "a", f"v2:127.0.0.1:{self.mon_port}",
                   "--fsid", self.fsid, self._p("monmap"), *conf], deadline, "monmaptool")
        self._run(["ceph-mon", "--mkfs", "-i", "a", "--monmap", self._p("monmap"), *conf],
                  deadline, "ceph-mon --mkfs")
        if _port_answers(self.mon_port):
            raise RGWError(f"port {self.mon_port} was taken meanwhile: try again")
        self._spawn("mon", ["ceph-mon", "-f", "-i", "a", *conf], bound_to_parent)
        status = json.loads(self._ceph("status", "--format", "json", deadline=deadline))
        if status.get("fsid") != self.fsid:              # another cluster's monitor answered
            raise RGWError(f"a stranger's monitor answers on port {self.mon_port}")
        self._check_alive("mon")

        # One OSD on memstore.
        osd_uuid = str(uuid.uuid4())
        osd_id = self._ceph("osd", "new", osd_uuid, deadline=deadline).strip()
        self._run(["ceph-osd", "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid, *conf],
                  deadline, "ceph-osd --mkfs")
        self._spawn("osd", ["ceph-osd", "-f", "-i", osd_id, *conf], bound_to_parent)

        # The S3 user, with a full and a read-only key pair (waits for the OSD).
        admin = ["radosgw-admin", *conf, "-n", "client.rgw"]
        self._run([*admin, "user", "create", f"--uid={USER}", f"--display-name={USER}",
                   f"--access-key={self.access_key}", f"--secret-key={self.secret_key}"],
                  deadline, "radosgw-admin user create")
        self._check_alive("osd")
        self._run([*admin, "subuser", "create", f"--uid={USER}", f"--subuser={USER}:ro",
                   "--access=read", "--key-type=s3", f"--access-key={self.read_only_access_key}",
                   f"--secret-key={self.read_only_secret_key}"],
                  deadline, "radosgw-admin subuser create")

        self._start_gateway(bound_to_parent, deadline)

    def _start_gateway(self, bound_to_parent: bool, deadline: float) -> None:
        if _port_answers(self.rgw_port):
            raise RGWError(f"port {self.rgw_port} was taken meanwhile: try again")
        self._spawn("rgw", ["radosgw", "-f", "-n", "client.rgw", "-c", self.conf_path],
                    bound_to_parent)
        while True:
            self._check_alive("rgw")
            if self._answers():
                break
            if time.monotonic() > deadline:
                raise RGWError(f"radosgw does not answer on {self.endpoint_url} "
                               f"(logs in {self._p('log')})")
            time.sleep(0.05)
        self._check_alive("rgw")          # the answer was ours, not a stale server's

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint_url + "/", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    # -- running ----------------------------------------------------------------------

    def status(self) -> dict:
        alive = {role: _alive(pid) for role, pid in self.pids.items()}
        return {"state_dir": self.state_dir, "endpoint_url": self.endpoint_url,
                "alive": alive, "answers": all(alive.values()) and self._answers(),
                "rss_bytes": {role: _rss_bytes(pid) for role, pid in self.pids.items()
                              if alive[role]},
                "started_s": self.started_s}

    def rss_bytes(self) -> int:
        """Resident memory of the three daemons together."""
        return sum(_rss_bytes(pid) for pid in self.pids.values() if _alive(pid))

    def admin(self, *args: str, timeout_s: float = 30.0) -> str:
        """Run radosgw-admin against this cluster (quotas, listing)."""
        return self._run(["radosgw-admin", "-c", self.conf_path, "-n", "client.rgw", *args],
                         time.monotonic() + timeout_s, "radosgw-admin " + " ".join(args))

    def stop_gateway(self) -> None:
        """Stop radosgw only (the endpoint is down; the data stays in the OSD)."""
        pid = self.pids.pop("rgw", None)
        if pid is not None:
            _stop_pid(pid, self._procs.pop("rgw", None), 10.0)
        self._save()

    def start_gateway(self, *, bound_to_parent: bool = True, timeout_s: float = 30.0) -> None:
        """Start radosgw again on its port, after `stop_gateway`."""
        if "rgw" in self.pids:
            raise RGWError("the gateway is running")
        self._start_gateway(bound_to_parent, time.monotonic() + timeout_s)
        self._save()

    def pause(self) -> None:
        """SIGSTOP the gateway: connections are accepted, nothing answers."""
        os.kill(self.pids["rgw"], signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pids["rgw"], signal.SIGCONT)

    # -- stopping ---------------------------------------------------------------------

    def stop(self, *, keep: bool = False, timeout_s: float = 10.0) -> None:
        """Stop radosgw, then the OSD, then the monitor; remove the state
        directory unless `keep`. Idempotent."""
        for role in STOP_ORDER:
            pid = self.pids.get(role)
            if pid is None:
                continue
            proc = self._procs.get(role)
            _stop_pid(pid, proc, timeout_s)
        if self.pids:
            self.pids = {}
            if os.path.isdir(self.state_dir):
                self._save()
        if not keep:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> "RGW":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_pid(pid: int, proc: Optional[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM (and SIGCONT, in case it was paused), wait, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            break
        end = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < end:
            if proc is not None:
                if proc.poll() is not None:
                    return
            elif not _alive(pid):
                return
            time.sleep(0.02)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1)


def create_bucket(rgw: RGW, name: str) -> None:
    import botocore.session
    s3 = botocore.session.get_session().create_client(
        "s3", endpoint_url=rgw.endpoint_url, region_name=rgw.region,
        aws_access_key_id=rgw.access_key, aws_secret_access_key=rgw.secret_key)
    s3.create_bucket(Bucket=name)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tools/rgw.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start a new gateway; prints shell exports for clients")
    s.add_argument("--dir", help="state directory (default: a new temp dir)")
    s.add_argument("--bucket", action="append", default=[], help="create this bucket too")
    s.add_argument("--memstore", default=str(DEFAULT_MEMSTORE_BYTES >> 20),
                   help="MiB of RAM the OSD may hold (default 4096)")
    st = sub.add_parser("status", help="is it running; memory")
    st.add_argument("dir")
    sp = sub.add_parser("stop", help="stop it and remove its state directory")
    sp.add_argument("dir")
    sp.add_argument("--keep", action="store_true", help="keep the state directory (logs)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "start":
            rgw = RGW.start(args.dir, memstore_bytes=int(args.memstore) << 20)
            try:
                for b in args.bucket:
                    create_bucket(rgw, b)
            except Exception:
                rgw.stop()
                raise
            config, creds = rgw.write_aws_files()
            for k, v in rgw.env().items():
                print(f"export {k}={shlex.quote(v)}")
            print(f"# gateway up in {rgw.started_s:.2f} s, {rgw.rss_bytes() >> 20} MiB "
                  f"resident; state in {rgw.state_dir}")
            print(f"# profiles ckptfs-rgw and ckptfs-rgw-ro: AWS_CONFIG_FILE={config} "
                  f"AWS_SHARED_CREDENTIALS_FILE={creds}")
            print(f"# stop with: python3 tools/rgw.py stop {shlex.quote(rgw.state_dir)}")
        elif args.cmd == "status":
            st = RGW.load(args.dir).status()
            print(json.dumps(st, indent=1))
            return 0 if st["answers"] else 1
        else:
            RGW.load(args.dir).stop(keep=args.keep)
        return 0
    except RGWError as e:
        print(f"rgw: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
