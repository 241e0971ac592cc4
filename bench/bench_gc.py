"""Mark and sweep cost on a store of many checkpoints.

Builds a store of N checkpoints (default 500) of a small model whose backbone is frozen and whose
head and optimizer moments change at every save, then times gc passes: a pass that removes
nothing (mark cost alone), one that keeps the last 50 (mark + sweep of ~90% of the objects),
and the same rules again (nothing left to do). Cost should follow the number of unique objects,
not checkpoints x tensors.

    .venv/bin/python bench/bench_gc.py [--checkpoints 500] [--out bench/out/gc.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

import cas


def build(path: str, n: int) -> float:
    g = torch.Generator().manual_seed(0)
    backbone = {f"backbone.{i}": torch.randn(256, 256, generator=g) for i in range(16)}  # 4 MiB, frozen
    t0 = time.perf_counter()
    # pack_max=4 KiB: every chunk becomes a file, so the sweep pays for real unlinks
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        for step in range(n):
            head = {f"head.{i}": torch.randn(64, 256, generator=g) for i in range(4)}
            moments = {f"m.{i}": torch.randn(64, 256, generator=g) for i in range(4)}
            store.save({"model": {**backbone, **head}, "opt": moments, "step": step}, step=step)
    return time.perf_counter() - t0


def timed_gc(path: str, **rules) -> dict:
    with cas.open(path) as store:
        objects_before = store.stats().num_objects
        t0 = time.perf_counter()
        report = store.gc(**rules) if rules else store.gc()
        total = time.perf_counter() - t0
    return {"rules": rules or "none (sweep only)", "objects_before": objects_before, "live": report.live_objects,
            "swept": report.objects_swept, "freed_MiB": round(report.freed_bytes / 2**20, 1),
            "mark_s": round(report.mark_seconds, 3), "sweep_s": round(report.sweep_seconds, 3),
            "total_s": round(total, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=500)
    ap.add_argument("--out", default="bench/out/gc.json")
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="cas-bench-gc-")
    try:
        path = os.path.join(scratch, "store")
        build_s = build(path, args.checkpoints)
        rows = [timed_gc(path), timed_gc(path, keep_last=50), timed_gc(path, keep_last=50)]
        print(f"store: {args.checkpoints} checkpoints built in {build_s:.1f}s")
        print(f"{'rules':28} {'objects':>8} {'live':>8} {'swept':>8} {'freed MiB':>10} {'mark s':>8} {'sweep s':>8} "
              f"{'total s':>8}")
        for r in rows:
            print(f"{str(r['rules']):28} {r['objects_before']:>8} {r['live']:>8} {r['swept']:>8} {r['freed_MiB']:>10} "
                  f"{r['mark_s']:>8} {r['sweep_s']:>8} {r['total_s']:>8}")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"checkpoints": args.checkpoints, "build_seconds": build_s, "passes": rows}, f, indent=2)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
