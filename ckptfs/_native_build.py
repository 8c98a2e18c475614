"""cffi (out-of-line, API mode) builders for ``ckptfs._native`` and ``ckptfs._fusepath``.

setuptools picks up ``ffibuilder`` and ``fuse_ffibuilder`` via ``cffi_modules``
in setup.py and runs with the repo root as the working directory.  For
development, run ``python ckptfs/_native_build.py`` to build both in place.

``_fusepath`` (native/ckptfs_fuse.c, the FUSE channel fast path) is a module
of its own because the daemon loads it with RTLD_GLOBAL: it links libfuse3
(pkg-config fuse3) and stands in for one libfuse function.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "native" / "ckptfs_native.h"
FUSE_HEADER = ROOT / "native" / "ckptfs_fuse.h"

# Baseline x86-64 only: newer instructions are enabled per function with
# target attributes and chosen at run time, so no -march here.
# Warnings are errors in CI (CKPTFS_WERROR=1) but not for users, whose newer
# compiler may add a warning we have not seen yet.
EXTRA_COMPILE_ARGS = ["-std=c11", "-O2", "-Wall", "-Wextra"]
if os.environ.get("CKPTFS_WERROR") == "1":
    EXTRA_COMPILE_ARGS.append("-Werror")


def _cdef(header: Path = HEADER) -> str:
    # The header is the single source of the declarations; cdef() cannot
    # parse preprocessor lines, so drop them.
    lines = header.read_text().splitlines()
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


def _pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args, "fuse3"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError("building ckptfs._fusepath needs libfuse3's headers "
                           "(apt-get install libfuse3-dev pkg-config)") from e
    return out.split()


def make_fuse_builder(root: str) -> FFI:
    """Builder of ``ckptfs._fusepath``, the FUSE channel fast path."""
    ffi = FFI()
    ffi.cdef(_cdef(FUSE_HEADER))
    cflags = _pkg_config("--cflags")
    ffi.set_source(
        "ckptfs._fusepath",
        '#include "ckptfs_fuse.h"',
        sources=[os.path.join(root, "native", "ckptfs_fuse.c")],
        include_dirs=[os.path.join(root, "native")]
        + [f[2:] for f in cflags if f.startswith("-I")],
        libraries=[f[2:] for f in _pkg_config("--libs") if f.startswith("-l")],
        extra_compile_args=EXTRA_COMPILE_ARGS,
    )
    return ffi


# setuptools wants source paths relative to setup.py's directory.
ffibuilder = make_builder("")
fuse_ffibuilder = make_fuse_builder("")


def build_in_place() -> list[Path]:
    # cffi compiles after chdir() into tmpdir, so the in-place build needs
    # absolute source paths; intermediates stay under build/.
    tmpdir = ROOT / "build" / "cffi"
    pkg = ROOT / "ckptfs"
    out = []
    for name, make in (("_native", make_builder), ("_fusepath", make_fuse_builder)):
        built = Path(make(str(ROOT)).compile(tmpdir=str(tmpdir), verbose=True))
        # A stale build under another suffix (pip makes _native.abi3.so) would
        # win or lose the import depending on suffix order, so keep only one.
        for old in pkg.glob(f"{name}*.so"):
            old.unlink()
        dest = pkg / built.name
        shutil.copy2(built, dest)
        out.append(dest)
    return out


if __name__ == "__main__":
    for path in build_in_place():
        print(f"built {path}", file=sys.stderr)
