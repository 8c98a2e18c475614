"""Prometheus metrics (ckptfs/metrics.py): the exposition parses, carries the
numbers of a stats dict, the commit histogram counts observations, the
textfile is replaced atomically, the HTTP endpoint serves on loopback and
stops, the trio tasks refresh without the HTTP thread ever calling stats();
and, end to end, the numbers of a real mount (`ckptfs stat --json`).
"""

from __future__ import annotations

import errno
import math
import os
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from mounting import MOUNT_HELPER
from posix_helpers import MiB, check_clean, pattern, read_file, write_file

from ckptfs import metrics
from ckptfs.errors import UsageError
from ckptfs.metrics import (COMMIT_BUCKETS_S, CommitLatency, MetricsServer, MountMetrics,
                            Snapshot, make_registry, metrics_text)

MP = "/data/ckpt"

# What Filesystem.stats() returns on a mount with tiering on (shape of core.py + tier.py).
STATS = {
    "version": 1, "pid": 4242, "uptime_s": 12.5, "sync": "close",
    "files": 7, "logical_bytes": 300 * MiB, "stored_bytes": 120 * MiB,
    "hot_bytes": 100 * MiB, "pmem_size": 512 * MiB, "pmem_free_bytes": 412 * MiB,
    "pmem_dax": False, "source_bytes": 0, "cold_bytes": 20 * MiB,
    "cold_logical_bytes": 50 * MiB, "compression_ratio": 2.5, "chunks": 1234,
    "dedup": True, "dedup_ratio": 2.5, "dedup_hits": 321, "dedup_saved_bytes": 77 * MiB,
    "open_files": 2, "dirty_files": 1, "commits": 99, "commit_seconds_avg": 0.0042,
    "bytes_written": 400 * MiB, "bytes_read": 250 * MiB,
    "errors": {"DamagedData": 3, "unexpected": 1}, "read_only": True,
    "last_error": "disk on fire", "index_map_bytes": 1 << 30, "index_used_bytes": 1 << 20,
    "tier_state": "moving", "tier_backlog_bytes": 30 * MiB, "tier_moved_bytes": 60 * MiB,
    "tier_packs_written": 4, "tier_last_error": None, "tier_longest_writer_wait_s": 0.25,
    "tier_leftover_packs": 1,
    "cold_cache_hits": 10, "cold_fetches": 5, "backing": "file:///store",
}

# metric sample name -> stats key (counters carry _total)
EXPECTED = {
    "ckptfs_written_bytes_total": "bytes_written",
    "ckptfs_read_bytes_total": "bytes_read",
    "ckptfs_commits_total": "commits",
    "ckptfs_dedup_hits_total": "dedup_hits",
    "ckptfs_dedup_saved_bytes_total": "dedup_saved_bytes",
    "ckptfs_tier_moved_bytes_total": "tier_moved_bytes",
    "ckptfs_tier_packs_written_total": "tier_packs_written",
    "ckptfs_cold_cache_hits_total": "cold_cache_hits",
    "ckptfs_cold_fetches_total": "cold_fetches",
    "ckptfs_log_used_bytes": "hot_bytes",
    "ckptfs_log_size_bytes": "pmem_size",
    "ckptfs_log_free_bytes": "pmem_free_bytes",
    "ckptfs_logical_bytes": "logical_bytes",
    "ckptfs_stored_bytes": "stored_bytes",
    "ckptfs_cold_bytes": "cold_bytes",
    "ckptfs_cold_logical_bytes": "cold_logical_bytes",
    "ckptfs_source_bytes": "source_bytes",
    "ckptfs_chunks": "chunks",
    "ckptfs_files": "files",
    "ckptfs_open_files": "open_files",
    "ckptfs_dirty_files": "dirty_files",
    "ckptfs_dedup_ratio": "dedup_ratio",
    "ckptfs_index_used_bytes": "index_used_bytes",
    "ckptfs_tier_backlog_bytes": "tier_backlog_bytes",
    "ckptfs_tier_leftover_packs": "tier_leftover_packs",
    "ckptfs_tier_longest_writer_wait_seconds": "tier_longest_writer_wait_s",
    "ckptfs_uptime_seconds": "uptime_s",
    "ckptfs_read_only": "read_only",
    "ckptfs_dedup_enabled": "dedup",
}


def parse(text: str) -> dict[str, list]:
    """sample name -> [Sample]; also checks the text parses and names are well-formed."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("ckptfs_"), family.name
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(samples: dict, name: str, **labels) -> float:
    hits = [s for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, f"{name} {labels}: {hits}"
    return hits[0].value


# ------------------------------------------------------------------ collector

def test_counters_and_gauges_carry_the_stats_values():
    samples = parse(metrics_text(STATS, MP))
    for name, key in EXPECTED.items():
        assert value(samples, name) == float(STATS[key]), name
    assert value(samples, "ckptfs_up") == 1
    assert value(samples, "ckptfs_tiering_enabled") == 1
    assert value(samples, "ckptfs_tier_error") == 0
    assert value(samples, "ckptfs_tier_state", state="moving") == 1
    assert value(samples, "ckptfs_errors_total", kind="DamagedData") == 3
    assert value(samples, "ckptfs_errors_total", kind="unexpected") == 1
    # every series names its mount
    for name, ss in samples.items():
        for s in ss:
            assert s.labels.get("mountpoint") == MP, (name, s.labels)


def test_types_and_units_follow_prometheus_conventions():
    families = {f.name: f for f in text_string_to_metric_families(metrics_text(STATS, MP))}
    for name, f in families.items():
        if f.type == "counter":
            assert all(s.name.endswith("_total") for s in f.samples if s.name != name + "_created")
        if "bytes" in name:
            assert name.endswith("_bytes"), name          # base unit last (before _total)
        if "seconds" in name or "wait" in name or "uptime" in name:
            assert name.endswith("_seconds"), name
    assert families["ckptfs_written_bytes"].type == "counter"
    assert families["ckptfs_log_used_bytes"].type == "gauge"
    assert families["ckptfs_tier_backlog_bytes"].type == "gauge"
    assert families["ckptfs_errors"].type == "counter"


def test_tiering_off_leaves_out_the_tier_series():
    stats = {k: v for k, v in STATS.items() if not k.startswith(("tier_", "cold_cache",
                                                                 "cold_fetches", "backing"))}
    stats["tiering"] = False
    stats["read_only"] = False
    stats["errors"] = {}
    samples = parse(metrics_text(stats, MP))
    assert value(samples, "ckptfs_tiering_enabled") == 0
    assert value(samples, "ckptfs_read_only") == 0
    for name in ("ckptfs_tier_backlog_bytes", "ckptfs_tier_moved_bytes_total",
                 "ckptfs_tier_state", "ckptfs_tier_error", "ckptfs_errors_total"):
        assert name not in samples
    assert value(samples, "ckptfs_cold_bytes") == stats["cold_bytes"]


def test_tier_error_and_odd_values():
    stats = dict(STATS, tier_last_error="store gone", errors={"X": "not a number"},
                 dedup_ratio=None, compression_ratio="n/a")
    samples = parse(metrics_text(stats, MP))
    assert value(samples, "ckptfs_tier_error") == 1
    assert "ckptfs_errors_total" not in samples
    assert "ckptfs_dedup_ratio" not in samples and "ckptfs_compression_ratio" not in samples


def test_empty_snapshot_gives_only_the_histogram():
    snap = Snapshot()
    assert snap.age_s() is None
    reg = make_registry(snap.get, MP, CommitLatency(), snap.age_s)
    from prometheus_client import generate_latest
    samples = parse(generate_latest(reg).decode())
    assert "ckptfs_up" not in samples and "ckptfs_stats_age_seconds" not in samples
    assert value(samples, "ckptfs_commit_duration_seconds_count") == 0
    snap.set(STATS)
    samples = parse(generate_latest(reg).decode())
    assert value(samples, "ckptfs_up") == 1
    assert 0 <= value(samples, "ckptfs_stats_age_seconds") < 5


def test_private_registry_not_the_global_one():
    from prometheus_client import REGISTRY
    before = set(REGISTRY._collector_to_names)
    mm = MountMetrics(MP)
    mm.snapshot.set(STATS)
    assert "ckptfs_written_bytes_total" in mm.text()
    assert set(REGISTRY._collector_to_names) == before
    # two mounts in one process do not collide
    other = MountMetrics("/other")
    other.snapshot.set(STATS)
    assert 'mountpoint="/other"' in other.text()


# ------------------------------------------------------------------ histogram

def test_histogram_buckets_count_observations():
    lat = CommitLatency()
    assert lat.bounds == COMMIT_BUCKETS_S
    assert lat.bounds[0] == pytest.approx(0.0001) and lat.bounds[-1] == 10
    for s in (0.00005, 0.0001, 0.0003, 0.004, 0.004, 0.2, 7.0, 10.0, 11.0, -1.0):
        lat.observe(s)
    samples = parse(metrics_text(STATS, MP, lat))
    bucket = {s.labels["le"]: s.value for s in samples["ckptfs_commit_duration_seconds_bucket"]}
    # cumulative; a value on a bound counts in that bound's bucket (le); negatives as 0
    assert bucket["0.0001"] == 3          # 0.00005, 0.0001, -1 -> 0
    assert bucket["0.00025"] == 3
    assert bucket["0.0005"] == 4          # 0.0003
    assert bucket["0.005"] == 6           # 2 x 0.004
    assert bucket["0.25"] == 7            # 0.2
    assert bucket["5.0"] == 7
    assert bucket["10.0"] == 9            # 7.0, 10.0
    assert bucket["+Inf"] == 10           # 11.0
    assert list(bucket) == [metrics._le(b) for b in COMMIT_BUCKETS_S] + ["+Inf"]
    assert value(samples, "ckptfs_commit_duration_seconds_count") == 10
    assert value(samples, "ckptfs_commit_duration_seconds_sum") == pytest.approx(
        0.00005 + 0.0001 + 0.0003 + 0.008 + 0.2 + 7 + 10 + 11)


def test_histogram_is_consistent_under_concurrent_observe_and_collect():
    lat = CommitLatency()
    reg = make_registry(lambda: STATS, MP, lat)
    stop = threading.Event()
    seen_bad: list[str] = []

    def scrape():
        from prometheus_client import generate_latest
        while not stop.is_set():
            s = parse(generate_latest(reg).decode())
            buckets = [x.value for x in s["ckptfs_commit_duration_seconds_bucket"]]
            if buckets != sorted(buckets) or buckets[-1] != \
                    value(s, "ckptfs_commit_duration_seconds_count"):
                seen_bad.append(repr(buckets))

    t = threading.Thread(target=scrape)
    t.start()
    workers = [threading.Thread(target=lambda i=i: [lat.observe((j % 50) * 0.001 * (i + 1))
                                                    for j in range(20000)]) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    t.join()
    assert not seen_bad
    _, count, _ = lat.snapshot()
    assert count == 80000


def test_histogram_rejects_bad_buckets():
    for bad in ([], [0.1, math.inf], [0.1, 0.1], [math.nan]):
        with pytest.raises(ValueError):
            CommitLatency(bad)
    assert CommitLatency([1, 0.5]).bounds == (0.5, 1.0)


# ------------------------------------------------------------------ textfile

def test_textfile_is_written_atomically(tmp_path):
    path = tmp_path / "ckptfs.prom"
    snap = Snapshot(STATS)
    lat = CommitLatency()
    reg = make_registry(snap.get, MP, lat, snap.age_s)
    metrics.write_textfile(str(path), reg)
    assert os.stat(path).st_mode & 0o777 == 0o644
    first = path.read_text()
    assert value(parse(first), "ckptfs_written_bytes_total") == STATS["bytes_written"]
    assert os.listdir(tmp_path) == ["ckptfs.prom"]          # no temporary left

    # A reader never sees a partial file while the writer rewrites it over and over.
    stop = threading.Event()
    bad: list[str] = []

    def writer():
        n = 0
        while not stop.is_set():
            n += 1
            snap.set(dict(STATS, bytes_written=n, errors={f"kind{i}": i for i in range(n % 50)}))
            lat.observe(0.001)
            metrics.write_textfile(str(path), reg)

    t = threading.Thread(target=writer)
    t.start()
    try:
        deadline = time.monotonic() + 1.5
        reads = 0
        while time.monotonic() < deadline:
            text = path.read_text()
            reads += 1
            samples = parse(text)
            if "ckptfs_stats_age_seconds" not in samples or \
                    "ckptfs_commit_duration_seconds_count" not in samples:
                bad.append(text[-200:])
    finally:
        stop.set()
        t.join()
    assert reads > 10 and not bad
    assert os.listdir(tmp_path) == ["ckptfs.prom"]


def test_textfile_failed_rename_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "ckptfs.prom"
    path.write_text("# old\n")

    def broken_rename(src, dst, **dir_fds):
        raise OSError(errno.EIO, "Input/output error", src)

    monkeypatch.setattr(metrics.os, "rename", broken_rename)
    with pytest.raises(OSError):
        metrics.write_textfile(str(path), make_registry(lambda: STATS, MP))
    monkeypatch.undo()
    assert path.read_text() == "# old\n"
    assert os.listdir(tmp_path) == ["ckptfs.prom"]


def test_trio_tasks_refresh_on_the_trio_thread_and_write_the_file(tmp_path):
    path = tmp_path / "m.prom"
    mm = MountMetrics(MP)
    calls: list[int] = []
    trio_thread: list[int] = []

    def stats():
        calls.append(threading.get_ident())
        return dict(STATS, bytes_written=len(calls))

    async def main():
        trio_thread.append(threading.get_ident())
        async with trio.open_nursery() as nursery:
            await nursery.start(metrics.refresh_periodically, mm.snapshot, stats, 0.05)
            assert len(calls) == 1          # started after the first refresh
            await nursery.start(metrics.write_textfile_periodically, str(path), mm.registry,
                                0.05)
            assert path.exists()            # first write done before started()
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(calls) >= 5
    assert set(calls) == {trio_thread[0]}
    got = value(parse(path.read_text()), "ckptfs_written_bytes_total")
    assert got >= 3
    assert sorted(os.listdir(tmp_path)) == ["m.prom"]


def test_textfile_writer_survives_a_missing_directory(tmp_path, caplog):
    gone = tmp_path / "gone"
    gone.mkdir()
    path = gone / "m.prom"
    reg = make_registry(lambda: STATS, MP)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(metrics.write_textfile_periodically, str(path), reg, 0.05)
            os.unlink(path)
            os.rmdir(gone)
            await trio.sleep(0.2)           # failing: logged once, keeps going
            gone.mkdir()
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    with caplog.at_level("INFO", logger="ckptfs.metrics"):
        trio.run(main)
    assert path.exists()
    warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1
    assert any("works again" in r.getMessage() for r in caplog.records)


def test_refresh_keeps_last_numbers_when_stats_fails():
    snap = Snapshot()
    n = [0]

    def stats():
        n[0] += 1
        if n[0] > 1:
            raise RuntimeError("boom")
        return {"bytes_written": 5}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(metrics.refresh_periodically, snap, stats, 0.02)
            # Until it has failed twice (a fixed 0.15 s saw only one failure
            # under load in CI), bounded so a refresher that stopped fails.
            with trio.fail_after(10):
                while n[0] <= 2:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert n[0] > 2 and snap.get() == {"bytes_written": 5}


# ------------------------------------------------------------------ HTTP

def http_get(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def test_http_server_serves_on_loopback_and_stops():
    mm = MountMetrics(MP)
    mm.snapshot.set(STATS)
    server = MetricsServer.start(mm.registry, 0)
    try:
        assert server._httpd.server_address[0] == "127.0.0.1"
        samples = parse(http_get(server.port))
        assert value(samples, "ckptfs_written_bytes_total") == STATS["bytes_written"]
        # the port is taken: a second server says so in one line
        with pytest.raises(UsageError, match=f"cannot serve metrics on 127.0.0.1:{server.port}"):
            MetricsServer.start(mm.registry, server.port)
    finally:
        port = server.port
        server.stop()
    assert not server._thread.is_alive()
    with pytest.raises(urllib.error.URLError):
        http_get(port)


def test_http_thread_reads_the_snapshot_the_trio_task_refreshes():
    """The daemon's threading model: stats() only on the trio thread, scrapes
    from the HTTP thread see the latest snapshot."""
    mm = MountMetrics(MP)
    callers: set[int] = set()
    counter = [0]

    def stats():
        callers.add(threading.get_ident())
        counter[0] += 1
        return dict(STATS, commits=counter[0])

    seen: list[float] = []

    async def main():
        trio_ident = threading.get_ident()
        async with trio.open_nursery() as nursery:
            await nursery.start(metrics.refresh_periodically, mm.snapshot, stats, 0.05)
            server = await trio.to_thread.run_sync(MetricsServer.start, mm.registry, 0)
            try:
                for _ in range(4):
                    text = await trio.to_thread.run_sync(http_get, server.port)
                    seen.append(value(parse(text), "ckptfs_commits_total"))
                    mm.commit_latency.observe(0.002)
                    await trio.sleep(0.12)
            finally:
                await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
        assert callers == {trio_ident}

    trio.run(main)
    assert seen == sorted(seen) and seen[-1] > seen[0] >= 1


def test_textfile_never_writes_through_a_planted_symlink(tmp_path, monkeypatch):
    """Root writes the textfile into a directory other users write into (sticky,
    like /tmp): symlinks planted at the temporary's name (even a guessed one) and
    at the final name never make it write or chmod anything else."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's data\n")
    os.chmod(victim, 0o600)
    path = shared / "ckptfs.prom"
    # The name the writer used to take (pid and thread id are no secret) ...
    (shared / f".ckptfs.prom.{os.getpid()}.{threading.get_ident()}.tmp").symlink_to(victim)
    # ... and the final name.
    path.symlink_to(victim)
    reg = make_registry(lambda: STATS, MP)
    metrics.write_textfile(str(path), reg)
    # Even a guessed temporary name: the planted symlink there is never opened.
    guesses = iter(["guessed", "fresh"])
    monkeypatch.setattr(metrics.secrets, "token_hex", lambda n: next(guesses))
    (shared / ".ckptfs.prom.guessed.tmp").symlink_to(victim)
    metrics.write_textfile(str(path), reg)
    monkeypatch.undo()
    assert victim.read_bytes() == b"root's data\n"
    assert os.stat(victim).st_mode & 0o777 == 0o600
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 == 0o644
    assert value(parse(path.read_text()), "ckptfs_written_bytes_total") == STATS["bytes_written"]
    assert sorted(os.listdir(shared)) == sorted([
        "ckptfs.prom", ".ckptfs.prom.guessed.tmp",
        f".ckptfs.prom.{os.getpid()}.{threading.get_ident()}.tmp"])


def test_textfile_refuses_a_world_writable_directory_without_sticky_bit(make_mount, tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(UsageError, match="world-writable without the sticky bit"):
        metrics.check_textfile_path(str(open_dir / "x.prom"), str(tmp_path / "mnt"))
    with pytest.raises(OSError, match="world-writable"):
        metrics.write_textfile(str(open_dir / "x.prom"), make_registry(lambda: STATS, MP))
    assert os.listdir(open_dir) == []
    # At mount: one line, exit 2, nothing mounted.
    m = make_mount(start=False)
    res = subprocess.run(MOUNT_HELPER + [str(m.source), str(m.path), "-o",
                                         f"pmem_size=64M,metrics_file={open_dir}/x.prom"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "sticky" in lines[0], res.stderr
    assert not (m.source / ".ckptfs").exists()
    # The sticky bit makes it fine (/tmp).
    os.chmod(open_dir, 0o1777)
    assert metrics.check_textfile_path(str(open_dir / "x.prom"), str(tmp_path / "mnt"))


# ------------------------------------------------------------------ options

def test_option_helpers(tmp_path):
    assert metrics.parse_port("9105") == 9105
    for bad in ("0", "65536", "-1", "http", ""):
        with pytest.raises(UsageError):
            metrics.parse_port(bad)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    ok = metrics.check_textfile_path(str(tmp_path / "ckptfs.prom"), str(mnt))
    assert ok == str(tmp_path / "ckptfs.prom")
    with pytest.raises(UsageError, match="inside the mount"):
        metrics.check_textfile_path(str(mnt / "ckptfs.prom"), str(mnt))
    link = tmp_path / "link"
    link.symlink_to(mnt)
    with pytest.raises(UsageError, match="inside the mount"):
        metrics.check_textfile_path(str(link / "x.prom"), str(mnt))
    with pytest.raises(UsageError, match="does not exist"):
        metrics.check_textfile_path(str(tmp_path / "nodir" / "x.prom"), str(mnt))
    with pytest.raises(UsageError, match="is a directory"):
        metrics.check_textfile_path(str(mnt), str(tmp_path / "elsewhere"))


# ------------------------------------------------------------------ end to end

def test_metrics_of_a_real_mount(mounted, fsck_clean):
    m = mounted
    data = pattern(3 * MiB, seed=1)
    write_file(m.path / "a.bin", data)
    write_file(m.path / "b.bin", data)          # the same bytes: dedup hits
    (m.path / "d").mkdir()
    write_file(m.path / "d" / "small", b"x" * 100)
    assert read_file(m.path / "a.bin") == data
    stats = m.stat()
    samples = parse(metrics_text(stats, str(m.path)))
    assert value(samples, "ckptfs_written_bytes_total") == stats["bytes_written"] >= 6 * MiB + 100
    assert value(samples, "ckptfs_read_bytes_total") == stats["bytes_read"]
    assert value(samples, "ckptfs_commits_total") == stats["commits"] >= 1
    assert value(samples, "ckptfs_dedup_hits_total") == stats["dedup_hits"] >= 1
    assert value(samples, "ckptfs_dedup_saved_bytes_total") == stats["dedup_saved_bytes"] > 0
    assert value(samples, "ckptfs_log_used_bytes") == stats["hot_bytes"] > 0
    assert value(samples, "ckptfs_log_size_bytes") == stats["pmem_size"] == 512 * MiB
    assert value(samples, "ckptfs_files") == 3
    assert value(samples, "ckptfs_logical_bytes") == 6 * MiB + 100
    assert value(samples, "ckptfs_read_only") == 0
    assert value(samples, "ckptfs_tiering_enabled") == (0 if stats.get("tiering") is False else 1)
    for ss in samples.values():
        assert all(s.labels["mountpoint"] == str(m.path) for s in ss)
    check_clean(fsck_clean, m)
