"""What it costs to open a store whose truth is its record log and whose index is a cache.

Builds a store of N checkpoints (default 500; the small model of bench_gc.py, with milestones
and pins set after saving) and times: an open whose cache is current (the fingerprint check: one
small read and one stat, and the pools); an open after the index files were deleted (a full
rebuild: every pack's entries and object file's header read, the whole log folded); an open
after a kill between a log entry and its cache update (the same rebuild). Figures, not tests.

    .venv/bin/python bench/bench_open.py [--checkpoints 500] [--out bench/out/open.json]
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


def build(path: str, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    backbone = {f"backbone.{i}": torch.randn(256, 256, generator=g) for i in range(16)}
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        for step in range(n):
            head = {f"head.{i}": torch.randn(64, 256, generator=g) for i in range(4)}
            store.save({"model": {**backbone, **head}, "step": step}, step=step)
            if step % 50 == 0:
                store.set_milestone(step)
            if step % 100 == 0:
                store.pin(step)


def timed_open(path: str) -> tuple[float, str | None, int]:
    t0 = time.perf_counter()
    store = cas.open(path)
    elapsed = time.perf_counter() - t0
    reason, count = store.cache_report.reason, len(store.checkpoints())
    store.close()
    return elapsed, reason, count


def drop_index(path: str) -> None:
    folder = os.path.join(path, "index")
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=500)
    parser.add_argument("--out", default="bench/out/open.json")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="cas-bench-open-")
    path = os.path.join(root, "s")
    try:
        t0 = time.perf_counter()
        build(path, args.checkpoints)
        built = time.perf_counter() - t0
        objects = sum(len(files) for _, _, files in os.walk(os.path.join(path, "objects")))
        entries = len(os.listdir(os.path.join(path, "log")))
        current = [timed_open(path)[0] for _ in range(7)]
        drop_index(path)
        rebuilt, reason, count = timed_open(path)
        after = timed_open(path)[0]
        results = {"checkpoints": count, "log_entries": entries, "object_files": objects,
                   "build_s": round(built, 2), "open_current_ms": round(1000 * statistics.median(current), 1),
                   "open_rebuild_ms": round(1000 * rebuilt, 1), "rebuild_reason": reason,
                   "open_after_rebuild_ms": round(1000 * after, 1)}
        print(f"{count} checkpoints, {entries} log entries, {objects} object files (built in {built:.1f} s)")
        print(f"open, cache current:       {results['open_current_ms']:8.1f} ms (median of 7)")
        print(f"open, index files deleted: {results['open_rebuild_ms']:8.1f} ms (full rebuild: {reason})")
        print(f"open again:                {results['open_after_rebuild_ms']:8.1f} ms")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
