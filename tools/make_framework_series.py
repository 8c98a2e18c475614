#!/usr/bin/env python3
"""Frozen-layer fine-tune series saved by TensorFlow, Orbax, DeepSpeed and Megatron-core.

The sibling of tools/make_ckpt_series.py (which covers torch.save, safetensors
and DCP) for the other frameworks: each scenario trains a small residual MLP
language model (token embedding, --layers blocks of LayerNorm + d -> 4d -> d,
final LayerNorm, output head) on synthetic tokens with all but the last two
blocks and the final LayerNorm frozen (embedding and head too, as in
make_ckpt_series.py's frozen scenario), and saves --versions
versions, --steps Adam steps apart, with the framework's own checkpointing
into OUT/<scenario>/ of every OUT directory (the order rotates per version):

  tf            tf.train.Checkpoint(model, optimizer) + CheckpointManager:
                ckpt-N.index + ckpt-N.data-00000-of-00001 (Keras 3, Adam)
  orbax-ocdbt   ocp.CheckpointManager, PyTree of params, Adam moments of the
                trained leaves and the step: <step>/ with OCDBT data files
  orbax-zarr    the same with use_ocdbt=False: one zarr3 file per array chunk
  deepspeed     2 ranks (gloo, CPU accelerator), ZeRO stage 2, torch AdamW:
                global_stepN/ (model states + one optimizer shard per rank)
  megatron      2 ranks (gloo): the model's weights and Adam moments as
                tensor-parallel ShardedTensors, dist_checkpointing.save with
                torch_dist: iter_000000N/

Every scenario records, per OUT, the seconds inside the save calls and the
bytes saved (--timings, the format tools/bench_dedup.py reads). Defaults:
8 blocks, d_model 512, vocab 8192: 33.6M parameters, about 130 MB of fp32
weights plus 50 MB of Adam moments per version.

  python tools/make_framework_series.py /tmp/fwseries --scenarios tf,orbax-ocdbt
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_ckpt_series import Timings, add_save, tree_bytes  # noqa: E402

ALL = "tf,orbax-ocdbt,orbax-zarr,deepspeed,megatron"
TRAINED_BLOCKS = 2


def tokens_for(step: int, rank: int, args: argparse.Namespace, batch: int):
    import numpy as np

    rng = np.random.default_rng(step * 1000 + rank)
    ranks = np.arange(1, args.vocab + 1)
    p = (1.0 / ranks) / (1.0 / ranks).sum()        # Zipf-like token frequencies
    return rng.choice(args.vocab, size=(batch, args.ctx + 1), p=p)


def order(outs: list[Path], version: int) -> list[Path]:
    k = version % len(outs)
    return outs[k:] + outs[:k]


# ------------------------------------------------------------------------------- tf


def run_tf(args: argparse.Namespace, name: str, timings: Timings) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    keras.utils.set_random_seed(0)
    d = args.d_model
    inp = keras.Input((args.ctx,), dtype="int32")
    x = keras.layers.Embedding(args.vocab, d, name="embed")(inp)
    blocks = []
    for i in range(args.layers):
        ln = keras.layers.LayerNormalization(name=f"ln_{i}")
        fc = keras.layers.Dense(4 * d, activation="gelu", name=f"fc_{i}")
        fc2 = keras.layers.Dense(d, name=f"fc2_{i}")
        x = x + fc2(fc(ln(x)))
        blocks.append((ln, fc, fc2))
    ln_f = keras.layers.LayerNormalization(name="ln_f")
    out = keras.layers.Dense(args.vocab, use_bias=False, name="head")(ln_f(x))
    model = keras.Model(inp, out)
    model.get_layer("embed").trainable = False
    model.get_layer("head").trainable = False
    for layers in blocks[:-TRAINED_BLOCKS]:
        for layer in layers:
            layer.trainable = False
    opt = keras.optimizers.Adam(1e-3)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    outs = [o / name for o in args.out]
    managers = {}
    for o in outs:
        o.mkdir(parents=True, exist_ok=True)
        managers[o] = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=opt),
                                                 str(o), max_to_keep=None)
    rec = timings.scenario(name)
    step = 0
    for version in range(args.versions):
        n = args.steps if version else 1
        t0 = time.perf_counter()
        for _ in range(n):
            step += 1
            tok = tokens_for(step, 0, args, args.batch)
            model.train_on_batch(tok[:, :-1], tok[:, 1:])
        rec["train_seconds"] += time.perf_counter() - t0
        tag = f"ckpt-{version + 1}"
        rec["versions"].append(tag)
        for o in order(outs, version):
            t0 = time.perf_counter()
            path = managers[o].save()
            seconds = time.perf_counter() - t0
            assert path.endswith(tag), path
            nbytes = sum(p.stat().st_size for p in o.glob(tag + ".*"))
            timings.add(name, o.parent, tag, seconds, nbytes)
        print(f"{name} v{version} {tag}: step {step}", flush=True)


# ---------------------------------------------------------------------------- orbax


def run_orbax(args: argparse.Namespace, name: str, timings: Timings) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    d, v = args.d_model, args.vocab
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 4 + 2 * args.layers))
    params = {"embed": jax.random.normal(next(keys), (v, d)) * 0.02}
    for i in range(args.layers):
        params[f"block_{i}"] = {
            "ln": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
            "fc": {"w": jax.random.normal(next(keys), (d, 4 * d)) / d ** 0.5,
                   "b": jnp.zeros((4 * d,))},
            "fc2": {"w": jax.random.normal(next(keys), (4 * d, d)) / (4 * d) ** 0.5,
                    "b": jnp.zeros((d,))}}
    params["ln_f"] = {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))}
    params["head"] = jax.random.normal(next(keys), (d, v)) / d ** 0.5
    trained = [f"block_{i}" for i in range(args.layers - TRAINED_BLOCKS, args.layers)] + ["ln_f"]

    def ln(p, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]

    def loss_fn(train, frozen, tok):
        p = {**frozen, **train}
        x = p["embed"][tok[:, :-1]]
        for i in range(args.layers):
            b = p[f"block_{i}"]
            x = x + jax.nn.gelu(ln(b["ln"], x) @ b["fc"]["w"] + b["fc"]["b"]) @ b["fc2"]["w"] \
                + b["fc2"]["b"]
        logits = ln(p["ln_f"], x) @ p["head"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tok[:, 1:, None], -1).mean()

    @jax.jit
    def step_fn(state, frozen, tok):
        grads = jax.grad(loss_fn)(state["params"], frozen, tok)
        t = state["step"] + 1
        mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["mu"], grads)
        nu = jax.tree.map(lambda s, g: 0.999 * s + 0.001 * g * g, state["nu"], grads)
        new = jax.tree.map(lambda p, m, s: p - 1e-3 * (m / (1 - 0.9 ** t)) /
                           (jnp.sqrt(s / (1 - 0.999 ** t)) + 1e-8), state["params"], mu, nu)
        return {"params": new, "mu": mu, "nu": nu, "step": t}

    frozen = {k: p for k, p in params.items() if k not in trained}
    train = {k: params[k] for k in trained}
    zeros = jax.tree.map(jnp.zeros_like, train)
    state = {"params": train, "mu": zeros, "nu": zeros, "step": jnp.asarray(0, jnp.int32)}
    ocdbt = name == "orbax-ocdbt"
    outs = [o / name for o in args.out]
    managers = {}
    for o in outs:
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=True)
        managers[o] = ocp.CheckpointManager(
            o, options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
            item_handlers={"state": handler})
    rec = timings.scenario(name)
    step = 0
    for version in range(args.versions):
        n = args.steps if version else 1
        t0 = time.perf_counter()
        for _ in range(n):
            step += 1
            state = step_fn(state, frozen, jnp.asarray(tokens_for(step, 0, args, args.batch)))
        jax.block_until_ready(state)
        rec["train_seconds"] += time.perf_counter() - t0
        tag = str(step)
        rec["versions"].append(tag)
        full = {"frozen": frozen, **state}
        for o in order(outs, version):
            t0 = time.perf_counter()
            managers[o].save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(full)))
            managers[o].wait_until_finished()
            seconds = time.perf_counter() - t0
            timings.add(name, o.parent, tag, seconds, tree_bytes(o / tag))
        print(f"{name} v{version} step {step}", flush=True)
    for m in managers.values():
        m.close()


# ------------------------------------------------------------------ torch-based ranks


def torch_model(args: argparse.Namespace):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc(self.ln(x))))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.d_model)
            self.blocks = nn.ModuleList(Block(args.d_model) for _ in range(args.layers))
            self.ln_f = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, args.vocab, bias=False)

        def forward(self, tok):
            x = self.embed(tok)
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    model = LM()
    for p in model.parameters():
        p.requires_grad_(False)
    for m in list(model.blocks[-TRAINED_BLOCKS:]) + [model.ln_f]:
        for p in m.parameters():
            p.requires_grad_(True)
    return model


def loss_of(model, tok, vocab: int):
    import torch

    tok = torch.as_tensor(tok)
    logits = model(tok[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tok[:, 1:].reshape(-1))


def rank_main(args: argparse.Namespace, name: str, rank: int, world: int, port: int,
              result: str) -> None:
    """One rank of the deepspeed or megatron scenario."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    outs = [o / name for o in args.out]
    rec: dict = {"per_out": {}, "versions": [], "train_seconds": 0.0}
    if name == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        # DeepSpeed's fallback where its shared-memory all-reduce op cannot be
        # built (it is JIT-compiled at first use): collectives through gloo.
        shm = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if shm is not None:
            deepspeed.ops.__compatible_ops__[shm.NAME] = False
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        model = torch_model(args)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
            "train_micro_batch_size_per_gpu": max(1, args.batch // world),
            "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10 ** 9})
    else:
        if not torch.cuda.is_available():
            # megatron-core 0.16.1 calls these unconditionally in its save path
            # (see tests/compat/helpers/compat_megatron_worker.py).
            torch.cuda.synchronize = lambda device=None: None
            torch.cuda.current_device = lambda: "cpu"
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = torch_model(args)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    step = 0
    for version in range(args.versions):
        n = args.steps if version else 1
        t0 = time.perf_counter()
        for _ in range(n):
            step += 1
            if name == "deepspeed":
                tok = tokens_for(step, rank, args, max(1, args.batch // world))
                engine.backward(loss_of(engine, tok, args.vocab))
                engine.step()
            else:       # data parallel by hand: same batch everywhere, replicas stay equal
                loss = loss_of(model, tokens_for(step, 0, args, args.batch), args.vocab)
                opt.zero_grad()
                loss.backward()
                opt.step()
        rec["train_seconds"] += time.perf_counter() - t0
        tag = f"global_step{step}" if name == "deepspeed" else f"iter_{step:07d}"
        rec["versions"].append(tag)
        for o in order(outs, version):
            dist.barrier()
            t0 = time.perf_counter()
            if name == "deepspeed":
                engine.save_checkpoint(str(o), tag=tag)
            else:
                megatron_save(model, opt, o / tag, rank, world, step)
            dist.barrier()
            if rank == 0:
                add_save(rec, o.parent, tag, time.perf_counter() - t0, tree_bytes(o / tag))
        if rank == 0:
            print(f"{name} v{version} {tag}", flush=True)
    if rank == 0:
        Path(result).write_text(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()


def megatron_save(model, opt, ckpt_dir: Path, rank: int, world: int, step: int) -> None:
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = opt.state_dict()["state"]
    index = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    sharded: dict = {"model": {}, "optimizer": {}}

    def shard(key: str, t: torch.Tensor) -> ShardedTensor:
        t = t.detach()
        if t.dim() >= 1 and t.shape[0] % world == 0:      # tensor-parallel on dim 0
            return ShardedTensor.from_rank_offsets(key, t.chunk(world)[rank].clone(),
                                                   (0, rank, world), replica_id=0)
        return ShardedTensor.from_rank_offsets(key, t.clone(), replica_id=rank)

    for name, p in model.named_parameters():
        sharded["model"][name] = shard(name, p)
        if id(p) in index:
            st = state[index[id(p)]]
            for moment in ("exp_avg", "exp_avg_sq"):
                key = f"optimizer.{moment}.{name}"
                sharded["optimizer"][key] = shard(key, st[moment])
    sharded["iteration"] = step
    dist_checkpointing.save(sharded, str(ckpt_dir))


def run_ranks(args: argparse.Namespace, name: str, timings: Timings) -> None:
    for o in args.out:
        (o / name).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(args.threads),
               PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory(prefix="ckpt-fw-") as tmp:
        result = os.path.join(tmp, "result.json")
        argv = [sys.executable, __file__, *map(str, args.out), "--scenarios", name,
                "--versions", str(args.versions), "--steps", str(args.steps),
                "--layers", str(args.layers), "--d-model", str(args.d_model),
                "--vocab", str(args.vocab), "--ctx", str(args.ctx), "--batch", str(args.batch),
                "--threads", str(args.threads), "--_port", str(port), "--_result", result]
        # The ranks stay in this process group, so whoever kills the group (as
        # bench_dedup.py does on a timeout) takes them and their helpers too.
        procs = [subprocess.Popen(argv + ["--_rank", str(r)], env=env) for r in range(args.ranks)]
        try:
            while any(p.poll() is None for p in procs):
                if any(p.returncode for p in procs if p.returncode is not None):
                    break           # a rank failed: the others would wait for it forever
                time.sleep(0.5)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        if any(codes):
            raise SystemExit(f"{name}: rank exit codes {codes}")
        timings.data["scenarios"][name] = json.loads(Path(result).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="+")
    ap.add_argument("--scenarios", default=ALL, help=f"comma-separated ({ALL})")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps between versions")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2, help="processes for deepspeed and megatron")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timings", type=Path)
    ap.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out = [o.resolve() for o in args.out]
    names = args.scenarios.split(",")
    for n in names:
        if n not in ALL.split(","):
            ap.error(f"unknown scenario {n!r} (one of {ALL})")
    if args._rank is not None:
        rank_main(args, names[0], args._rank, args.ranks, args._port, args._result)
        return
    timings = Timings(args.out)
    for n in names:
        if n == "tf":
            run_tf(args, n, timings)
        elif n.startswith("orbax"):
            run_orbax(args, n, timings)
        else:
            run_ranks(args, n, timings)
        timings.write(args.timings)


if __name__ == "__main__":
    main()
