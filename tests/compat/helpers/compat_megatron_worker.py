"""One rank of a Megatron-core dist_checkpointing save or load (tests/compat/test_compat_megatron.py).

    compat_megatron_worker.py RANK WORLD INIT_FILE MODE:CKPT_DIR:STEP:STRATEGY [...]

MODE is save or load; STRATEGY is torch_dist (Megatron's default sharded
backend, over torch.distributed.checkpoint) or fully_parallel (torch_dist
wrapped in FullyParallelSave/LoadStrategyWrapper: each replicated tensor is
saved by one rank, and on load each rank reads a share and the ranks exchange
what they read). The ranks form a gloo group.

CPU only: megatron-core 0.16.1's save calls torch.cuda.synchronize()
unconditionally after copying tensors to the host (FileSystemWriterAsync.
preload_tensors); torch's CPU build raises "Torch not compiled with CUDA
enabled" there, so without a GPU this worker makes torch.cuda.synchronize a
no-op (there is no device to wait for). The fully-parallel load's default
exchange ('broadcast') allocates CUDA tensors, so the load uses
exchange_algo='gather_object'; AsyncCallsQueue (Megatron's --async-save)
all-reduces CUDA tensors and cannot run on the CPU at all.

The sharded state dict is that of a small GPT built from CONFIG with tensor
parallelism over the WORLD ranks: column-parallel weights split on dim 0,
row-parallel ones on dim 1 (ShardedTensor.from_rank_offsets), LayerNorms and
embeddings' position table replicated (replica_id = rank), the optimizer's
Adam moments sharded like their parameters, plus common state (iteration,
args) that rank 0 writes to common.pt. Every tensor is a function of (key,
STEP), so a loading rank knows exactly what it must read back.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

CONFIG = {"vocab": 2048, "d_model": 256, "ffn": 1024, "layers": 2, "ctx": 64}


def full_tensor(key: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    seed = (sum(map(ord, key)) * 7919 + step) % (2 ** 31)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def layout() -> list[tuple[str, tuple[int, ...], int | None, torch.dtype]]:
    """(key, full shape, tensor-parallel axis or None when replicated, dtype)."""
    c = CONFIG
    d, f = c["d_model"], c["ffn"]
    out: list[tuple[str, tuple[int, ...], int | None, torch.dtype]] = [
        ("embedding.word_embeddings.weight", (c["vocab"], d), 0, torch.float32),
        ("embedding.position_embeddings.weight", (c["ctx"], d), None, torch.float32)]
    for i in range(c["layers"]):
        p = f"decoder.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,), None, torch.float32),
                (p + "self_attention.linear_qkv.weight", (3 * d, d), 0, torch.bfloat16),
                (p + "self_attention.linear_proj.weight", (d, d), 1, torch.bfloat16),
                (p + "mlp.linear_fc1.weight", (f, d), 0, torch.bfloat16),
                (p + "mlp.linear_fc2.weight", (d, f), 1, torch.bfloat16)]
    out.append(("decoder.final_layernorm.weight", (d,), None, torch.float32))
    return out


def sharded_state(step: int, rank: int, world: int, empty: bool) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    model, optim = {}, {}
    for key, shape, axis, dtype in layout():
        for prefix, target in (("", model), ("optimizer.exp_avg.", optim),
                               ("optimizer.exp_avg_sq.", optim)):
            full = full_tensor(prefix + key, shape, step)
            full = full.abs() if "exp_avg_sq" in prefix else full
            full = full.to(dtype if not prefix else torch.float32)
            if axis is None:
                local = full.clone()
                st = ShardedTensor.from_rank_offsets(prefix + key, local, replica_id=rank)
            else:
                local = full.chunk(world, dim=axis)[rank].clone()
                st = ShardedTensor.from_rank_offsets(prefix + key, local, (axis, rank, world),
                                                     replica_id=0)
            if empty:
                st.data.zero_()
            target[prefix + key] = st
    common = {"iteration": -1 if empty else step,
              "args": {} if empty else {"num_layers": CONFIG["layers"], "tp": world},
              "rng_tracker": torch.zeros(4) if empty else torch.arange(4.0) + step}
    return {"model": model, "optimizer": optim, **common}


def strategies(name: str, action: str, ckpt_dir: str):
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy, get_default_save_sharded_strategy)
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)

    if action == "save":
        base = get_default_save_sharded_strategy("torch_dist")
        return FullyParallelSaveStrategyWrapper(base) if name == "fully_parallel" else base
    if name != "fully_parallel":
        return None         # the backend the checkpoint's metadata names
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(ckpt_dir),
                                            exchange_algo="gather_object")


def run_op(mode: str, ckpt_dir: str, step: int, strategy: str, rank: int, world: int) -> None:
    from megatron.core import dist_checkpointing

    if mode == "save":
        if rank == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
        dist.barrier()
        sd = sharded_state(step, rank, world, empty=False)
        dist_checkpointing.save(sd, ckpt_dir, strategies(strategy, "save", ckpt_dir))
        dist.barrier()
        return
    assert mode == "load", mode
    template = sharded_state(step, rank, world, empty=True)
    got = dist_checkpointing.load(template, ckpt_dir, strategies(strategy, "load", ckpt_dir))
    want = sharded_state(step, rank, world, empty=False)
    for group in ("model", "optimizer"):
        for key, st in want[group].items():
            g = got[group][key]
            assert g.dtype == st.data.dtype and g.shape == st.data.shape, (key, g.dtype, g.shape)
            assert torch.equal(g, st.data), f"{ckpt_dir}: {key} differs on rank {rank}"
    assert got["iteration"] == step and got["args"] == want["args"], (got["iteration"], got["args"])
    assert torch.equal(got["rng_tracker"], want["rng_tracker"])
    dist.barrier()


def main() -> int:
    rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    if not torch.cuda.is_available():       # see the module docstring
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        import megatron.core

        for op in sys.argv[4:]:
            mode, ckpt_dir, step, strategy = op.split(":")
            run_op(mode, ckpt_dir, int(step), strategy, rank, world)
            print(f"rank {rank}: megatron-core {megatron.core.__version__} {op} ok", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # A normal exit: Megatron's writer keeps a multiprocessing Manager (a
    # spawned process) that only interpreter teardown shuts down.
    sys.exit(main())
