"""A store written by one process is read by another: nothing lives only in memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from helpers import tensor_bytes, tiny_model, train_tiny

import cas


def test_reopen_in_a_new_process_loads_bit_for_bit(store_path):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_tiny(model, opt, 5, seed=0)
    with cas.open(store_path) as s:
        ck = s.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step=5)
    digest = {k: tensor_bytes(v).hex()[:64] + str(len(tensor_bytes(v))) for k, v in model.state_dict().items()}
    script = textwrap.dedent(f"""
        import cas, torch, sys
        sys.path.insert(0, {str(__import__('os').path.dirname(__file__))!r})
        from helpers import tensor_bytes
        with cas.open({str(store_path)!r}) as s:
            ck = s.latest()
            assert ck.id == {ck.id!r}, ck.id
            state = s.load()
            print(repr({{k: tensor_bytes(v).hex()[:64] + str(len(tensor_bytes(v))) for k, v in state["model"].items()}}))
            assert s.verify().ok
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert eval(out.stdout) == digest


def test_training_resumes_from_a_loaded_checkpoint_exactly(store_path):
    """Train 4 steps, save, train 4 more; a fresh model loaded from the save and trained the same
    4 steps ends bit-for-bit equal."""
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_tiny(model, opt, 4, seed=1)
    with cas.open(store_path) as s:
        s.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step=4)
        losses_a = train_tiny(model, opt, 4, seed=2)
        state = s.load(4)
    fresh = tiny_model(seed=99)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    losses_b = train_tiny(fresh, fresh_opt, 4, seed=2)
    assert losses_a == losses_b
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert tensor_bytes(a) == tensor_bytes(b), k


def test_one_store_opened_twice_in_a_process(store_path):
    a, b = cas.open(store_path), cas.open(store_path)
    a.save({"x": torch.ones(3)}, step=1)
    assert [ck.step for ck in b.checkpoints()] == [1]
    a.close()
    b.save({"x": torch.zeros(3)}, step=2)  # the shared environment outlives the first close
    assert torch.equal(b.load(1)["x"], torch.ones(3))
    b.close()
    with cas.open(store_path, readonly=True) as ro:
        assert len(ro.checkpoints()) == 2
