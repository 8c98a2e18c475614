"""One rank of a torch.distributed.checkpoint save or load (tests/compat/test_compat_dcp.py).

    compat_dcp_worker.py INIT_FILE RANK WORLD MODE:CKPT_DIR:STEP [MODE:CKPT_DIR:STEP ...]

MODE is save, async_save or load; CKPT_DIR may be "DIR0+DIR1+...", one per
rank (each rank its node's mount: tests/store/test_peers.py); the operations run in order in one process
group (one torch start-up for several checkpoints). The state is built from STEP alone, so the
loading ranks know exactly what every tensor must hold. Tensors are DTensors
sharded over a CPU device mesh (gloo), so every rank writes its own shard
file, plus a replicated tensor, a plain per-rank tensor and a non-tensor
value (DCP stores those in rank 0's file). Exit status 0 means the save
finished, or the load matched bit for bit.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def full_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "embed.weight": torch.randn(8192, 256, generator=g),             # 8 MiB
            "proj.weight": torch.randn(1024, 512, generator=g).to(torch.bfloat16),
            "proj.bias": torch.randn(512, generator=g),
        },
        "optim": {"exp_avg": torch.randn(8192, 256, generator=g),
                  "exp_avg_sq": torch.rand(8192, 256, generator=g)},
    }


def sharded(step: int, mesh, rank: int, empty: bool) -> dict:
    full = full_state(step)
    out: dict = {"model": {}, "optim": {}}
    for group, tensors in full.items():
        for name, t in tensors.items():
            if empty:
                t = torch.zeros_like(t)
            placement = Replicate() if name.endswith("bias") else Shard(0)
            out[group][name] = distribute_tensor(t, mesh, [placement])
    own = torch.full((1000,), float(rank * 1000 + step))
    out[f"rank{rank}_rng"] = torch.zeros_like(own) if empty else own
    out["step"] = -1 if empty else step
    out["extra"] = {"note": "" if empty else f"saved at step {step}"}
    return out


def run_op(mode: str, ckpt_dir: str, step: int, mesh, rank: int) -> None:
    if mode in ("save", "async_save"):
        sd = sharded(step, mesh, rank, empty=False)
        writer = dcp.FileSystemWriter(ckpt_dir, sync_files=True, thread_count=2)
        if mode == "save":
            dcp.save(sd, storage_writer=writer)
        else:
            fut = dcp.async_save(sd, storage_writer=writer)
            fut.result()
        dist.barrier()
        return
    assert mode == "load", mode
    sd = sharded(step, mesh, rank, empty=True)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(ckpt_dir))
    want = sharded(step, mesh, rank, empty=False)
    for group in ("model", "optim"):
        for name, t in want[group].items():
            got = sd[group][name]
            assert isinstance(got, DTensor), name
            assert got.to_local().dtype == t.to_local().dtype, name
            assert torch.equal(got.to_local(), t.to_local()), f"{ckpt_dir}: {group}.{name} differs"
    assert torch.equal(sd[f"rank{rank}_rng"], want[f"rank{rank}_rng"])
    assert sd["step"] == step, sd["step"]
    assert sd["extra"] == want["extra"], sd["extra"]
    dist.barrier()


def main() -> int:
    init_file = sys.argv[1]
    rank, world = int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for op in sys.argv[4:]:
            mode, ckpt_dir, step = op.split(":")
            ckpt_dir = ckpt_dir.split("+")[rank] if "+" in ckpt_dir else ckpt_dir
            run_op(mode, ckpt_dir, int(step), mesh, rank)
            print(f"rank {rank}: {op} ok", flush=True)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: torch 2.13's async_save leaves a C++ thread that
    # sometimes aborts the process at exit ("terminate called without an active
    # exception") after every operation has finished and been checked.
    os._exit(code)
