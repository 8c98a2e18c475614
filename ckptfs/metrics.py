"""Prometheus metrics of a running mount (prometheus_client, a private registry).

Two ways out, chosen by mount options:

- ``metrics_port=PORT``: an HTTP endpoint on 127.0.0.1:PORT only
  (`MetricsServer`, prometheus_client's WSGI server in a daemon thread,
  stopped at unmount);
- ``metrics_file=PATH``: the text exposition written to PATH every few
  seconds, atomically (an unpredictable temporary name in the same
  directory, created with O_EXCL|O_NOFOLLOW, then rename),
  for node_exporter's textfile collector (`write_textfile_periodically`).

Threads. `Filesystem.stats()` belongs to the trio thread (it reads the index
and scans every inode), and the trio thread must never block. So the numbers
travel through a `Snapshot`: a trio task (`refresh_periodically`) calls
``fs.stats()`` every few seconds and swaps in the new dict (a reference
assignment; the dict is never changed afterwards); the HTTP thread and the
textfile writer's worker thread only ever read the latest one. The commit
latency histogram (`CommitLatency`) is observed by the index committer on the
trio thread and read under a lock.

Names follow the Prometheus conventions: ``ckptfs_`` prefix, base units in
the name (``_bytes``, ``_seconds``), ``_total`` on counters, and a
``mountpoint`` label on every series. Counters restart at zero at every mount
(the daemon counts since it started); ``rate()`` handles that as a reset.
`metrics_text(stats)` renders one stats dict (for tests and tools).
"""

from __future__ import annotations

import bisect
import errno
import logging
import math
import os
import secrets
import stat
import threading
import time
from typing import Callable, Iterable, Iterator, Mapping, Optional

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector

from .errors import UsageError

log = logging.getLogger(__name__)

#: Commit latency buckets (seconds): 0.1 ms .. 10 s, about 2.5x apart.
COMMIT_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: How often the trio task refreshes the snapshot, and the textfile is written.
DEFAULT_REFRESH_S = 5.0
DEFAULT_TEXTFILE_S = 10.0
#: The snapshot refresh may use at most this share of the trio thread: with a
#: huge namespace (stats() scans every inode) refreshes space themselves out.
MAX_REFRESH_DUTY = 0.01

LOOPBACK = "127.0.0.1"

StatsDict = Mapping[str, object]


# ------------------------------------------------------------------ inputs

class Snapshot:
    """The latest `Filesystem.stats()` dict, readable from any thread.

    `set` swaps in a new dict (one reference assignment: atomic under the
    GIL); readers get a dict nobody changes any more.
    """

    def __init__(self, stats: Optional[StatsDict] = None) -> None:
        self._stats: StatsDict = dict(stats) if stats is not None else {}
        self._taken_at: Optional[float] = time.monotonic() if stats is not None else None

    def set(self, stats: StatsDict) -> None:
        self._stats, self._taken_at = stats, time.monotonic()

    def get(self) -> StatsDict:
        return self._stats

    def age_s(self) -> Optional[float]:
        """Seconds since the last refresh (None before the first)."""
        taken = self._taken_at
        return None if taken is None else time.monotonic() - taken


class CommitLatency:
    """Histogram of index commit durations (seconds), safe to read from any thread.

    The index committer calls `observe` after each durable batch (trio
    thread); the collector reads `snapshot` (HTTP or worker thread).
    """

    def __init__(self, buckets: Iterable[float] = COMMIT_BUCKETS_S) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or any(math.isinf(b) or math.isnan(b) for b in bounds):
            raise ValueError("buckets must be finite numbers (+Inf is implied)")
        if len(set(bounds)) != len(bounds):
            raise ValueError("buckets must be distinct")
        self.bounds: tuple[float, ...] = tuple(bounds)
        self._counts = [0] * (len(bounds) + 1)      # last one: above the top bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        i = bisect.bisect_left(self.bounds, seconds)    # le: a value on a bound counts there
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[tuple[float, int]], int, float]:
        """(cumulative (upper bound, count) pairs ending with +Inf, count, sum)."""
        with self._lock:
            counts = list(self._counts)
            total_sum = self._sum
        cumulative, running = [], 0
        for bound, n in zip(self.bounds + (math.inf,), counts):
            running += n
            cumulative.append((bound, running))
        return cumulative, running, total_sum


# --------------------------------------------------------------- collector

# (stats key, metric name, help); a missing key (tiering off, older daemon) is skipped.
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("bytes_written", "ckptfs_written_bytes", "Bytes written to files since mount"),
    ("bytes_read", "ckptfs_read_bytes", "Bytes read from files since mount"),
    ("commits", "ckptfs_commits", "Durable index commits (group-commit batches) since mount"),
    ("dedup_hits", "ckptfs_dedup_hits", "Chunks found already stored since mount"),
    ("dedup_saved_bytes", "ckptfs_dedup_saved_bytes",
     "Bytes of chunks found already stored since mount"),
    ("tier_moved_bytes", "ckptfs_tier_moved_bytes",
     "Bytes moved to the backing store since mount (rate() = tiering throughput)"),
    ("tier_packs_written", "ckptfs_tier_packs_written",
     "Packs written to the backing store since mount"),
    ("published_bytes", "ckptfs_published_bytes",
     "Bytes of committed chunks copied to the backing store since mount (rate() = "
     "publish throughput)"),
    ("publish_packs_written", "ckptfs_publish_packs_written",
     "Packs written by publishing since mount"),
    ("cold_cache_hits", "ckptfs_cold_cache_hits", "Cold chunk reads answered from the cache"),
    ("cold_fetches", "ckptfs_cold_fetches", "Cold chunks fetched from the backing store"),
)

_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("hot_bytes", "ckptfs_log_used_bytes",
     "Log space in use (committed chunks, staged bytes, reserved arenas)"),
    ("pmem_size", "ckptfs_log_size_bytes", "Size of the persistent-memory log"),
    ("pmem_free_bytes", "ckptfs_log_free_bytes", "Free log space"),
    ("logical_bytes", "ckptfs_logical_bytes", "Sum of the sizes of all regular files"),
    ("stored_bytes", "ckptfs_stored_bytes",
     "Bytes held in chunks (log + pre-existing files + backing store)"),
    ("source_bytes", "ckptfs_source_bytes", "Bytes of pre-existing files read in place"),
    ("cold_bytes", "ckptfs_cold_bytes", "Bytes stored in the backing store (compressed)"),
    ("cold_logical_bytes", "ckptfs_cold_logical_bytes",
     "Bytes in the backing store before compression"),
    ("chunks", "ckptfs_chunks", "Chunks in the index"),
    ("files", "ckptfs_files", "Regular files"),
    ("open_files", "ckptfs_open_files", "Files open now"),
    ("dirty_files", "ckptfs_dirty_files", "Files with uncommitted changes"),
    ("dedup_ratio", "ckptfs_dedup_ratio", "logical_bytes / stored_bytes"),
    ("compression_ratio", "ckptfs_compression_ratio",
     "Backing store bytes before / after compression"),
    ("index_used_bytes", "ckptfs_index_used_bytes", "LMDB index space in use"),
    ("index_map_bytes", "ckptfs_index_map_bytes", "LMDB index map size"),
    ("tier_backlog_bytes", "ckptfs_tier_backlog_bytes",
     "Bytes the tiering policy wants moved and not moved yet"),
    ("tier_leftover_packs", "ckptfs_tier_leftover_packs",
     "Packs interrupted tiering passes left in the backing store, still to remove"),
    ("tier_longest_writer_wait_s", "ckptfs_tier_longest_writer_wait_seconds",
     "Longest time a writer waited for log space since mount"),
    ("uptime_s", "ckptfs_uptime_seconds", "Seconds since the daemon mounted"),
    ("publish_lag_s", "ckptfs_publish_lag_seconds",
     "Age of the oldest committed change not yet in a published snapshot (0: all published)"),
    ("publish_backlog_bytes", "ckptfs_publish_backlog_bytes",
     "Bytes of committed chunks not yet copied to the backing store"),
    ("published_copy_bytes", "ckptfs_published_copy_bytes",
     "Bytes in the backing store holding copies of hot chunks (compressed)"),
    ("volume_generation", "ckptfs_volume_generation",
     "Lease generation of the volume this filesystem holds"),
)

_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("read_only", "ckptfs_read_only",
     "1 if the filesystem turned read-only (an index failure, or its volume taken over)"),
    ("volume_fenced", "ckptfs_volume_fenced",
     "1 once another node took this filesystem's volume over (it publishes nothing more)"),
    ("dedup", "ckptfs_dedup_enabled", "1 if dedup=on"),
    ("pmem_dax", "ckptfs_log_dax", "1 if the log is mapped from a DAX device or file"),
)


def _number(value: object) -> Optional[float]:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


class CkptfsCollector(Collector):
    """Metric families of one mount, read from a stats source on each collect.

    `stats` is called on whatever thread collects (the HTTP server's): pass
    `Snapshot.get`, never `Filesystem.stats` itself.
    """

    def __init__(self, stats: Callable[[], StatsDict], mountpoint: str,
                 commit_latency: Optional[CommitLatency] = None,
                 snapshot_age: Optional[Callable[[], Optional[float]]] = None) -> None:
        self._stats = stats
        self._mountpoint = mountpoint
        self._latency = commit_latency
        self._age = snapshot_age

    def collect(self) -> Iterator[Metric]:
        stats = self._stats() or {}
        labels = ["mountpoint"]
        mp = [self._mountpoint]
        if stats:
            yield from self._families(stats, labels, mp)
        if self._latency is not None:
            cumulative, _, total = self._latency.snapshot()
            h = HistogramMetricFamily(
                "ckptfs_commit_duration_seconds",
                "Time to write one group-commit batch durably (log persist + LMDB commit)",
                labels=labels)
            h.add_metric(mp, [(_le(b), n) for b, n in cumulative], total)
            yield h
        if self._age is not None:
            age = self._age()
            if age is not None:
                g = GaugeMetricFamily("ckptfs_stats_age_seconds",
                                      "Seconds since these numbers were taken from the daemon",
                                      labels=labels)
                g.add_metric(mp, age)
                yield g

    @staticmethod
    def _families(stats: StatsDict, labels: list[str], mp: list[str]) -> Iterator[Metric]:
        up = GaugeMetricFamily("ckptfs_up", "1 while the mount is served", labels=labels)
        up.add_metric(mp, 1.0)
        yield up
        for key, name, text in _COUNTERS:
            value = _number(stats.get(key))
            if value is not None:
                c = CounterMetricFamily(name, text, labels=labels)
                c.add_metric(mp, value)
                yield c
        for key, name, text in _GAUGES + _FLAGS:
            value = _number(stats.get(key))
            if value is not None:
                g = GaugeMetricFamily(name, text, labels=labels)
                g.add_metric(mp, value)
                yield g
        # stats has "tiering": False without a tierer, and the tier_* keys with one.
        tiering = GaugeMetricFamily("ckptfs_tiering_enabled", "1 if a backing store is attached",
                                    labels=labels)
        tiering.add_metric(mp, float(bool(stats.get("tiering", "tier_state" in stats))))
        yield tiering
        errors = stats.get("errors")
        c = CounterMetricFamily("ckptfs_errors",
                                "EIO-class errors answered to applications since mount, by kind",
                                labels=labels + ["kind"])
        if isinstance(errors, Mapping):
            for kind, n in sorted(errors.items()):
                value = _number(n)
                if value is not None:
                    c.add_metric(mp + [str(kind)], value)
        yield c
        state = stats.get("tier_state")
        if isinstance(state, str):
            g = GaugeMetricFamily("ckptfs_tier_state", "1 for the tiering mover's current state",
                                  labels=labels + ["state"])
            g.add_metric(mp + [state], 1.0)
            yield g
        state = stats.get("publish_state")
        if isinstance(state, str):
            g = GaugeMetricFamily("ckptfs_publish_state", "1 for publishing's current state",
                                  labels=labels + ["state"])
            g.add_metric(mp + [state], 1.0)
            yield g
            g = GaugeMetricFamily("ckptfs_publish_error", "1 while publishing fails (see "
                                  "ckptfs stat for publish_last_error)", labels=labels)
            g.add_metric(mp, 1.0 if stats.get("publish_last_error") else 0.0)
            yield g
        g = GaugeMetricFamily("ckptfs_tier_error",
                              "1 while tiering fails (see ckptfs stat for tier_last_error)",
                              labels=labels)
        if "tier_last_error" in stats:
            g.add_metric(mp, 1.0 if stats.get("tier_last_error") else 0.0)
            yield g


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def make_registry(stats: Callable[[], StatsDict], mountpoint: str,
                  commit_latency: Optional[CommitLatency] = None,
                  snapshot_age: Optional[Callable[[], Optional[float]]] = None
                  ) -> CollectorRegistry:
    """A private registry (never the global one) holding one `CkptfsCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CkptfsCollector(stats, mountpoint, commit_latency, snapshot_age))
    return registry


class MountMetrics:
    """Everything one mount needs: snapshot, commit histogram, registry."""

    def __init__(self, mountpoint: str) -> None:
        self.mountpoint = mountpoint
        self.snapshot = Snapshot()
        self.commit_latency = CommitLatency()
        self.registry = make_registry(self.snapshot.get, mountpoint, self.commit_latency,
                                      self.snapshot.age_s)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def metrics_text(stats: StatsDict, mountpoint: str = "",
                 commit_latency: Optional[CommitLatency] = None) -> str:
    """The text exposition for one stats dict (as `ckptfs stat --json` prints it)."""
    frozen = dict(stats)
    return generate_latest(make_registry(lambda: frozen, mountpoint, commit_latency)).decode()


# ------------------------------------------------------------- trio tasks

async def refresh_periodically(snapshot: Snapshot, stats: Callable[[], StatsDict],
                               interval_s: float = DEFAULT_REFRESH_S,
                               task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Trio task: snapshot.set(stats()) now and every interval_s, until cancelled.

    stats runs on the trio thread (where `Filesystem.stats` belongs). It
    scans every inode, so on a huge namespace the pause between refreshes
    grows to keep it under MAX_REFRESH_DUTY of the thread. Signals readiness
    (`nursery.start`) after the first refresh.
    """
    started = False
    while True:
        t0 = time.monotonic()
        try:
            snapshot.set(stats())
        except Exception as e:  # a failed refresh keeps the last numbers
            log.warning("metrics: could not take stats: %s", e)
        took = time.monotonic() - t0
        if not started:
            started = True
            task_status.started()
        await trio.sleep(max(interval_s, took / MAX_REFRESH_DUTY))


def write_textfile(path: str, registry: CollectorRegistry) -> None:
    """Write the exposition to path atomically: a hidden temporary in the same
    directory (node_exporter reads only ``*.prom``), then rename. Blocks.

    The daemon runs as root and the directory may be one other users write
    into (a shared textfile directory, /tmp): everything happens relative to
    one directory fd, the temporary gets an unpredictable name and is created
    with O_EXCL|O_NOFOLLOW (a planted file or symlink is never opened), and the
    rename replaces whatever is at the final name without following it.
    """
    data = generate_latest(registry)
    directory, name = os.path.split(os.path.abspath(path))
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        unsafe = unsafe_directory(os.fstat(dir_fd))
        if unsafe:
            raise OSError(errno.EPERM, f"{directory} is {unsafe}: anyone could replace the "
                                       "metrics file")
        while True:
            tmp = f".{name}.{secrets.token_hex(8)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
                break
            except FileExistsError:
                continue
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, 0o644)        # whatever the umask: node_exporter must read it
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        os.close(dir_fd)


def unsafe_directory(st: os.stat_result) -> Optional[str]:
    """Why a directory is no place for a file root writes, or None.

    World-writable without the sticky bit: any user may rename or delete what
    is in it, so whatever the daemon writes there could be swapped.
    """
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return "world-writable without the sticky bit"
    return None


async def write_textfile_periodically(path: str, registry: CollectorRegistry,
                                      interval_s: float = DEFAULT_TEXTFILE_S,
                                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Trio task: write_textfile on a worker thread now and every interval_s.

    A failed write (disk full, directory gone) is logged (once until it
    works again) and retried at the next interval; it never stops the mount.
    """
    failing = False
    started = False
    while True:
        try:
            await trio.to_thread.run_sync(write_textfile, path, registry)
            if failing:
                log.info("metrics: writing %s works again", path)
            failing = False
        except OSError as e:
            if not failing:
                log.warning("metrics: cannot write %s: %s", path, e.strerror or e)
            failing = True
        if not started:
            started = True
            task_status.started()
        await trio.sleep(interval_s)


# ------------------------------------------------------------- HTTP server

class MetricsServer:
    """prometheus_client's HTTP server on 127.0.0.1:port, in a daemon thread."""

    def __init__(self, httpd, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread

    @property
    def port(self) -> int:
        return self._httpd.server_port

    @classmethod
    def start(cls, registry: CollectorRegistry, port: int, addr: str = LOOPBACK
              ) -> "MetricsServer":
        """Bind and serve (port 0: any free port, see .port). UsageError if it cannot bind."""
        from prometheus_client import start_http_server
        try:
            httpd, thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as e:
            raise UsageError(f"cannot serve metrics on {addr}:{port}: "
                             f"{e.strerror or e}") from None
        thread.name = f"ckptfs-metrics-{port}"
        return cls(httpd, thread)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the socket. Blocks (up to ~0.5 s for the poll loop)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout_s)


# ------------------------------------------------------------- options

def parse_port(value: str) -> int:
    """metrics_port=PORT: a TCP port, 1..65535."""
    try:
        port = int(value)
    except ValueError:
        raise UsageError(f"metrics_port must be a TCP port number, not {value!r}") from None
    if not 1 <= port <= 65535:
        raise UsageError(f"metrics_port must be between 1 and 65535, not {port}")
    return port


def check_textfile_path(path: str, mountpoint: str) -> str:
    """metrics_file=PATH: absolute, its directory exists, and not inside the mount
    (the daemon must never reach its own mount). Returns the absolute path."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise UsageError(f"metrics_file: directory {directory} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"metrics_file: {path} is a directory")
    unsafe = unsafe_directory(os.stat(directory))
    if unsafe:
        raise UsageError(f"metrics_file: directory {directory} is {unsafe} (anyone could "
                         "replace the file); use a directory only its owner can write, or "
                         "one with the sticky bit")
    mp = os.path.realpath(mountpoint)
    real = os.path.join(os.path.realpath(directory), os.path.basename(path))
    if real == mp or real.startswith(mp.rstrip(os.sep) + os.sep):
        raise UsageError(f"metrics_file {path} is inside the mount {mountpoint}; "
                         "put it outside (e.g. the node_exporter textfile directory)")
    return path
