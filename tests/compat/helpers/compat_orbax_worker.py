"""JAX + Orbax checkpointing on ckptfs (tests/compat/test_compat_orbax.py).

    compat_orbax_worker.py save LAYOUT:MOUNT_DIR:PLAIN_DIR [...]
    compat_orbax_worker.py verify LAYOUT:MOUNT_DIR:PLAIN_DIR [...]

Each LAYOUT:MOUNT_DIR:PLAIN_DIR in turn, in one process (importing JAX and
Orbax is most of a run), each with a CheckpointManager of its own.

LAYOUT is ocdbt (Orbax's default: one OCDBT key-value store per checkpoint
item, arrays as zarr3 chunks packed into its data files) or zarr (use_ocdbt=
False: a zarr3 array directory per leaf, one file per chunk).

save: an MLP built from CONFIG (jax.random, float32 weights, bfloat16
embedding) trains with hand-written Adam (grads by jax.grad on synthetic
data); after every step an ocp.CheckpointManager (max_to_keep=2, async
saves) saves params, optimizer moments and the step into MOUNT_DIR/ckpts;
the exact arrays of every save go to PLAIN_DIR/expected-<step>.pkl.

verify: the manager finds the kept steps after the remount; each is restored
(into abstract arrays, as a resuming job does) and compared array by array
with expected-<step>.pkl; training resumed from the newest step matches one
more step taken from the expected values. Exit 0: all equal.
"""

from __future__ import annotations

import os
import pickle
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

CONFIG = {"vocab": 512, "d_model": 128, "hidden": [256, 256], "outputs": 32, "seed": 3}
STEPS = 4
KEEP = 2


def init(config: dict) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(config["seed"]), 2 + len(config["hidden"]))
    params = {"embed": (jax.random.normal(keys[0], (config["vocab"], config["d_model"]))
                        * 0.02).astype(jnp.bfloat16)}
    width = config["d_model"]
    for i, h in enumerate(config["hidden"]):
        params[f"layer_{i}"] = {"w": jax.random.normal(keys[1 + i], (width, h)) / width ** 0.5,
                                "b": jnp.zeros((h,))}
        width = h
    params["head"] = {"w": jax.random.normal(keys[-1], (width, config["outputs"])) / width ** 0.5,
                      "b": jnp.zeros((config["outputs"],))}
    return params


def forward(params: dict, tokens: jax.Array) -> jax.Array:
    x = params["embed"][tokens].astype(jnp.float32).mean(axis=1)
    i = 0
    while f"layer_{i}" in params:
        x = jax.nn.gelu(x @ params[f"layer_{i}"]["w"] + params[f"layer_{i}"]["b"])
        i += 1
    return x @ params["head"]["w"] + params["head"]["b"]


def loss_fn(params: dict, tokens: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((forward(params, tokens) - target) ** 2)


def batch(step: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(1000 + step)
    tokens = rng.integers(0, CONFIG["vocab"], (16, 8))
    return jnp.asarray(tokens), jnp.asarray(rng.standard_normal((16, CONFIG["outputs"])),
                                            jnp.float32)


@jax.jit
def train_step(state: dict, tokens: jax.Array, target: jax.Array) -> dict:
    """Adam, with the first layer frozen (its moments stay zero)."""
    grads = jax.grad(loss_fn)(state["params"], tokens, target)
    grads["layer_0"] = jax.tree.map(jnp.zeros_like, grads["layer_0"])
    t = state["step"] + 1
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g.astype(m.dtype), state["mu"], grads)
    nu = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * (g.astype(v.dtype) ** 2), state["nu"],
                      grads)

    def update(p, m, v):
        mhat, vhat = m / (1 - 0.9 ** t), v / (1 - 0.999 ** t)
        return (p - 1e-3 * mhat / (jnp.sqrt(vhat) + 1e-8)).astype(p.dtype)

    params = jax.tree.map(update, state["params"], mu, nu)
    return {"params": params, "mu": mu, "nu": nu, "step": t}


def new_state() -> dict:
    params = init(CONFIG)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return {"params": params, "mu": zeros, "nu": jax.tree.map(jnp.copy, zeros),
            "step": jnp.asarray(0, jnp.int32)}


def flat(tree: dict) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def expect(plain_dir: str, step: int, arrays: dict[str, np.ndarray]) -> None:
    # pickle, not npz: npz stores bfloat16 as raw void.
    with open(os.path.join(plain_dir, f"expected-{step}.pkl"), "wb") as f:
        pickle.dump(arrays, f)


def expected(plain_dir: str, step: int) -> dict[str, np.ndarray]:
    with open(os.path.join(plain_dir, f"expected-{step}.pkl"), "rb") as f:
        return pickle.load(f)


def manager(mount_dir: str, layout: str) -> ocp.CheckpointManager:
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=layout == "ocdbt", use_zarr3=True)
    options = ocp.CheckpointManagerOptions(max_to_keep=KEEP, create=True,
                                           enable_async_checkpointing=True)
    return ocp.CheckpointManager(os.path.join(mount_dir, "ckpts"), options=options,
                                 item_handlers={"state": handler})


def save(mount_dir: str, plain_dir: str, layout: str) -> None:
    state = new_state()
    mngr = manager(mount_dir, layout)
    for step in range(1, STEPS + 1):
        state = train_step(state, *batch(step))
        assert mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
        expect(plain_dir, step, flat(state))
    mngr.wait_until_finished()
    assert mngr.all_steps() == list(range(STEPS - KEEP + 1, STEPS + 1)), mngr.all_steps()
    mngr.close()


def same(got: dict, want: dict[str, np.ndarray], what: str) -> None:
    got_flat = flat(got)
    assert sorted(got_flat) == sorted(want), (what, sorted(got_flat), sorted(want))
    for name, value in want.items():
        g = got_flat[name]
        assert g.dtype == value.dtype and g.shape == value.shape, (what, name, g.dtype, value.dtype)
        assert g.tobytes() == value.tobytes(), f"{what}: {name} differs"


def restore(mngr: ocp.CheckpointManager, step: int, abstract: dict) -> dict:
    """What a resuming job does: restore into arrays of known shape, dtype, sharding."""
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(dtype=s.dtype, sharding=s.sharding), abstract)
    got = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(abstract, restore_args=restore_args)))
    return got["state"]


def verify(mount_dir: str, plain_dir: str, layout: str) -> None:
    mngr = manager(mount_dir, layout)
    assert mngr.all_steps() == list(range(STEPS - KEEP + 1, STEPS + 1)), mngr.all_steps()
    assert mngr.latest_step() == STEPS
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, new_state())
    for step in mngr.all_steps():
        want = expected(plain_dir, step)
        same(restore(mngr, step, abstract), want, f"step {step}")
    # Resume: one more step from the restored state equals one more step from the
    # values saved (nothing else hides in the checkpoint).
    resumed = train_step(restore(mngr, STEPS, abstract), *batch(STEPS + 1))
    want = expected(plain_dir, STEPS)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(new_state())
    reference = jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(want[jax.tree_util.keystr(p)]) for p, _ in leaves])
    same(resumed, flat(train_step(reference, *batch(STEPS + 1))), "resumed step")
    mngr.close()


def main() -> int:
    mode = sys.argv[1]
    for job in sys.argv[2:]:
        layout, mount_dir, plain_dir = job.split(":", 2)
        assert layout in ("ocdbt", "zarr"), layout
        {"save": save, "verify": verify}[mode](mount_dir, plain_dir, layout)
        print(f"jax {jax.__version__}, orbax-checkpoint {ocp.__version__}: {mode} {layout} ok",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
