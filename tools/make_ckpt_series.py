#!/usr/bin/env python3
"""Write checkpoint series for chunk-size measurements (tools/chunk_sizes.py).

Trains a small GPT-style model on CPU for a few steps between saves and saves
each version with torch.save (step_N.pt) and safetensors (step_N.safetensors)
under OUT/<scenario>/:

  frozen  all but the last two transformer blocks frozen (fine-tuning the top)
  lora    rank-8 LoRA adapters on every linear layer of a frozen base; the
          adapters sit between the frozen matrices in both file formats
  embed   only the token embedding trains (sparse updates: rows of tokens
          never seen stay unchanged)

Defaults: 8 blocks, d_model 512, vocab 8192 (33.6M parameters, 134 MB fp32
per file), 3 versions, 3 Adam steps apart, one CPU thread.

  python tools/make_ckpt_series.py /tmp/ckseries
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn


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
    for p in model.parameters():
        p.requires_grad_(False)
    if scenario == "frozen":
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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--scenarios", default="frozen,lora,embed")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps between versions")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    for scenario in args.scenarios.split(","):
        torch.manual_seed(0)  # the same base model in every scenario
        model = GPT(args.vocab, args.d_model, args.layers, args.d_model // 64, args.ctx)
        setup(model, scenario, args.rank)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        gen = torch.Generator().manual_seed(1)
        out = args.out / scenario
        out.mkdir(parents=True, exist_ok=True)
        step = 0
        for version in range(args.versions):
            for _ in range(args.steps if version else 1):
                tokens = batch(gen, args.vocab, args.batch, args.ctx)
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
            sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            torch.save(sd, out / f"step_{step * 50}.pt")
            save_file(sd, str(out / f"step_{step * 50}.safetensors"),
                      metadata={"step": str(step * 50), "loss": f"{loss.item():.6g}"})
            n_train = sum(p.numel() for p in params)
            n_all = sum(v.numel() for v in sd.values())
            print(f"{scenario} v{version} step {step * 50}: loss {loss.item():.4f}, "
                  f"{n_train / 1e6:.2f}M of {n_all / 1e6:.1f}M parameters train")


if __name__ == "__main__":
    main()
