"""Entry points for the child processes of multi-process tests: `python tests/workers.py CMD ARGS`.

Deterministic tensors come from seeds, so parent and child agree on contents without sharing
memory.
"""

from __future__ import annotations

import sys

import torch

import cas


def tensor(seed: int, rows: int = 64) -> torch.Tensor:
    return torch.randn(rows, 1024, generator=torch.Generator().manual_seed(seed))


def state_of(seeds: list[int]) -> dict:
    return {f"t{s}": tensor(s) for s in seeds}


def save(path: str, step: int, seeds: str) -> None:
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        store.save(state_of([int(s) for s in seeds.split("+")]), step=step)


def save_async(path: str, step: int, seeds: str) -> None:
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        store.save_async(state_of([int(s) for s in seeds.split("+")]), step=step).result()


def gc(path: str, keep_last: str = "") -> None:
    with cas.open(path, chunk_size=64 << 10) as store:
        report = store.gc(keep_last=int(keep_last)) if keep_last else store.gc()
        print(report.objects_swept, report.freed_bytes)


def save_loop(path: str, first: int, count: int) -> None:
    """Save `count` steps, each reusing tensors of earlier steps (seeds overlap)."""
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        for step in range(first, first + count):
            store.save(state_of([step % 5, step % 7 + 10, step]), step=step)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    fn = {"save": save, "save_async": save_async, "gc": gc, "save_loop": save_loop}[cmd]
    fn(*[int(a) if a.isdigit() and fn is not gc else a for a in args])
