"""The test S3 server itself (tools/rgw.py): it starts, answers as itself,
stops without leaving a daemon behind; and the S3 semantics of Debian 12's
RGW (Ceph 16.2) that the volume lease of issue 13 will build on.
"""

from __future__ import annotations

import http.server
import threading

import botocore.session
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

import rgw as rgw_tool


SESSION = botocore.session.get_session()      # one session: loading the S3 model is slow


def client(gw, **kw):
    return SESSION.create_client(
        "s3", endpoint_url=gw.endpoint_url, region_name=gw.region,
        aws_access_key_id=gw.access_key, aws_secret_access_key=gw.secret_key,
        config=Config(retries={"mode": "standard", "max_attempts": 1}), **kw)


def test_gateway_is_up_and_small(rgw):
    st = rgw.status()
    assert st["answers"] and all(st["alive"].values()), st
    assert set(rgw.pids) == {"mon", "osd", "rgw"}
    assert rgw.rss_bytes() < 512 << 20              # three daemons, memstore nearly empty
    s3 = client(rgw)
    s3.create_bucket(Bucket="ckptfs-rgw-smoke")
    s3.put_object(Bucket="ckptfs-rgw-smoke", Key="k", Body=b"hello")
    assert s3.get_object(Bucket="ckptfs-rgw-smoke", Key="k", Range="bytes=1-3")["Body"].read() \
        == b"ell"
    with pytest.raises(ClientError, match="AccessDenied"):       # the read-only key pair
        SESSION.create_client(
            "s3", endpoint_url=rgw.endpoint_url, region_name=rgw.region,
            aws_access_key_id=rgw.read_only_access_key,
            aws_secret_access_key=rgw.read_only_secret_key,
        ).put_object(Bucket="ckptfs-rgw-smoke", Key="k2", Body=b"no")
    s3.delete_object(Bucket="ckptfs-rgw-smoke", Key="k")
    s3.delete_bucket(Bucket="ckptfs-rgw-smoke")


class _Stranger(http.server.BaseHTTPRequestHandler):
    def do_GET(self):                                   # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_stale_server_on_the_port_is_never_taken_for_ours(tmp_path, monkeypatch):
    """Another server answering on the gateway's port (a stale radosgw of an
    earlier run) fails the start with one line; nothing is left running."""
    tool = rgw_tool
    if tool.missing_binaries():
        pytest.skip("Ceph is not installed")
    stranger = http.server.HTTPServer(("127.0.0.1", 0), _Stranger)
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    ports = iter([tool._free_port(), stranger.server_port])
    monkeypatch.setattr(tool, "_free_port", lambda: next(ports))
    try:
        with pytest.raises(tool.RGWError, match=f"port {stranger.server_port} was taken"):
            tool.RGW.start(str(tmp_path / "gw"), bound_to_parent=True)
    finally:
        stranger.shutdown()
        stranger.server_close()
    assert not (tmp_path / "gw").exists()               # stopped and removed


def test_start_stop_leaves_nothing(tmp_path):
    tool = rgw_tool
    if tool.missing_binaries():
        pytest.skip("Ceph is not installed")
    with pytest.raises(tool.RGWError, match="not empty"):
        (tmp_path / "used").mkdir()
        (tmp_path / "used" / "x").write_text("x")
        tool.RGW.start(str(tmp_path / "used"))
    gw = tool.RGW.start(str(tmp_path / "gw"), memstore_bytes=256 << 20, bound_to_parent=True)
    pids = dict(gw.pids)
    try:
        assert tool.RGW.load(gw.state_dir).status()["answers"]
    finally:
        gw.stop()
    assert not any(tool._alive(pid) for pid in pids.values())
    assert not tool._port_answers(gw.rgw_port) and not tool._port_answers(gw.mon_port)
    assert not (tmp_path / "gw").exists()
    gw.stop()                                            # idempotent


# -- what a lease between nodes can rely on (issue 13, item 4) ---------------------------

def test_create_once_is_atomic(rgw):
    """PUT with If-None-Match: * creates an object once: of 8 nodes racing for
    each generation number exactly one wins, the others get 412."""
    bucket = "ckptfs-rgw-leases"
    clients = [client(rgw) for _ in range(8)]
    clients[0].create_bucket(Bucket=bucket)
    for gen in range(10):
        wins, errors = [], []
        barrier = threading.Barrier(len(clients))

        def race(i: int) -> None:
            barrier.wait()
            try:
                clients[i].put_object(Bucket=bucket, Key=f"lease/{gen:020d}",
                                      Body=f"node {i}".encode(), IfNoneMatch="*")
                wins.append(i)
            except ClientError as e:
                errors.append(e.response["Error"]["Code"])

        threads = [threading.Thread(target=race, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1 and errors == ["PreconditionFailed"] * 7, (gen, wins, errors)
        body = clients[1].get_object(Bucket=bucket, Key=f"lease/{gen:020d}")["Body"].read()
        assert body == f"node {wins[0]}".encode()        # read-after-write, from another client


def test_compare_and_swap_with_the_bare_etag(rgw):
    """PUT with If-Match replaces an object only if its ETag is still the one
    given. Ceph 16.2 compares the ETag without its quotes: the quoted form
    (RFC 7232's, and what GET/HEAD return) never matches."""
    bucket = "ckptfs-rgw-cas"
    s3 = client(rgw)
    s3.create_bucket(Bucket=bucket)
    first = s3.put_object(Bucket=bucket, Key="head", Body=b"gen 1")["ETag"].strip('"')
    second = s3.put_object(Bucket=bucket, Key="head", Body=b"gen 2", IfMatch=first)["ETag"]
    with pytest.raises(ClientError, match="PreconditionFailed"):
        s3.put_object(Bucket=bucket, Key="head", Body=b"stale writer", IfMatch=first)
    assert s3.get_object(Bucket=bucket, Key="head")["Body"].read() == b"gen 2"
    with pytest.raises(ClientError, match="PreconditionFailed"):
        s3.put_object(Bucket=bucket, Key="head", Body=b"gen 3", IfMatch=second)   # quoted
    s3.put_object(Bucket=bucket, Key="head", Body=b"gen 3", IfMatch=second.strip('"'))
    assert s3.get_object(Bucket=bucket, Key="head")["Body"].read() == b"gen 3"
