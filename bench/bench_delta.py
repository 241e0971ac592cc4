"""Differential chains and float-aware compression on a realistic series of training checkpoints.

A small GPT (~17 M parameters: vocab 8192, d 384, 6 layers, 64 tokens x batch 4; Zipf-distributed
random tokens) is trained with AdamW (lr 1e-3, fp32) on this machine's CPUs, after a short warm-up
run, through four series of checkpoints, one after the other:

  every 1 step      20 checkpoints
  every 10 steps    20 checkpoints
  every 100 steps    5 checkpoints (all the time budget allows)
  fine-tune         20 checkpoints every 10 steps at lr 1e-5 with the token embedding frozen (a
                    fresh AdamW over the other parameters)

Each checkpoint is two states, as plain dicts of tensors (the layout of baselines.md's test model):
  fp32: {"w": fp32 weights, "exp_avg": ..., "exp_avg_sq": ...}     bf16: {"w_bf16": bf16 weight copy}
and each state goes, per series, into: a cas store with delta=True (the default max_chain), one with
delta=False, one with delta="forward" (its own default max_chain), and torch.save (serialized in memory, its size counted as its file's), that same file
compressed with zstd level 1, and ZipNN (per file: the file's tensors of each kind concatenated and
compressed by zipnn, torch input, 2 threads). Reported per series and state: stored bytes against
the torch.save files, and the delta store's bytes by part of the state; save throughput (GB/s of
logical bytes, each save timed to its durable return) with and without delta.

On the every-10-steps series also: a delta store with delta_memory=0 (fp32: every base decoded
from the store by the save's workers instead of kept in host memory); restore time by chain depth
(the deepest chunk of a checkpoint, from the index records of its chunk keys) in the delta store,
restoring into preallocated tensors (store.restore, min of reps, warm page cache); the same
against the delta=False store; and max_chain 1, 2, 4, 8, 16 side by side (stored bytes of both
states, deepest restore of the fp32 one) to choose the default from data.
The issue's targets are printed next to the results.

Run from the repository root (full: about 6-8 minutes, ~2 GiB RAM, ~12 GB of /tmp; needs
`pip install zipnn` in the venv for the ZipNN column, which is skipped, saying so, without it):

    .venv/bin/python bench/bench_delta.py                # JSON to bench/out/delta.json
    .venv/bin/python bench/bench_delta.py --quick        # ~1 M parameters, few checkpoints (<1 min)
    .venv/bin/python bench/bench_delta.py --out x.json
    .venv/bin/python bench/bench_delta.py --only "every 10 steps"   # one series (~3 min)

Stores go to a fresh folder under /tmp, deleted at the end. GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import zstandard

import cas
from cas.store.options import DEFAULT_MAX_CHAIN, FORWARD_MAX_CHAIN
from bench_async import GB, CpuShare, ModelConfig, Stat, Trainer, adamw, exit_on_sigterm, load_avg, log

try:
    import zipnn
    ZIPNN = f"zipnn {importlib.metadata.version('zipnn')}"
except Exception as exc:  # noqa: BLE001 - any failure to import means: skip the column
    zipnn, ZIPNN = None, f"SKIPPED, zipnn unavailable ({type(exc).__name__}: {exc})"

MAIN_CHAIN = DEFAULT_MAX_CHAIN  # the main delta stores use the store's default chain bound
# Training only makes the data here. One intra-op thread: with other processes on this 2-core
# machine, 2 OpenMP threads ran a step 3.3x slower than 1 (barrier waits); cas's own pool is unaffected.
TRAIN_THREADS = 1
TORCH, ZSTD, ZIPNN_COL = "torch.save files", "zstd-1 per file", "ZipNN per file"
DELTA, PLAIN, FORWARD = "cas delta=True", "cas delta=False", 'cas delta="forward"'
READBACK = f"{DELTA} delta_memory=0"  # no bytes kept in memory: every base decoded from the store


@dataclass(frozen=True)
class Series:
    name: str
    every: int
    count: int
    finetune: bool = False


@dataclass(frozen=True)
class Settings:
    model: ModelConfig
    warmup_steps: int
    series: tuple
    chain_series: str  # the series of the restore-by-depth and max_chain study
    max_chains: tuple
    restore_reps: int


FULL = Settings(ModelConfig(vocab=8192, dim=384, layers=6, heads=6), warmup_steps=50,
                series=(Series("every 1 step", 1, 20), Series("every 10 steps", 10, 20),
                        Series("every 100 steps", 100, 5),
                        Series("fine-tune lr 1e-5, frozen embedding, every 10", 10, 20, finetune=True)),
                chain_series="every 10 steps", max_chains=(1, 2, 4, 8, 16), restore_reps=3)
QUICK = Settings(ModelConfig(vocab=2048, dim=128, layers=2, heads=4, ctx=32), warmup_steps=5,
                 series=(Series("every 1 step", 1, 3), Series("every 10 steps", 10, 5),
                         Series("every 100 steps", 100, 2),
                         Series("fine-tune lr 1e-5, frozen embedding, every 10", 10, 3, finetune=True)),
                 chain_series="every 10 steps", max_chains=(2, 4, 8), restore_reps=1)

# (what, series, state, measured key, comparison, limit): issue "Deltas on by default"
TARGETS = [
    ("dense fp32 AdamW state every 10 steps: bytes / torch.save", "every 10 steps", "fp32", "delta_vs_torch",
     "<=", 0.72),
    ("bf16 weights every 10 steps: bytes / torch.save", "every 10 steps", "bf16", "delta_vs_torch", "<=", 0.45),
    ("newest checkpoint restore / the same in a delta=False store", "every 10 steps", "fp32", "newest_vs_plain",
     "<=", 1.15),
    ("series save time / delta=False (to each durable return)", "every 10 steps", "fp32", "save_time_vs_plain",
     "<=", 1.2),
]


# --- the checkpointed states ---------------------------------------------------------------------
def fp32_state(trainer: Trainer) -> dict:
    """Weights and AdamW moments of the trained parameters, as live tensors (no copies)."""
    named = list(trainer.model.named_parameters())
    moments = {k: {n: trainer.opt.state[p][k] for n, p in named if p in trainer.opt.state}
               for k in ("exp_avg", "exp_avg_sq")}
    return {"w": {n: p.detach() for n, p in named}, **moments}


def bf16_state(trainer: Trainer) -> dict:
    return {"w_bf16": {n: p.detach().to(torch.bfloat16) for n, p in trainer.model.named_parameters()}}


STATES = {"fp32": fp32_state, "bf16": bf16_state}


def start_finetune(trainer: Trainer, lr: float = 1e-5) -> None:
    """Freeze the token embedding and continue with a fresh AdamW over the other parameters."""
    trainer.model.embed.weight.requires_grad_(False)
    trainer.opt = adamw(trainer.model.parameters(), lr)


# --- where checkpoints go ------------------------------------------------------------------------
class CasSink:
    """A cas store; each save is timed to its durable return."""

    def __init__(self, label: str, path: str, **options) -> None:
        self.labels = [label]
        self.options = options
        self.store = cas.open(path, **options)
        self.save_s = Stat()
        self.recode_s = Stat()  # the background recode after each save, timed alone (it overlaps training)
        self.logical = 0

    def add(self, state: dict, step: int) -> None:
        t0 = time.perf_counter()
        ck = self.store.save(state, step=step)
        t1 = time.perf_counter()
        self.store.wait_recoding()
        self.save_s.times.append(t1 - t0)
        self.recode_s.times.append(time.perf_counter() - t1)
        self.logical += ck.logical_bytes

    def sizes(self) -> dict:
        self.store.wait_recoding()
        return {self.labels[0]: self.store.stats().stored_bytes}

    def gbps(self) -> float:
        return self.logical / sum(self.save_s.times) / GB

    def close(self) -> None:
        self.store.close()


class FileSink:
    """One torch.save file per checkpoint (serialized in memory), the same file compressed with
    zstd-1, and the file's tensors compressed by ZipNN (per kind, concatenated)."""

    def __init__(self) -> None:
        self.labels = [TORCH, ZSTD] + ([ZIPNN_COL] if zipnn else [])
        self.bytes = dict.fromkeys(self.labels, 0)
        self.zstd = zstandard.ZstdCompressor(level=1)
        self.zipnn = zipnn.ZipNN(input_format="torch", threads=2) if zipnn else None

    def add(self, state: dict, step: int) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        self.bytes[TORCH] += buf.tell()
        self.bytes[ZSTD] += len(self.zstd.compress(buf.getbuffer()))
        if self.zipnn:
            for tensors in state.values():
                flat = torch.cat([t.reshape(-1) for t in tensors.values()])  # a copy: zipnn reorders its input
                self.bytes[ZIPNN_COL] += len(self.zipnn.compress(flat))

    def sizes(self) -> dict:
        return dict(self.bytes)

    def close(self) -> None:
        pass


def make_sinks(folder: str, kind: str, chains: tuple) -> list:
    """The sinks of one state kind: files, cas without and with delta, plus a delta store for
    each max_chain of the study (`chains`, empty outside the chain series)."""
    sinks = [FileSink(), CasSink(PLAIN, os.path.join(folder, f"{kind}-plain"), delta=False),
             CasSink(DELTA, os.path.join(folder, f"{kind}-delta"), delta=True, max_chain=MAIN_CHAIN),
             CasSink(FORWARD, os.path.join(folder, f"{kind}-forward"), delta="forward", max_chain=FORWARD_MAX_CHAIN)]
    for mc in chains:
        if mc != MAIN_CHAIN:
            sinks.append(CasSink(f"{DELTA} max_chain={mc}", os.path.join(folder, f"{kind}-delta-{mc}"),
                                 delta=True, max_chain=mc))
    if chains:  # the other source of base bytes: read back from the store, at bounded memory
        sinks.append(CasSink(READBACK, os.path.join(folder, f"{kind}-readback"), delta=True, max_chain=MAIN_CHAIN,
                             delta_memory=0))
    return sinks


def cas_sink(sinks: list, label: str) -> CasSink:
    return next(s for s in sinks if isinstance(s, CasSink) and s.labels[0] == label)


def chain_sink(sinks: list, mc: int) -> CasSink:
    return cas_sink(sinks, DELTA if mc == MAIN_CHAIN else f"{DELTA} max_chain={mc}")


# --- restore --------------------------------------------------------------------------------------
class InPlace:
    """A restore target holding preallocated tensors: cas decodes straight into them."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict:
        return self.tensors

    def load_state_dict(self, state: dict) -> None:
        if any(state[k] is not t for k, t in self.tensors.items()):
            raise AssertionError("restore did not decode in place")


def checkpoint_depths(store) -> dict[int, dict]:
    """Per step: the deepest delta chain among its chunks, and the share of its chunk bytes
    stored as deltas."""
    out = {}
    for ck in store.checkpoints():
        depths = [(store.objects.record(key).depth, size) for t in store.tensors(ck.step)
                  for key, size in zip(t["chunks"], chunk_sizes(t["bytes"], store.chunk_size))]
        total = sum(s for _, s in depths)
        out[ck.step] = {"depth": max(d for d, _ in depths),
                        "delta_share": sum(s for d, s in depths if d > 0) / total}
    return out


def bytes_by_part(store) -> dict[str, int]:
    """Stored bytes per top-level part of the state (w, exp_avg, ...): each object counted once,
    for the part that first references it, deltas included."""
    seen: set = set()
    out: dict[str, int] = {}
    for ck in store.checkpoints():
        for t in store.tensors(ck.step):
            part = t["path"].split(".")[0].split("/")[0].split("[")[0] or t["path"]
            for key in t["chunks"]:
                if key not in seen:
                    seen.add(key)
                    out[part] = out.get(part, 0) + store.objects.record(key).stored_size
    return out


def chunk_sizes(nbytes: int, chunk: int) -> list[int]:
    return [min(chunk, nbytes - start) for start in range(0, nbytes, chunk)]


def time_restore(store, step: int, reps: int) -> Stat:
    """store.restore into tensors preallocated by one untimed load (so no fresh memory is timed)."""
    targets = {k: InPlace(v) for k, v in store.load(step).items()}
    stat = Stat()
    for _ in range(reps):
        t0 = time.perf_counter()
        store.restore(targets, step=step)
        stat.times.append(time.perf_counter() - t0)
    return stat


def restore_by_depth(sink: CasSink, reps: int, ends_only: bool = False) -> list[dict]:
    """For each chain depth present (only the shallowest and the deepest with `ends_only`), the
    first checkpoint whose deepest chunk has that depth, and its restore time."""
    depths = checkpoint_depths(sink.store)
    first: dict[int, int] = {}
    for step, d in sorted(depths.items()):
        first.setdefault(d["depth"], step)
    chosen = sorted(first.items())
    if ends_only:
        chosen = [chosen[0], chosen[-1]] if len(chosen) > 1 else chosen
    rows = []
    for depth, step in chosen:
        stat = time_restore(sink.store, step, reps)
        logical = sink.store.get(step).logical_bytes
        rows.append({"depth": depth, "step": step, "delta_share": depths[step]["delta_share"],
                     "logical_bytes": logical, **stat.summary(), "gbps": logical / stat.min / GB})
    return rows


def chain_study(sinks: list, s: Settings) -> dict:
    """Restore by depth in the main delta store, the delta=False store's restore of the same
    depth-0 step, and per max_chain: stored bytes and the deepest restore."""
    by_depth = restore_by_depth(cas_sink(sinks, DELTA), s.restore_reps)
    plain = time_restore(cas_sink(sinks, PLAIN).store, by_depth[0]["step"], s.restore_reps)
    newest = cas_sink(sinks, DELTA).store.latest().step  # what a resume restores
    newest_s = {label: time_restore(cas_sink(sinks, label).store, newest, s.restore_reps).summary()
                for label in (PLAIN, DELTA, FORWARD)}
    torch_bytes = sinks[0].bytes[TORCH]
    sweep = {}
    for mc in s.max_chains:
        sink = chain_sink(sinks, mc)
        rows = by_depth if mc == MAIN_CHAIN else restore_by_depth(sink, s.restore_reps, ends_only=True)
        deepest, full = rows[-1], rows[0]
        stored = sink.store.stats().stored_bytes
        sweep[mc] = {"stored_bytes": stored, "vs_torch": stored / torch_bytes, "save_gbps": sink.gbps(),
                     "deepest_depth": deepest["depth"], "deepest_restore_s": deepest["min_s"],
                     "full_restore_s": full["min_s"], "deepest_vs_full": deepest["min_s"] / full["min_s"]}
    return {"by_depth": by_depth, "newest": {"step": newest, **{k: v["min_s"] for k, v in newest_s.items()}},
            "newest_vs_plain": newest_s[DELTA]["min_s"] / newest_s[PLAIN]["min_s"],
            "forward_newest_vs_plain": newest_s[FORWARD]["min_s"] / newest_s[PLAIN]["min_s"],
            "plain_restore": {**plain.summary(), "step": by_depth[0]["step"],
                                                    "gbps": by_depth[0]["logical_bytes"] / plain.min / GB},
            "max_chain": sweep, "codec_usage": cas_sink(sinks, DELTA).store.codec_usage()}


# --- one series -----------------------------------------------------------------------------------
def run_series(trainer: Trainer, series: Series, s: Settings, scratch: str) -> dict:
    folder = os.path.join(scratch, series.name.split(",")[0].replace(" ", "-"))
    if series.finetune:
        start_finetune(trainer)
    study = series.name == s.chain_series
    sinks = {kind: make_sinks(folder, kind, s.max_chains if study else ())
             for kind in STATES}
    first_step, train_s, cpu, loss = trainer.step_count, 0.0, CpuShare(), float("nan")
    for i in range(series.count):
        t0 = time.perf_counter()
        for _ in range(series.every):
            loss = trainer.step()
        train_s += time.perf_counter() - t0
        for kind, kind_sinks in sinks.items():
            state = STATES[kind](trainer)
            for sink in kind_sinks if i % 2 == 0 else reversed(kind_sinks):  # alternate who goes first
                sink.add(state, trainer.step_count)
    result = {"series": asdict(series), "steps": [first_step + series.every, trainer.step_count],
              "train_s_per_step": train_s / (series.count * series.every), "loss": loss,
              "others_cpu_share": cpu.others(), "states": {kind: summarize(ks) for kind, ks in sinks.items()}}
    if study:
        log("restore by chain depth and max_chain study")
        result["chains"] = chain_study(sinks["fp32"], s)
    for sink in (x for ks in sinks.values() for x in ks):
        sink.close()
    shutil.rmtree(folder)
    return result


def summarize(sinks: list) -> dict:
    sizes = {label: n for sink in sinks for label, n in sink.sizes().items()}
    delta, plain = cas_sink(sinks, DELTA), cas_sink(sinks, PLAIN)
    parts = bytes_by_part(delta.store)
    return {"bytes": sizes, "vs_torch": {k: v / sizes[TORCH] for k, v in sizes.items()},
            "delta_vs_torch": sizes[DELTA] / sizes[TORCH], "logical_bytes": delta.logical,
            "delta_parts_vs_torch": {k: v / sizes[TORCH] for k, v in parts.items()},
            "save_gbps": {s.labels[0]: s.gbps() for s in sinks if isinstance(s, CasSink)},
            "delta_speed": delta.gbps() / plain.gbps(),
            "save_time_vs_plain": sum(delta.save_s.times) / sum(plain.save_s.times),
            "save_and_recode_vs_plain": (sum(delta.save_s.times) + sum(delta.recode_s.times)) / sum(plain.save_s.times),
            "save_s": {DELTA: delta.save_s.summary(), PLAIN: plain.save_s.summary()},
            "recode_s": delta.recode_s.summary()}


# --- report ---------------------------------------------------------------------------------------
def mb(n: int) -> str:
    return f"{n / 1e6:9.1f} MB"


def print_series(r: dict) -> None:
    ser = r["series"]
    print(f"\n== {ser['name']}: {ser['count']} checkpoints, steps {r['steps'][0]}..{r['steps'][1]} "
          f"({r['train_s_per_step']:.2f} s/step, loss {r['loss']:.3f}; other processes used "
          f"{r['others_cpu_share'] * 100:.0f}% of the CPU)")
    fp32, bf16 = r["states"]["fp32"], r["states"]["bf16"]
    print(f"  {'stored bytes':32} {'fp32 state (w+m+v)':>24} {'bf16 weights':>24}")
    for label in fp32["bytes"]:
        cells = [f"{mb(st['bytes'][label])} {st['vs_torch'][label]:6.3f}x" if label in st["bytes"] else ""
                 for st in (fp32, bf16)]
        print(f"  {label:32} {cells[0]:>24} {cells[1]:>24}")
    for label in (x for x in (PLAIN, DELTA, FORWARD, READBACK) if x in fp32["save_gbps"] or x in bf16["save_gbps"]):
        cells = [f"{st['save_gbps'][label]:24.3f}" if label in st["save_gbps"] else f"{'':24}" for st in (fp32, bf16)]
        print(f"  save GB/s, {label:21} {cells[0]} {cells[1]}")
    print(f"  {'delta / no-delta save speed':32} {fp32['delta_speed']:24.3f} {bf16['delta_speed']:24.3f}")
    print(f"  {'save time / no-delta':32} {fp32['save_time_vs_plain']:24.3f} {bf16['save_time_vs_plain']:24.3f}")
    print(f"  {'(save + background recode) / no-d':32} {fp32['save_and_recode_vs_plain']:24.3f} "
          f"{bf16['save_and_recode_vs_plain']:24.3f}")
    parts = ", ".join(f"{k} {v:.3f}" for st in (fp32, bf16) for k, v in st["delta_parts_vs_torch"].items())
    print(f"  delta store's bytes by part, as a share of the torch.save files: {parts}")


def print_chains(c: dict) -> None:
    print(f"\n  restore (store.restore into preallocated tensors, warm cache; min of reps), fp32 state, "
          f"max_chain={MAIN_CHAIN}:")
    print(f"  {'depth':>5} {'step':>6} {'delta bytes':>11} {'min':>9} {'median':>9} {'GB/s':>6} {'x depth 0':>9}")
    full = c["by_depth"][0]["min_s"]
    for row in c["by_depth"]:
        print(f"  {row['depth']:5d} {row['step']:6d} {row['delta_share'] * 100:10.0f}% {row['min_s']:8.3f}s "
              f"{row['median_s']:8.3f}s {row['gbps']:6.2f} {row['min_s'] / full:9.2f}")
    p = c["plain_restore"]
    print(f"  delta=False store, step {p['step']}: {p['min_s']:.3f} s ({p['gbps']:.2f} GB/s)")
    n = c["newest"]
    print(f"  newest checkpoint (step {n['step']}, what a resume restores): delta=False {n[PLAIN]:.3f} s, "
          f"delta=True {n[DELTA]:.3f} s ({c['newest_vs_plain']:.2f}x), delta=\"forward\" {n[FORWARD]:.3f} s "
          f"({c['forward_newest_vs_plain']:.2f}x)")
    print(f"\n  {'max_chain':>9} {'stored':>12} {'x torch':>8} {'save GB/s':>9} {'deepest':>7} "
          f"{'deepest restore':>15} {'x depth 0':>9}")
    for mc, row in c["max_chain"].items():
        print(f"  {mc:9} {mb(row['stored_bytes'])} {row['vs_torch']:8.3f} {row['save_gbps']:9.3f} "
              f"{row['deepest_depth']:7d} {row['deepest_restore_s']:14.3f}s {row['deepest_vs_full']:9.2f}")
    usage = ", ".join(f"{k}: {u['objects']} objects {u['stored_bytes'] / 1e6:.0f} MB (max depth {u['max_depth']})"
                      for k, u in c["codec_usage"].items())
    print(f"  codecs in the max_chain={MAIN_CHAIN} delta store: {usage}")


def check_targets(series: list[dict]) -> list[dict]:
    out = []
    for what, name, kind, key, op, limit in TARGETS:
        r = next((x for x in series if x["series"]["name"].startswith(name)), None)
        if r is None:
            continue
        value = r["chains"][key] if key == "newest_vs_plain" else r["states"][kind][key]
        met = value <= limit if op == "<=" else value >= limit
        out.append({"target": what, "value": value, "limit": f"{op} {limit}", "met": met})
    return out


def print_targets(targets: list[dict]) -> None:
    print("\ntargets from the issue:")
    for t in targets:
        print(f"  {t['target']:58} {t['value']:7.3f}  (target {t['limit']}): {'MET' if t['met'] else 'NOT MET'}")


# --- main -----------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~1 M parameters, few checkpoints (smoke test)")
    parser.add_argument("--only", metavar="TEXT", help="run only the series whose name contains TEXT "
                        "(the training before it still runs; targets of other series are skipped)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "delta.json"))
    args = parser.parse_args()
    s = QUICK if args.quick else FULL
    exit_on_sigterm()
    torch.set_num_threads(TRAIN_THREADS)
    started, load_start = time.perf_counter(), load_avg()
    trainer = Trainer(s.model)
    print(f"cas delta benchmark{' (--quick)' if args.quick else ''}; load average at start {load_start}; "
          f"GPT {trainer.params() / 1e6:.1f} M params {asdict(s.model)}, AdamW lr 1e-3, "
          f"{s.warmup_steps} warm-up steps, {TRAIN_THREADS} torch thread; chunk 4 MiB, zstd-1")
    print(f"ZipNN column: {ZIPNN}")
    for _ in range(s.warmup_steps):
        trainer.step()
    scratch = tempfile.mkdtemp(prefix="cas-bench-delta-", dir="/tmp")
    results = []
    try:
        chosen = [x for x in s.series if not args.only or args.only in x.name]
        for series in s.series[:s.series.index(chosen[-1]) + 1]:
            if series not in chosen:
                log(f"training through series {series.name} without checkpoints")
                if series.finetune:
                    start_finetune(trainer)
                for _ in range(series.every * series.count):
                    trainer.step()
                continue
            log(f"series: {series.name}")
            results.append(run_series(trainer, series, s, scratch))
            print_series(results[-1])
            if "chains" in results[-1]:
                print_chains(results[-1]["chains"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    targets = check_targets(results)
    print_targets(targets)
    report = {"settings": asdict(s), "quick": args.quick, "series": results, "targets": targets,
              "zipnn": ZIPNN,
              "wall_s": time.perf_counter() - started, "load_avg_start": load_start, "load_avg_end": load_avg()}
    print(f"wall {report['wall_s']:.0f} s; load average start {load_start}, end {report['load_avg_end']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
