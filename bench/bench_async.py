"""Asynchronous saves and exact training resume: how long a checkpoint blocks training.

A GPT-style transformer (~96 M parameters, fp32, AdamW, batch 4 x 64 tokens) is trained on
this machine's CPUs, and its state {"model": model, "optimizer": opt} (~1.15 GB: weights and
both AdamW moments) is checkpointed four ways:

  cas save_async      the call returns once the state is copied into the store's reusable host
                      staging buffer; hashing, encoding, writing and the commit run in the
                      background (blocked = the call; completion = until its future is done)
  cas save            synchronous, durable on return
  torch.save + fsync  one file per checkpoint
  memcpy floor        torch copy_ of every tensor into preallocated buffers (what staging can
                      at best cost)

Two measurements, in one run:
  A. per checkpoint with training paused (one AdamW step between checkpoints so that every
     save holds new bytes): blocked time and completion time, min and median of --reps;
  B. training for K steps with a checkpoint every N steps, per method, against the same loop
     without checkpoints. The methods run in interleaved rounds (none, async, save, torch.save,
     none, ...) so that other processes' load falls on all alike; each method's fastest round
     counts. The wall time includes waiting at the end for a save still in the background.
Then an exact-resume check: a save_async whose state training changes at once is restored into
a fresh model and optimizer, and one more step must give the same loss and weights bit for bit.

Every method is warmed up once, untimed (the first save_async allocates the staging buffer;
the first touch of fresh memory is slow on this VM). Stores and files go to a fresh folder
under /tmp, deleted at the end.

Run from the repository root (full: about 5-8 minutes, longer while other processes load the CPUs;
~5 GiB RAM, ~12 GB of /tmp):

    .venv/bin/python bench/bench_async.py                # JSON to bench/out/async.json
    .venv/bin/python bench/bench_async.py --quick        # small model, few steps (~30 s)
    .venv/bin/python bench/bench_async.py --out x.json

bench_delta.py imports the model and trainer defined here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch
import torch.nn as nn

import cas

GB = 1e9
TARGET_ASYNC_VS_TORCH = 0.10  # the issue: blocked time of save_async <= 1/10 of torch.save's


# --- model and training (shared with bench_delta.py) -------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    ctx: int = 64
    batch: int = 4


class GPT(nn.Module):
    """Token and position embeddings, pre-norm causal transformer blocks, final norm, untied head."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.ctx, c.dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(c.dim, c.heads, 4 * c.dim, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.embed(tokens) + self.pos.weight[:n]
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def adamw(params, lr: float) -> torch.optim.AdamW:
    """AdamW as GPT training uses it: weight decay 0.1 on matrices only, betas 0.9/0.95."""
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


class Trainer:
    """A GPT and its AdamW. Batches are Zipf-distributed random tokens (rare tokens are rare, as
    in text) drawn from a generator seeded by the step number, so a resumed run sees the same data."""

    def __init__(self, c: ModelConfig, lr: float = 1e-3, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.config = c
        self.model = GPT(c)
        self.opt = adamw(self.model.parameters(), lr)
        self.step_count = 0
        self.zipf = 1.0 / torch.arange(1, c.vocab + 1, dtype=torch.float64) ** 1.1

    def batch(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 * (i + 1))
        n = self.config.batch * (self.config.ctx + 1)
        return torch.multinomial(self.zipf, n, replacement=True, generator=g).view(self.config.batch, -1)

    def step(self) -> float:
        tokens = self.batch(self.step_count)
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step_count += 1
        return loss.item()

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def log(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that `finally` blocks still delete the scratch folder."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def write_json(results: dict, path: str) -> None:
    """A benchmark's results as JSON at `path` (its folder made), and where they went."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nJSON: {path}")


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def iter_tensors(obj):
    """Every tensor in a nested dict/list state."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def state_dicts(trainer: Trainer) -> dict:
    return {"model": trainer.model.state_dict(), "optimizer": trainer.opt.state_dict()}


def state_bytes(trainer: Trainer) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(state_dicts(trainer)))


@dataclass
class Stat:
    times: list[float] = field(default_factory=list)

    @property
    def min(self) -> float:
        return min(self.times) if self.times else float("nan")

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    def summary(self) -> dict:
        return {"min_s": self.min, "median_s": self.median, "times_s": self.times}


class CpuShare:
    """The share of the machine's CPU time that other processes used since start (from
    /proc/stat and this process's own CPU time): how noisy a measurement was."""

    def __init__(self) -> None:
        self.busy0, self.total0, self.own0 = *self._machine(), self._own()

    @staticmethod
    def _machine() -> tuple[float, float]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # to steal; guest is in user
        hz = os.sysconf("SC_CLK_TCK")
        idle = ticks[3] + ticks[4]
        return (sum(ticks) - idle) / hz, sum(ticks) / hz

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def others(self) -> float:
        busy, total = self._machine()
        own = self._own() - self.own0
        return max(0.0, (busy - self.busy0 - own) / max(total - self.total0, 1e-9))


# --- settings ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    model: ModelConfig
    k: int  # training steps per loop
    every: int  # checkpoint interval in the loop
    reps: int  # paused repetitions
    rounds: int  # interleaved rounds of the training loops


FULL = Settings(ModelConfig(vocab=16384, dim=768, layers=10, heads=12), k=20, every=5, reps=5, rounds=2)
QUICK = Settings(ModelConfig(vocab=4096, dim=256, layers=2, heads=4), k=8, every=3, reps=2, rounds=2)


# --- the methods compared ----------------------------------------------------------------------
class Method:
    """One way to checkpoint. checkpoint() is what blocks the training loop and returns its
    duration; completion times (call start to durable) are appended to `completions`."""

    name = ""
    saves = True  # False for the no-checkpoint reference
    waited = 0  # checkpoints that first waited for the previous one to finish (async only)

    def __init__(self) -> None:
        self.completions: list[float] = []

    def checkpoint(self, trainer: Trainer, step: int) -> float:
        t0 = time.perf_counter()
        self.save(trainer, step)
        elapsed = time.perf_counter() - t0
        self.completions.append(elapsed)
        return elapsed

    def save(self, trainer: Trainer, step: int) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        """Wait for anything still running in the background."""

    def cleanup(self) -> None:
        """Free disk space between measurements (untimed)."""

    def close(self) -> None:
        """Release resources (untimed)."""


class NoCheckpoint(Method):
    name = "no checkpoint"
    saves = False


def cas_state(trainer: Trainer) -> dict:
    """The state as cas saves it: the stateful objects themselves."""
    return {"model": trainer.model, "optimizer": trainer.opt}


class CasMethod(Method):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.store = cas.open(path)

    def close(self) -> None:
        self.store.close()


class CasAsync(CasMethod):
    name = "cas save_async"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.last = None

    def checkpoint(self, trainer: Trainer, step: int) -> float:
        self.waited += self.last is not None and not self.last.done()
        t0 = time.perf_counter()
        self.last = self.store.save_async(cas_state(trainer), step=step)
        blocked = time.perf_counter() - t0
        self.last.add_done_callback(lambda _: self.completions.append(time.perf_counter() - t0))
        return blocked

    def drain(self) -> None:
        self.store.wait()


class CasSync(CasMethod):
    name = "cas save"

    def save(self, trainer: Trainer, step: int) -> None:
        self.store.save(cas_state(trainer), step=step)


class TorchSave(Method):
    name = "torch.save + fsync"

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        os.makedirs(folder)

    def save(self, trainer: Trainer, step: int) -> None:
        with open(os.path.join(self.folder, f"step{step}.pt"), "wb") as f:
            torch.save(state_dicts(trainer), f)
            f.flush()
            os.fsync(f.fileno())

    def cleanup(self) -> None:
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))


class MemcpyFloor(Method):
    """copy_ of every tensor of the state into buffers allocated (and touched) beforehand."""

    name = "memcpy floor (copy_ into preallocated)"

    def __init__(self, trainer: Trainer) -> None:
        super().__init__()
        self.buffers = [torch.empty_like(t) for t in iter_tensors(state_dicts(trainer))]

    def save(self, trainer: Trainer, step: int) -> None:
        for buf, t in zip(self.buffers, iter_tensors(state_dicts(trainer))):
            buf.copy_(t)


# --- measurements ------------------------------------------------------------------------------
def measure_paused(trainer: Trainer, methods: list[Method], reps: int, steps: Iterator[int]) -> dict:
    """Section A: for each rep, one AdamW step, then each method's checkpoint with training
    paused; the loop waits for each to complete before the next method runs."""
    blocked = {m.name: Stat() for m in methods}
    for m in methods:
        m.completions.clear()
    cpu = CpuShare()
    for _ in range(reps):
        trainer.step()
        for m in methods:
            blocked[m.name].times.append(m.checkpoint(trainer, next(steps)))
            m.drain()
    others = cpu.others()
    return {m.name: {"blocked": blocked[m.name].summary(), "completion": Stat(list(m.completions)).summary(),
                     "others_cpu_share": others} for m in methods}


def train_loop(trainer: Trainer, method: Method, k: int, every: int, steps: Iterator[int]) -> dict:
    """Section B: K training steps with a checkpoint after every `every` steps (not after the
    last); the wall time includes waiting for a save still running when the loop ends."""
    method.completions.clear()
    waited = method.waited
    blocked = Stat()
    cpu = CpuShare()
    t0 = time.perf_counter()
    for i in range(1, k + 1):
        trainer.step()
        if method.saves and i % every == 0 and i < k:
            blocked.times.append(method.checkpoint(trainer, next(steps)))
    t_loop = time.perf_counter()
    method.drain()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tail_wait_s": wall - (t_loop - t0), "checkpoints": len(blocked.times),
            "blocked": blocked.summary(), "completion": Stat(list(method.completions)).summary(),
            "others_cpu_share": cpu.others(), "waited_for_previous": method.waited - waited}


def train_loops(trainer: Trainer, methods: list[Method], s: Settings, steps: Iterator[int]) -> dict:
    """Section B for every method, in `rounds` interleaved rounds (so that other processes'
    load falls on all of them alike); per method, the round with the least wall time."""
    runs: dict[str, list] = {m.name: [] for m in methods}
    for r in range(s.rounds):
        for m in methods:
            log(f"B. round {r + 1}/{s.rounds}: {m.name}")
            runs[m.name].append(train_loop(trainer, m, s.k, s.every, steps))
            m.cleanup()
    best = {name: min(rs, key=lambda x: x["wall_s"]) for name, rs in runs.items()}
    return {name: {**best[name], "wall_all_s": [x["wall_s"] for x in rs]} for name, rs in runs.items()}


def check_resume(trainer: Trainer, path: str, steps: Iterator[int]) -> dict:
    """save_async, then change the state at once by training one step; restore the checkpoint
    into a fresh model and optimizer and take the same step: loss and weights must match bit
    for bit."""
    with cas.open(path) as store:
        step = next(steps)
        future = store.save_async({**cas_state(trainer), "step": trainer.step_count}, step=step)
        loss = trainer.step()
        future.result()
        fresh = Trainer(trainer.config, seed=1)
        fresh.step()  # gives the fresh optimizer its state tensors, which restore then fills in place
        loaded = store.restore({"model": fresh.model, "optimizer": fresh.opt}, step=step)
    fresh.step_count = loaded["step"]
    resumed_loss = fresh.step()
    same = all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) for a, b in
               zip(iter_tensors(state_dicts(trainer)), iter_tensors(state_dicts(fresh))))
    return {"loss": loss, "resumed_loss": resumed_loss, "bit_identical": same and loss == resumed_loss}


# --- report ------------------------------------------------------------------------------------
def ms(t: float) -> str:
    return f"{t * 1e3:7.1f} ms"


def print_paused(paused: dict, nbytes: int) -> None:
    others = next(iter(paused.values()))["others_cpu_share"]
    print(f"\nA. one checkpoint, training paused (min / median; other processes used {others * 100:.0f}% of the CPU)")
    print(f"  {'method':42} {'blocked':>21} {'to durable':>21} {'GB/s blocked':>13}")
    for name, r in paused.items():
        b, c = r["blocked"], r["completion"]
        done = f"{ms(c['min_s'])} / {ms(c['median_s'])}" if c["times_s"] else ""
        print(f"  {name:42} {ms(b['min_s'])} / {ms(b['median_s'])}  {done:>21} {nbytes / b['min_s'] / GB:13.2f}")


def print_loops(loops: dict, ref: str, s: Settings) -> None:
    print(f"\nB. {s.k} training steps, a checkpoint every {s.every} steps; best of {s.rounds} interleaved rounds "
          "(per checkpoint: median)")
    print(f"  {'method':20} {'wall':>8} {'all rounds':>14} {'s/step':>7} {'slowdown':>9} {'ckpts':>5} "
          f"{'blocked':>11} {'to durable':>11} {'tail wait':>10} {'others':>6}")
    base = loops[ref]["wall_s"]
    for name, r in loops.items():
        slow = (r["wall_s"] / base - 1) * 100
        rounds = "/".join(f"{w:.1f}" for w in r["wall_all_s"])
        done = ms(r["completion"]["median_s"]) if r["completion"]["times_s"] else ""
        blocked = ms(r["blocked"]["median_s"]) if r["blocked"]["times_s"] else ""
        print(f"  {name:20} {r['wall_s']:7.2f}s {rounds:>14} {r['wall_s'] / s.k:7.3f} {slow:+8.1f}% "
              f"{r['checkpoints']:5d} {blocked:>11} {done:>11} {r['tail_wait_s'] * 1e3:8.1f}ms "
              f"{r['others_cpu_share'] * 100:5.0f}%")
    print("  others = CPU share of the machine used by other processes during that round")
    waits = {name: r["waited_for_previous"] for name, r in loops.items() if r["waited_for_previous"]}
    if waits:
        print(f"  checkpoints that waited for the previous save to finish (max_inflight=1): {waits}")


def ratios(paused: dict, loops: dict) -> dict:
    blocked = {name: r["blocked"]["min_s"] for name, r in paused.items()}
    in_loop = {name: r["blocked"]["median_s"] for name, r in loops.items() if r["blocked"]["times_s"]}
    a, s, t, f = CasAsync.name, CasSync.name, TorchSave.name, MemcpyFloor.name
    return {
        "async_blocked_vs_torch_save": blocked[a] / blocked[t],
        "async_blocked_vs_memcpy_floor": blocked[a] / blocked[f],
        "async_blocked_minus_floor_s": blocked[a] - blocked[f],
        "async_blocked_in_loop_vs_torch_save_in_loop": in_loop[a] / in_loop[t],
        "cas_save_vs_torch_save": blocked[s] / blocked[t],
        "async_to_durable_vs_cas_save": paused[a]["completion"]["min_s"] / blocked[s],
    }


def print_ratios(r: dict) -> None:
    met = r["async_blocked_vs_torch_save"] <= TARGET_ASYNC_VS_TORCH
    print("\nratios (paused, min):")
    print(f"  save_async blocked / torch.save+fsync   {r['async_blocked_vs_torch_save']:.3f}   "
          f"target <= {TARGET_ASYNC_VS_TORCH:.2f}: {'MET' if met else 'NOT MET'}")
    print(f"  save_async blocked / memcpy floor       {r['async_blocked_vs_memcpy_floor']:.2f}x "
          f"(+{r['async_blocked_minus_floor_s'] * 1e3:.1f} ms)")
    print(f"  same, in the training loop (median)     {r['async_blocked_in_loop_vs_torch_save_in_loop']:.3f}"
          "   (save_async / torch.save)")
    print(f"  cas save / torch.save+fsync             {r['cas_save_vs_torch_save']:.2f}")
    print(f"  save_async to durable / cas save        {r['async_to_durable_vs_cas_save']:.2f}")


# --- main --------------------------------------------------------------------------------------
def run(s: Settings, scratch: str) -> dict:
    trainer = Trainer(s.model)
    log(f"model {trainer.params() / 1e6:.1f} M params; warming up")
    for _ in range(2):
        trainer.step()
    nbytes = state_bytes(trainer)
    steps = itertools.count(1)  # every checkpoint of every store gets its own step
    none = NoCheckpoint()
    methods = [MemcpyFloor(trainer), CasAsync(os.path.join(scratch, "async")),
               CasSync(os.path.join(scratch, "sync")), TorchSave(os.path.join(scratch, "torch"))]
    for m in methods:  # untimed warm-up: staging buffer, encoder scratch, first files
        m.checkpoint(trainer, next(steps))
        m.drain()
    print(f"state: {nbytes / GB:.3f} GB in {sum(1 for _ in iter_tensors(state_dicts(trainer)))} tensors "
          f"(GPT {trainer.params() / 1e6:.1f} M params, {asdict(s.model)}, fp32 + AdamW moments)")

    log("A. paused checkpoints")
    paused = measure_paused(trainer, methods, s.reps, steps)
    for m in methods:
        m.cleanup()
    loops = train_loops(trainer, [none] + methods[1:], s, steps)
    for m in methods:
        m.close()
    log("exact-resume check")
    resume = check_resume(trainer, os.path.join(scratch, "resume"), steps)
    return {"state_bytes": nbytes, "params": trainer.params(), "paused": paused, "loops": loops,
            "loop_reference": none.name, "resume": resume}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps (smoke test)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "async.json"))
    args = parser.parse_args()
    s = QUICK if args.quick else FULL
    exit_on_sigterm()
    started, load_start = time.perf_counter(), load_avg()
    print(f"cas async benchmark{' (--quick)' if args.quick else ''}; load average at start {load_start} "
          f"({os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads)")
    scratch = tempfile.mkdtemp(prefix="cas-bench-async-", dir="/tmp")
    try:
        report = run(s, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_paused(report["paused"], report["state_bytes"])
    print_loops(report["loops"], report["loop_reference"], s)
    report["ratios"] = ratios(report["paused"], report["loops"])
    print_ratios(report["ratios"])
    r = report["resume"]
    print(f"\nexact resume after save_async + immediate state change: loss {r['loss']:.6f} -> resumed "
          f"{r['resumed_loss']:.6f}; bit-identical: {r['bit_identical']}")
    report.update(settings=asdict(s), quick=args.quick, wall_s=time.perf_counter() - started,
                  load_avg_start=load_start, load_avg_end=load_avg(), target_async_vs_torch=TARGET_ASYNC_VS_TORCH)
    print(f"wall {report['wall_s']:.0f} s; load average start {load_start}, end {report['load_avg_end']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
