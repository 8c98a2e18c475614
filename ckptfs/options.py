"""Mount options: parsing, validation and the embedded defaults.

One table (`OPTIONS`) lists every option ckptfs understands; `mount.ckptfs
--help` and the README are written from it. An option not in the table is an
error, never silently ignored; the generic mount(8) options that make no
sense for ckptfs (auto, nofail, ...) are accepted because fstab passes them.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Optional

from .errors import OperationFailed, UsageError

STATE_DIR = ".ckptfs"
DEFAULT_PMEM_SIZE_MAX = 8 << 30
DEFAULT_PMEM_SIZE_MIN = 256 << 20

# name -> (takes a value, help)
OPTIONS: dict[str, tuple[bool, str]] = {
    "pmem": (True, "log file or DAX device (default SOURCE/.ckptfs/pmem.log)"),
    "pmem_size": (True, "log size with K/M/G/T suffix; default for a new log: a quarter of "
                        "the free space there, between 256M and 8G; an existing log keeps its "
                        "size unless a larger one is given (it grows)"),
    "sync": (True, "close (default): close returns once the file's commit is durable; "
                   "lazy: close returns at once, the commit is durable within lazy_delay"),
    "lazy_delay": (True, "sync=lazy: seconds a commit may wait to be durable before closes "
                         "wait for it (default 1)"),
    "dedup": (True, "on (default): store bytes already stored (by any file, any version) "
                    "only once; off: store every write as written"),
    "backing": (True, "backing store cold chunks move to, compressed: an absolute "
                      "directory path or file:///DIR (default SOURCE/.ckptfs/store; in "
                      "production a shared filesystem), or s3://BUCKET/PREFIX (endpoint, "
                      "region and keys the standard AWS way: AWS_* variables, ~/.aws/config "
                      "and ~/.aws/credentials; never in these options)"),
    "aws_profile": (True, "s3:// store: the AWS profile of ~/.aws/config and "
                          "~/.aws/credentials to use (default: AWS_PROFILE, else 'default')"),
    "volume": (True, "this filesystem's name in the backing store (default: the host name); "
                     "a name another filesystem holds there is refused; `ckptfs recover` "
                     "with volume= restores a volume and the next mount takes it over"),
    "publish_delay": (True, "seconds within which every commit is copied to the backing "
                            "store and published (default 5 when backing= names a store, off "
                            "for the default store below SOURCE); off: only at tiering"),
    "unmount_publish_timeout": (True, "with publishing on: seconds a clean unmount may spend "
                                      "copying what is not in the store yet and publishing "
                                      "(default 60); what is left then stays in the log and "
                                      "the next mount publishes it"),
    "peers": (True, "all, or volume names joined by ':': show below this mount's own files, "
                    "read-only, what those other volumes of the backing store published "
                    "(merged by path; own names win); default: none"),
    "peer_refresh": (True, "peers=: seconds between looks at the store for newer publishes "
                           "of the peers (default 2); the kernel caches peers' names as long"),
    "hot_versions": (True, "checkpoint versions kept hot in the log (default 2); older ones "
                           "move to the backing store"),
    "tiering": (True, "on (default): move cold versions to the backing store in the "
                      "background; off: keep everything in the log"),
    "metrics_port": (True, "serve Prometheus metrics on http://127.0.0.1:PORT/metrics "
                           "(loopback only)"),
    "metrics_file": (True, "write Prometheus metrics to PATH every 10 s, atomically (for "
                           "node_exporter's textfile collector; PATH must be outside the mount)"),
    "allow_other": (False, "on (default when root mounts): every user may use the mount, "
                           "file modes decide (default_permissions); =off: only the user who "
                           "mounted (the default for others; =on needs user_allow_other in "
                           "/etc/fuse.conf)"),
    "ro": (False, "mount read-only"),
    "debug": (False, "log every operation's detail (to stderr with -f, else the daemon log)"),
    "foreground": (False, "same as -f"),
}

# Generic options mount(8) and fstab hand to every helper.
PASSED_THROUGH = {"rw", "nosuid", "suid", "nodev", "dev", "noexec", "exec", "noatime",
                  "atime", "relatime"}
IGNORED = {"defaults", "auto", "noauto", "nofail", "_netdev", "user", "nouser", "users",
           "owner", "group", "nocomment"}

_PROFILE = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGTP]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"bad size {text!r} (use a number with an optional K/M/G/T suffix)")
    shift = " KMGTP".index((m.group(2) or " ").upper()) * 10
    return int(m.group(1)) << shift


@dataclass
class MountOptions:
    source: str
    mountpoint: str
    pmem: Optional[str] = None
    pmem_size: Optional[int] = None
    sync: str = "close"
    lazy_delay_s: float = 1.0
    dedup: bool = True
    backing: Optional[str] = None
    aws_profile: Optional[str] = None
    volume: Optional[str] = None
    publish_delay_s: Optional[float] = None     # None: the default; math.inf: off
    unmount_publish_timeout_s: float = 60.0
    peers: Optional[list[str]] = None           # None: no peer view; []: every other volume
    peer_refresh_s: float = 2.0
    hot_versions: int = 2
    tiering: bool = True
    metrics_port: Optional[int] = None
    metrics_file: Optional[str] = None
    allow_other: Optional[bool] = None     # None: on when root mounts (parse_options)
    read_only: bool = False
    debug: bool = False
    foreground: bool = False
    kernel_flags: list[str] = field(default_factory=list)

    @property
    def state_dir(self) -> str:
        return os.path.join(self.source, STATE_DIR)

    @property
    def pmem_path(self) -> str:
        return self.pmem or os.path.join(self.state_dir, "pmem.log")

    @property
    def backing_dir(self) -> str:
        return self.backing or os.path.join(self.state_dir, "store")

    @property
    def index_dir(self) -> str:
        # Never on the DAX mapping: LMDB needs sector-atomic meta page writes.
        return os.path.join(self.state_dir, "index")

    def default_pmem_size(self) -> int:
        where = os.path.dirname(self.pmem_path) or "."
        free = shutil.disk_usage(where).free
        size = min(DEFAULT_PMEM_SIZE_MAX, max(DEFAULT_PMEM_SIZE_MIN, free // 4))
        return size // (1 << 20) * (1 << 20)

    def to_option_string(self) -> str:
        """Back to -o form, for handing to the daemon process."""
        parts = []
        if self.pmem:
            parts.append(f"pmem={self.pmem}")
        if self.pmem_size is not None:
            parts.append(f"pmem_size={self.pmem_size}")
        parts.append(f"sync={self.sync}")
        parts.append(f"lazy_delay={self.lazy_delay_s}")
        parts.append(f"dedup={'on' if self.dedup else 'off'}")
        if self.backing:
            parts.append(f"backing={self.backing}")
        if self.aws_profile:
            parts.append(f"aws_profile={self.aws_profile}")
        if self.volume:
            parts.append(f"volume={self.volume}")
        if self.publish_delay_s is not None:
            parts.append("publish_delay=" + ("off" if math.isinf(self.publish_delay_s)
                                             else f"{self.publish_delay_s}"))
        parts.append(f"unmount_publish_timeout={self.unmount_publish_timeout_s:g}")
        if self.peers is not None:
            parts.append("peers=" + (":".join(self.peers) or "all"))
            parts.append(f"peer_refresh={self.peer_refresh_s:g}")
        parts.append(f"hot_versions={self.hot_versions}")
        parts.append(f"tiering={'on' if self.tiering else 'off'}")
        if self.metrics_port is not None:
            parts.append(f"metrics_port={self.metrics_port}")
        if self.metrics_file:
            parts.append(f"metrics_file={self.metrics_file}")
        parts.append("allow_other" if self.allow_other else "allow_other=off")
        for flag, on in (("ro", self.read_only), ("debug", self.debug)):
            if on:
                parts.append(flag)
        parts.extend(self.kernel_flags)
        return ",".join(parts)


def parse_options(source: str, mountpoint: str, option_strings: list[str]) -> MountOptions:
    """Validate SOURCE, MOUNTPOINT and every -o option.

    A bad option raises UsageError, a SOURCE or MOUNTPOINT that is not a
    directory OperationFailed; either with one line.
    """
    source = os.path.abspath(source)
    mountpoint = os.path.abspath(mountpoint)
    if not os.path.isdir(source):
        raise OperationFailed(f"source {source} is not a directory (create it first)")
    if not os.path.isdir(mountpoint):
        raise OperationFailed(f"mountpoint {mountpoint} does not exist or is not a directory "
                              "(create it first)")
    opts = MountOptions(source=source, mountpoint=mountpoint)
    for chunk in option_strings:
        for item in filter(None, (s.strip() for s in chunk.split(","))):
            name, eq, value = item.partition("=")
            _apply(opts, name, value if eq else None, item)
    if opts.allow_other is None:
        # Root mounts (setup script, fstab, systemd) serve the training job's own
        # user too: with default_permissions the file modes decide, as on ext4.
        opts.allow_other = os.geteuid() == 0
    return opts


def _apply(opts: MountOptions, name: str, value: Optional[str], item: str) -> None:
    if name in IGNORED or name.startswith("x-") or name == "comment":
        return
    if name in PASSED_THROUGH and value is None:
        if name != "rw":
            opts.kernel_flags.append(name)
        return
    spec = OPTIONS.get(name)
    if spec is None:
        raise UsageError(f"unknown mount option {item!r} (see mount.ckptfs --help)")
    if name == "allow_other":
        # Bare (as fstab lines have it) or =on; =off keeps the mount to its user.
        if value not in (None, "on", "off"):
            raise UsageError(f"allow_other must be 'on' or 'off', not {value!r}")
        opts.allow_other = value != "off"
        return
    takes_value, _ = spec
    if takes_value and not value:
        raise UsageError(f"mount option {name} needs a value ({name}=...)")
    if not takes_value and value is not None:
        raise UsageError(f"mount option {name} takes no value")
    if name == "pmem":
        opts.pmem = os.path.abspath(value)
    elif name == "pmem_size":
        from .pmemlog import MIN_SIZE_BYTES
        opts.pmem_size = parse_size(value)
        if opts.pmem_size < MIN_SIZE_BYTES:
            raise UsageError(f"pmem_size {value} is too small (at least {MIN_SIZE_BYTES >> 10}K)")
    elif name == "sync":
        if value not in ("close", "lazy"):
            raise UsageError(f"sync must be close or lazy, not {value!r}")
        opts.sync = value
    elif name == "lazy_delay":
        opts.lazy_delay_s = _seconds(name, value, 0, 3600, low_ok=False)
    elif name == "dedup":
        opts.dedup = _on_off(name, value)
    elif name == "backing":
        from .backing import check_location
        opts.backing = check_location(value)
    elif name == "aws_profile":
        if not _PROFILE.match(value):
            raise UsageError(f"aws_profile must be a profile name (letters, digits, . _ + -), "
                             f"not {value!r}")
        opts.aws_profile = value
    elif name == "volume":
        from .volumes import check_name
        opts.volume = check_name(value)
    elif name == "publish_delay":
        opts.publish_delay_s = math.inf if value == "off" else \
            _seconds(name, value, 0, 86400, low_ok=False, or_off=True)
    elif name == "unmount_publish_timeout":
        opts.unmount_publish_timeout_s = _seconds(name, value, 0, 86400)
    elif name == "peers":
        from .volumes import check_name
        if value in ("all", "") or value is None:
            opts.peers = []
        elif value == "none":
            opts.peers = None
        else:
            opts.peers = [check_name(v) for v in value.split(":")]
    elif name == "peer_refresh":
        opts.peer_refresh_s = _seconds(name, value, 0.1, 3600)
    elif name == "hot_versions":
        try:
            opts.hot_versions = int(value)
        except ValueError:
            raise UsageError(f"hot_versions must be a whole number, not {value!r}") from None
        if not 0 <= opts.hot_versions <= 1_000_000:
            raise UsageError("hot_versions must be between 0 and 1000000")
    elif name == "tiering":
        opts.tiering = _on_off(name, value)
    elif name == "metrics_port":
        from .metrics import parse_port
        opts.metrics_port = parse_port(value)
    elif name == "metrics_file":
        from .metrics import check_textfile_path
        opts.metrics_file = check_textfile_path(value, opts.mountpoint)
    elif name == "ro":
        opts.read_only = True
    elif name == "debug":
        opts.debug = True
    elif name == "foreground":
        opts.foreground = True


def _on_off(name: str, value: str) -> bool:
    if value not in ("on", "off"):
        raise UsageError(f"{name} must be 'on' or 'off', not {value!r}")
    return value == "on"


def _seconds(name: str, value: str, low: float, high: float, *, low_ok: bool = True,
             or_off: bool = False) -> float:
    """value as seconds in [low, high] ((low, high] unless low_ok); or_off:
    the option also takes "off" (the messages say so)."""
    try:
        seconds = float(value)
    except ValueError:
        raise UsageError(f"{name} must be a number of seconds{' or off' if or_off else ''}, "
                         f"not {value!r}") from None
    if not (low <= seconds if low_ok else low < seconds) or not seconds <= high:
        raise UsageError(f"{name} must be between {low:g} and {high:g} seconds"
                         f"{', or off' if or_off else ''}")
    return seconds


def options_help() -> str:
    lines = ["Options (-o NAME[=VALUE],...):"]
    for name, (takes_value, text) in OPTIONS.items():
        shown = name + ("=VALUE" if takes_value else "[=off]" if name == "allow_other" else "")
        lines.append(f"  {shown:<18} {text}")
    lines.append("  Generic mount options " + ", ".join(sorted(PASSED_THROUGH)) +
                 " are passed to the kernel; " + ", ".join(sorted(IGNORED)) +
                 ", x-* and comment= are accepted and ignored.")
    return "\n".join(lines)
