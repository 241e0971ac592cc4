"""Exact resume with a DataLoader that has worker processes: torchdata's StatefulDataLoader over
cas.ResumableRandomSampler, num_workers=2, shuffled, SIGKILLed after a save, resumed in a fresh
process, equals an uninterrupted run bit for bit; a plain DataLoader with workers, whose sampler
runs batches ahead of the loop, is refused at save time with what to use instead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import cas

WORKER = os.path.join(os.path.dirname(__file__), "loader_worker.py")
N, K = 30, 17  # K is mid-epoch (12 batches an epoch), in the second epoch


def start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out)


def test_stateful_loader_with_workers_resumes_bit_for_bit_after_sigkill(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    full = start("full", tmp_path / "unused", N, "stateful")  # alongside: they share nothing
    store = tmp_path / "store"
    first = start("first", store, N, K, "stateful")
    try:
        line = first.stdout.readline()  # printed once the save has returned; training goes on
        assert line, first.stderr.read()
        os.killpg(first.pid, signal.SIGKILL)  # the trainer and its two workers, mid-training
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == -signal.SIGKILL
    uninterrupted = result(full)
    assert json.loads(line)["losses"] == uninterrupted["losses"][:K]
    second = result(start("second", store, N, "stateful"))
    assert json.loads(line)["losses"] + second["losses"] == uninterrupted["losses"]
    assert second["digest"] == uninterrupted["digest"]
    with cas.open(store, readonly=True) as s:  # the loader's record of what the loop took: K batches
        taken = s.load(K, keys=["loader"])["loader"]["_snapshot"]["_main_snapshot"]["_sampler_iter_state"]
    assert taken["sampler_state"]["epoch"] == 1 and taken["sampler_state"]["position"] == (K - 12) * 8


def test_plain_loader_with_workers_refuses_to_save_the_sampler(tmp_path):
    proc = start("first", tmp_path / "store", N, K, "plain")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err
    refused = json.loads(out)
    assert refused["type"] == "UnresumableStateError" and refused["checkpoints"] == []
    message = refused["error"]
    assert message.startswith("state entry 'loader': ResumableRandomSampler")
    assert "num_workers=2" in message and "StatefulDataLoader" in message and "num_workers=0" in message
    # 17 batches of 8 taken, 4 more drawn by the workers: 5 batches into epoch 1, 9 drawn
    assert "(epoch 1, 72 of 96)" in message


def test_sampler_without_workers_saves_and_a_restore_clears_the_refusal(tmp_path):
    """num_workers=0 draws only what the loop takes: the position is exact and saved as is."""
    data = torch.utils.data.TensorDataset(torch.arange(20.0))
    sampler = cas.ResumableRandomSampler(20, seed=5)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, num_workers=0)
    it = iter(loader)
    taken = [next(it)[0] for _ in range(3)]
    with cas.open(tmp_path / "store") as store:
        store.save({"loader": sampler}, step=0)
        assert store.load(0)["loader"]["position"] == 12
        fresh = cas.ResumableRandomSampler(20, seed=5)
        store.restore({"loader": fresh})
    rest = list(torch.utils.data.DataLoader(data, batch_size=4, sampler=fresh))
    order = torch.randperm(20, generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.cat(taken + [b[0] for b in rest]), order.float())


# --- a resume that meets a damaged newest checkpoint ------------------------------------------
def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01
        f.seek(0)
        f.write(data)


def _weight_file(store, step: int) -> str:
    key = next(t for t in store.tensors(step) if t["path"] == "model.0.weight")["chunks"][0]
    return store.objects.files.path(key)


def _trained_store(path):
    """Three checkpoints of a real run (AdamW moves every weight, so each has chunks of its own)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # the weights in files of their own, each checkpoint's its own (with deltas on, an older one's
    # chunks are deltas of the newer one's, so damage to the newest reaches those: not this test's point)
    store = cas.open(path, chunk_size=64 << 10, pack_max=16 << 10, delta=False)
    for step in (1, 2, 3):
        loss = model(torch.randn(16, 128)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        store.save({"model": model, "optimizer": opt, "step": step}, step=step)
    return store


def _fresh():
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_restore_with_fallback_restores_the_newest_checkpoint_that_verifies(tmp_path):
    with _trained_store(tmp_path / "store") as store:
        _flip(_weight_file(store, 3))
        model, opt = _fresh()
        with pytest.raises(cas.CorruptionError, match="checkpoint step 3"):  # asked for nothing else
            store.restore({"model": model, "optimizer": opt})
        model, opt = _fresh()
        with pytest.warns(RuntimeWarning, match=r"using checkpoint step 2 .* skipped 1 damaged .*step 3: "):
            restored = store.restore({"model": model, "optimizer": opt}, fallback=True)
        assert restored["step"] == 2 and restored.checkpoint.step == 2 and restored["model"] is model
        [skipped] = restored.skipped
        assert skipped.step == 3 and skipped.id == store.get(3).id and "does not match its hash" in skipped.reason
        expected = store.load(2)
        for name, t in model.state_dict().items():
            assert torch.equal(t, expected["model"][name]), name
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])
        again = store.restore({"model": _fresh()[0]}, step=2)
        assert again.checkpoint.step == 2 and again.skipped == []
        _flip(_weight_file(store, 2))
        _flip(_weight_file(store, 1))
        model, opt = _fresh()
        before = {k: t.clone() for k, t in model.state_dict().items()}
        with pytest.raises(cas.CorruptionError, match="no checkpoint of .* can be read whole"):
            store.restore({"model": model, "optimizer": opt}, fallback=True)
        for name, t in model.state_dict().items():  # verified before restoring: no chunk of any landed
            assert torch.equal(t, before[name]), name
        assert opt.state_dict()["state"] == {}


def test_load_with_fallback_skips_every_damaged_one_and_refuses_when_none_is_whole(tmp_path):
    with _trained_store(tmp_path / "store") as store:
        _flip(_weight_file(store, 3))
        os.unlink(_weight_file(store, 2))  # a missing object is damage too
        with pytest.warns(RuntimeWarning, match="using checkpoint step 1 "):
            state = store.load(fallback=True)
        assert state["step"] == 1 and [s.step for s in state.skipped] == [3, 2]
        assert "missing" in state.skipped[1].reason
        part = store.load(fallback=True, keys=["step"])  # keys=: only those entries need be whole
        assert part == {"step": 3} and part.skipped == [] and part.checkpoint.step == 3
        _flip(_weight_file(store, 1))
        with pytest.raises(cas.CorruptionError, match=r"no checkpoint of .* can be read whole.*step 3.*step 2.*step 1"):
            store.load(fallback=True)
