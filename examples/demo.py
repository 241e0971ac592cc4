"""A real demo: fine-tune a small model with a frozen embedding, checkpoint every 10 steps into
a store, restore the latest into a fresh model, then show the store with the CLI.

    make demo          (or: .venv/bin/python examples/demo.py --store demo-store)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import torch

import cas


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 4096, dim: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.body = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="demo-store", help="store folder (recreated)")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    shutil.rmtree(args.store, ignore_errors=True)

    torch.manual_seed(0)
    model = TinyLM()
    model.embed.weight.requires_grad_(False)  # a frozen embedding: its chunks dedup across saves
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tokens = torch.randint(0, 4096, (64, 32))

    with cas.open(args.store) as store:
        for step in range(1, args.steps + 1):
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 0:
                t0 = time.perf_counter()
                ck = store.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                                step=step, milestone=step == 30, metrics={"loss": loss.item()})
                print(f"step {step:3d}  loss {loss.item():.4f}  saved {ck.logical_bytes / 2**20:.1f} MiB "
                      f"in {time.perf_counter() - t0:.2f}s, {ck.new_bytes / 2**20:.1f} MiB new on disk")

        fresh = TinyLM()
        state = store.load()
        fresh.load_state_dict(state["model"])
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
        print(f"restored step {state['step']} into a fresh model: {'bit-for-bit equal' if same else 'DIFFERENT'}")
        print(f"verify: {'ok' if store.verify().ok else 'DAMAGED'}\n")

    for cmd in (["ls"], ["du"]):
        print(f"$ cas {' '.join(cmd)} --store {args.store}")
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", "cas.cli", *cmd, "--store", args.store], check=True)
        print()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
