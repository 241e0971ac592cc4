"""DCP benchmark: torch.distributed.checkpoint through FileSystemWriter against CasWriter.

Two ranks on this machine (gloo on CPU) hold an MLP sharded with FSDP2 (fully_shard over a
2-rank mesh) plus AdamW's moments, taken with get_state_dict: about 67 MB of weights and
201 MB of state. Measured, each as the slowest rank (barrier before and after), as the median
of 3 rounds that each start from fresh folders and a fresh store:

  1. first save: FileSystemWriter into a fresh folder, CasWriter into a fresh store
  2. incremental save after one training step with the first half of the layers frozen (their
     weights and moments do not change): FileSystemWriter writes a whole new folder again,
     CasWriter writes only the chunks that changed
  3. load of the incremental checkpoint, cold (every file fsynced and evicted from the page
     cache first), into the zeroed state, checked bit for bit against the state saved
  4. once, a dense series: every layer trains (AdamW lr 1e-3) and is saved every 10 steps, 5
     times, through FileSystemWriter (a folder each), CasWriter and CasWriter(delta=True) (each
     rank codes changed chunks against its own previous save); the last checkpoint of the delta
     store is then loaded cold and checked. Reported: bytes on disk after the series and the
     median save time

Bytes written are what each save added on disk (the folder for DCP, the store's growth for
cas). Run from the repository root; under a minute; JSON to bench/out/dcp.json:

    .venv/bin/python bench/bench_dcp.py            # full run
    .venv/bin/python bench/bench_dcp.py --quick    # a 4x smaller model (smoke test)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cas.store import dcp as cdcp  # noqa: E402

WORLD = 2
MB = 1e6


# --- one rank --------------------------------------------------------------------------------
def build(width: int, layers: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, opt, width: int, seed: int) -> None:
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def local_tensors(state) -> list[torch.Tensor]:
    """Each DTensor's local shard (or the plain tensor), in a fixed order."""
    out = []
    if isinstance(state, dict):
        for key in sorted(state, key=str):
            out += local_tensors(state[key])
    elif isinstance(state, list):
        for item in state:
            out += local_tensors(item)
    elif isinstance(state, torch.Tensor):
        out.append(state.to_local() if hasattr(state, "to_local") else state)
    return out


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def evict(path: str) -> None:
    """Make the next read of every file under `path` come from disk."""
    for d, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn) -> float:
    """Seconds from a barrier to the slowest rank's end."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def load_checked(state: dict, load) -> float:
    """Zero the state, time `load`, and check every tensor came back bit for bit."""
    tensors = local_tensors(state)
    expected = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    seconds = timed(load)
    bad = sum(not torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in
              zip((t.reshape(-1) for t in tensors), (e.reshape(-1) for e in expected)))
    if bad:
        raise SystemExit(f"a load returned {bad} tensors that differ from what was saved")
    return seconds


def one_round(args, work: str) -> dict:
    """First save, incremental save and cold load through both writers, into fresh targets."""
    model, opt = build(args.width, args.layers)
    train_step(model, opt, args.width, seed=1)
    state = state_of(model, opt)
    store = os.path.join(work, "store")
    res: dict = {}
    res["fs_save1_s"] = timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{work}/fs1")))
    res["fs_save1_bytes"] = folder_bytes(f"{work}/fs1")
    res["cas_save1_s"] = timed(lambda: res.update(cas1=cdcp.save(state, store, 1, chunk_size=1 << 20)))
    res["cas_save1_bytes"] = folder_bytes(store)

    for layer in list(model)[: args.layers // 2]:  # freeze the first half: weights and moments stay put
        layer.requires_grad_(False)
    train_step(model, opt, args.width, seed=2)
    state = state_of(model, opt)
    res["fs_save2_s"] = timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{work}/fs2")))
    res["fs_save2_bytes"] = folder_bytes(f"{work}/fs2")
    before = folder_bytes(store)
    res["cas_save2_s"] = timed(lambda: res.update(cas2=cdcp.save(state, store, 2)))
    res["cas_save2_bytes"] = folder_bytes(store) - before

    if dist.get_rank() == 0:
        evict(f"{work}/fs2")
    res["fs_load_s"] = load_checked(state, lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(f"{work}/fs2")))
    if dist.get_rank() == 0:
        evict(store)
    res["cas_load_s"] = load_checked(state, lambda: cdcp.load(state, store, 2))
    res["cas1"], res["cas2"] = vars(res["cas1"]), vars(res["cas2"])
    return res


def dense_series(args, work: str, saves: int = 5, every: int = 10) -> dict:
    """Dense training (no layer frozen) saved every `every` steps through the three writers."""
    model, opt = build(args.width, args.layers)
    writers = {"fs": lambda st, step: dcp.save(st, storage_writer=dcp.FileSystemWriter(f"{work}/fs{step}")),
               "cas": lambda st, step: cdcp.save(st, f"{work}/cas", step, chunk_size=1 << 20),
               "cas_delta": lambda st, step: cdcp.save(st, f"{work}/delta", step, chunk_size=1 << 20, delta=True)}
    times: dict = {name: [] for name in writers}
    for step in range(1, saves + 1):
        for n in range(every):
            train_step(model, opt, args.width, seed=100 * step + n)
        state = state_of(model, opt)
        for name, save in writers.items():
            times[name].append(timed(lambda: save(state, step)))
    res = {f"dense_{name}_save_s": statistics.median(t) for name, t in times.items()}
    res["dense_fs_bytes"] = folder_bytes(work) - folder_bytes(f"{work}/cas") - folder_bytes(f"{work}/delta")
    res["dense_cas_bytes"] = folder_bytes(f"{work}/cas")
    res["dense_cas_delta_bytes"] = folder_bytes(f"{work}/delta")
    if dist.get_rank() == 0:
        evict(f"{work}/delta")
    res["dense_cas_delta_load_s"] = load_checked(state, lambda: cdcp.load(state, f"{work}/delta", saves))
    if dist.get_rank() == 0:
        evict(f"{work}/cas")
    res["dense_cas_load_s"] = load_checked(state, lambda: cdcp.load(state, f"{work}/cas", saves))
    return res


def rank_main(args) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{args.pg}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    warnings.filterwarnings("ignore")
    rounds = []
    for n in range(args.reps):
        work = os.path.join(args.work, f"round{n}")
        rounds.append(one_round(args, work))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work)
    dense = dense_series(args, os.path.join(args.work, "dense"))
    model, opt = build(args.width, args.layers)
    train_step(model, opt, args.width, seed=1)
    state_bytes = torch.tensor([sum(t.numel() * t.element_size() for t in local_tensors(state_of(model, opt)))])
    dist.all_reduce(state_bytes)
    if rank == 0:
        summary = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key.endswith(("_s", "_bytes"))}
        summary.update(state_bytes=int(state_bytes.item()), params=sum(p.numel() for p in model.parameters()),
                       cas1=rounds[-1]["cas1"], cas2=rounds[-1]["cas2"], rounds=rounds, **dense)
        with open(os.path.join(args.work, "result.json"), "w") as f:
            json.dump(summary, f)
    dist.destroy_process_group()
    exit_now()


def exit_now() -> None:
    """Leave without the interpreter's teardown: with torch 2.13's gloo on this machine, about one
    exit in three aborted there ("terminate called without an active exception", SIGABRT) after
    a clean destroy_process_group, which made a finished run look failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the launcher ----------------------------------------------------------------------------
def launch(args) -> dict:
    work = tempfile.mkdtemp(prefix="cas-bench-dcp-")
    try:
        pg = os.path.join(work, "pg")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-of", work, "--pg", pg,
                                   "--width", str(args.width), "--layers", str(args.layers),
                                   "--reps", str(args.reps)],
                                  env=dict(os.environ, RANK=str(rank), PYTHONPATH=ROOT))
                 for rank in range(WORLD)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"benchmark ranks exited with {codes}")
        with open(os.path.join(work, "result.json")) as f:
            return json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(res: dict, args) -> str:
    rows = [("first save", "s", res["fs_save1_s"], res["cas_save1_s"]),
            ("first save, written", "MB", res["fs_save1_bytes"] / MB, res["cas_save1_bytes"] / MB),
            ("incremental save", "s", res["fs_save2_s"], res["cas_save2_s"]),
            ("incremental save, written", "MB", res["fs_save2_bytes"] / MB, res["cas_save2_bytes"] / MB),
            ("load (cold, bit-checked)", "s", res["fs_load_s"], res["cas_load_s"])]
    head = (f"median of {args.reps} rounds; DCP, {WORLD} ranks (gloo, CPU, FSDP2): MLP {args.layers}x{args.width}, "
            f"{res['params'] / 1e6:.1f} M params + AdamW = {res['state_bytes'] / MB:.0f} MB of state; "
            "incremental: first half of the layers frozen, one step")
    lines = [head, f"{'':28}{'':4}{'FileSystemWriter':>18}{'CasWriter':>12}{'cas / fs':>10}"]
    for name, unit, fs, cs in rows:
        lines.append(f"{name:28}{unit:4}{fs:18.2f}{cs:12.2f}{cs / fs if fs else float('nan'):10.2f}")
    lines.append(f"cas new_bytes (registry): first {res['cas1']['new_bytes'] / MB:.1f} MB, "
                 f"incremental {res['cas2']['new_bytes'] / MB:.1f} MB of {res['cas2']['logical_bytes'] / MB:.1f} MB")
    fs_b, fs_s = res["dense_fs_bytes"], res["dense_fs_save_s"]
    lines.append("\ndense series: every layer trains, saved every 10 steps, 5 saves (on disk after the series; "
                 "median save; cold load of the last)")
    lines.append(f"{'':28}{'MB':>8}{'x fs':>7}{'save s':>9}{'x fs':>7}{'load s':>9}")
    lines.append(f"{'FileSystemWriter':28}{fs_b / MB:8.1f}{1:7.2f}{fs_s:9.2f}{1:7.2f}{'':>9}")
    for label, name in (("CasWriter", "cas"), ("CasWriter delta=True", "cas_delta")):
        b, t = res[f"dense_{name}_bytes"], res[f"dense_{name}_save_s"]
        lines.append(f"{label:28}{b / MB:8.1f}{b / fs_b:7.2f}{t:9.2f}{t / fs_s:7.2f}{res[f'dense_{name}_load_s']:9.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "dcp.json"))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3, help="rounds; the table shows their medians")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank-of", dest="work", help=argparse.SUPPRESS)
    parser.add_argument("--pg", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.work:
        return rank_main(args)
    if args.quick:
        args.width, args.reps = args.width // 2, 1
    t0 = time.perf_counter()
    res = launch(args)
    res["wall_s"] = time.perf_counter() - t0
    print(table(res, args))
    print(f"(wall {res['wall_s']:.0f} s, including process start-up)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"world": WORLD, "width": args.width, "layers": args.layers, **res}, f, indent=2)


if __name__ == "__main__":
    main()
