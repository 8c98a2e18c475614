"""The S3 backend against a real Ceph RADOS Gateway, beyond the conformance
suite (tests/store/test_backing.py): where its endpoint and credentials come from,
and what it does when the gateway is down, throttles (503 SlowDown), stops
answering in the middle of an upload, or refuses the credentials.

Faults are real: radosgw stopped or paused with SIGSTOP, and a small HTTP
proxy that answers 503 SlowDown to the first N requests and forwards the
rest, unchanged, to the gateway.
"""

from __future__ import annotations

import errno
import http.client
import http.server
import os
import random
import shutil
import socket
import subprocess
import threading
import time
import uuid

import botocore.session
import pytest

from ckptfs.backing.s3 import S3Backend
from ckptfs.errors import (BackingCredentials, BackingUnavailable, BlobMissing,
                           InvalidArgument)

from mounting import MOUNT_HELPER, is_mounted, run_ckptfs
from posix_helpers import check_clean, pattern, read_file, write_file
from store_state import kill_in_tier_pass
from test_backing import put, s3_client, s3_session
from test_tier import tier_now, verify, write_version

KIB = 1024
MiB = 1 << 20


@pytest.fixture
def bucket(rgw):
    """A fresh, empty bucket on the test gateway; emptied and removed after."""
    admin = s3_client(rgw)
    name = f"ckptfs-s3-{uuid.uuid4().hex[:16]}"
    admin.create_bucket(Bucket=name)
    yield name
    if "rgw" not in rgw.pids:                # a test left the gateway down
        rgw.start_gateway()
    for up in admin.list_multipart_uploads(Bucket=name).get("Uploads", ()):
        admin.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=name):
        for obj in page.get("Contents", ()):
            admin.delete_object(Bucket=name, Key=obj["Key"])
    admin.delete_bucket(Bucket=name)


def make_store(rgw, bucket: str, **kw) -> S3Backend:
    kw.setdefault("session", s3_session(rgw))
    kw.setdefault("part_size_bytes", 64 * KIB)
    return S3Backend.create(f"s3://{bucket}/store", **kw)


def aws_env(monkeypatch, **values: str) -> None:
    """Only these AWS_* variables (and no instance metadata lookups)."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    for k, v in values.items():
        monkeypatch.setenv(k, v)


# -- where endpoint and credentials come from ---------------------------------------------

@pytest.mark.parametrize("endpoint_var", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_endpoint_and_keys_from_the_environment(rgw, bucket, monkeypatch, endpoint_var):
    env = rgw.env()
    aws_env(monkeypatch, AWS_ACCESS_KEY_ID=env["AWS_ACCESS_KEY_ID"],
            AWS_SECRET_ACCESS_KEY=env["AWS_SECRET_ACCESS_KEY"],
            AWS_DEFAULT_REGION=rgw.region, **{endpoint_var: rgw.endpoint_url})
    with S3Backend.create(f"s3://{bucket}/p") as b:
        put(b, "m/a", b"from the environment")
        assert b.endpoint_url == rgw.endpoint_url
    with S3Backend(f"s3://{bucket}/p") as again:
        assert again.read("m/a", 0, 20) == b"from the environment"


@pytest.mark.parametrize("per_service", [False, True], ids=["endpoint_url", "services"])
def test_profile_from_the_shared_files(rgw, bucket, monkeypatch, tmp_path, per_service):
    """A named profile: keys in the credentials file, region and endpoint in
    the config file (the profile's endpoint_url, or S3's in a `[services]`
    section it names), chosen by AWS_PROFILE or by the `profile` argument."""
    env = rgw.env()
    config, creds = tmp_path / "config", tmp_path / "credentials"
    endpoint = (f"services = rgw\n\n[services rgw]\ns3 =\n  endpoint_url = {rgw.endpoint_url}\n"
                if per_service else f"endpoint_url = {rgw.endpoint_url}\n")
    config.write_text(f"[profile ckpt]\nregion = {rgw.region}\n{endpoint}")
    creds.write_text(f"[ckpt]\naws_access_key_id = {env['AWS_ACCESS_KEY_ID']}\n"
                     f"aws_secret_access_key = {env['AWS_SECRET_ACCESS_KEY']}\n")
    aws_env(monkeypatch, AWS_CONFIG_FILE=str(config), AWS_SHARED_CREDENTIALS_FILE=str(creds))
    with S3Backend.create(f"s3://{bucket}/p", profile="ckpt") as b:
        put(b, "m/a", b"profile")
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    with S3Backend(f"s3://{bucket}/p") as b:
        assert b.read("m/a", 0, 7) == b"profile"
    with pytest.raises(BackingCredentials, match="nope"):
        S3Backend(f"s3://{bucket}/p", profile="nope").check()


# -- credentials refused ----------------------------------------------------------------------

def test_bad_credentials_are_one_clear_line(rgw, bucket, monkeypatch):
    env = rgw.env()
    make_store(rgw, bucket).close()
    cases = {
        "InvalidAccessKeyId": dict(AWS_ACCESS_KEY_ID="AKIANOSUCHKEY0000000",
                                   AWS_SECRET_ACCESS_KEY=env["AWS_SECRET_ACCESS_KEY"]),
        "SignatureDoesNotMatch": dict(AWS_ACCESS_KEY_ID=env["AWS_ACCESS_KEY_ID"],
                                      AWS_SECRET_ACCESS_KEY="not-the-secret"),
        "no usable AWS credentials": {},
    }
    for why, keys in cases.items():
        aws_env(monkeypatch, AWS_ENDPOINT_URL=rgw.endpoint_url, **keys)
        b = S3Backend(f"s3://{bucket}/store")
        for call in (b.check, b.list, lambda: b.read("m/a", 0, 1)):
            with pytest.raises(BackingCredentials, match=why) as info:
                call()
            msg = str(info.value)
            assert "\n" not in msg and f"s3://{bucket}/store" in msg
            assert env["AWS_SECRET_ACCESS_KEY"] not in msg and "not-the-secret" not in msg
        b.close()


# -- the gateway down, throttling, stalled ----------------------------------------------------

def test_endpoint_down_then_back(rgw, bucket):
    """radosgw stopped: every call is BackingUnavailable naming the endpoint,
    within the retry budget; started again, the same handle works and the
    data is all there."""
    b = make_store(rgw, bucket, connect_timeout_s=1, read_timeout_s=2, max_attempts=2)
    data = random.Random(1).randbytes(200 * KIB)
    put(b, "packs/aa/1.pack", data)
    rgw.stop_gateway()
    try:
        for call in (b.check, b.list, lambda: b.read("packs/aa/1.pack", 0, 10),
                     lambda: b.size("packs/aa/1.pack"), lambda: put(b, "m/new", b"x"),
                     lambda: b.delete("packs/aa/1.pack"), lambda: b.remove_incomplete(0)):
            t = time.monotonic()
            with pytest.raises(BackingUnavailable, match=f"cannot reach {rgw.endpoint_url}"):
                call()
            assert time.monotonic() - t < 10
    finally:
        rgw.start_gateway()
    b.check()
    assert b.list() == ["packs/aa/1.pack"]
    assert b.read("packs/aa/1.pack", 0, len(data)) == data


class SlowDownProxy:
    """An HTTP proxy on 127.0.0.1 that answers 503 SlowDown (S3's "reduce
    your request rate") to the requests `slow(n)` picks (n counts requests
    from 0) and forwards every other one to the gateway unchanged (the Host
    header too, so SigV4 signatures stay valid). Counts what it did."""

    def __init__(self, target_port: int, slow) -> None:
        self.target_port = target_port
        self.slow = slow
        self.requests = 0
        self.throttled = 0
        self.forwarded = 0
        self.bytes_served = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    throttle = proxy.slow(proxy.requests)
                    proxy.requests += 1
                    if throttle:
                        proxy.throttled += 1
                    else:
                        proxy.forwarded += 1
                if throttle:
                    reply = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown'
                             b'</Code><Message>Please reduce your request rate.</Message>'
                             b'</Error>')
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(reply)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=30)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True,
                                    skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        conn.putheader(k, v)
                    conn.endheaders(body or None)
                    resp = conn.getresponse()
                    payload = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        with proxy._lock:       # counted before the client can see it
                            proxy.bytes_served += len(payload)
                        self.wfile.write(payload)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(rgw):
    """proxy(slow) -> a SlowDownProxy in front of the test gateway."""
    made: list[SlowDownProxy] = []

    def factory(slow=lambda n: False) -> SlowDownProxy:
        p = SlowDownProxy(rgw.rgw_port, slow)
        made.append(p)
        return p

    yield factory
    for p in made:
        p.close()


def via(rgw, p: SlowDownProxy):
    """A botocore session with the test keys whose clients go through `p`."""
    env = rgw.env()
    sess = botocore.session.Session()
    sess.set_credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    sess.set_config_variable("region", rgw.region)
    create = sess.create_client
    sess.create_client = lambda *a, **kw: create(*a, endpoint_url=p.url, **kw)
    return sess


def test_slowdown_is_retried_with_backoff(rgw, bucket, proxy):
    """Every request answered 503 SlowDown once before it goes through: a
    multipart pack upload and its read back succeed, each request retried
    after a backoff; nothing is left over."""
    b0 = make_store(rgw, bucket)
    p = proxy(slow=lambda n: n % 2 == 0)
    b = S3Backend(b0.url, b0.store_uuid, session=via(rgw, p), part_size_bytes=64 * KIB,
                  max_attempts=3)
    data = random.Random(2).randbytes(150 * KIB)
    t = time.monotonic()
    put(b, "packs/bb/1.pack", data)            # marker, checks, create, 3 parts, complete
    assert b.read("packs/bb/1.pack", 0, len(data)) == data
    elapsed = time.monotonic() - t
    assert p.throttled == p.forwarded and p.forwarded >= 8, (p.throttled, p.forwarded)
    assert elapsed > 0.1 * p.throttled                     # it backed off (jittered)
    assert b0.list() == ["packs/bb/1.pack"] and b0.incomplete_uploads() == []


def test_slowdown_that_does_not_stop_is_unavailable(rgw, bucket, proxy):
    b0 = make_store(rgw, bucket)
    put(b0, "m/a", b"hello")
    p = proxy(slow=lambda n: True)
    b = S3Backend(b0.url, b0.store_uuid, session=via(rgw, p), max_attempts=3)
    with pytest.raises(BackingUnavailable, match="SlowDown.*after retries") as info:
        b.read("m/a", 0, 5)
    assert p.throttled == 3 and p.forwarded == 0           # three attempts, then it says so
    assert b.url in str(info.value) and "m/a" in str(info.value)
    p.slow = lambda n: False
    assert b.read("m/a", 0, 5) == b"hello"


def test_reads_are_ranged(rgw, bucket, proxy):
    """A read of 1000 bytes of a 2 MiB pack moves about 1000 bytes."""
    b0 = make_store(rgw, bucket)
    data = random.Random(5).randbytes(2 << 20)
    put(b0, "packs/dd/1.pack", data)
    p = proxy()
    b = S3Backend(b0.url, b0.store_uuid, session=via(rgw, p))
    assert b.read("packs/dd/1.pack", 1 << 20, 1000) == data[1 << 20:(1 << 20) + 1000]
    assert p.forwarded == 1 and p.bytes_served == 1000


def test_timeout_mid_upload_and_gc_removes_what_is_left(rgw, bucket):
    """The gateway stops answering (SIGSTOP) between two parts of a pack: the
    write fails within the timeout budget and nothing becomes visible; once
    the gateway is back, remove_incomplete (what `ckptfs gc` calls) removes
    the upload if the writer's own abort did not get through."""
    b = make_store(rgw, bucket, connect_timeout_s=1, read_timeout_s=1, max_attempts=2)
    w = b.writer("packs/cc/1.pack")
    w.write(random.Random(3).randbytes(200 * KIB))          # three parts are up
    assert b.incomplete_uploads() == ["packs/cc/1.pack"]
    rgw.pause()
    try:
        t = time.monotonic()
        with pytest.raises(BackingUnavailable, match="did not answer within 1 s"):
            w.write(random.Random(4).randbytes(100 * KIB))
        assert time.monotonic() - t < 20
        assert not w.committed
    finally:
        rgw.resume()
    with pytest.raises(InvalidArgument, match="aborted"):
        w.commit()                                         # the failed writer was aborted
    time.sleep(0.5)                                        # requests queued in the pause finish
    assert b.list() == []
    with pytest.raises(BlobMissing):
        b.size("packs/cc/1.pack")
    left = b.incomplete_uploads()
    assert left in ([], ["packs/cc/1.pack"])
    assert b.remove_incomplete(older_than=3600) == 0       # too young for a routine sweep
    assert b.remove_incomplete(older_than=0) == len(left)
    assert b.incomplete_uploads() == [] and b.list() == []


def test_remove_incomplete_spares_other_prefixes(rgw, bucket):
    """gc of one store never aborts uploads of another store in the bucket,
    even one whose prefix starts with the same letters."""
    a = S3Backend.create(f"s3://{bucket}/a", session=s3_session(rgw), part_size_bytes=64 * KIB)
    other = S3Backend.create(f"s3://{bucket}/ab", session=s3_session(rgw),
                             part_size_bytes=64 * KIB)
    wa, wo = a.writer("packs/1.pack"), other.writer("packs/1.pack")
    for w in (wa, wo):
        w.write(bytes(100 * KIB))
    assert a.remove_incomplete(older_than=0) == 1
    assert other.incomplete_uploads() == ["packs/1.pack"]
    wo.write(b"more")
    wo.commit()
    assert other.list() == ["packs/1.pack"]
    wa.abort()


# -- through a real mount ----------------------------------------------------------------------

@pytest.fixture
def s3_env(rgw, monkeypatch):
    """The test gateway in the environment (AWS_ENDPOINT_URL, the keys), the
    standard way: the daemons, fsck and recover the test starts inherit it."""
    aws_env(monkeypatch, **rgw.env())
    return rgw.env()


def objects(rgw, bucket: str, prefix: str = "") -> list[str]:
    pages = s3_client(rgw).get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                      Prefix=prefix)
    return [o["Key"] for p in pages for o in p.get("Contents", ())]


def mount_cmd(m, *options: str) -> subprocess.CompletedProcess:
    args = MOUNT_HELPER + [str(m.source), str(m.path), "-o", ",".join(m.options + list(options))]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_mount_tiers_to_s3_remounts_and_reads_back(make_mount, rgw, bucket, s3_env, fsck_clean):
    url = f"s3://{bucket}/ckpt"
    m = make_mount(options=["pmem_size=256M", "hot_versions=1", f"backing={url}"])
    files: dict[str, bytes] = {}
    for step in range(1, 4):
        files.update(write_version(m.path, step, size=2 * MiB))
    tier_now(m, "--all")
    st = m.stat()
    assert st["backing"] == url
    assert st["cold_bytes"] > 0 and st["cold_logical_bytes"] >= 3 * 3 * MiB
    keys = objects(rgw, bucket)
    assert "ckpt/ckptfs-store" in keys
    assert any(k.startswith("ckpt/packs/") for k in keys)
    # The namespace as a snapshot (docs/STORE.md): objects, then the head naming them.
    assert any(k.startswith("ckpt/volumes/") and "/objects/" in k for k in keys)
    assert any(k.startswith("ckpt/volumes/") and "/heads/" in k for k in keys)
    m.remount()                        # empty caches: every cold byte from RGW
    assert m.stat()["hot_bytes"] < 4 * MiB
    verify(m.path, files)
    m.umount()
    check_clean(fsck_clean, m)


def test_recover_from_s3_alone(make_mount, rgw, bucket, s3_env, fsck_clean):
    """The index and the log lost: `ckptfs recover -o backing=s3://...` rebuilds
    every tiered file from the bucket."""
    url = f"s3://{bucket}/ckpt"
    m = make_mount(options=["pmem_size=128M", f"backing={url}"])
    files: dict[str, bytes] = {}
    for step in range(1, 3):
        files.update(write_version(m.path, step, size=1 * MiB))
    tier_now(m, "--all")
    m.umount()
    state = m.source / ".ckptfs"
    shutil.rmtree(state / "index")
    os.unlink(state / "pmem.log")
    res = run_ckptfs("recover", str(m.source), "-o", f"backing={url}")
    assert "recovered 6 files" in res.stdout and url in res.stdout, res.stdout
    m.start()
    verify(m.path, files)
    check_clean(fsck_clean, m)


def test_mount_with_bad_credentials_fails_with_one_line(make_mount, rgw, bucket, s3_env,
                                                        monkeypatch):
    url = f"s3://{bucket}/ckpt"
    m = make_mount(options=["pmem_size=64M", f"backing={url}"], start=False)
    cases = [(True, "AWS_SECRET_ACCESS_KEY", "not-the-secret", "SignatureDoesNotMatch"),
             (False, "AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000", "InvalidAccessKeyId")]
    for first_mount, var, value, code in cases:
        if not first_mount:            # the store exists now: a later mount is refused too
            m.start()
            m.umount()                 # publishes the (empty) namespace: a head and its root
            written = objects(rgw, bucket)
        monkeypatch.setenv(var, value)
        res = mount_cmd(m)
        monkeypatch.setenv(var, s3_env[var])
        assert res.returncode == 1, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and code in lines[0] and url in lines[0], lines
        assert "rejects the credentials" in lines[0] and value not in lines[0]
        assert not is_mounted(m.path)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    res = mount_cmd(m)
    assert res.returncode == 1 and "no usable AWS credentials" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not is_mounted(m.path)
    assert objects(rgw, bucket) == written       # the refused mounts wrote nothing
    assert "ckpt/ckptfs-store" in written


def test_endpoint_down_at_mount_and_back(make_mount, rgw, bucket, s3_env, fsck_clean,
                                         monkeypatch):
    """The gateway is down when an existing store is mounted: the mount goes
    ahead with one warning; hot data works, cold reads fail with EIO, tiering
    fails and says why; once the gateway is back, the same mount reads the
    cold data and tiers again."""
    url = f"s3://{bucket}/ckpt"
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")        # the AWS way to retry less
    m = make_mount(options=["pmem_size=128M", f"backing={url}"])
    cold = write_version(m.path, 1, size=1 * MiB)
    tier_now(m, "--all")
    m.umount()
    rgw.stop_gateway()
    try:
        res = mount_cmd(m)
        assert res.returncode == 0, res.stderr
        m.pid = m.stat()["pid"]
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptfs: warning: ") and url in lines[0]
        assert f"cannot reach {rgw.endpoint_url}" in lines[0] and "mounted anyway" in lines[0]
        hot = {"hot.bin": pattern(MiB, 7)}
        write_file(m.path / "hot.bin", hot["hot.bin"])
        verify(m.path, hot)
        with pytest.raises(OSError) as info:
            read_file(m.path / "step_1/model.bin")
        assert info.value.errno == errno.EIO
        res = run_ckptfs("tier", str(m.path), "--now", "--all", check=False, timeout=300)
        assert res.returncode == 1 and "cannot reach" in res.stderr, res.stderr
        assert "cannot reach" in (m.stat()["tier_last_error"] or "")
    finally:
        rgw.start_gateway()
    verify(m.path, cold)
    tier_now(m, "--all")
    verify(m.path, hot)
    check_clean(fsck_clean, m)


def test_interrupted_pass_is_undone_by_the_next_mount(make_mount, rgw, bucket, s3_env,
                                                     monkeypatch, tmp_path, fsck_clean):
    """SIGKILL after a pack went up to the bucket and before the index named
    it (the mover's debug hook stops it there): fsck notes the pack as a
    leftover (exit 0); the next mount publishes a snapshot, then deletes it by
    itself; every byte reads back and fsck is clean."""
    url = f"s3://{bucket}/ckpt"
    marker = tmp_path / "paused"
    monkeypatch.setenv("CKPTFS_DEBUG_PAUSE", f"pack-written:{marker}")
    m = make_mount(options=["pmem_size=128M", "hot_versions=0", f"backing={url}"])
    monkeypatch.delenv("CKPTFS_DEBUG_PAUSE")
    files = write_version(m.path, 1, size=2 * MiB)
    kill_in_tier_pass(m, marker, "the mover never committed a pack")
    (leftover,) = objects(rgw, bucket, "ckpt/packs/")
    res = m.fsck()
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"note: {leftover[len('ckpt/'):]} was left by an interrupted tiering pass" \
        in res.stdout, res.stdout
    m.start()
    deadline = time.monotonic() + 60
    while m.stat()["tier_leftover_packs"]:
        assert time.monotonic() < deadline, "the leftover was never removed"
        time.sleep(0.1)
    assert m.stat()["snapshot_seq"] is not None        # published before it deleted
    assert leftover not in objects(rgw, bucket, "ckpt/packs/")
    verify(m.path, files)
    m.umount()
    res = m.fsck()
    assert res.returncode == 0 and "note:" not in res.stdout, res.stdout
    check_clean(fsck_clean, m)


def test_gc_aborts_stale_multipart_uploads(make_mount, rgw, bucket, s3_env, fsck_clean):
    """A pack upload interrupted for good (a crash, a timeout whose abort was
    lost) is invisible; `ckptfs gc` aborts it; another store's upload in the
    same bucket is left alone."""
    url = f"s3://{bucket}/ckpt"
    m = make_mount(options=["pmem_size=64M", f"backing={url}"])
    write_file(m.path / "f", pattern(MiB))
    admin = s3_client(rgw)
    stale = admin.create_multipart_upload(Bucket=bucket, Key="ckpt/packs/00/00000000000000ff.pack")
    admin.upload_part(Bucket=bucket, Key="ckpt/packs/00/00000000000000ff.pack",
                      UploadId=stale["UploadId"], PartNumber=1, Body=b"half a pack")
    other = admin.create_multipart_upload(Bucket=bucket, Key="ckpt2/packs/00/1.pack")
    res = run_ckptfs("gc", str(m.path))
    assert "1 temporary files" in res.stdout, res.stdout
    left = admin.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["UploadId"] for u in left] == [other["UploadId"]]
    admin.abort_multipart_upload(Bucket=bucket, Key="ckpt2/packs/00/1.pack",
                                 UploadId=other["UploadId"])
    check_clean(fsck_clean, m)


def test_failed_first_mount_leaves_the_bucket_as_it_was(make_mount, rgw, bucket, s3_env):
    """A first mount that fails after it created the S3 store (here: its
    metrics port is taken) deletes the marker it wrote; the next first mount
    makes the store again."""
    url = f"s3://{bucket}/ckpt"
    m = make_mount(options=["pmem_size=64M", f"backing={url}"], start=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = mount_cmd(m, f"metrics_port={taken.getsockname()[1]}")
    assert res.returncode == 1 and "metrics" in res.stderr, res.stderr
    assert not is_mounted(m.path)
    assert objects(rgw, bucket) == []
    m.start()
    write_file(m.path / "f", b"after")
    keys = objects(rgw, bucket)         # the marker, its volume's lease and pack space
    assert "ckpt/ckptfs-store" in keys, keys
    assert {k.split("/")[1] for k in keys} >= {"leases", "spaces"}, keys
