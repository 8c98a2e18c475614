#!/bin/sh
# Install ckptfs with its test extras, then run the default test suite.
# Extra arguments go to pytest, e.g. tools/test.sh -m soak   (the long crash soak)
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
export CKPTFS_WERROR=1      # the native helpers build warning-free, or CI fails
export CKPTFS_REQUIRE_RGW=1 # the S3 tests run against a real RGW, never skip
"$repo/tools/setup-debian.sh" --with-tests
cd "$repo"
exec python3 -m pytest -q "$@"
