"""TensorFlow checkpoints on ckptfs: tf.train.CheckpointManager and Keras model.save.

What TensorFlow 2.21 does on CheckpointManager.save (seen with strace; it
fsyncs nothing): mkdir `ckpt-N_temp`, write
`part-00000-of-00001.data-00000-of-00001.tempstate<random>` and rename it,
the same for the `.index`, then MergeV2Checkpoints renames the data file to
`ckpt-N.data-00000-of-00001`, writes `ckpt-N.index`, unlinks the temp index
and rmdirs `ckpt-N_temp`; the `checkpoint` state file is written as
`checkpoint.tmp<uuid>` and renamed over, twice per save, and checkpoints
beyond max_to_keep are unlinked. Keras 3's model.save writes a `.keras` zip.

The library runs in tests/compat/helpers/compat_tf_worker.py (TensorFlow in its own
process): it saves every checkpoint into the mount and into a plain
directory, and after a remount restores each kept checkpoint into a fresh
model, reads every tensor, and loads the Keras file.
"""

from __future__ import annotations

import os
from pathlib import Path

from compat_util import run_helper, sha256_file, skip_unless_installed

skip_unless_installed("tensorflow-cpu", "tensorflow", "keras")

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")

PMEM_SIZE = "128M"         # the log of each test's mount (compat/conftest.py)


def shas(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and ".ckptfs" not in p.parts}


def state_paths(state_file: Path) -> list[str]:
    """The checkpoint paths a `checkpoint` state file names (it also holds timestamps)."""
    return [line for line in state_file.read_text().splitlines()
            if line.startswith(("model_checkpoint_path", "all_model_checkpoint_paths"))]


def test_checkpoint_manager_and_keras_save(mounted, fsck_clean, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    run_helper("compat_tf_worker.py", "save", mounted.path, plain, env=ENV, timeout=600)
    ckpts = mounted.path / "ckpts"
    # max_to_keep=2 of 4 saves; no temp directory or temp file left behind.
    assert sorted(os.listdir(ckpts)) == [
        "checkpoint", "ckpt-3.data-00000-of-00001", "ckpt-3.index",
        "ckpt-4.data-00000-of-00001", "ckpt-4.index"]
    assert state_paths(ckpts / "checkpoint") == [
        'model_checkpoint_path: "ckpt-4"', 'all_model_checkpoint_paths: "ckpt-3"',
        'all_model_checkpoint_paths: "ckpt-4"']
    # The bundles are byte for byte what TensorFlow wrote into the plain directory.
    bundle = {n: s for n, s in shas(ckpts).items() if n != "checkpoint"}
    assert bundle == {n: s for n, s in shas(plain / "ckpts").items() if n != "checkpoint"}
    before = shas(mounted.path)
    assert "model.keras" in before

    mounted.remount()
    assert shas(mounted.path) == before
    run_helper("compat_tf_worker.py", "verify", mounted.path, plain, env=ENV, timeout=600)
    fsck_clean(mounted)
