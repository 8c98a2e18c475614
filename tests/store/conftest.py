"""Fixtures of the store family: a real S3 server for the S3 backend's tests.

tools/rgw.py is on sys.path (tests/conftest.py puts tools/ there).
"""

from __future__ import annotations

import os

import pytest
import rgw as rgw_tool


@pytest.fixture(scope="session")
def rgw(tmp_path_factory):
    """Ceph's RADOS Gateway on a one-node Ceph in RAM (tools/rgw.py), started
    the first time a test asks for it and stopped at the end of the session,
    whatever the tests did (and by SIGTERM if pytest itself dies). Skips when
    Ceph is not installed, unless CKPTFS_REQUIRE_RGW=1 (tools/test.sh, CI)."""
    missing = rgw_tool.missing_binaries()
    if missing:
        why = (f"Ceph is not installed ({', '.join(missing)} missing): "
               "tools/setup-debian.sh --with-tests installs it")
        if os.environ.get("CKPTFS_REQUIRE_RGW") == "1":
            pytest.fail(why)
        pytest.skip(why)
    gw = rgw_tool.RGW.start(str(tmp_path_factory.mktemp("rgw")), memstore_bytes=2 << 30,
                            bound_to_parent=True)
    try:
        yield gw
    finally:
        gw.stop(keep=True)          # the logs stay in pytest's tmp dir
