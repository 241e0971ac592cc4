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
    with cas.open(path, chunk_size=64 << 10, pack_max=4096, delta=False) as store:
        store.save(state_of([int(s) for s in seeds.split("+")]), step=step)


def nudged(seed: int) -> torch.Tensor:
    """tensor(seed) moved by a few units in the last place: a delta store codes it as a delta."""
    return tensor(seed) * (1 + 1e-6)


def save_streamed(path: str, step: int, seeds: str) -> None:
    """Save with the default packing (every object streamed into packs), a pack closed past
    256 KiB so that one save writes several."""
    with cas.open(path, chunk_size=64 << 10) as store:
        store.objects.stream_target = 256 << 10
        store.save(state_of([int(s) for s in seeds.split("+")]), step=step)


def save_nudged(path: str, step: int, seed: int) -> None:
    """Save {"t": nudged(seed)} without deltas: whole objects, another encoding of the same keys."""
    with cas.open(path, chunk_size=64 << 10, pack_max=4096, delta=False) as store:
        store.save({"t": nudged(seed)}, step=step)


def trajectory(i: int) -> torch.Tensor:
    """State i of a weight moving steadily (momentum): a delta store codes state 2 on as
    `linear` deltas of the two before."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 1024, generator=g)
    velocity = 1e-3 * torch.randn(64, 1024, generator=g)
    for _ in range(i + 1):
        velocity = 0.95 * velocity + 5e-5 * torch.randn(64, 1024, generator=g)
        w = w + velocity
    return w


def save_packed(path: str, step: int, i: int) -> None:
    """Save {"w": trajectory(i)} whole with every object in a pack (pack_max huge)."""
    with cas.open(path, chunk_size=256 << 10, pack_max=1 << 30, delta=False) as store:
        store.save({"w": trajectory(i)}, step=step)


def save_async(path: str, step: int, seeds: str) -> None:
    with cas.open(path, chunk_size=64 << 10, pack_max=4096, delta=False) as store:
        store.save_async(state_of([int(s) for s in seeds.split("+")]), step=step).result()


def gc(path: str, keep_last: str = "") -> None:
    with cas.open(path, chunk_size=64 << 10, delta=False) as store:
        report = store.gc(keep_last=int(keep_last)) if keep_last else store.gc()
        print(report.objects_swept, report.freed_bytes)


def save_loop(path: str, first: int, count: int) -> None:
    """Save `count` steps, each reusing tensors of earlier steps (seeds overlap)."""
    with cas.open(path, chunk_size=64 << 10, pack_max=4096, delta=False) as store:
        print("ready", flush=True)  # past interpreter start-up and the open: the saves begin
        for step in range(first, first + count):
            store.save(state_of([step % 5, step % 7 + 10, step]), step=step)


def load_loop(path: str, seconds: str) -> None:
    """Load the latest checkpoint over and over while another process commits new ones; every
    load must be a whole checkpoint, bit for bit."""
    import time

    deadline = time.monotonic() + float(seconds)
    loads = 0
    with cas.open(path, create=False, delta=False) as store:
        while time.monotonic() < deadline:
            ck = store.latest()
            if ck is None:
                continue
            loaded = store.load(ck.step)
            for k, t in state_of([ck.step % 5, ck.step % 7 + 10, ck.step]).items():
                if not torch.equal(loaded[k], t):
                    raise SystemExit(f"step {ck.step} tensor {k} differs")
            loads += 1
    print(loads)


def load_all(path: str) -> None:
    """Open (read-only when the files say so) and load every checkpoint."""
    with cas.open(path, create=False, delta=False) as store:
        for ck in store.checkpoints():
            store.load(ck.step)
        print(len(store.checkpoints()), store.readonly)


def open_only(path: str) -> None:
    """Open the store (rebuilding its cache if it must) and print its steps."""
    with cas.open(path, create=False, delta=False) as store:
        print(",".join(str(ck.step) for ck in store.checkpoints()))


def hold_lease(path: str, purpose: str) -> None:
    """Open a write session (a barrier one when the purpose says so) and wait to be killed."""
    import time
    with cas.open(path, create=False, delta=False) as store:
        session = store.objects.session(purpose)
        print("held", flush=True)
        time.sleep(600)
        session.abort()


def drifting(step: int) -> dict:
    """State `step` of a series whose weight drifts a little each step (recoded as deltas)."""
    w = tensor(11)
    for i in range(step):
        w = w + 1e-4 * tensor(100 + i)
    return {"w": w, "b": tensor(50 + step, rows=2)}


def smooth(step: int) -> dict:
    """State `step` of a series whose weight moves steadily, plus a little noise (older chunks
    become `linear` deltas extrapolating backward)."""
    w = tensor(11) + step * 1e-3 * tensor(12) + 1e-6 * tensor(200 + step)
    return {"w": w, "b": tensor(50 + step, rows=2)}


def comeback(step: int) -> dict:
    """smooth(0..5), then smooth(2), smooth(3), ...: a run resumed from step 2 saving again
    what it saved before (steps 6 on hold content its recodes made deltas)."""
    return smooth(step if step < 6 else step - 4)


def recode_series(path: str, steps: str, series: str = "drifting") -> None:
    """Save drifting(0..steps-1) (or smooth, or comeback) with the default (reverse) deltas, each
    recode finished before the next save, so a fault point in a recode stops the series at a
    known step."""
    state = {"drifting": drifting, "smooth": smooth, "comeback": comeback}[series]
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as store:
        for step in range(int(steps)):
            store.save(state(step), step=step)
            store.wait()


def repair(path: str) -> None:
    from cas.store.repair import repair as run
    print(run(path).checkpoints)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    fn = {"save": save, "save_streamed": save_streamed, "save_async": save_async, "save_nudged": save_nudged, "save_packed": save_packed, "gc": gc,
          "save_loop": save_loop, "load_loop": load_loop, "load_all": load_all, "open_only": open_only,
          "hold_lease": hold_lease, "repair": repair, "recode_series": recode_series}[cmd]
    fn(*[int(a) if a.isdigit() and fn in (save, save_streamed, save_async, save_nudged, save_packed, save_loop) else a
         for a in args])
