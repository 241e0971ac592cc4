"""Core benchmark: cas against torch.save, safetensors and torch.distributed.checkpoint (DCP).

Everything runs on one training state of about 1 GiB: a GPT-style transformer's fp32 weights
plus AdamW's exp_avg and exp_avg_sq (~89 M parameters, 2 real AdamW steps on a random batch),
saved as {"model": model.state_dict(), "optimizer": opt.state_dict()}. Measured side by side:

  1. full save, durable (fsync): torch.save, safetensors, DCP, cas (default codec), cas (raw)
     -- seconds, GB/s, bytes on disk, ratios against torch.save + fsync
  2. load, cold (the files read are evicted from the page cache first): torch.load, safetensors
     (+ clone), DCP into a pre-allocated state, cas (verifies every byte), compressed and raw
  3. incremental save with ~10% of the tensor bytes changed (a frozen backbone: the last
     layers and their moments get small noise) into a store that holds the previous checkpoint
  4. stored bytes after 10 such incremental saves against 10 torch.save files
  5. chunk-size sweep (1, 4, 16 MiB): full save, cold load, stored bytes after 10 incremental saves
  plus a breakdown of the cas default-codec save measured separately on the same chunks:
  blake3 (2 threads), byte-group + zstd-1 (2 threads), writing the encoded chunks with fsync.

Run from the repository root (takes about 2-4 minutes; needs ~3 GiB of free RAM and ~8 GiB of
scratch disk under /tmp, deleted at the end):

    .venv/bin/python bench/bench_core.py               # full run, JSON to bench/out/core.json
    .venv/bin/python bench/bench_core.py --quick       # ~256 MiB state, 1 repetition (smoke test)
    .venv/bin/python bench/bench_core.py --out x.json  # JSON elsewhere

Each figure is the min (the machine's capability) and median of 3 repetitions, after one
untimed warm-up: this VM first-touches fresh memory slowly, so the warm-up keeps that cost out of
the min. "Cold" means fsync + posix_fadvise(DONTNEED) on every file to be read; the host below
the VM may still cache the disk image. GB = 1e9 bytes, GiB = 2^30; throughput counts the state's
tensor bytes. Section 5 runs one repetition per chunk size (after the warm-up). A cas save is
timed from store.save() to its return (the store is opened untimed); a cas load includes
cas.open(). A last line reports a CPU probe at the start and end and the steal time, since the
host is shared and run-to-run swings of 1.5x have been seen on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import load_file, save_file

import cas
from cas.codecs import CodecPolicy
from cas.fsutil import atomic_write, fsync_dir, write_parts
from cas.hashing import hash_bytes
from cas.store.tree import chunk_spans, plan

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
DEFAULT_CHUNK = 4 * MiB
SWEEP_CHUNKS = (1 * MiB, 4 * MiB, 16 * MiB)
INCREMENTAL_SAVES = 10
CHANGED_FRACTION = 0.10
WORKERS = 2  # thread pool width of the breakdown (the machine has 2 cores)
NOISY_PCT = 10  # other processes' share of the CPU above which a section is flagged
SMALL_OBJECT_MAX = 64 << 10  # cas keeps encoded objects up to this size out of files of their own

# (label, key of the measured ratio, comparison, limit). Ratios are cas / torch for time and
# bytes, except the incremental speed-up, which is torch / cas.
TARGETS = [
    ("first full save, default codec: time vs torch.save+fsync", "save_time_cas", "<=", 1.3),
    ("first full save, default codec: bytes vs torch.save", "save_bytes_cas", "<=", 0.8),
    ("first full save, compress=False: time vs torch.save+fsync", "save_time_cas_raw", "<=", 1.0),
    ("incremental save, 10% changed: speed-up over torch.save+fsync", "incremental_speedup", ">=", 2.5),
    ("verified load, default codec: time vs cold torch.load", "load_time_cas", "<=", 1.5),
    ("verified load, compress=False: time vs cold torch.load", "load_time_cas_raw", "<=", 1.0),
]


@dataclass(frozen=True)
class Settings:
    vocab: int
    dim: int
    layers: int
    heads: int
    reps: int
    warmup: int
    batch: int = 2
    tokens: int = 64
    train_steps: int = 2


FULL = Settings(vocab=16384, dim=768, layers=9, heads=12, reps=3, warmup=1)
QUICK = Settings(vocab=8192, dim=512, layers=4, heads=8, reps=1, warmup=0)


def log(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


# --- the training state ---------------------------------------------------------------------
class GPT(nn.Module):
    """Token embedding, pre-norm causal transformer blocks, final norm, untied head."""

    def __init__(self, s: Settings) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(s.dim, s.heads, 4 * s.dim, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True) for _ in range(s.layers))
        self.norm = nn.LayerNorm(s.dim)
        self.head = nn.Linear(s.dim, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def build_state(s: Settings):
    """A model and AdamW after a few real steps; returns (model, optimizer, state)."""
    torch.manual_seed(0)
    model = GPT(s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, s.vocab, (s.batch, s.tokens + 1))
    for _ in range(s.train_steps):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt, {"model": model.state_dict(), "optimizer": opt.state_dict()}


def iter_tensors(obj, prefix: str = ""):
    """(dotted path, tensor) for every tensor in a nested dict/list state."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def map_tensors(fn, obj):
    """The same nested structure with every tensor replaced by fn(tensor)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def tensor_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(state))


def same_tensors(a, b) -> bool:
    """Bit-for-bit equality of the tensors two states hold, path by path."""
    ta, tb = dict(iter_tensors(a)), dict(iter_tensors(b))

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape and torch.equal(raw(ta[k]), raw(tb[k]))
        for k in ta)


class Mutator:
    """Adds small noise to the last blocks' parameters (about `fraction` of the parameter bytes)
    and to their AdamW moments, as a fine-tune with a frozen backbone would change them."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, fraction: float) -> None:
        total = sum(p.numel() for p in model.parameters())
        chosen, count = [], 0
        blocks = [(n, p) for n, p in model.named_parameters() if n.startswith("blocks.")]
        for name, p in reversed(blocks):
            if count >= fraction * total:
                break
            chosen.append((name, p, opt.state[p]))
            count += p.numel()
        self.targets = chosen
        self.fraction = count / total
        self.names = [n for n, _, _ in chosen]
        self.noise = torch.empty(max(p.numel() for _, p, _ in chosen))
        self.gen = torch.Generator().manual_seed(1)

    @torch.no_grad()
    def apply(self) -> None:
        for _, p, st in self.targets:
            noise = self.noise[:p.numel()].view_as(p).normal_(generator=self.gen)
            p.add_(noise, alpha=1e-4)
            st["exp_avg"].add_(noise, alpha=1e-5)
            st["exp_avg_sq"].add_(noise.abs_(), alpha=1e-9)
            st["step"] += 1


# --- files ------------------------------------------------------------------------------------
def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]


def du(path: str) -> int:
    """Allocated bytes of a file or a folder tree (what `du` reports)."""
    if not os.path.exists(path):
        return 0
    if os.path.isfile(path):
        return os.stat(path).st_blocks * 512
    total = 0
    for d, _, names in os.walk(path):
        total += os.stat(d).st_blocks * 512
        total += sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for f in names)
    return total


def drop_cache(path: str) -> None:
    """Evict a file's or folder's pages from the page cache: fsync, then FADV_DONTNEED."""
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


# --- timing -----------------------------------------------------------------------------------
@dataclass
class Timing:
    times: list[float]
    warmup: list[float] = field(default_factory=list)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def measure(fn, *, reps: int, warmup: int, setup=None, teardown=None):
    """Time fn(setup()) `reps` times after `warmup` untimed runs; setup and teardown(ctx) are
    untimed. Returns (Timing, the last run's result); earlier results are freed before the next
    run so that at most one is alive."""
    timing, result = Timing([]), None
    for i in range(warmup + reps):
        ctx = setup() if setup else None
        result = None
        t0 = time.perf_counter()
        result = fn(ctx)
        elapsed = time.perf_counter() - t0
        if teardown:
            teardown(ctx)
        (timing.warmup if i < warmup else timing.times).append(elapsed)
    return timing, result


# --- the formats compared ---------------------------------------------------------------------
class Format:
    """A way of saving and loading the state; `fresh` prepares an empty target (untimed)."""

    name = ""  # the save, as the tables show it
    load_name = ""
    target = ""  # file or folder name under the scratch folder

    def __init__(self, state) -> None:
        self.state = state

    def fresh(self, path: str):
        remove(path)
        return path

    def save(self, ctx) -> None:
        raise NotImplementedError

    def done(self, ctx) -> None:
        """Called after each timed save (untimed)."""

    def load(self, path: str):
        raise NotImplementedError

    def loaded_state(self, result):
        """The state a load produced, for the correctness check."""
        return result


class TorchSave(Format):
    name, load_name, target = "torch.save + fsync", "torch.load (weights_only)", "state.pt"

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, path: str):
        return torch.load(path, map_location="cpu", weights_only=True)


class Safetensors(Format):
    name, load_name, target = "safetensors save_file + fsync", "safetensors load_file + clone", "state.safetensors"

    def __init__(self, state) -> None:
        super().__init__(state)
        self.flat = {k: t.contiguous() for k, t in iter_tensors(state)}

    def save(self, path: str) -> None:
        save_file(self.flat, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, path: str):
        return {k: t.clone() for k, t in load_file(path).items()}

    def loaded_state(self, result):
        return _unflatten_like(self.state, result)


class DCP(Format):
    name, target = "dcp.save (FileSystemWriter, 1 process)", "state.dcp"
    load_name = "dcp.load into a pre-allocated state"

    def __init__(self, state) -> None:
        super().__init__(state)
        self.into = map_tensors(lambda t: torch.zeros_like(t), state)  # pre-allocated, reused

    def save(self, path: str) -> None:
        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)

    def load(self, path: str):
        dcp.load(self.into, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        return self.into


CAS_ZSTD = "cas, zstd-1 bytegroup (default)"
CAS_RAW = "cas, compress=False"
LOAD_ZSTD, LOAD_RAW = CAS_ZSTD + ", verified", CAS_RAW + ", verified"


class CasFormat(Format):
    """A cas store: saved into a store opened (untimed) just before; a load's time includes
    opening the store."""

    def __init__(self, state, *, compress: bool, chunk_size: int = DEFAULT_CHUNK) -> None:
        super().__init__(state)
        self.compress, self.chunk_size = compress, chunk_size
        self.name = CAS_ZSTD if compress else CAS_RAW
        self.load_name = LOAD_ZSTD if compress else LOAD_RAW
        self.target = f"cas-{'zstd' if compress else 'raw'}-{chunk_size // MiB}m"

    def fresh(self, path: str):
        remove(path)
        return self.open(path)

    def open(self, path: str):
        return cas.open(path, chunk_size=self.chunk_size, compress=self.compress)

    def save(self, store, step: int = 0):
        return store.save(self.state, step=step)

    def done(self, store) -> None:
        store.close()

    def load(self, path: str):
        with self.open(path) as store:
            return store.load()


def _unflatten_like(template, flat: dict):
    paths = iter(flat[k] for k, _ in iter_tensors(template))
    return map_tensors(lambda _: next(paths), template)


# --- sections -----------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    t_min: float
    t_med: float
    gbps: float | None = None
    disk_bytes: int | None = None
    time_ratio: float | None = None  # against the section's reference row
    bytes_ratio: float | None = None
    extra: dict = field(default_factory=dict)


def timed_row(name: str, timing: Timing, nbytes: int | None, **extra) -> Row:
    return Row(name, timing.min, timing.median, nbytes / timing.min / GB if nbytes else None,
               extra={"times_s": timing.times, "warmup_s": timing.warmup, **extra})


def set_ratios(rows: list[Row], ref: Row) -> None:
    for r in rows:
        r.time_ratio = r.t_min / ref.t_min
        if r.disk_bytes is not None and ref.disk_bytes:
            r.bytes_ratio = r.disk_bytes / ref.disk_bytes


def section_full_save(formats: list[Format], scratch: str, s: Settings, nbytes: int) -> list[Row]:
    rows = []
    for fmt in formats:
        log(f"full save: {fmt.name}")
        path = os.path.join(scratch, fmt.target)
        timing, _ = measure(fmt.save, reps=s.reps, warmup=s.warmup,
                            setup=lambda p=path, f=fmt: f.fresh(p), teardown=fmt.done)
        row = timed_row(fmt.name, timing, nbytes)
        row.disk_bytes = du(path)
        rows.append(row)
    set_ratios(rows, rows[0])
    return rows


def section_load(formats: list[Format], scratch: str, s: Settings, nbytes: int, state,
                 warm: tuple[Format, ...] = ()) -> tuple[list[Row], dict]:
    """Cold loads of every format's last save (and warm loads of `warm`); checks each result."""
    rows, correct = [], {}
    runs = [(f, True) for f in formats] + [(f, False) for f in warm]
    for fmt, cold in runs:
        label = f"{fmt.load_name}{'' if cold else ', WARM page cache'}"
        log(f"load: {label}")
        path = os.path.join(scratch, fmt.target)
        timing, result = measure(fmt.load, reps=s.reps, warmup=s.warmup,
                                 setup=(lambda p=path: drop_cache(p) or p) if cold else (lambda p=path: p))
        correct[label] = same_tensors(fmt.loaded_state(result), state)
        del result
        rows.append(timed_row(label, timing, nbytes, cold=cold, bit_exact=correct[label]))
    set_ratios(rows, rows[0])
    return rows, correct


def raw_chunks(state, chunk_size: int) -> list[tuple]:
    """(uint8 view, byte-group size) of every chunk, cut exactly as cas cuts them."""
    _, leaves = plan(state, chunk_size=chunk_size)
    out = []
    for leaf in leaves:
        data = leaf.bytes_view()
        out += [(data[a:b], leaf.group) for a, b in chunk_spans(leaf.nbytes, chunk_size)]
    return out


def encoded_parts(encoded) -> list:
    """The [header, payload] parts of CodecPolicy.encode's result (a list, or an object holding it)."""
    return getattr(encoded, "parts", encoded)


def size(parts) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def section_breakdown(state, scratch: str, s: Settings, nbytes: int, cas_save: Row) -> list[Row]:
    """Where the default-codec save's time goes: each stage alone, on the same chunks."""
    chunks = raw_chunks(state, DEFAULT_CHUNK)
    policy = CodecPolicy()
    folder = os.path.join(scratch, "breakdown")
    single = os.path.join(scratch, "breakdown.bin")
    with ThreadPoolExecutor(WORKERS) as pool:
        def hash_all(_):
            return list(pool.map(lambda c: hash_bytes(c[0]), chunks))

        def encode_all(_):
            return list(pool.map(lambda c: encoded_parts(policy.encode(c[0], c[1])), chunks))

        def fresh_folder():
            remove(folder)
            os.makedirs(folder)

        def write_files(_):  # as cas does: only the larger objects become files of their own
            big = [parts for parts in encoded if size(parts) > SMALL_OBJECT_MAX]
            names = [os.path.join(folder, f"{i:06d}") for i in range(len(big))]
            list(pool.map(lambda a: atomic_write(a[0], a[1], tmp_dir=folder), zip(names, big)))
            fsync_dir(folder)
            return len(big)

        def write_one(_):
            with open(single, "wb") as f:
                for parts in encoded:
                    write_parts(f.fileno(), parts)
                os.fsync(f.fileno())

        log("breakdown: blake3")
        t_hash, _ = measure(hash_all, reps=s.reps, warmup=s.warmup)
        log("breakdown: bytegroup + zstd-1")
        t_enc, encoded = measure(encode_all, reps=s.reps, warmup=s.warmup)
        stored = sum(size(parts) for parts in encoded)
        log("breakdown: writes")
        t_files, nfiles = measure(write_files, reps=s.reps, warmup=s.warmup, setup=fresh_folder)
        t_one, _ = measure(write_one, reps=s.reps, warmup=s.warmup, setup=lambda: remove(single))
    remove(folder)
    remove(single)
    del encoded
    rows = [
        timed_row(f"blake3 all chunks, {WORKERS}-thread pool", t_hash, nbytes),
        timed_row(f"bytegroup + zstd-1 all chunks, {WORKERS}-thread pool", t_enc, nbytes,
                  encoded_bytes=stored, size_pct=100 * stored / nbytes),
        timed_row(f"write the {nfiles} chunks > {SMALL_OBJECT_MAX >> 10} KiB as files (tmp+fsync+rename)",
                  t_files, nbytes),
        timed_row(f"write all {len(chunks)} encoded chunks as 1 file + fsync", t_one, nbytes),
    ]
    cpu = Timing([a + b for a, b in zip(t_hash.times, t_enc.times)])
    floor = Timing([a + b + c for a, b, c in zip(t_hash.times, t_enc.times, t_files.times)])
    rows.append(timed_row("CPU floor: hash + encode (no overlap)", cpu, nbytes))
    rows.append(timed_row("sum: hash + encode + chunk files (no overlap)", floor, nbytes))
    rows.append(Row(cas_save.name + " (section 1)", cas_save.t_min, cas_save.t_med, cas_save.gbps))
    for r in rows:
        r.time_ratio = r.t_min / cas_save.t_min
    rows[1].disk_bytes = stored
    return rows


def incremental_chain(fmt: CasFormat, path: str, mutator: Mutator, n: int,
                      compare: TorchSave | None = None, torch_path: str = "") -> dict:
    """A base save, then n saves each after mutator.apply(), into one store. Times each cas
    save (and, with `compare`, a torch.save + fsync of the same state right after it)."""
    store = fmt.fresh(path)
    out = {"cas_s": [], "torch_s": [], "torch_bytes": [], "new_bytes": []}
    try:
        fmt.save(store, step=0)
        out["base_disk_bytes"] = du(path)
        for step in range(1, n + 1):
            mutator.apply()
            t0 = time.perf_counter()
            ck = fmt.save(store, step=step)
            out["cas_s"].append(time.perf_counter() - t0)
            out["new_bytes"].append(ck.new_bytes)
            if compare is not None:
                remove(torch_path)
                t0 = time.perf_counter()
                compare.save(torch_path)
                out["torch_s"].append(time.perf_counter() - t0)
                out["torch_bytes"].append(du(torch_path))
        out["stored_bytes"] = store.stats().stored_bytes
    finally:
        store.close()
    remove(torch_path)
    out["disk_bytes"] = du(path)
    return out


def section_incremental(state, scratch: str, mutator: Mutator,
                        torch_file_bytes: int) -> tuple[list[Row], list[Row], dict]:
    log(f"incremental: base + {INCREMENTAL_SAVES} saves, cas and torch.save side by side")
    fmt = CasFormat(state, compress=True)
    path = os.path.join(scratch, "incremental.cas")
    run = incremental_chain(fmt, path, mutator, INCREMENTAL_SAVES, TorchSave(state), os.path.join(scratch, "inc.pt"))
    remove(path)
    nbytes = tensor_bytes(state)
    t_torch, t_cas = Timing(run["torch_s"]), Timing(run["cas_s"])
    times = [timed_row("torch.save + fsync, full state", t_torch, nbytes),
             timed_row(f"cas save, {mutator.fraction:.1%} of tensor bytes changed", t_cas, nbytes,
                       new_bytes=run["new_bytes"])]
    set_ratios(times, times[0])
    added = run["disk_bytes"] - run["base_disk_bytes"]
    torch_n = sum(run["torch_bytes"])
    sizes = [Row(f"{INCREMENTAL_SAVES} torch.save files", 0, 0, disk_bytes=torch_n),
             Row(f"cas: bytes added by the {INCREMENTAL_SAVES} incremental saves (du)", 0, 0, disk_bytes=added,
                 extra={"sum_new_bytes": sum(run["new_bytes"])}),
             Row(f"{INCREMENTAL_SAVES + 1} torch.save files (base + {INCREMENTAL_SAVES})", 0, 0,
                 disk_bytes=torch_n + torch_file_bytes),
             Row(f"cas store, base + {INCREMENTAL_SAVES} checkpoints (du)", 0, 0, disk_bytes=run["disk_bytes"],
                 extra={"stored_bytes": run["stored_bytes"]})]
    sizes[1].bytes_ratio = added / torch_n
    sizes[3].bytes_ratio = run["disk_bytes"] / (torch_n + torch_file_bytes)
    return times, sizes, run


def section_sweep(state, scratch: str, s: Settings, mutator: Mutator, torch_file_bytes: int) -> list[dict]:
    """One repetition (after the warm-up) per chunk size: full save, cold load, and the bytes
    and save times of an incremental chain."""
    nbytes = tensor_bytes(state)
    out = []
    for chunk in SWEEP_CHUNKS:
        log(f"sweep: chunk_size {chunk // MiB} MiB")
        fmt = CasFormat(state, compress=True, chunk_size=chunk)
        path = os.path.join(scratch, fmt.target)
        save_t, _ = measure(fmt.save, reps=1, warmup=s.warmup, setup=lambda p=path, f=fmt: f.fresh(p),
                            teardown=fmt.done)
        full_disk = du(path)
        load_t, _ = measure(fmt.load, reps=1, warmup=s.warmup, setup=lambda p=path: drop_cache(p) or p)
        run = incremental_chain(fmt, path, mutator, INCREMENTAL_SAVES)
        remove(path)
        total = (INCREMENTAL_SAVES + 1) * torch_file_bytes
        out.append({"chunk_MiB": chunk // MiB, "save_s": save_t.min, "save_GBps": nbytes / save_t.min / GB,
                    "full_disk_bytes": full_disk, "load_s": load_t.min, "load_GBps": nbytes / load_t.min / GB,
                    "incremental_min_s": min(run["cas_s"]), "incremental_median_s": statistics.median(run["cas_s"]),
                    "disk_bytes_after_chain": run["disk_bytes"], "vs_torch_files": run["disk_bytes"] / total})
    return out


# --- report -------------------------------------------------------------------------------------
def fmt_s(t: float) -> str:
    return f"{t * 1e3:.0f} ms" if t < 1 else f"{t:.2f} s"


def fmt_b(n: int | None) -> str:
    if n is None:
        return ""
    return f"{n / GiB:.3f} GiB" if n >= GiB / 2 else f"{n / MiB:.1f} MiB"


def fmt_x(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def print_rows(title: str, rows: list[Row], ratio_note: str, timed: bool = True) -> None:
    print(f"\n{title}")
    if timed:
        print(f"  {'what':<58} {'min':>8} {'median':>8} {'GB/s':>6} {'on disk':>11} {'time':>7} {'bytes':>7}")
    else:
        print(f"  {'what':<58} {'on disk':>11} {'bytes':>7}")
    for r in rows:
        if timed:
            gbps = f"{r.gbps:.2f}" if r.gbps else ""
            print(f"  {r.name:<58} {fmt_s(r.t_min):>8} {fmt_s(r.t_med):>8} {gbps:>6} {fmt_b(r.disk_bytes):>11} "
                  f"{fmt_x(r.time_ratio):>7} {fmt_x(r.bytes_ratio):>7}")
        else:
            print(f"  {r.name:<58} {fmt_b(r.disk_bytes):>11} {fmt_x(r.bytes_ratio):>7}")
    print(f"  ({ratio_note})")


def print_sweep(rows: list[dict], note: str) -> None:
    print(f"\n5. Chunk-size sweep, cas default codec (1 repetition each after the warm-up; cold load; "
          f"incremental saves and bytes of base + {INCREMENTAL_SAVES} incremental saves)")
    print(f"  {'chunk':>6} {'full save':>10} {'GB/s':>6} {'on disk':>11} {'cold load':>10} {'GB/s':>6} "
          f"{'incr. min':>10} {'incr. med':>10} {'after chain':>12} {'vs torch':>9}")
    for r in rows:
        print(f"  {r['chunk_MiB']:>3} MiB {fmt_s(r['save_s']):>10} {r['save_GBps']:>6.2f} "
              f"{fmt_b(r['full_disk_bytes']):>11} "
              f"{fmt_s(r['load_s']):>10} {r['load_GBps']:>6.2f} {fmt_s(r['incremental_min_s']):>10} "
              f"{fmt_s(r['incremental_median_s']):>10} {fmt_b(r['disk_bytes_after_chain']):>12} "
              f"{fmt_x(r['vs_torch_files']):>9}")
    print(f"  (vs torch: store size after the chain / {INCREMENTAL_SAVES + 1} torch.save files; {note})")


def print_targets() -> None:
    print("Targets from the issue:")
    for label, _, op, limit in TARGETS:
        print(f"  - {label} {op} {limit}x")


def verdicts(saves: list[Row], loads: list[Row], incr: list[Row]) -> list[dict]:
    """Each target against the measured ratios (min against min, and median against median)."""
    save, load = {r.name: r for r in saves}, {r.name: r for r in loads}

    def ratios(rows: dict, name: str, ref: Row, what: str = "time") -> tuple[float, float]:
        r = rows[name]
        if what == "bytes":
            return r.bytes_ratio, r.bytes_ratio
        return r.t_min / ref.t_min, r.t_med / ref.t_med

    measured = {
        "save_time_cas": ratios(save, CAS_ZSTD, saves[0]),
        "save_bytes_cas": ratios(save, CAS_ZSTD, saves[0], "bytes"),
        "save_time_cas_raw": ratios(save, CAS_RAW, saves[0]),
        "incremental_speedup": (incr[0].t_min / incr[1].t_min, incr[0].t_med / incr[1].t_med),
        "load_time_cas": ratios(load, LOAD_ZSTD, loads[0]),
        "load_time_cas_raw": ratios(load, LOAD_RAW, loads[0]),
    }
    out = []
    for label, key, op, limit in TARGETS:
        best, typical = measured[key]
        met = best <= limit if op == "<=" else best >= limit
        out.append({"target": f"{label} {op} {limit}x", "min_ratio": best, "median_ratio": typical, "met": met})
    return out


def print_verdicts(results: list[dict]) -> None:
    print("\nTargets against this run (ratio of mins; of medians in brackets):")
    for v in results:
        print(f"  {'MET ' if v['met'] else 'MISS'}  {v['target']:<72} {v['min_ratio']:.2f}x ({v['median_ratio']:.2f}x)")


def machine() -> dict:
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": sys.version.split()[0], "loadavg_start": os.getloadavg()}


def cpu_probe() -> float:
    """Single-thread GB/s of byte-group + zstd-1 on a fixed 4 MiB chunk of weight-like floats:
    taken at the start and the end, it shows whether the (shared) machine was slow meanwhile."""
    gen = torch.Generator().manual_seed(2)
    chunk = (torch.randn(DEFAULT_CHUNK // 4, generator=gen) * 0.02).view(torch.uint8).numpy()
    policy = CodecPolicy()
    policy.encode(chunk, 4)
    t0 = time.perf_counter()
    for _ in range(10):
        policy.encode(chunk, 4)
    return 10 * chunk.nbytes / (time.perf_counter() - t0) / GB


class CpuNoise:
    """CPU time taken outside this process during the run, in % of the machine: user time of
    other processes, kernel time not charged to us (I/O threads, other processes), and steal."""

    def __init__(self) -> None:
        self.t0, self.stat0, self.own0 = time.perf_counter(), self._stat(), os.times()

    @staticmethod
    def _stat() -> tuple[int, int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[0] + v[1], v[2] + v[5] + v[6], v[7]  # user+nice, system+irq+softirq, steal

    def result(self) -> dict:
        hz, wall = os.sysconf("SC_CLK_TCK"), time.perf_counter() - self.t0
        pct = 100 / (wall * (os.cpu_count() or 1))
        (user0, sys0, steal0), (user1, sys1, steal1) = self.stat0, self._stat()
        own = os.times()
        return {"other_user_pct": max(0.0, (user1 - user0) / hz - (own.user - self.own0.user)) * pct,
                "other_kernel_pct": max(0.0, (sys1 - sys0) / hz - (own.system - self.own0.system)) * pct,
                "steal_pct": (steal1 - steal0) / hz * pct}


def busy_note(busy: dict) -> str:
    """How much CPU other processes took during a section, flagged when it skews the figures."""
    text = f"other processes took {busy['other_user_pct']:.0f}% of the CPU meanwhile"
    return text + (" -- NOISY, rerun on a quiet machine" if busy["other_user_pct"] > NOISY_PCT else "")


def sectioned(fn, *args):
    """Run one section; returns (its result, CpuNoise of the time it ran)."""
    noise = CpuNoise()
    out = fn(*args)
    return out, noise.result()


# --- main ---------------------------------------------------------------------------------------
def run_sections(s: Settings, state, mutator: Mutator, scratch: str) -> dict:
    """Every section, printed as it completes; returns the rows and figures for the JSON."""
    nbytes = tensor_bytes(state)
    formats = [TorchSave(state), Safetensors(state), DCP(state),
               CasFormat(state, compress=True), CasFormat(state, compress=False)]
    saves, busy = sectioned(section_full_save, formats, scratch, s, nbytes)
    print_rows("1. Full save (durable)", saves, "time and bytes ratios against torch.save + fsync; " + busy_note(busy))
    breakdown, busy = sectioned(section_breakdown, state, scratch, s, nbytes, saves[3])
    print_rows("1b. Where the default-codec cas save goes (each stage alone, same 4 MiB chunks)", breakdown,
               "time ratio against the measured cas save; 'on disk' = encoded bytes; " + busy_note(busy))
    (loads, correct), busy = sectioned(section_load, formats, scratch, s, nbytes, state, (formats[0], formats[3]))
    exact = ("every result bit-exact" if all(correct.values())
             else "NOT bit-exact: " + ", ".join(k for k, ok in correct.items() if not ok))
    print_rows("2. Load (cold unless marked; every result checked bit-exact against the state)", loads,
               f"time ratio against cold torch.load; {exact}; {busy_note(busy)}")
    for fmt in formats:
        remove(os.path.join(scratch, fmt.target))
    (incr_times, incr_sizes, incr_run), busy = sectioned(section_incremental, state, scratch, mutator,
                                                         saves[0].disk_bytes)
    print_rows(f"3. Incremental save, {mutator.fraction:.1%} of tensor bytes changed ({INCREMENTAL_SAVES} saves, "
               f"each into a store holding the previous checkpoint)", incr_times,
               "time ratio against torch.save + fsync of the same state, measured right after each cas save; "
               + busy_note(busy))
    print_rows(f"4. Stored bytes after {INCREMENTAL_SAVES} incremental saves", incr_sizes,
               "bytes ratio: cas row against the torch row above it", timed=False)
    sweep, busy = sectioned(section_sweep, state, scratch, s, mutator, saves[0].disk_bytes)
    print_sweep(sweep, busy_note(busy))
    return {"targets": verdicts(saves, loads, incr_times),
            "full_save": [asdict(r) for r in saves],
            "save_breakdown": [asdict(r) for r in breakdown],
            "load": [asdict(r) for r in loads],
            "incremental": [asdict(r) for r in incr_times],
            "incremental_bytes": [asdict(r) for r in incr_sizes],
            "incremental_run": incr_run,
            "chunk_sweep": sweep}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~256 MiB state, one repetition (smoke test)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "core.json"),
                        help="where to write the JSON figures (default: bench/out/core.json)")
    args = parser.parse_args()
    s = QUICK if args.quick else FULL
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    started, noise, meta = time.perf_counter(), CpuNoise(), machine()
    probe_start = cpu_probe()

    log("building the model and running AdamW steps")
    t0 = time.perf_counter()
    model, opt, state = build_state(s)
    build_s = time.perf_counter() - t0
    nbytes, ntensors = tensor_bytes(state), sum(1 for _ in iter_tensors(state))
    params = sum(p.numel() for p in model.parameters())
    mutator = Mutator(model, opt, CHANGED_FRACTION)
    print(f"cas core benchmark{' (--quick)' if args.quick else ''}: state {nbytes / GiB:.3f} GiB "
          f"({nbytes / GB:.2f} GB) in {ntensors} tensors: GPT {params / 1e6:.1f} M params\n"
          f"(vocab {s.vocab}, d {s.dim}, {s.layers} layers, fp32) + AdamW exp_avg/exp_avg_sq after "
          f"{s.train_steps} steps. Min and median of {s.reps} run(s) after {s.warmup} warm-up.")
    print_targets()

    scratch = tempfile.mkdtemp(prefix="cas-bench-core-", dir="/tmp")
    try:
        report = run_sections(s, state, mutator, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print_verdicts(report["targets"])
    wall = time.perf_counter() - started
    probe_end, busy = cpu_probe(), noise.result()
    meta.update(loadavg_end=os.getloadavg(), wall_s=wall, build_s=build_s, cpu_probe_start_GBps=probe_start,
                cpu_probe_end_GBps=probe_end, **busy, quick=args.quick, settings=asdict(s), state_bytes=nbytes,
                tensors=ntensors, params=params, changed_fraction=mutator.fraction, changed_tensors=mutator.names)
    print(f"\nmachine during the run: CPU probe (1-thread bytegroup+zstd-1, 4 MiB) {probe_start:.2f} GB/s at start, "
          f"{probe_end:.2f} GB/s at end; CPU taken outside this process: user {busy['other_user_pct']:.0f}%, "
          f"kernel {busy['other_kernel_pct']:.0f}% (I/O threads), steal {busy['steal_pct']:.0f}% of the machine")
    print(f"wall time {wall:.0f} s (model build + {s.train_steps} AdamW steps {build_s:.1f} s); "
          f"each incremental save changes {len(mutator.names)} parameters and their AdamW state "
          f"({mutator.names[-1]} .. {mutator.names[0]})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, **report}, f, indent=1)
    print(f"figures written to {args.out}")


if __name__ == "__main__":
    main()
