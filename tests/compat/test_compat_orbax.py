"""JAX + Orbax checkpoints on ckptfs: ocp.CheckpointManager, OCDBT and zarr3 layouts.

What orbax-checkpoint 0.12.8 does on CheckpointManager.save (seen with
strace): the step is written into `<step>.orbax-checkpoint-tmp/` with the item
in `state.orbax-checkpoint-tmp/`; tensorstore writes array chunks (zstd
compressed zarr3 chunks) either packed into OCDBT data files
(`ocdbt.process_0/d/<random>`, with `manifest.ocdbt` rewritten through
`manifest.ocdbt.__lock` + rename, each fsync'ed) or one file per chunk
(`<leaf>/c/0/0`, use_ocdbt=False); then `_METADATA`, `_sharding`,
`_CHECKPOINT_METADATA` and `commit_success.txt`, the item directory is renamed
to `state`, the step directory to `<step>`, and steps beyond max_to_keep are
removed with rmtree. Saves run asynchronously on Orbax's threads.

The library runs in tests/compat/helpers/compat_orbax_worker.py (JAX in its own
process); after a remount it restores every kept step array by array and
resumes training from the newest.
"""

from __future__ import annotations

import os
from pathlib import Path

from compat_util import run_helper, sha256_file, skip_unless_installed

skip_unless_installed("jax and orbax-checkpoint", "jax", "orbax")

ENV = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")

PMEM_SIZE = "128M"         # the log of each test's mount (compat/conftest.py)


def shas(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and ".ckptfs" not in p.parts}


LAYOUTS = ("ocdbt", "zarr")


def test_checkpoint_manager_save_rotate_restore(mounted, fsck_clean, tmp_path):
    """Both layouts, each in a directory of its own on one mount, saved by one
    worker process and verified by another (JAX's import is most of a run)."""
    jobs = []
    for layout in LAYOUTS:
        (mounted.path / layout).mkdir()
        (tmp_path / f"plain-{layout}").mkdir()
        jobs.append(f"{layout}:{mounted.path / layout}:{tmp_path / f'plain-{layout}'}")
    run_helper("compat_orbax_worker.py", "save", *jobs, env=ENV, timeout=600)
    for layout in LAYOUTS:
        ckpts = mounted.path / layout / "ckpts"
        # max_to_keep=2 of 4 steps, every temp directory renamed or gone.
        assert sorted(os.listdir(ckpts)) == ["3", "4"], layout
        for step in ("3", "4"):
            item = ckpts / step / "state"
            assert (ckpts / step / "_CHECKPOINT_METADATA").is_file()
            assert (item / "_METADATA").is_file()
            if layout == "ocdbt":
                assert (item / "manifest.ocdbt").is_file()
                assert list((item / "ocdbt.process_0" / "d").iterdir())
            else:
                assert (item / "params.head.w" / "zarr.json").is_file()
                assert (item / "params.embed" / "c" / "0" / "0").is_file()
    assert not [p for p in mounted.path.rglob("*") if "tmp" in p.name and
                ".ckptfs" not in p.parts]
    before = shas(mounted.path)

    mounted.remount()
    assert shas(mounted.path) == before
    run_helper("compat_orbax_worker.py", "verify", *jobs, env=ENV, timeout=600)
    fsck_clean(mounted)
