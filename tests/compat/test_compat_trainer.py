"""A Hugging Face Trainer-style checkpoint rotation on ckptfs.

What the Trainer does on every save, with the libraries doing the I/O:
write model.safetensors (safetensors), optimizer.pt, scheduler.pt and
rng_state.pth (torch.save), trainer_state.json and config.json into
`tmp-checkpoint-N`, rename the directory to `checkpoint-N`, fsync the
output directory, then keep the newest K checkpoints and shutil.rmtree the
rest. A save cut short leaves a `tmp-checkpoint-N` behind that resuming
ignores. After a remount, training resumes from the newest checkpoint
(found the way transformers' get_last_checkpoint finds it) and continues
exactly like the run that never stopped. The same saves go to a plain
directory, and every file must match it byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from compat_util import assert_same, manifest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

PMEM_SIZE = "128M"         # the log of each test's mount (compat/conftest.py)

KEEP = 2
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class Run:
    """A tiny regression model, AdamW, a LR schedule and an RNG: a Trainer's state."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                         torch.nn.Linear(1024, 256))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.step = 0
        self.losses: list[float] = []

    def train_step(self) -> None:
        x = torch.randn(32, 256, generator=self.gen)
        loss = (self.model(x) - x.flip(1)).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.losses.append(loss.item())

    def save(self, out: Path, partial: bool = False) -> Path:
        tmp = out / f"tmp-checkpoint-{self.step}"
        tmp.mkdir()
        st_torch.save_file(self.model.state_dict(), tmp / "model.safetensors",
                           metadata={"format": "pt"})
        torch.save(self.opt.state_dict(), tmp / "optimizer.pt")
        if partial:
            return tmp          # the job died here
        torch.save(self.sched.state_dict(), tmp / "scheduler.pt")
        torch.save({"generator": self.gen.get_state(), "cpu": torch.get_rng_state()},
                   tmp / "rng_state.pth")
        with open(tmp / "trainer_state.json", "w") as f:
            json.dump({"global_step": self.step, "log_history": self.losses}, f, indent=2)
        with open(tmp / "config.json", "w") as f:
            json.dump({"model_type": "tiny-mlp", "hidden": 1024}, f, indent=2)
        final = out / f"checkpoint-{self.step}"
        os.rename(tmp, final)
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return final

    def load(self, ckpt: Path) -> None:
        self.model.load_state_dict(st_torch.load_file(ckpt / "model.safetensors"))
        self.opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        self.sched.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
        rng = torch.load(ckpt / "rng_state.pth", weights_only=True)
        self.gen.set_state(rng["generator"])
        torch.set_rng_state(rng["cpu"])
        state = json.loads((ckpt / "trainer_state.json").read_text())
        self.step = state["global_step"]
        self.losses = state["log_history"]


def rotate(out: Path, keep: int) -> None:
    """The Trainer's _rotate_checkpoints: oldest first, rmtree beyond `keep`."""
    ckpts = sorted((int(m.group(1)), out / n) for n in os.listdir(out)
                   if (m := CHECKPOINT_RE.match(n)))
    for _, path in ckpts[:-keep]:
        shutil.rmtree(path)


def last_checkpoint(out: Path) -> Path:
    """transformers.trainer_utils.get_last_checkpoint."""
    ckpts = [n for n in os.listdir(out) if CHECKPOINT_RE.match(n) and (out / n).is_dir()]
    return out / max(ckpts, key=lambda n: int(CHECKPOINT_RE.match(n).group(1)))


def test_trainer_rotation_and_resume(mounted, fsck_clean, tmp_path):
    out = mounted.path / "output"
    ref = tmp_path / "plain-output"
    out.mkdir()
    ref.mkdir()
    run = Run()
    for _ in range(6):
        run.train_step()
        for root in (out, ref):
            run.save(root)
            rotate(root, KEEP)
    run.train_step()
    for root in (out, ref):
        run.save(root, partial=True)      # step 7 never finished
    assert sorted(os.listdir(out)) == ["checkpoint-5", "checkpoint-6", "tmp-checkpoint-7"]
    want = manifest(ref, times=False, xattrs=False)

    mounted.remount()
    assert_same(manifest(out, times=False, xattrs=False), want, "after remount")
    resumed = Run(seed=99)
    resumed.load(last_checkpoint(out))
    assert resumed.step == 6

    # The uninterrupted run, rewound to step 6 from the plain copy, and the resumed
    # run must now take identical steps.
    straight = Run(seed=99)
    straight.load(ref / "checkpoint-6")
    for _ in range(3):
        straight.train_step()
        resumed.train_step()
    assert resumed.losses == straight.losses
    for a, b in zip(resumed.model.state_dict().values(), straight.model.state_dict().values()):
        assert torch.equal(a, b)
    # The resumed job goes on saving and rotating (the stale tmp dir is replaced first).
    shutil.rmtree(out / "tmp-checkpoint-7")
    resumed_ckpt = resumed.save(out)
    rotate(out, KEEP)
    assert sorted(os.listdir(out)) == ["checkpoint-6", resumed_ckpt.name]
    mounted.remount()
    resumed_again = Run(seed=5)
    resumed_again.load(last_checkpoint(out))
    for a, b in zip(resumed.model.state_dict().values(),
                    resumed_again.model.state_dict().values()):
        assert torch.equal(a, b)
    fsck_clean(mounted)
