"""What only a GPU can show: CUDA tensors through save, save_async and restore, on a real GPU.

Run on a machine with CUDA (no test needs one; CI has none):

    python bench/gpu_check.py [--out gpu.json] [--dim 1024 --layers 8]

1. Round trip: CUDA tensors of every dtype family (fp32, bf16, fp16, float8, int64, bool,
   complex64), a transposed view, a conjugate view, a slice with a storage offset and an empty
   tensor are saved and loaded onto "cuda" and onto the CPU; every byte must match.
2. save_async of a GPT and its AdamW on the GPU: the call's blocked time against torch.save +
   fsync of the same state (which copies it to the host too), min / median of --reps; after
   each call the optimizer steps at once (the GPU tensors change in place) and the checkpoint
   must hold the bytes as of the call.
3. Exact resume on the GPU: a model with dropout (CUDA's generator) trained with
   deterministic algorithms; a checkpoint with cas.RNGState(), more steps, then restore into a
   fresh model and optimizer on the GPU: the same losses and weights, bit for bit.

Prints a line per check and writes the figures as JSON; exits 1 if a check failed.
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

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before torch starts it

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cas  # noqa: E402
from bench_async import GPT, ModelConfig, adamw  # noqa: E402

FAILED: list[str] = []
DEVICE = "cuda"  # --device cpu: a smoke run of this script on a machine without a GPU


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def check(ok: bool, what: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILED.append(what)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality whatever the dtype (NaN, -0.0, float8, conjugate views)."""
    a, b = a.detach().cpu().resolve_conj().resolve_neg(), b.detach().cpu().resolve_conj().resolve_neg()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous().view(-1), b.contiguous().view(-1)
    if a.numel() == 0:
        return True
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def flat(state) -> dict:
    """Every tensor of a nested state, by path, copied to the host."""
    out = {}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj.detach().cpu().clone()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
    walk("", state)
    return out


def round_trip(root: str) -> dict:
    print("1. CUDA tensors round trip", flush=True)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    base = torch.randn(257, 129, device=DEVICE, generator=g)
    base[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    state = {
        "fp32": base,
        "bf16": base.to(torch.bfloat16),
        "fp16": base.to(torch.float16),
        "f8": base.to(torch.float8_e4m3fn),
        "i64": torch.randint(-2**62, 2**62, (1000,), device=DEVICE, generator=g),
        "bool": base > 0,
        "c64": torch.complex(base, -base),
        "transposed": base.t(),
        "conj": torch.complex(base, base).conj(),
        "offset": base[100:, 3:70],
        "empty": torch.empty(0, 5, device=DEVICE),
    }
    with cas.open(os.path.join(root, "rt")) as store:
        store.save(state, step=1)
        for device in (DEVICE, "cpu"):
            loaded = store.load(1, device=device)
            for name, t in state.items():
                got = loaded[name]
                check(got.device.type == device and same_bytes(got, t), f"{name} {t.dtype} onto {device}")
    return {}


def async_saves(root: str, dim: int, layers: int, reps: int) -> dict:
    print(f"2. save_async of a GPT on the GPU (dim {dim}, {layers} layers)", flush=True)
    torch.manual_seed(0)
    c = ModelConfig(vocab=32000, dim=dim, layers=layers, heads=max(1, dim // 64), ctx=128, batch=8)
    model = GPT(c).to(DEVICE)
    opt = adamw(model.parameters(), 1e-3)

    def step(i: int) -> None:
        tokens = torch.randint(0, c.vocab, (c.batch, c.ctx + 1), device=DEVICE,
                               generator=torch.Generator(device=DEVICE).manual_seed(i))
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step(0)
    nbytes = sum(t.numel() * t.element_size() for t in flat({"m": model.state_dict(), "o": opt.state_dict()}).values())
    blocked, completed, torch_save = [], [], []
    with cas.open(os.path.join(root, "async")) as store:
        for i in range(1, reps + 2):  # the first round is a warm-up (the staging buffer is allocated)
            sync()
            expected = flat({"model": model.state_dict(), "optimizer": opt.state_dict()})
            t0 = time.perf_counter()
            fut = store.save_async({"model": model, "optimizer": opt}, step=i)
            t1 = time.perf_counter()
            step(i)  # the GPU tensors change at once, in place
            step(i + 1000)
            sync()
            fut.result()
            t2 = time.perf_counter()
            got = flat(store.load(i))
            check(got.keys() == expected.keys() and all(same_bytes(got[k], expected[k]) for k in expected),
                  f"save_async {i}: the checkpoint holds the state as of the call ({len(expected)} tensors)")
            path = os.path.join(root, f"torch{i}.pt")
            sync()
            t3 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            t4 = time.perf_counter()
            os.unlink(path)
            if i > 1:
                blocked.append(t1 - t0)
                completed.append(t2 - t0)
                torch_save.append(t4 - t3)
    res = {"state_bytes": nbytes, "blocked_s": blocked, "completed_s": completed, "torch_save_fsync_s": torch_save,
           "blocked_vs_torch_min": min(blocked) / min(torch_save),
           "blocked_vs_torch_median": statistics.median(blocked) / statistics.median(torch_save)}
    print(f"  state {nbytes / 1e9:.2f} GB: save_async blocked {min(blocked) * 1e3:.0f} / "
          f"{statistics.median(blocked) * 1e3:.0f} ms, done after {min(completed):.2f} / "
          f"{statistics.median(completed):.2f} s; torch.save + fsync {min(torch_save):.2f} / "
          f"{statistics.median(torch_save):.2f} s; blocked / torch.save {res['blocked_vs_torch_min']:.3f}x "
          f"({res['blocked_vs_torch_median']:.3f}x)", flush=True)
    return res


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Dropout(0.3), nn.Linear(512, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def exact_resume(root: str) -> dict:
    print("3. exact resume on the GPU (dropout draws from CUDA's generator)", flush=True)
    torch.use_deterministic_algorithms(True)

    def make():
        model = DropoutNet().to(DEVICE)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(model, opt, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            x = torch.randn(64, 256, device=DEVICE)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    torch.manual_seed(1)
    model, opt = make()
    train(model, opt, 5)
    with cas.open(os.path.join(root, "resume")) as store:
        store.save({"model": model, "optimizer": opt, "rng": cas.RNGState()}, step=5)
        after = train(model, opt, 5)
        final = flat(model.state_dict())
        torch.manual_seed(999)  # other generator states, which the restore must replace
        if DEVICE == "cuda":
            torch.cuda.manual_seed(999)
        model2, opt2 = make()
        store.restore({"model": model2, "optimizer": opt2, "rng": cas.RNGState()})
        check(all(p.device.type == DEVICE for p in model2.parameters()), "restored into the model's GPU tensors")
        again = train(model2, opt2, 5)
    check(again == after, f"the losses after a resume equal the run's, bit for bit ({after[-1]!r})")
    got = flat(model2.state_dict())
    check(all(same_bytes(got[k], final[k]) for k in final), "the weights after a resume equal the run's")
    torch.use_deterministic_algorithms(False)
    return {"losses": after, "resumed_losses": again}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here")
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "the CPU"
    print(f"torch {torch.__version__} on {name}; {os.cpu_count()} CPUs; "
          f"cas from {os.path.dirname(cas.__file__)}", flush=True)
    root = tempfile.mkdtemp(prefix="cas-gpu-")
    try:
        result = {"round_trip": round_trip(root), "async": async_saves(root, args.dim, args.layers, args.reps),
                  "resume": exact_resume(root)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["failed"] = FAILED
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{len(FAILED)} check(s) failed" if FAILED else "all checks passed")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
