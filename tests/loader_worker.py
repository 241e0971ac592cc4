"""A real training run fed by a DataLoader with worker processes, which can stop at a checkpoint,
be SIGKILLed and resume in another process.

    python loader_worker.py full   STORE N LOADER      train N steps, no checkpoint
    python loader_worker.py first  STORE N K LOADER    train K steps, save, print the losses on one
                                                       line, then keep training until killed
    python loader_worker.py second STORE N LOADER      restore the latest checkpoint, train to N
LOADER: `stateful` (torchdata's StatefulDataLoader, saved as the loader) or `plain` (torch's
DataLoader, the sampler saved: a save refuses, and the error is printed as JSON, exit 3).
Both use two workers and cas.ResumableRandomSampler. The model, optimizer, schedule and training
step are tests/resume_worker.py's. Prints JSON: the losses (as float.hex) from the first step this
process ran, and blake3 digests of the final parameters and optimizer state.
"""

from __future__ import annotations

import json
import sys

import torch

import cas
from resume_worker import batches, build, digest, train

WORKERS, BATCH = 2, 8


def make_loader(kind: str, dataset, sampler):
    """The loader under test and the object to save for its position."""
    common = dict(batch_size=BATCH, sampler=sampler, num_workers=WORKERS, generator=torch.Generator().manual_seed(0))
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(dataset, **common)
        return loader, loader
    return torch.utils.data.DataLoader(dataset, **common), sampler


def main() -> None:
    mode, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kind = sys.argv[-1]
    model, opt, sched, scaler, sampler, plain = build()
    loader, position = make_loader(kind, plain.dataset, sampler)
    stream = batches(loader)
    losses: list[str] = []
    if mode == "full":
        losses = train(model, opt, sched, scaler, stream, n)
    elif mode == "first":
        k = int(sys.argv[4])
        losses = train(model, opt, sched, scaler, stream, k)
        state = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "loader": position,
                 "rng": cas.RNGState(), "step": k}
        with cas.open(path) as store:
            try:
                store.save(state, step=k)
            except cas.CasError as exc:
                print(json.dumps({"error": str(exc), "type": type(exc).__name__,
                                  "checkpoints": [ck.step for ck in store.checkpoints()]}), flush=True)
                sys.exit(3)
        print(json.dumps({"losses": losses}), flush=True)
        while True:  # the workers prefetch on; the test SIGKILLs this process group here
            train(model, opt, sched, scaler, stream, 1)
    else:
        with cas.open(path) as store:
            loaded = store.restore({"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
                                    "loader": position, "rng": cas.RNGState()})
        stream = batches(loader)
        losses = train(model, opt, sched, scaler, stream, n - loaded["step"])
    print(json.dumps({"losses": losses, "digest": digest(model, opt)}), flush=True)


if __name__ == "__main__":
    main()
