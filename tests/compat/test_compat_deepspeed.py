"""DeepSpeed ZeRO checkpoints on ckptfs: two CPU ranks (gloo), stage 1 and 2.

What DeepSpeed 0.19.8 does on engine.save_checkpoint(dir, tag) with ZeRO
stage 1/2: rank 0 torch.saves `tag/mp_rank_00_model_states.pt` (the module's
state dict, frozen-parameter fragments, buffers); every rank torch.saves its
optimizer partition `tag/zero_pp_rank_<r>_mp_rank_00_optim_states.pt` (its
slice of the flat fp32 master weights and Adam moments); rank 0 copies
zero_to_fp32.py and zero_to_torch.py into dir and writes `latest` (the tag)
after all ranks are done. load_checkpoint(dir) reads `latest`.

The ranks run tests/compat/helpers/compat_deepspeed_worker.py as processes of their
own; after a remount a fresh job loads the checkpoint through `latest` and
every rank's module and optimizer state is compared with what it held at
the save, resumed training is compared with the run that never stopped,
and the checkpoint's own zero_to_fp32.py consolidates the shards from the
mount into safetensors that must equal the model (stage 2: every parameter;
stage 1 saves no frozen-parameter fragments, so only the trained ones).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from compat_util import HELPERS, run, run_ranks, sha256_file, skip_unless_installed

skip_unless_installed("deepspeed", "deepspeed")

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

WORLD = 2
ENV = dict(os.environ, DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
           PYTHONWARNINGS="ignore")

PMEM_SIZE = "128M"         # the log of each test's mount (compat/conftest.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_ranks(ops: list[str], log_dir: Path) -> None:
    """Both ranks of one DeepSpeed job doing ops ("STAGE:MODE:CKPT_DIR:PLAIN_DIR") in
    order: one job per mode for both stages, as the imports cost most of a job."""
    port = free_port()
    run_ranks([[sys.executable, HELPERS / "compat_deepspeed_worker.py", str(rank), str(WORLD),
                str(port), *ops] for rank in range(WORLD)],
              log_dir, ENV, what=f"running {ops}")


def shas(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and ".ckptfs" not in p.parts}


STAGES = (1, 2)


def test_zero_save_load_and_zero_to_fp32(mounted, fsck_clean, tmp_path):
    """Stage 1 and stage 2, each in a directory of its own on one mount."""
    ckpts = {stage: mounted.path / f"ckpts-zero{stage}" for stage in STAGES}
    plain = {stage: tmp_path / f"plain-zero{stage}" for stage in STAGES}
    for d in plain.values():
        d.mkdir()
    deepspeed_ranks([f"{stage}:save:{ckpts[stage]}:{plain[stage]}" for stage in STAGES],
                    tmp_path)
    shards = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
              "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    for stage in STAGES:
        assert sorted(os.listdir(ckpts[stage])) == ["global_step2", "global_step4", "latest",
                                                    "zero_to_fp32.py", "zero_to_torch.py"]
        for tag in ("global_step2", "global_step4"):
            assert sorted(os.listdir(ckpts[stage] / tag)) == shards, (stage, tag)
        assert (ckpts[stage] / "latest").read_text() == "global_step4"
    before = shas(mounted.path)

    mounted.remount()
    assert shas(mounted.path) == before
    deepspeed_ranks([f"{stage}:load:{ckpts[stage]}:{plain[stage]}" for stage in STAGES],
                    tmp_path)
    # The checkpoint's own conversion script, reading the shards from the mount.
    out = {stage: mounted.path / f"fp32-zero{stage}" for stage in STAGES}
    for stage in STAGES:
        run([sys.executable, ckpts[stage] / "zero_to_fp32.py", ckpts[stage], out[stage],
             "--safe_serialization"], env=ENV, timeout=300)
    mounted.remount()
    for stage in STAGES:
        got = st_torch.load((out[stage] / "model.safetensors").read_bytes())  # no mmap left
        want = torch.load(plain[stage] / "weights-global_step4.pt", weights_only=True)
        if stage == 1:
            # Stage 1 saves no frozen-parameter fragments, so zero_to_fp32 gives the
            # trained parameters only (the frozen ones are in mp_rank_00_model_states.pt).
            frozen = ("embed.", "blocks.0.")
            want = {k: v for k, v in want.items() if not k.startswith(frozen)}
        assert sorted(got) == sorted(want), stage
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), (stage, name)
    fsck_clean(mounted)
