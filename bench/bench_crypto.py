"""Encryption at rest: save and load of the same states into a plain and an encrypted store, side
by side in one run, and their ratios (the issue asks for within 1.15x).

States: 256 MiB of randn fp32 (64 tensors of 4 MiB; incompressible mantissas, so zstd does
little and the cipher's share is the largest), and a small trained model (an MLP of ~2.4 M
parameters after 20 AdamW steps: weights plus both moments, ~29 MiB). For each, in alternation
plain / encrypted, `repeats` times after one untimed warm-up of each: a full save into a fresh
store (timed from store.save() to its return; the store is opened untimed, so the KDF is not in
it), then a load of it (store.load(), every byte verified; the page cache warm, as right after
the save). Figures are the median of the repetitions; the ratio is encrypted / plain. The
encrypted store is opened with a passphrase (scrypt at its default strength, untimed).

    .venv/bin/python bench/bench_crypto.py [--repeats 5] [--out bench/out/crypto.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import cas


def randn_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(64)}


def trained_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1536), torch.nn.GELU(), torch.nn.Linear(1536, 1024),
                                torch.nn.GELU(), torch.nn.Linear(1024, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    for _ in range(20):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 20}


def one(state: dict, root: str, key) -> tuple[float, float]:
    path = os.path.join(root, "enc" if key else "plain")
    shutil.rmtree(path, ignore_errors=True)
    with cas.open(path, key=key) as store:
        t = time.perf_counter()
        store.save(state, step=1)
        save = time.perf_counter() - t
    with cas.open(path, key=key) as store:
        t = time.perf_counter()
        store.load(1)
        load = time.perf_counter() - t
    shutil.rmtree(path, ignore_errors=True)
    return save, load


def measure(name: str, state: dict, root: str, repeats: int) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    one(state, root, None), one(state, root, "bench passphrase")  # warm-up, untimed
    runs = {"plain": [], "encrypted": []}
    for _ in range(repeats):
        runs["plain"].append(one(state, root, None))
        runs["encrypted"].append(one(state, root, "bench passphrase"))
    out = {"state": name, "tensor_bytes": nbytes}
    for kind in runs:
        out[f"{kind}_save_s"] = statistics.median(r[0] for r in runs[kind])
        out[f"{kind}_load_s"] = statistics.median(r[1] for r in runs[kind])
    out["save_ratio"] = out["encrypted_save_s"] / out["plain_save_s"]
    out["load_ratio"] = out["encrypted_load_s"] / out["plain_load_s"]
    return out


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "crypto.json"))
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="cas-bench-crypto-")
    try:
        rows = [measure("randn fp32 256 MiB", randn_state(), root, args.repeats),
                measure("trained MLP + AdamW", trained_state(), root, args.repeats)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'state':24} {'MiB':>6} {'save plain':>11} {'save enc':>9} {'ratio':>6} {'load plain':>11} "
          f"{'load enc':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['state']:24} {r['tensor_bytes'] / 2**20:6.0f} {r['plain_save_s']:10.3f}s {r['encrypted_save_s']:8.3f}s "
              f"{r['save_ratio']:6.3f} {r['plain_load_s']:10.3f}s {r['encrypted_load_s']:8.3f}s {r['load_ratio']:6.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "repeats": args.repeats, "cpus": os.cpu_count()}, f, indent=2)


if __name__ == "__main__":
    main()
