"""Megatron-core dist_checkpointing on ckptfs: two gloo ranks, torch_dist and fully parallel.

What megatron-core 0.16.1 writes with its only sharded backend, torch_dist
(over torch.distributed.checkpoint, through its own FileSystemWriterAsync):
every rank `__<rank>_<n>.distcp` (each item a torch.save record), rank 0
`.metadata`, `common.pt` (torch.save of the non-sharded state) and
`metadata.json` (backend and version). The fully-parallel wrapper spreads
the replicated tensors' saving and loading over the ranks.

The ranks run tests/compat/helpers/compat_megatron_worker.py, which builds a
tensor-parallel GPT state (column- and row-parallel shards, replicated
LayerNorms, Adam moments, common state) from the step number and, when
loading, checks every shard bit for bit. On a CPU-only torch the worker
makes torch.cuda.synchronize a no-op and torch.cuda.current_device return
"cpu": Megatron calls both unconditionally in its save path (the
worker's docstring says where); everything it reads and writes is its own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from compat_util import HELPERS, run_ranks, sha256_file, skip_unless_installed

skip_unless_installed("megatron-core", "megatron.core")

WORLD = 2
ENV = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

PMEM_SIZE = "256M"         # the log of each test's mount (compat/conftest.py)


def megatron_ranks(tmp_path: Path, *ops: str) -> None:
    """Both ranks doing ops ("mode:dir:step:strategy") in order, in one process group."""
    init = tmp_path / f"init-{os.urandom(4).hex()}"
    run_ranks([[sys.executable, HELPERS / "compat_megatron_worker.py", str(rank), str(WORLD),
                str(init), *ops] for rank in range(WORLD)], tmp_path, ENV, what=f"running {ops}")


def shas(d: Path) -> dict[str, str]:
    return {n: sha256_file(d / n) for n in sorted(os.listdir(d))}


def test_dist_checkpointing_save_load(mounted, fsck_clean, tmp_path):
    a, b = mounted.path / "iter_0000001", mounted.path / "iter_0000002"
    megatron_ranks(tmp_path, f"save:{a}:1:torch_dist", f"save:{b}:2:fully_parallel",
              f"load:{a}:1:torch_dist")
    for d in (a, b):
        names = sorted(os.listdir(d))
        assert {".metadata", "common.pt", "metadata.json"} <= set(names), names
        assert {n.split("_")[2] for n in names if n.endswith(".distcp")} == {"0", "1"}, names
    before = {d: shas(d) for d in (a, b)}
    mounted.remount()
    assert {d: shas(d) for d in (a, b)} == before
    megatron_ranks(tmp_path, f"load:{a}:1:fully_parallel", f"load:{b}:2:torch_dist",
              f"load:{b}:2:fully_parallel")
    fsck_clean(mounted)
