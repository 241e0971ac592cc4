"""Where a first full save and a verified load spend their time, stage by stage.

A state of randn fp32 tensors (256 MiB in 8 tensors by default; --mib 1024 for 1 GiB) is saved
into a fresh store and loaded back, against torch.save + fsync and torch.load of the same state,
run interleaved (torch, cas, cas raw, torch, cas, ...) so that the noise of this shared machine
falls on all of them alike; each figure is the min and median of --reps runs after one warm-up.
Then one instrumented save and load (timers wrapped around the functions below; not part of the
timed runs) say where the time goes:

  save: hash (blake3 of each chunk), claim (index holds and dedup lookups), encode (of which
        byte grouping and zstd), write (the write syscalls), fsync, rename (names taken),
        LMDB (time inside write transactions), manifest nodes (encoding and writing them),
        commit (WriteSession.commit as a whole)
  load: read (object and pack reads), zstd (decompressing), ungroup, verify (blake3), the rest

Stage times are thread-seconds summed over the worker threads (two of them work at once on this
2-core machine, so the sum can exceed the wall time), and the CPU time of the same calls
(time.thread_time: what the stage costs whatever else runs; time waiting for a core or the disk
is in the first figure only); nested stages are shown under their parent.

    .venv/bin/python bench/bench_profile.py                  # 256 MiB, 5 reps
    .venv/bin/python bench/bench_profile.py --mib 1024 --reps 3
    .venv/bin/python bench/bench_profile.py --json out.json
    .venv/bin/python bench/bench_profile.py --codec          # per 4 MiB chunk: the codec's parts, one thread
    .venv/bin/python bench/bench_profile.py --mib 1024 --tensors 32 --fresh 5  # each load in a new process
    .venv/bin/python bench/bench_profile.py --key            # every cas store encrypted (stages save.seal,
                                                             # load.decrypt); against bench_crypto's plain one
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch

import cas

MiB = 1 << 20
KEY = bytes(range(32))  # --key: every store is encrypted with this raw key (no passphrase KDF to time)
OPEN_OPTIONS: dict = {}  # what every cas.open of the contenders gets (--key sets key=)


# --- timers ------------------------------------------------------------------------------------
class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._undo: list = []

    def add(self, stage: str, seconds: float, cpu: float = 0.0) -> None:
        with self._lock:
            self.seconds[stage] += seconds
            self.cpu[stage] += cpu
            self.calls[stage] += 1

    def wrap(self, owner, name: str, stage: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(stage, time.perf_counter() - start, time.thread_time() - cpu)

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def wrap_context(self, owner, name: str, stage: str) -> None:
        original = getattr(owner, name)
        timers = self

        @contextmanager
        def timed(*args, **kwargs):
            with original(*args, **kwargs) as value:
                start, cpu = time.perf_counter(), time.thread_time()
                try:
                    yield value
                finally:
                    timers.add(stage, time.perf_counter() - start, time.thread_time() - cpu)

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def undo(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


class _TimedCompressor:
    def __init__(self, inner, timers: Timers) -> None:
        self._inner, self._timers = inner, timers

    def compress(self, data):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._inner.compress(data)
        finally:
            self._timers.add("save.encode.zstd", time.perf_counter() - start, time.thread_time() - cpu)


def instrument(timers: Timers) -> None:
    """Wrap the functions each stage runs (looked up where their callers find them)."""
    import cas.backend  # noqa: F401
    import cas.codecs as codecs
    import cas.crypt as crypt
    import cas.hashing as hashing
    import cas.fsutil as fsutil
    import cas.index as index
    import cas.localfs as localfs
    import cas.objectstore as objectstore
    import cas.packs as packs
    import cas.slots as slots
    import cas.store.store as store_module
    import cas.store.pipeline as pipeline

    # blake3: a chunk's key on save, the check of every decoded object on load (each store's Namer)
    timers.wrap(hashing.Namer, "key", "blake3")
    timers.wrap(objectstore.WriteSession, "hold", "save.claim")
    timers.wrap(codecs.CodecPolicy, "encode", "save.encode")
    timers.wrap(codecs, "group_bytes", "save.encode.group")
    timers.wrap(codecs, "group_planes", "save.encode.group")  # (a float chunk's planes straight into its frame)
    original_c = codecs._zstd_c
    codecs._zstd_c = lambda *a, **k: _TimedCompressor(original_c(*a, **k), timers)
    timers._undo.append((codecs, "_zstd_c", original_c))
    for name in ("write", "writev", "pwrite", "pwritev"):
        if hasattr(os, name):
            timers.wrap(os, name, "save.write")
    timers.wrap(os, "fsync", "fsync")
    timers.wrap(os, "fdatasync", "fsync")
    timers.wrap(fsutil, "name_new", "save.rename")
    timers.wrap(localfs, "name_new", "save.rename")
    timers.wrap_context(index.Index, "write", "save.lmdb")
    timers.wrap(store_module, "encode_nodes", "save.nodes")
    timers.wrap(pipeline, "write_blobs", "save.nodes")
    timers.wrap(objectstore.WriteSession, "commit", "save.commit")
    timers.wrap(localfs.LocalBackend, "get", "load.read")
    timers.wrap(codecs, "_decompress_into", "load.zstd")
    timers.wrap(codecs, "ungroup_bytes", "load.ungroup")
    timers.wrap(crypt.EncryptedBackend, "seal", "save.seal")  # --key: AES-GCM, whole blobs
    timers.wrap(crypt.SealedStream, "_seal", "save.seal")  # and segments of streamed packs (sealing 3)
    timers.wrap(slots.SplitStream, "_seal", "save.seal")  # (sealing 4)
    timers.wrap(crypt.EncryptedBackend, "_open_segments", "load.decrypt")
    del packs


# --- the state and the contenders ----------------------------------------------------------
def make_state(mib: int, tensors: int) -> dict:
    torch.manual_seed(0)
    per = mib * MiB // 4 // tensors
    return {f"t{i}": torch.randn(per) for i in range(tensors)}


def drop_cache(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def torch_save(state, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def cpu_now() -> float:
    """This process's CPU seconds so far, every thread, user and system (the kernel's copies
    into the page cache and its page faults included; disk writeback by kernel threads not)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cas_save(state, path: str, compress: bool) -> tuple[float, float]:
    with cas.open(path, compress=compress, **OPEN_OPTIONS) as store:
        start, cpu = time.perf_counter(), cpu_now()
        store.save(state, step=1)
        return time.perf_counter() - start, cpu_now() - cpu


def cas_load(path: str):
    with cas.open(path, **OPEN_OPTIONS) as store:
        return store.load(1)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_cpu(fn) -> tuple[float, float]:
    start, cpu = time.perf_counter(), cpu_now()
    fn()
    return time.perf_counter() - start, cpu_now() - cpu


def summary(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "runs": values}


def compare(state, scratch: str, reps: int, cold: bool) -> dict:
    """Interleaved saves and loads: torch.save+fsync, cas default, cas compress=False."""
    names = ("torch", "cas", "cas raw")
    saves = {n: [] for n in names}
    loads = {n: [] for n in names}
    save_cpu = {n: [] for n in names}
    load_cpu = {n: [] for n in names}
    sizes = {}
    for rep in range(reps + 1):  # the first round is a warm-up
        for name in names:
            where = os.path.join(scratch, f"{name.replace(' ', '_')}-{rep}")
            if name == "torch":
                t, c = timed_cpu(lambda: torch_save(state, where))
            else:
                t, c = cas_save(state, where, compress=name == "cas")
            sizes[name] = _du(where)
            if cold:
                drop_cache(where)
            if name == "torch":
                lt, lc = timed_cpu(lambda: torch.load(where, weights_only=True))
            else:
                lt, lc = timed_cpu(lambda: cas_load(where))
            if rep:
                saves[name].append(t)
                loads[name].append(lt)
                save_cpu[name].append(c)
                load_cpu[name].append(lc)
            _remove(where)
    return {"save": {n: summary(v) for n, v in saves.items()}, "load": {n: summary(v) for n, v in loads.items()},
            "save_cpu": {n: summary(v) for n, v in save_cpu.items()},
            "load_cpu": {n: summary(v) for n, v in load_cpu.items()}, "bytes": sizes}


def profile(state, scratch: str) -> dict:
    """One instrumented save and load (after an uninstrumented warm-up of each)."""
    where = os.path.join(scratch, "profiled")
    cas_save(state, where, compress=True)
    cas_load(where)
    _remove(where)
    timers = Timers()
    instrument(timers)
    try:
        wall_save, _ = cas_save(state, where, compress=True)
        save_stages, save_cpu, save_calls = dict(timers.seconds), dict(timers.cpu), dict(timers.calls)
        for table in (timers.seconds, timers.cpu, timers.calls):
            table.clear()
        wall_load = timed(lambda: cas_load(where))
        load_stages, load_cpu, load_calls = dict(timers.seconds), dict(timers.cpu), dict(timers.calls)
    finally:
        timers.undo()
        _remove(where)
    return {"save": {"wall": wall_save, "stages": save_stages, "cpu": save_cpu, "calls": save_calls},
            "load": {"wall": wall_load, "stages": load_stages, "cpu": load_cpu, "calls": load_calls}}


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


_FRESH_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[3])
import torch, cas
import cas.api  # cas.open imports it on first use: an import, timed no more than torch's
from bench_profile import cpu_now
mode, where = sys.argv[1], sys.argv[2]
options = {"key": bytes.fromhex(sys.argv[4])} if len(sys.argv) > 4 else {}
start, cpu = time.perf_counter(), cpu_now()
if mode == "torch":
    torch.load(where, weights_only=True)
else:
    with cas.open(where, **options) as store:
        store.load(1)
print(json.dumps([time.perf_counter() - start, cpu_now() - cpu]))
"""


def fresh_loads(state, scratch: str, rounds: int) -> dict:
    """A resumed job's load: each in a new Python process (memory the process never touched,
    the files in the page cache), interleaved torch.load / cas / cas compress=False; the load
    call alone is timed (cas's open included, the imports not: this sandbox sets
    PYTHONDONTWRITEBYTECODE, so each new process compiles cas from source, 0.2 s)."""
    paths = {"torch": os.path.join(scratch, "fresh.pt"), "cas": os.path.join(scratch, "fresh-store"),
             "cas raw": os.path.join(scratch, "fresh-store-raw")}
    torch_save(state, paths["torch"])
    cas_save(state, paths["cas"], compress=True)
    cas_save(state, paths["cas raw"], compress=False)
    here = os.path.dirname(os.path.abspath(__file__))
    modes = tuple(paths)
    runs: dict[str, list] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode in modes:
            key = [OPEN_OPTIONS["key"].hex()] if "key" in OPEN_OPTIONS else []
            out = subprocess.run([sys.executable, "-c", _FRESH_CHILD, mode, paths[mode], here, *key],
                                 capture_output=True, text=True, check=True, cwd=scratch)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    ref = [w for w, _ in runs["torch"]]
    print(f"\nresume loads, each in a new process ({rounds} rounds, interleaved); wall s min / median, "
          f"ratio to torch.load by min (median); CPU s median")
    result = {}
    for mode in modes:
        walls, cpus = [w for w, _ in runs[mode]], [c for _, c in runs[mode]]
        result[mode] = {"wall": summary(walls), "cpu": summary(cpus)}
        print(f"  {mode:<17s} {min(walls):.3f} / {statistics.median(walls):.3f}   {min(walls) / min(ref):.2f}x "
              f"({statistics.median(walls) / statistics.median(ref):.2f}x)   CPU {statistics.median(cpus):.3f}")
    return result


def print_profile(prof: dict) -> None:
    for phase in ("save", "load"):
        p = prof[phase]
        print(f"\n{phase}: wall {p['wall'] * 1e3:.1f} ms; per stage: thread-ms (time inside it, summed over "
              f"threads), CPU-ms (of it on a CPU), calls")
        stages = p["stages"]
        for stage in sorted(stages):
            depth = stage.count(".") - 1
            print(f"  {'  ' * depth}{stage:<24s} {stages[stage] * 1e3:8.1f} {p['cpu'][stage] * 1e3:8.1f}  "
                  f"({p['calls'][stage]})")


def codec_parts() -> dict:
    """Per 4 MiB chunk, one thread: blake3, the whole encode and its parts, decode + verify."""
    from cas import codecs
    from cas.hashing import hash_bytes
    torch.manual_seed(0)
    out = {}
    for name, t in (("fp32 randn", torch.randn(1 << 20)), ("bf16 randn", torch.randn(2 << 20).bfloat16())):
        raw = t.view(torch.uint8).numpy()
        es = t.element_size()
        key = hash_bytes(raw)
        pol = codecs.CodecPolicy()
        blob = b"".join(bytes(p) for p in pol.encode(raw, es).parts)
        grouped = codecs.group_bytes(raw, es, np.empty(raw.size, np.uint8))
        dest = np.empty(raw.size, np.uint8)
        rows = {"blake3": lambda: hash_bytes(raw), "group": lambda: codecs.group_bytes(raw, es, dest),
                "ungroup": lambda: codecs.ungroup_bytes(grouped, es, dest),
                "zstd level 1, whole grouped chunk": lambda: codecs._zstd_c(1).compress(grouped),
                "zstd float params, whole grouped chunk": lambda: codecs._zstd_c(1, floats=True).compress(grouped),
                "encode (cas default)": lambda: pol.encode(raw, es),
                "decode + verify (cas default)": lambda: codecs.decode_into(blob, key, dest)}
        res = {}
        for label, fn in rows.items():
            runs = []
            for _ in range(11):
                runs.append(timed(fn))
            res[label] = summary(runs)
        res["ratio"] = len(blob) / raw.size
        out[name] = res
        print(f"\n{name} (per 4 MiB chunk, one thread; ms min / median), stored {res['ratio']:.4f} of raw")
        for label in rows:
            print(f"  {label:<40s} {res[label]['min'] * 1e3:6.2f} / {res[label]['median'] * 1e3:6.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="evict the files from the page cache before each load")
    ap.add_argument("--codec", action="store_true", help="only the per-chunk codec figures")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--fresh", type=int, default=0, metavar="N",
                    help="also N rounds of resume loads, each in a new process (torch.load, cas, cas compress=False)")
    ap.add_argument("--key", action="store_true", help="every cas store encrypted (a raw key: no KDF)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.key:
        OPEN_OPTIONS["key"] = KEY
    result: dict = {"args": vars(args), "cas": os.path.dirname(cas.__file__)}
    if args.codec:
        result["codec"] = codec_parts()
    else:
        state = make_state(args.mib, args.tensors)
        scratch = tempfile.mkdtemp(prefix="cas-profile-")
        try:
            result["compare"] = comp = compare(state, scratch, args.reps, args.cold)
            ref_s, ref_l = comp["save"]["torch"], comp["load"]["torch"]
            print(f"{args.mib} MiB randn fp32 in {args.tensors} tensors, {args.reps} interleaved runs "
                  f"({'cold' if args.cold else 'warm'} loads); wall seconds min / median, ratio to torch by min "
                  f"(median); CPU seconds of the process (all threads) min / median, ratio by median")
            for what, ref in (("save", ref_s), ("load", ref_l)):
                for name, s in comp[what].items():
                    c, cref = comp[f"{what}_cpu"][name], comp[f"{what}_cpu"]["torch"]
                    print(f"  {what} {name:<8s} {s['min']:.3f} / {s['median']:.3f}   "
                          f"{s['min'] / ref['min']:.2f}x ({s['median'] / ref['median']:.2f}x)   "
                          f"CPU s {c['min']:.3f} / {c['median']:.3f}  {c['median'] / cref['median']:.2f}x")
            for name, size in comp["bytes"].items():
                print(f"  bytes {name:<8s} {size / MiB:8.1f} MiB  {size / comp['bytes']['torch']:.3f}")
            if not args.no_profile:
                result["profile"] = prof = profile(state, scratch)
                print_profile(prof)
            if args.fresh:
                result["fresh"] = fresh_loads(state, scratch, args.fresh)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n(cas from {result['cas']}; loadavg {os.getloadavg()[0]:.2f})", file=sys.stderr)


if __name__ == "__main__":
    main()
