"""TensorFlow's own checkpoint I/O on ckptfs (tests/compat/test_compat_tensorflow.py).

    compat_tf_worker.py save MOUNT_DIR PLAIN_DIR
    compat_tf_worker.py verify MOUNT_DIR PLAIN_DIR

save: builds a small Keras model from a config (seeded), trains it on
synthetic data, and after every epoch saves it with tf.train.CheckpointManager
(max_to_keep=2) into MOUNT_DIR/ckpts and, through a second Checkpoint object
over the same model and optimizer, into PLAIN_DIR/ckpts (same bytes, same
save counter). The values of every variable at each save go to
PLAIN_DIR/expected-<n>.npz. Then Keras model.save writes MOUNT_DIR/model.keras,
its predictions on a fixed input go to PLAIN_DIR/predictions.npy.

verify: for every checkpoint the manager kept, restores it into a freshly
built model and optimizer (tf.train.Checkpoint.restore(...).assert_consumed())
and compares every variable with expected-<n>.npz; reads every tensor of the
bundle with tf.train.load_checkpoint and compares it with the plain copy's;
loads model.keras with keras.models.load_model and compares its weights and
predictions. Exit status 0: all equal.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

CONFIG = {"inputs": 64, "hidden": [256, 256, 128], "outputs": 16, "seed": 7}
SAVES = 4
KEEP = 2


def build(config: dict) -> tuple[keras.Model, keras.optimizers.Optimizer]:
    keras.utils.set_random_seed(config["seed"])
    inp = keras.Input((config["inputs"],), name="x")
    x = inp
    for i, width in enumerate(config["hidden"]):
        x = keras.layers.Dense(width, activation="gelu", name=f"dense_{i}")(x)
        x = keras.layers.LayerNormalization(name=f"norm_{i}")(x)
    out = keras.layers.Dense(config["outputs"], name="head")(x)
    model = keras.Model(inp, out, name="tiny_mlp")
    model.get_layer("dense_0").trainable = False     # a frozen-base fine-tune
    opt = keras.optimizers.Adam(1e-3)
    model.compile(opt, "mse")
    return model, opt


def data(seed: int, n: int = 256) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, CONFIG["inputs"])).astype("float32")
    return x, np.tanh(x[:, : CONFIG["outputs"]] * 2.0)


def variables(ckpt: tf.train.Checkpoint) -> dict[str, np.ndarray]:
    """Every variable the checkpoint saves, by its checkpoint key."""
    out = {}
    for name, _shape in tf.train.list_variables(ckpt):
        if name != "_CHECKPOINTABLE_OBJECT_GRAPH":
            out[name] = tf.train.load_variable(ckpt, name)
    return out


def save(mount_dir: str, plain_dir: str) -> None:
    model, opt = build(CONFIG)
    on_mount = tf.train.Checkpoint(model=model, optimizer=opt)
    on_plain = tf.train.Checkpoint(model=model, optimizer=opt)
    mgr = tf.train.CheckpointManager(on_mount, os.path.join(mount_dir, "ckpts"), max_to_keep=KEEP)
    ref = tf.train.CheckpointManager(on_plain, os.path.join(plain_dir, "ckpts"), max_to_keep=KEEP)
    x, y = data(1)
    for n in range(1, SAVES + 1):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
        path = mgr.save()
        ref_path = ref.save()
        assert path.endswith(f"ckpt-{n}") and ref_path.endswith(f"ckpt-{n}"), (path, ref_path)
        np.savez(os.path.join(plain_dir, f"expected-{n}.npz"), **variables(ref_path))
    assert mgr.checkpoints == [os.path.join(mount_dir, "ckpts", f"ckpt-{n}")
                               for n in range(SAVES - KEEP + 1, SAVES + 1)], mgr.checkpoints
    model.save(os.path.join(mount_dir, "model.keras"))
    probe, _ = data(2, 64)
    np.save(os.path.join(plain_dir, "predictions.npy"), model.predict(probe, verbose=0))
    np.savez(os.path.join(plain_dir, "keras-weights.npz"),
             **{f"w{i}": w for i, w in enumerate(model.get_weights())})


def verify(mount_dir: str, plain_dir: str) -> None:
    ckpt_dir = os.path.join(mount_dir, "ckpts")
    latest = tf.train.latest_checkpoint(ckpt_dir)
    assert latest == os.path.join(ckpt_dir, f"ckpt-{SAVES}"), latest
    state = tf.train.get_checkpoint_state(ckpt_dir)
    kept = [os.path.join(ckpt_dir, f"ckpt-{n}") for n in range(SAVES - KEEP + 1, SAVES + 1)]
    assert list(state.all_model_checkpoint_paths) == kept, state
    for n in range(SAVES - KEEP + 1, SAVES + 1):
        prefix = os.path.join(ckpt_dir, f"ckpt-{n}")
        expected = dict(np.load(os.path.join(plain_dir, f"expected-{n}.npz")))
        # The bundle, tensor by tensor, against the values saved and the plain copy.
        got = variables(prefix)
        plain = variables(os.path.join(plain_dir, "ckpts", f"ckpt-{n}"))
        assert sorted(got) == sorted(expected) == sorted(plain), (sorted(got), sorted(expected))
        for name, value in expected.items():
            assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name
            assert np.array_equal(plain[name], value), name
        # Restored into a fresh model: every object consumed, every weight equal.
        model, opt = build(dict(CONFIG, seed=CONFIG["seed"] + 100))
        x, y = data(1, 32)
        model.fit(x, y, epochs=1, verbose=0)       # creates the optimizer's slots
        restored = tf.train.Checkpoint(model=model, optimizer=opt)
        restored.restore(prefix).assert_consumed()
        assert int(restored.save_counter.numpy()) == n
        again = tf.train.Checkpoint(model=model, optimizer=opt)
        check_dir = os.path.join(plain_dir, f"roundtrip-{n}")
        for name, value in variables(again.write(os.path.join(check_dir, "ck"))).items():
            if name != "save_counter/.ATTRIBUTES/VARIABLE_VALUE":
                assert np.array_equal(value, expected[name]), f"ckpt-{n}: {name} after restore"
    loaded = keras.models.load_model(os.path.join(mount_dir, "model.keras"))
    probe, _ = data(2, 64)
    want = np.load(os.path.join(plain_dir, "predictions.npy"))
    assert np.array_equal(loaded.predict(probe, verbose=0), want), "model.keras predictions"
    weights = np.load(os.path.join(plain_dir, "keras-weights.npz"))
    got_weights = loaded.get_weights()
    assert len(got_weights) == len(weights.files)
    for i, w in enumerate(got_weights):
        assert w.dtype == weights[f"w{i}"].dtype and np.array_equal(w, weights[f"w{i}"]), i
    assert not loaded.get_layer("dense_0").trainable


def main() -> int:
    mode, mount_dir, plain_dir = sys.argv[1:4]
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    {"save": save, "verify": verify}[mode](mount_dir, plain_dir)
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}: {mode} ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
