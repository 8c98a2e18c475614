"""cffi (out-of-line, API mode) builder for ``ckptfs._native``.

setuptools picks up ``ffibuilder`` via ``cffi_modules`` in setup.py and runs
with the repo root as the working directory.  For development, run
``python ckptfs/_native_build.py`` to build ``ckptfs/_native*.so`` in place.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "native" / "ckptfs_native.h"

# Baseline x86-64 only: newer instructions are enabled per function with
# target attributes and chosen at run time, so no -march here.
# Warnings are errors in CI (CKPTFS_WERROR=1) but not for users, whose newer
# compiler may add a warning we have not seen yet.
EXTRA_COMPILE_ARGS = ["-std=c11", "-O2", "-Wall", "-Wextra"]
if os.environ.get("CKPTFS_WERROR") == "1":
    EXTRA_COMPILE_ARGS.append("-Werror")


def _cdef() -> str:
    # The header is the single source of the declarations; cdef() cannot
    # parse preprocessor lines, so drop them.
    lines = HEADER.read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def make_builder(root: str) -> FFI:
    """Builder with source paths under ``root`` ('' means relative to the cwd)."""
    ffi = FFI()
    ffi.cdef(_cdef())
    ffi.set_source(
        "ckptfs._native",
        '#include "ckptfs_native.h"',
        sources=[os.path.join(root, "native", name)
                 for name in ("ckptfs_native.c", "ckptfs_beneath.c")],
        include_dirs=[os.path.join(root, "native")],
        extra_compile_args=EXTRA_COMPILE_ARGS,
    )
    return ffi


# setuptools wants source paths relative to setup.py's directory.
ffibuilder = make_builder("")


def build_in_place() -> Path:
    # cffi compiles after chdir() into tmpdir, so the in-place build needs
    # absolute source paths; intermediates stay under build/.
    tmpdir = ROOT / "build" / "cffi"
    built = Path(make_builder(str(ROOT)).compile(tmpdir=str(tmpdir), verbose=True))
    pkg = ROOT / "ckptfs"
    # A stale build under another suffix (pip makes _native.abi3.so) would
    # win or lose the import depending on suffix order, so keep only one.
    for old in pkg.glob("_native*.so"):
        old.unlink()
    dest = pkg / built.name
    shutil.copy2(built, dest)
    return dest


if __name__ == "__main__":
    print(f"built {build_in_place()}", file=sys.stderr)
