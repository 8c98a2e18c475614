"""safetensors on ckptfs, unchanged.

safetensors 0.8's save_file writes a hidden temp file in the target
directory (O_CREAT|O_EXCL, mode 0600), ftruncates it to the final size,
writes header and data, renames it over the target while still open, then
closes it. load_file and safe_open mmap the file (MAP_PRIVATE). Every file
is compared byte for byte with the same save into a plain directory.
"""

from __future__ import annotations

import gc
import os
import stat

import pytest

from compat_util import sha256_file

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
st_torch = pytest.importorskip("safetensors.torch")
st_numpy = pytest.importorskip("safetensors.numpy")
from safetensors import safe_open  # noqa: E402

PMEM_SIZE = "256M"         # the log of each test's mount (compat/conftest.py)


def tensors(seed: int, scale: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(4096 * scale, 512, generator=g),                 # 8 MiB
        "layers.0.attn.qkv": torch.randn(512, 1536, generator=g).to(torch.bfloat16),
        "layers.0.mlp.up": torch.randn(512, 2048, generator=g).to(torch.float16),
        "layers.0.norm.bias": torch.zeros(512),
        "position_ids": torch.arange(2048, dtype=torch.int64),
        "mask": torch.rand(333, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
    }


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_save_file_load_file_safe_open(mounted, fsck_clean, tmp_path):
    p = mounted.path / "model.safetensors"
    ref = tmp_path / "plain"
    ref.mkdir()
    t = tensors(0, scale=8)                       # ~80 MiB file
    # One key: with several, safetensors orders the header's metadata randomly.
    meta = {"format": "pt"}
    st_torch.save_file(t, p, metadata=meta)
    st_torch.save_file(t, ref / "model.safetensors", metadata=meta)
    assert os.path.getsize(p) > 64 << 20
    assert stat.S_IMODE(os.stat(p).st_mode) == stat.S_IMODE(os.stat(ref / "model.safetensors").st_mode)
    assert [n for n in os.listdir(mounted.path) if n.startswith(".tmp")] == []
    assert_same_tensors(t, st_torch.load_file(p))           # right after the save

    # Overwrite while a reader still maps the old version (rename over an open file).
    t2 = tensors(1, scale=8)
    with safe_open(p, framework="pt") as f:
        old = f.get_tensor("embed.weight")
        st_torch.save_file(t2, p, metadata=meta)
        assert torch.equal(f.get_slice("embed.weight")[10:20], t["embed.weight"][10:20])
    assert torch.equal(old, t["embed.weight"])
    st_torch.save_file(t2, ref / "model.safetensors", metadata=meta)
    del old, f
    gc.collect()

    mounted.remount()
    assert sha256_file(p) == sha256_file(ref / "model.safetensors")
    assert_same_tensors(t2, st_torch.load_file(p))
    with safe_open(p, framework="pt", device="cpu") as f:
        assert f.metadata() == meta
        assert sorted(f.keys()) == sorted(t2)
        for k in f.keys():
            assert torch.equal(f.get_tensor(k), t2[k]), k
        assert torch.equal(f.get_slice("layers.0.mlp.up")[100:200, 7:9],
                           t2["layers.0.mlp.up"][100:200, 7:9])
    del f
    gc.collect()
    assert sorted(os.listdir(mounted.path)) == ["model.safetensors"]
    fsck_clean(mounted)


def test_numpy_bytes_and_model_helpers(mounted, fsck_clean, tmp_path):
    d = mounted.path
    ref = tmp_path / "plain"
    ref.mkdir()
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((300, 300)).astype(np.float32),
              "b": rng.integers(0, 1 << 40, size=5000, dtype=np.int64),
              "c": np.zeros((0,), dtype=np.uint8)}

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 1000))
    model[1].weight = model[0].weight                     # tied weights, as LMs do
    blob = st_torch.save({"x": torch.arange(10_000, dtype=torch.int32)})
    for root in (d, ref):
        st_numpy.save_file(arrays, root / "arrays.safetensors")
        st_torch.save_model(model, root / "tied.safetensors")
        with open(root / "blob.safetensors", "wb") as f:
            f.write(blob)
    mounted.remount()
    for name in ("arrays.safetensors", "tied.safetensors", "blob.safetensors"):
        assert sha256_file(d / name) == sha256_file(ref / name), name
    got = st_numpy.load_file(d / "arrays.safetensors")
    assert sorted(got) == sorted(arrays)
    for k in arrays:
        assert got[k].dtype == arrays[k].dtype and np.array_equal(got[k], arrays[k])
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 1000))
    model2[1].weight = model2[0].weight
    missing, unexpected = st_torch.load_model(model2, d / "tied.safetensors")
    assert not missing and not unexpected
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(st_torch.load((d / "blob.safetensors").read_bytes())["x"],
                       torch.arange(10_000, dtype=torch.int32))
    gc.collect()
    fsck_clean(mounted)
