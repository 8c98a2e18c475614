#!/usr/bin/env python3
"""Write realistic checkpoint series by really training a small GPT on the CPU.

A GPT-style model trains for a few AdamW steps between saves; each version is
saved by the frameworks themselves (torch.save, safetensors save_file,
torch.distributed.checkpoint) under OUT/<scenario>/. Scenarios:

  pretrain  every weight trains (AdamW, weight decay 0.1): nothing repeats
            between versions, so nothing should dedup
  frozen    all but the last two transformer blocks frozen (fine-tuning the top)
  lora      rank-8 LoRA adapters on every linear layer of a frozen base; the
            adapters sit between the frozen matrices in both file formats
  embed     only the token embedding trains (sparse updates: rows of tokens
            never seen stay unchanged)
  dcp       the frozen fine-tune on --ranks processes (gloo, FSDP2 fully_shard,
            so every tensor is a DTensor shard), saved with
            torch.distributed.checkpoint's FileSystemWriter into
            OUT/dcp/step_N/ (__<rank>_0.distcp per rank, .metadata): model and
            optimizer state, as get_state_dict returns them

Any scenario takes the suffix -bf16 (pretrain-bf16, lora-bf16, ...): the model
is cast to bfloat16 and trained in it (pure bf16 AdamW, so the optimizer state
is bfloat16 too); its files go to OUT/<scenario>-bf16/. "all" means
pretrain,pretrain-bf16,frozen,lora,embed,dcp.

Files per version of the single-process scenarios (--files):

  pt           step_N.pt           torch.save(model.state_dict())
  safetensors  step_N.safetensors  save_file(model.state_dict(), metadata={step, loss})
  optim        step_N.optim.pt     torch.save({"optimizer": opt.state_dict(), "step": N})

--files auto (the default) is pt,safetensors for frozen, lora and embed (the
series tools/chunk_sizes.py and docs/CHUNKING.md measure) and
safetensors,optim for pretrain (a Trainer-style checkpoint: weights plus
optimizer state). N is 50 x the optimizer steps so far.

Several OUT directories: every version is saved into each of them in turn (the
order rotates from version to version), so one training run writes the same
series through, say, two mounts and a plain directory. --timings FILE records
per OUT the seconds spent inside the save calls and the bytes they wrote
(for DCP: rank 0's wall time of dcp.save between barriers).

Defaults: 8 blocks, d_model 512, vocab 8192 (33.6M parameters, 134 MB fp32
per model file), 3 versions, 3 AdamW steps apart, one CPU thread per process;
about 10-40 s of training per scenario on this machine's cores.

  python tools/make_ckpt_series.py /tmp/ckseries
  python tools/make_ckpt_series.py --scenarios all --files safetensors,optim \\
      --timings t.json /mnt/ckptfs-a /mnt/ckptfs-b /var/tmp/plain
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

ALL = "pretrain,pretrain-bf16,frozen,lora,embed,dcp"
KINDS = ("pretrain", "frozen", "lora", "embed", "dcp")
FILE_KINDS = ("pt", "safetensors", "optim")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        fan_in = math.sqrt(base.in_features)
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) / fan_in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv: nn.Module = nn.Linear(d, 3 * d)
        self.proj: nn.Module = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc: nn.Module = nn.Linear(d, 4 * d)
        self.fc2: nn.Module = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def setup(model: GPT, scenario: str, rank: int) -> None:
    """Choose what trains (scenario kind without the dtype suffix)."""
    if scenario == "pretrain":
        return
    for p in model.parameters():
        p.requires_grad_(False)
    if scenario in ("frozen", "dcp"):
        for module in list(model.blocks[-2:]) + [model.ln_f]:
            for p in module.parameters():
                p.requires_grad_(True)
    elif scenario == "lora":
        for block in model.blocks:
            for name in ("qkv", "proj", "fc", "fc2"):
                setattr(block, name, LoRALinear(getattr(block, name), rank))
    elif scenario == "embed":
        model.wte.weight.requires_grad_(True)
    else:
        raise SystemExit(f"unknown scenario {scenario}")


def batch(gen: torch.Generator, vocab: int, size: int, ctx: int) -> torch.Tensor:
    # Zipf-like token frequencies, so the embedding scenario touches few rows.
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(1.0 / ranks, size * (ctx + 1), replacement=True,
                             generator=gen).view(size, ctx + 1)


def parse_scenario(name: str) -> tuple[str, torch.dtype]:
    kind, _, suffix = name.partition("-")
    if kind not in KINDS or suffix not in ("", "bf16", "fp32"):
        raise SystemExit(f"unknown scenario {name!r} (one of {', '.join(KINDS)}, "
                         "optionally with -bf16)")
    return kind, (torch.bfloat16 if suffix == "bf16" else torch.float32)


def files_for(kind: str, spec: str) -> list[str]:
    if spec == "auto":
        return ["safetensors", "optim"] if kind == "pretrain" else ["pt", "safetensors"]
    files = spec.split(",")
    for f in files:
        if f not in FILE_KINDS:
            raise SystemExit(f"--files: unknown kind {f!r} (pt, safetensors, optim or auto)")
    return files


def make_model(args: argparse.Namespace, kind: str, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)  # the same base model in every scenario
    model = GPT(args.vocab, args.d_model, args.layers, max(1, args.d_model // 64), args.ctx)
    setup(model, kind, args.rank)
    return model.to(dtype)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
                args: argparse.Namespace, n: int, batch_size: int) -> torch.Tensor:
    loss = torch.tensor(0.0)
    for _ in range(n):
        tokens = batch(gen, args.vocab, batch_size, args.ctx)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab).float(),
                               tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss


class Timings:
    """Seconds inside save calls and bytes written, per OUT directory."""

    def __init__(self, outs: list[Path]) -> None:
        self.data: dict = {"outs": [str(o) for o in outs], "scenarios": {}}

    def scenario(self, name: str) -> dict:
        return self.data["scenarios"].setdefault(name, {
            "per_out": {}, "versions": [], "train_seconds": 0.0})

    def add(self, name: str, out: Path, what: str, seconds: float, nbytes: int) -> None:
        add_save(self.scenario(name), out, what, seconds, nbytes)

    def write(self, path: Optional[Path]) -> None:
        if path is not None:
            path.write_text(json.dumps(self.data, indent=1) + "\n")


def add_save(rec: dict, out: Path, what: str, seconds: float, nbytes: int) -> None:
    r = rec["per_out"].setdefault(str(out), {"seconds": 0.0, "bytes": 0, "saves": []})
    r["seconds"] += seconds
    r["bytes"] += nbytes
    r["saves"].append([what, nbytes, seconds])


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_single(args: argparse.Namespace, name: str, timings: Timings) -> None:
    kind, dtype = parse_scenario(name)
    files = files_for(kind, args.files)
    model = make_model(args, kind, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1 if kind == "pretrain" else 0.0)
    gen = torch.Generator().manual_seed(1)
    dirs = [out / name for out in args.out]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    rec = timings.scenario(name)
    step = 0
    for version in range(args.versions):
        n = args.steps if version else 1
        t0 = time.perf_counter()
        loss = train_steps(model, opt, gen, args, n, args.batch)
        rec["train_seconds"] += time.perf_counter() - t0
        step += n
        tag = f"step_{step * 50}"
        rec["versions"].append(tag)
        sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        osd = opt.state_dict() if "optim" in files else None
        meta = {"step": str(step * 50), "loss": f"{loss.item():.6g}"}
        order = dirs[version % len(dirs):] + dirs[:version % len(dirs)]
        for d in order:
            for f in files:
                path = d / (f"{tag}.optim.pt" if f == "optim" else f"{tag}.{f}")
                t0 = time.perf_counter()
                if f == "pt":
                    torch.save(sd, path)
                elif f == "safetensors":
                    save_file(sd, str(path), metadata=meta)
                else:
                    torch.save({"optimizer": osd, "step": step * 50}, path)
                seconds = time.perf_counter() - t0
                timings.add(name, d.parent, path.name, seconds, path.stat().st_size)
        n_train = sum(p.numel() for p in params)
        n_all = sum(v.numel() for v in sd.values())
        print(f"{name} v{version} {tag}: loss {loss.item():.4f}, "
              f"{n_train / 1e6:.2f}M of {n_all / 1e6:.1f}M parameters train, "
              f"files {','.join(files)}", flush=True)


# ------------------------------------------------------------------------ dcp


def _dcp_rank(rank: int, world: int, init_file: str, args: argparse.Namespace, name: str,
              result_file: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        _, dtype = parse_scenario(name)
        model = make_model(args, "dcp", dtype)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        gen = torch.Generator().manual_seed(1 + rank)   # each rank its own data
        per_rank = max(1, args.batch // world)
        dirs = [out / name for out in args.out]
        rec: dict = {"per_out": {}, "versions": [], "train_seconds": 0.0}
        step = 0
        for version in range(args.versions):
            n = args.steps if version else 1
            t0 = time.perf_counter()
            loss = train_steps(model, opt, gen, args, n, per_rank)
            rec["train_seconds"] += time.perf_counter() - t0
            step += n
            tag = f"step_{step * 50}"
            rec["versions"].append(tag)
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "step": step * 50}
            order = dirs[version % len(dirs):] + dirs[:version % len(dirs)]
            for d in order:
                dist.barrier()
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=dcp.FileSystemWriter(
                    str(d / tag), sync_files=True, thread_count=1))
                dist.barrier()
                seconds = time.perf_counter() - t0
                if rank == 0:
                    add_save(rec, d.parent, tag, seconds, tree_bytes(d / tag))
            if rank == 0:
                print(f"{name} v{version} {tag}: loss {loss.item():.4f}, "
                      f"{world} ranks, FSDP2 shards, dcp.save", flush=True)
        if rank == 0:
            Path(result_file).write_text(json.dumps(rec))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_dcp(args: argparse.Namespace, name: str, timings: Timings) -> None:
    import torch.multiprocessing as mp

    for out in args.out:
        (out / name).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="ckpt-dcp-") as tmp:
        result = os.path.join(tmp, "result.json")
        mp.spawn(_dcp_rank, args=(args.ranks, os.path.join(tmp, "init"), args, name, result),
                 nprocs=args.ranks, join=True)
        rec = json.loads(Path(result).read_text())
    timings.data["scenarios"][name] = rec


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="+",
                    help="output directories; every version is saved into each")
    ap.add_argument("--scenarios", default="frozen,lora,embed",
                    help=f"comma-separated, or all ({ALL})")
    ap.add_argument("--files", default="auto",
                    help="what each version saves: pt, safetensors, optim (comma-separated), "
                         "or auto (see above); not used by dcp")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps between versions")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="batch (split over ranks for dcp)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--ranks", type=int, default=2, help="processes for dcp")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--timings", type=Path, help="write save timings (JSON) here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = (ALL if args.scenarios == "all" else args.scenarios).split(",")
    for name in names:
        parse_scenario(name)
    files_for("frozen", args.files)

    timings = Timings(args.out)
    for name in names:
        kind, _ = parse_scenario(name)
        if kind == "dcp":
            run_dcp(args, name, timings)
        else:
            run_single(args, name, timings)
        timings.write(args.timings)


if __name__ == "__main__":
    main()
