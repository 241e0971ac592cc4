"""Reverse deltas in a bucket store: bytes, save time and the newest checkpoint's restore.

bench_delta.py's GPT (~17 M parameters) is trained with AdamW (lr 1e-3, fp32) after a short
warm-up and checkpointed every 10 steps, 20 times (`--quick`: a ~1 M-parameter model, 6 times),
as two states (fp32 weights + both AdamW moments; a bf16 weight copy), each into:
  - a bucket store with the defaults (delta=True: saves write whole, the background recode codes
    the chunks they replaced as deltas into new segments named in the record log),
  - a bucket store with delta=False,
  - a folder store with the defaults (which compacts a pack the recode left under half live),
  - torch.save (serialized in memory; its size counted as its file's).
All on one SeaweedFS server started here on loopback (tests/s3server.py), sharing the machine's
cores. Reported, per state, as ratios measured side by side in this run:
  - bytes in the bucket after the series with no gc called (the sweep after each save's recode
    has deleted the whole copies it superseded), the most it held against the delta=False
    bucket after any save, and after `store.gc()`, against the torch.save files and the
    delta=False bucket store; the folder store's packs before and after its gc, and its live
    (stored) bytes;
  - series save time (each save to its durable return) against the delta=False bucket store,
    and the background work after each save (its recode and sweep), timed alone;
  - the newest checkpoint's restore (what a resume reads), and the oldest's (deepest chain), on a
    fresh host (an empty cache: open + verified load), delta=True against delta=False,
    alternating, min of `--reps`.

    .venv/bin/python bench/bench_s3_delta.py            # ~4 minutes; JSON to bench/out/s3_delta.json
    .venv/bin/python bench/bench_s3_delta.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import cas  # noqa: E402
from bench_async import ModelConfig, Stat, Trainer, load_avg, log, write_json  # noqa: E402
from bench_delta import STATES, TRAIN_THREADS  # noqa: E402

REGION = "us-east-1"
CHECKPOINTS, EVERY, WARMUP = 20, 10, 50
MODEL = ModelConfig(vocab=8192, dim=384, layers=6, heads=6)
QUICK_MODEL = ModelConfig(vocab=2048, dim=128, layers=2, heads=4, ctx=32)


class Sink:
    """A cas store; each save timed to its durable return, then its recode waited for, timed alone."""

    def __init__(self, where: str, cache: str | None, **options) -> None:
        self.where, self.cache, self.options = where, cache, options
        self.store = cas.open(where, **({"cache_dir": cache} if cache else {}), **options)
        self.save_s, self.recode_s = Stat(), Stat()

    def add(self, state: dict, step: int) -> None:
        t0 = time.perf_counter()
        self.store.save(state, step=step)
        t1 = time.perf_counter()
        self.store.wait_recoding()
        self.save_s.times.append(t1 - t0)
        self.recode_s.times.append(time.perf_counter() - t1)

    def packed_bytes(self) -> int:
        return sum(self.store.objects.packs.sizes().values())


def fresh_load_s(where: str, step: int, scratch: str, n: int) -> float:
    """A new host's open (empty cache) and verified load of `step`."""
    cache = os.path.join(scratch, f"fresh-{n}")
    t0 = time.perf_counter()
    with cas.open(where, cache_dir=cache) as store:
        store.load(step)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(cache, ignore_errors=True)
    return elapsed


def run(quick: bool, reps: int, bucket: str, scratch: str) -> dict:
    torch.set_num_threads(TRAIN_THREADS)
    trainer = Trainer(QUICK_MODEL if quick else MODEL)
    count = 6 if quick else CHECKPOINTS
    for _ in range(5 if quick else WARMUP):
        trainer.step()
    sinks = {kind: {"delta": Sink(f"s3://{bucket}/{kind}-delta", os.path.join(scratch, f"c-{kind}-d")),
                    "plain": Sink(f"s3://{bucket}/{kind}-plain", os.path.join(scratch, f"c-{kind}-p"), delta=False),
                    "folder": Sink(os.path.join(scratch, f"{kind}-folder"), None)} for kind in STATES}
    torch_bytes = dict.fromkeys(STATES, 0)
    peak = dict.fromkeys(STATES, 0.0)  # the most the delta bucket held against the delta=False one, after a save
    log(f"{trainer.params() / 1e6:.1f} M parameters, {count} checkpoints every {EVERY} steps")
    for i in range(count):
        for _ in range(EVERY):
            trainer.step()
        for kind, make in STATES.items():
            state = make(trainer)
            buf = io.BytesIO()
            torch.save(state, buf)
            torch_bytes[kind] += buf.tell()
            order = list(sinks[kind].values())
            for sink in order if i % 2 == 0 else reversed(order):  # alternate who goes first
                sink.add(state, trainer.step_count)
            peak[kind] = max(peak[kind], sinks[kind]["delta"].packed_bytes() / sinks[kind]["plain"].packed_bytes())
    out = {"quick": quick, "checkpoints": count, "every": EVERY, "params": trainer.params(), "states": {}}
    for kind, ks in sinks.items():
        d, p, f = ks["delta"], ks["plain"], ks["folder"]
        before = d.packed_bytes()
        t0 = time.perf_counter()
        report = d.store.gc()
        gc_s = time.perf_counter() - t0
        p.store.gc()
        folder_before = f.packed_bytes()
        f.store.gc()
        after, plain, folder = d.packed_bytes(), p.packed_bytes(), f.packed_bytes()
        newest, oldest = d.store.latest().step, d.store.checkpoints()[0].step
        restore = {}
        for label, step in (("newest", newest), ("oldest", oldest)):
            times = {"delta": Stat(), "plain": Stat()}
            for r in range(reps):
                for name in ("delta", "plain") if r % 2 == 0 else ("plain", "delta"):
                    times[name].times.append(fresh_load_s(ks[name].where, step, scratch, r))
            restore[label] = {"step": step, "delta_s": times["delta"].summary(), "plain_s": times["plain"].summary(),
                              "delta_vs_plain": times["delta"].min / times["plain"].min}
        out["states"][kind] = {
            "torch_bytes": torch_bytes[kind],
            "bucket_bytes_before_gc": before, "bucket_bytes_after_gc": after, "plain_bucket_bytes": plain,
            "folder_bytes": folder, "folder_bytes_before_gc": folder_before,
            "folder_before_gc_vs_torch": folder_before / torch_bytes[kind],
            "folder_stored_vs_torch": f.store.stats().stored_bytes / torch_bytes[kind],
            "before_gc_vs_torch": before / torch_bytes[kind], "after_gc_vs_torch": after / torch_bytes[kind],
            "plain_vs_torch": plain / torch_bytes[kind], "folder_vs_torch": folder / torch_bytes[kind],
            "after_gc_vs_plain": after / plain, "after_gc_vs_folder": after / folder,
            "before_gc_vs_plain": before / plain, "peak_vs_plain": peak[kind],
            "gc_s": gc_s, "gc_packs_rewritten": report.packs_rewritten, "gc_packs_removed": report.packs_removed,
            "save_time_vs_plain": sum(d.save_s.times) / sum(p.save_s.times),
            "save_s": {"delta": d.save_s.summary(), "plain": p.save_s.summary()},
            "recode_s": d.recode_s.summary(),
            "recode_entries": sum(1 for e in d.store.log() if e.recoded),
            "restore_fresh_host": restore}
        for sink in ks.values():
            sink.store.close()
    out["load_avg_end"] = load_avg()
    return out


def print_report(r: dict) -> None:
    print(f"\n{r['params'] / 1e6:.1f} M parameters, {r['checkpoints']} checkpoints every {r['every']} steps; "
          f"bytes / torch.save files")
    print(f"{'state':6} {'bucket delta, no gc':>20} {'after gc':>9} {'bucket delta=False':>19} "
          f"{'folder delta, before gc':>24} {'after gc':>9} {'(live)':>7} {'no gc / delta=False (peak)':>27}")
    for kind, s in r["states"].items():
        print(f"{kind:6} {s['before_gc_vs_torch']:20.3f} {s['after_gc_vs_torch']:9.3f} {s['plain_vs_torch']:19.3f} "
              f"{s['folder_before_gc_vs_torch']:24.3f} {s['folder_vs_torch']:9.3f} {s['folder_stored_vs_torch']:7.3f} "
              f"{s['before_gc_vs_plain']:18.3f} ({s['peak_vs_plain']:.3f})")
    for kind, s in r["states"].items():
        rs = s["restore_fresh_host"]
        print(f"{kind}: series save time {s['save_time_vs_plain']:.2f}x delta=False; recode and sweep after each save "
              f"{s['recode_s']['median_s']:.2f} s median; gc {s['gc_s']:.1f} s ({s['gc_packs_rewritten']} rewritten, "
              f"{s['gc_packs_removed']} removed); fresh-host restore, delta / delta=False by min: newest "
              f"{rs['newest']['delta_vs_plain']:.2f}x, oldest {rs['oldest']['delta_vs_plain']:.2f}x")
    print(f"load average at the end: {r['load_avg_end']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "s3_delta.json"))
    args = ap.parse_args()
    from s3server import ACCESS_KEY, SECRET_KEY, SeaweedServer

    scratch = tempfile.mkdtemp(prefix="cas-bench-s3-delta-")
    server = SeaweedServer(os.path.join(scratch, "weed"), access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=server.endpoint, AWS_ACCESS_KEY_ID=ACCESS_KEY,
                      AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION=REGION)
    try:
        results = run(args.quick, args.reps, server.make_bucket(), scratch)
        print_report(results)
        write_json(results, args.out)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
