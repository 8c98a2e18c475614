"""One rank of a DeepSpeed ZeRO job on the CPU (tests/compat/test_compat_deepspeed.py).

    compat_deepspeed_worker.py RANK WORLD PORT STAGE:MODE:CKPT_DIR:PLAIN_DIR [...]

Rank processes of a gloo group (DeepSpeed's CPU accelerator, 127.0.0.1:PORT)
doing each operation in order, in one process group: importing torch and
DeepSpeed takes most of a job's time, so one job does both stages' saves
and another both stages' loads. The model is a small GPT-like stack built
from CONFIG with its embedding and first block frozen; the optimizer is
torch's AdamW wrapped by ZeRO stage STAGE (1 or 2: each rank owns a
partition of the fp32 master weights and of the Adam moments). Each
operation builds engines of its own, so one stage's engine never serves
another's checkpoint.

save: trains 2 steps, engine.save_checkpoint(CKPT_DIR) (tag global_step2:
`latest`, `global_step2/mp_rank_00_model_states.pt` from rank 0 and
`zero_pp_rank_<r>_mp_rank_00_optim_states.pt` from every rank, plus
zero_to_fp32.py), trains 2 more, saves global_step4. After each save every
rank writes what it holds (module state dict, the ZeRO optimizer's state
dict) to PLAIN_DIR/expected-<tag>-rank<r>.pt, and rank 0 the full fp32
weights to PLAIN_DIR/weights-<tag>.pt.

load: a fresh engine (other seed) loads CKPT_DIR through `latest`; every
rank's module and optimizer state must equal expected-global_step4-rank<r>.pt,
and one more training step must equal one taken by an engine loaded from
global_step2 and trained 3 steps (the run that never stopped).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch import nn  # noqa: E402

CONFIG = {"vocab": 1024, "d_model": 128, "layers": 3, "ctx": 16, "seed": 11}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))


class TinyLM(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.embed = nn.Embedding(config["vocab"], config["d_model"])
        self.blocks = nn.ModuleList(Block(config["d_model"]) for _ in range(config["layers"]))
        self.head = nn.Linear(config["d_model"], config["vocab"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM(CONFIG)
    for p in list(model.embed.parameters()) + list(model.blocks[0].parameters()):
        p.requires_grad_(False)
    return model


def engine_for(stage: int, seed: int):
    import deepspeed

    model = build(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def train(engine, first_step: int, n: int, rank: int) -> None:
    for step in range(first_step, first_step + n):
        g = torch.Generator().manual_seed(step * 100 + rank)
        tokens = torch.randint(0, CONFIG["vocab"], (4, CONFIG["ctx"] + 1), generator=g)
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CONFIG["vocab"]),
                                                 tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()


def held_state(engine) -> dict:
    return {"module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            "optimizer": engine.optimizer.state_dict()}


def assert_equal(got, want, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), f"{where} differs"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(map(str, got)) == sorted(map(str, want)), \
            (where, sorted(map(str, got)), sorted(map(str, want)))
        for k in want:
            assert_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_equal(a, b, f"{where}[{i}]")
    elif hasattr(want, "__dict__") and not isinstance(want, type):
        assert type(got) is type(want), where        # e.g. ZeRO's loss scaler object
        assert_equal(vars(got), vars(want), where)
    else:
        assert got == want, (where, got, want)


def no_shm_comm_op() -> None:
    """Take DeepSpeed's fallback for a machine that cannot build its shared-memory
    all-reduce op: that C++ extension is JIT-compiled at the first
    init_distributed (minutes on 2 busy cores), and a rank killed while
    compiling leaves a lock that hangs every later start. Collectives then go
    through gloo; nothing DeepSpeed reads or writes changes."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def run_op(rank: int, stage: int, mode: str, ckpt_dir: str, plain_dir: str) -> None:
    """One stage's save or load (the module docstring), ended by a barrier."""
    import deepspeed
    import torch.distributed as dist

    if mode == "save":
        engine = engine_for(stage, CONFIG["seed"])
        for tag, first in (("global_step2", 1), ("global_step4", 3)):
            train(engine, first, 2, rank)
            engine.save_checkpoint(ckpt_dir, tag=tag)
            torch.save(held_state(engine),
                       os.path.join(plain_dir, f"expected-{tag}-rank{rank}.pt"))
            if rank == 0:
                weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
                torch.save(weights, os.path.join(plain_dir, f"weights-{tag}.pt"))
            dist.barrier()
    elif mode == "load":
        engine = engine_for(stage, CONFIG["seed"] + 1)
        path, _ = engine.load_checkpoint(ckpt_dir)          # through `latest`
        tag = os.path.basename(os.path.dirname(path)) if path else None
        assert tag == "global_step4", path
        want = torch.load(os.path.join(plain_dir, f"expected-global_step4-rank{rank}.pt"),
                          weights_only=False)
        assert_equal(held_state(engine), want, f"rank {rank}")
        # Resume: loaded at step 4, trained one step == loaded at step 2, trained 3.
        train(engine, 5, 1, rank)
        other = engine_for(stage, CONFIG["seed"] + 2)
        other.load_checkpoint(ckpt_dir, tag="global_step2")
        train(other, 3, 3, rank)
        assert_equal(held_state(engine)["module"], held_state(other)["module"], "resumed")
        dist.barrier()
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(f"rank {rank}: deepspeed {deepspeed.__version__} ZeRO-{stage} {mode} ok", flush=True)


def main() -> int:
    rank, world, port = (int(x) for x in sys.argv[1:4])
    ops = [op.split(":", 3) for op in sys.argv[4:]]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    no_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    try:
        for stage, mode, ckpt_dir, plain_dir in ops:
            run_op(rank, int(stage), mode, ckpt_dir, plain_dir)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
