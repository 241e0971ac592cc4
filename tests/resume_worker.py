"""A real training run that can stop at a checkpoint and resume in another process.

    python resume_worker.py full   STORE N           train N steps, no checkpoint
    python resume_worker.py first  STORE N K MODE    train K steps, save (MODE sync|async), keep
                                                     training (async: the model changes while the
                                                     save runs) until N, then exit
    python resume_worker.py second STORE N           restore the latest checkpoint, train to N
Prints JSON: the losses (as float.hex) from the first step this process ran, and blake3 digests
of the final parameters and optimizer state.
"""

from __future__ import annotations

import json
import math
import sys

import blake3
import torch

import cas
from cas import ResumableRandomSampler

torch.set_num_threads(1)


def build():
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(96, 20, generator=g), torch.randint(0, 5, (96,), generator=g))
    sampler = ResumableRandomSampler(len(data), seed=3)
    # A DataLoader draws a seed from the global RNG each time an iterator starts, unless it has a
    # generator of its own: with one, a resumed run's fresh iterator does not shift dropout's RNG.
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler, num_workers=0,
                                         generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(64, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    warmup, total = 5, 40
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / total)))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return model, opt, sched, scaler, sampler, loader


def batches(loader):
    while True:  # epochs roll over; the sampler carries the position
        yield from loader


def train(model, opt, sched, scaler, stream, steps: int) -> list[str]:
    losses = []
    model.train()
    for _ in range(steps):
        x, y = next(stream)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item().hex())
    return losses


def digest(model, opt) -> dict:
    out = {}
    for name, t in model.state_dict().items():
        out[f"model.{name}"] = blake3.blake3(t.contiguous().numpy().tobytes()).hexdigest()
    for pid, st in opt.state_dict()["state"].items():
        for name, t in st.items():
            out[f"opt.{pid}.{name}"] = blake3.blake3(t.reshape(-1).numpy().tobytes()).hexdigest()
    return out


def main() -> None:
    mode, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, opt, sched, scaler, sampler, loader = build()
    stream = batches(loader)
    losses: list[str] = []
    if mode == "full":
        losses = train(model, opt, sched, scaler, stream, n)
    elif mode == "first":
        k, how = int(sys.argv[4]), sys.argv[5]
        losses = train(model, opt, sched, scaler, stream, k)
        state = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "loader": sampler,
                 "rng": cas.RNGState(), "step": k}
        with cas.open(path) as store:
            if how == "async":
                future = store.save_async(state, step=k)
                train(model, opt, sched, scaler, stream, n - k)  # the state changes under the save
                future.result()
            else:
                store.save(state, step=k)
    else:
        with cas.open(path) as store:
            loaded = store.restore({"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
                                    "loader": sampler, "rng": cas.RNGState()})
        stream = batches(loader)
        losses = train(model, opt, sched, scaler, stream, n - loaded["step"])
    print(json.dumps({"losses": losses, "digest": digest(model, opt)}))


if __name__ == "__main__":
    main()
