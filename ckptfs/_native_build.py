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
COLDTABLE_HEADER = ROOT / "native" / "ckptfs_coldtable.h"   # cold READs on the fast path
READX_HEADER = ROOT / "native" / "ckptfs_readx.h"     # the read executor (chunkread.py)
LOGWR_HEADER = ROOT / "native" / "ckptfs_logwr.h"     # the log writer (logwriter.py)

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


# BLAKE3 in the write path's native call (ckptfs_chunk_feed) comes from the
# BLAKE3 team's C implementation, which Debian ships as the C sources inside
# librust-blake3-dev (tools/setup-debian.sh installs it). Its x86-64 SIMD
# kernels are assembly (.S), so they need no per-file compiler flags, and
# blake3_dispatch.c picks SSE2/SSE4.1/AVX2/AVX-512 at run time. Without it the
# module builds anyway and Python names the chunks with the blake3 package.
# CKPTFS_BLAKE3_C=DIR points at another copy of that c/ directory; =none skips it.
BLAKE3_GLOB = "/usr/share/cargo/registry/blake3-*/c"
BLAKE3_C = ("blake3.c", "blake3_dispatch.c", "blake3_portable.c")
BLAKE3_ASM = ("blake3_sse2_x86-64_unix.S", "blake3_sse41_x86-64_unix.S",
              "blake3_avx2_x86-64_unix.S", "blake3_avx512_x86-64_unix.S")


def blake3_dir() -> Path | None:
    """The BLAKE3 C library's source directory, if this machine has one."""
    import glob
    import platform

    wanted = os.environ.get("CKPTFS_BLAKE3_C")
    if wanted == "none" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    found = [Path(wanted)] if wanted else [Path(d) for d in sorted(glob.glob(BLAKE3_GLOB))]
    for d in reversed(found):
        if all((d / name).is_file() for name in BLAKE3_C + BLAKE3_ASM + ("blake3.h",)):
            return d
    return None


def _blake3_objects(src: Path) -> list[str]:
    """Compile the library once into build/blake3 (distutils does not take .S)."""
    import sysconfig

    out_dir = ROOT / "build" / "blake3"
    out_dir.mkdir(parents=True, exist_ok=True)
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    objects = []
    for name in BLAKE3_C + BLAKE3_ASM:
        obj = out_dir / (name.rsplit(".", 1)[0] + ".o")
        if not obj.exists() or obj.stat().st_mtime < (src / name).stat().st_mtime:
            subprocess.run(cc + ["-O3", "-fPIC", "-c", str(src / name), "-o", str(obj)],
                           check=True)
        objects.append(str(obj))
    return objects


def make_builder(root: str) -> FFI:
    """Builder with source paths under ``root`` ('' means relative to the cwd)."""
    ffi = FFI()
    ffi.cdef(_cdef() + "\n" + _cdef(READX_HEADER) + "\n" + _cdef(LOGWR_HEADER))
    b3 = blake3_dir()
    ffi.set_source(
        "ckptfs._native",
        '#include "ckptfs_native.h"\n#include "ckptfs_readx.h"\n#include "ckptfs_logwr.h"',
        sources=[os.path.join(root, "native", name)
                 for name in ("ckptfs_native.c", "ckptfs_beneath.c", "ckptfs_readx.c",
                              "ckptfs_cold.c", "ckptfs_logwr.c", "ckptfs_logfault.c")],
        include_dirs=[os.path.join(root, "native")] + ([str(b3)] if b3 else []),
        define_macros=[("CKPTFS_HAVE_BLAKE3", "1")] if b3 else [],
        extra_objects=_blake3_objects(b3) if b3 else [],
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
    ffi.cdef(_cdef(FUSE_HEADER) + "\n" + _cdef(COLDTABLE_HEADER))
    cflags = _pkg_config("--cflags")
    ffi.set_source(
        "ckptfs._fusepath",
        '#include "ckptfs_fuse.h"\n#include "ckptfs_coldtable.h"',
        sources=[os.path.join(root, "native", name)
                 for name in ("ckptfs_fuse.c", "ckptfs_coldtable.c", "ckptfs_readpool.c")],
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
