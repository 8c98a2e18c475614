#!/bin/sh
# Install ckptfs with its test extras (tools/setup-debian.sh --with-tests: the
# checkout's .venv), then run the default test suite with that venv's python.
# Extra arguments go to pytest, e.g. tools/test.sh -m soak   (the long crash soak)
#                                    tools/test.sh tests/cli/test_mount_cli.py
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin    # sudo's: Debian's python3, whoever calls
export PATH
repo=$(cd "$(dirname "$0")/.." && pwd)
export CKPTFS_WERROR=1      # the native helpers build warning-free, or CI fails
export CKPTFS_REQUIRE_RGW=1 # the S3 tests run against a real RGW, never skip
"$repo/tools/setup-debian.sh" --with-tests
cd "$repo"
exec "$repo/.venv/bin/python" -m pytest -q "$@"
