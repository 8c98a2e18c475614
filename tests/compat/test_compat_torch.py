"""torch.save / torch.load on ckptfs, unchanged: the library does the I/O.

Each test builds a small model from a config (no downloads), trains one step
on synthetic data so the optimizer has state, saves with torch's own code to
the mount and, for a byte-level reference, to a plain directory under the
same file name (torch.save output depends only on the objects and the name).
After an unmount and remount every byte must match the reference and every
tensor must load back equal, through the plain, weights_only and mmap paths.
"""

from __future__ import annotations

import gc
import io
import os

import pytest

from compat_util import sha256_file

torch = pytest.importorskip("torch")

PMEM_SIZE = "256M"         # the log of each test's mount (compat/conftest.py)


def tiny_lm(vocab: int, d_model: int, layers: int, seed: int = 0) -> "torch.nn.Module":
    """A decoder-style LM built from a config: embedding, encoder layers, head."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=max(1, d_model // 64),
                                             dim_feedforward=4 * d_model, batch_first=True)
    return torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(vocab, d_model),
        "blocks": torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        "norm": torch.nn.LayerNorm(d_model),
    })


def train_step(model, opt, vocab: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 16), generator=g)
    h = model["norm"](model["blocks"](model["embed"](tokens)))
    logits = h @ model["embed"].weight.T
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def assert_equal_nested(a, b, path: str = "") -> None:
    """Tensors by torch.equal (dtype and shape too), everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"tensor {path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_equal_nested(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_nested(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_state_dicts_hundreds_of_mb(make_mount, fsck_clean, tmp_path):
    """Model + AdamW state (~250 MB) with torch.save; load plain, weights_only, mmap."""
    m = make_mount(options=["pmem_size=512M"])
    vocab = 8192
    model = tiny_lm(vocab, 768, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, vocab)
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1,
            "args": {"lr": 1e-3, "vocab": vocab}}
    ref_dir = tmp_path / "plain"
    ref_dir.mkdir()
    torch.save(ckpt, ref_dir / "checkpoint.pt")
    torch.save(ckpt, m.path / "checkpoint.pt")
    size = os.path.getsize(ref_dir / "checkpoint.pt")
    assert size > 200 << 20
    assert os.path.getsize(m.path / "checkpoint.pt") == size

    # Before the remount, straight from a fresh page cache of the mount.
    mm = torch.load(m.path / "checkpoint.pt", mmap=True, weights_only=True)
    assert_equal_nested(ckpt, mm)
    del mm
    gc.collect()      # an mmap'ed file keeps the mount busy

    m.remount()
    assert sha256_file(m.path / "checkpoint.pt") == sha256_file(ref_dir / "checkpoint.pt")
    loaded = torch.load(m.path / "checkpoint.pt", weights_only=True)
    assert_equal_nested(ckpt, loaded)
    del loaded
    loaded = torch.load(m.path / "checkpoint.pt", mmap=True, weights_only=True,
                        map_location="cpu")
    assert_equal_nested(ckpt, loaded)

    # Resume: a fresh model and optimizer continue exactly like the original.
    model2 = tiny_lm(vocab, 768, 2, seed=123)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    del loaded
    train_step(model, opt, vocab, seed=2)
    train_step(model2, opt2, vocab, seed=2)
    assert_equal_nested(model.state_dict(), model2.state_dict())
    del model2, opt2
    gc.collect()
    fsck_clean(m)


def test_save_variants_and_overwrite(mounted, fsck_clean, tmp_path):
    """File objects, BytesIO, the legacy format, overwrite in place, map_location."""
    vocab = 512
    model = tiny_lm(vocab, 64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, opt, vocab)
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    p = mounted.path
    ref = tmp_path / "plain"
    ref.mkdir()
    for d in (p, ref):
        with open(d / "fileobj.pt", "wb") as f:
            torch.save(sd, f)
        buf = io.BytesIO()
        torch.save(sd, buf)
        (d / "bytesio.pt").write_bytes(buf.getvalue())
        torch.save(sd, d / "legacy.pt", _use_new_zipfile_serialization=False)
        # Overwrite an existing, bigger checkpoint in place (O_TRUNC).
        torch.save({"big": torch.ones(1 << 20)}, d / "overwritten.pt")
        torch.save(sd["model"], d / "overwritten.pt")
    legacy_before = torch.load(p / "legacy.pt", weights_only=True)
    assert_equal_nested(sd, legacy_before)

    mounted.remount()
    for name in ("fileobj.pt", "bytesio.pt", "legacy.pt", "overwritten.pt"):
        assert sha256_file(p / name) == sha256_file(ref / name), name
    with open(p / "fileobj.pt", "rb") as f:
        assert_equal_nested(sd, torch.load(f, weights_only=True))
    assert_equal_nested(sd, torch.load(p / "bytesio.pt", weights_only=True, map_location="cpu"))
    assert_equal_nested(sd, torch.load(p / "legacy.pt", weights_only=True))
    assert_equal_nested(sd["model"], torch.load(p / "overwritten.pt", mmap=True,
                                                 weights_only=True))
    gc.collect()
    fsck_clean(mounted)


def test_mmap_load_survives_replace(mounted, fsck_clean):
    """A resumed job keeps an mmap'ed checkpoint while the next save replaces it."""
    p = mounted.path
    old = {"w": torch.arange(4 << 20, dtype=torch.float32)}
    new = {"w": -torch.arange(4 << 20, dtype=torch.float32)}
    torch.save(old, p / "latest.pt")
    mapped = torch.load(p / "latest.pt", mmap=True, weights_only=True)
    torch.save(new, p / "latest.pt.tmp")
    os.replace(p / "latest.pt.tmp", p / "latest.pt")
    assert torch.equal(mapped["w"], old["w"])     # the replaced inode, still mapped
    assert_equal_nested(new, torch.load(p / "latest.pt", weights_only=True))
    del mapped
    gc.collect()
    mounted.remount()
    assert_equal_nested(new, torch.load(p / "latest.pt", mmap=True, weights_only=True))
    gc.collect()
    assert sorted(os.listdir(p)) == ["latest.pt"]
    fsck_clean(mounted)
