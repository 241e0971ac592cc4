"""save_async: a consistent snapshot, back-pressure, errors that are never lost; restore in place."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers import assert_same, outcome_of, tiny_model, train_tiny, wait_for

import cas
from cas import faults


@pytest.fixture
def injected():
    yield faults.configure
    faults.configure("")


def test_state_changed_right_after_save_async_returns_is_not_what_is_saved(store):
    big = torch.randn(512, 1024)
    original = big.clone()
    future = store.save_async({"w": big, "n": 1}, step=1)
    big.add_(1.0)  # training goes on and changes the weights at once
    ck = future.result()
    assert ck.step == 1 and ck.logical_bytes == big.numel() * 4
    assert torch.equal(store.load(1)["w"], original)


def test_back_pressure_one_save_in_flight(store):
    first = store.save_async({"w": torch.randn(256, 1024)}, step=1)
    second = store.save_async({"w": torch.randn(256, 1024)}, step=2)
    assert first.done()  # the second call waited for the first
    store.wait()
    assert second.done() and [ck.step for ck in store.checkpoints()] == [1, 2]


def test_a_save_after_an_unfinished_save_async_commits_after_it(store_path, injected, tmp_path):
    """save() went ahead of an async save still in flight: the later call committed first, so
    latest() and load() gave the earlier step, and retention then removed the checkpoint save()
    had just returned. save() now waits for the saves before it."""
    gate = tmp_path / "gate"
    injected(f"save.background_started=pause:{gate}@1")  # the async save waits before it writes anything
    with cas.open(store_path, retention=cas.Retention(keep_last=1)) as store:
        future = store.save_async({"w": torch.randn(256, 1024)}, step=1)
        wait_for(f"{gate}.reached")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            later = pool.submit(outcome_of, lambda: store.save({"w": torch.zeros(4)}, step=2))
            try:
                later.result(timeout=2)  # (it went ahead before: done while the async save waits)
            except concurrent.futures.TimeoutError:
                pass
            gate.touch()
            assert getattr(later.result(), "step", later.result()) == 2
        assert future.result().step == 1
        store.wait()
        assert [ck.step for ck in store.checkpoints()] == [2] and store.latest().step == 2
        assert torch.equal(store.load()["w"], torch.zeros(4))


def test_an_in_flight_step_cannot_be_saved_twice(store):
    store.max_inflight = 2
    store.save_async({"w": torch.randn(64, 1024)}, step=1)
    with pytest.raises(cas.CheckpointExistsError):
        store.save_async({"w": torch.randn(4)}, step=1)
    store.wait()


def test_validation_errors_are_raised_by_the_call_itself(store):
    with pytest.raises(TypeError, match="'bad'"):
        store.save_async({"bad": object()}, step=1)
    store.wait()
    assert store.checkpoints() == []


def test_background_error_raised_by_result(store, injected):
    injected("save.chunks_written=raise")
    future = store.save_async({"w": torch.randn(64, 1024)}, step=1)
    with pytest.raises(faults.InjectedFault):
        future.result()
    injected("")
    assert store.checkpoints() == []
    store.save({"w": torch.ones(3)}, step=2)  # observed: the next save is not blocked by it


def test_unobserved_background_error_is_raised_by_the_next_save(store, injected):
    injected("save.nodes_written=raise")
    future = store.save_async({"w": torch.randn(64, 1024)}, step=1)
    concurrent.futures.wait([future])  # done, but nobody asked for its result
    injected("")
    with pytest.raises(faults.InjectedFault):
        store.save({"w": torch.ones(3)}, step=2)
    store.save({"w": torch.ones(3)}, step=2)  # raised once, then cleared
    assert [ck.step for ck in store.checkpoints()] == [2]


def test_unobserved_background_error_is_raised_by_close(store_path, injected):
    store = cas.open(store_path)
    injected("commit.synced=raise")
    store.save_async({"w": torch.randn(64, 1024)}, step=1)
    with pytest.raises(faults.InjectedFault):
        store.close()
    injected("")
    with cas.open(store_path) as again:
        assert again.checkpoints() == []


def test_crash_during_async_save_leaves_earlier_checkpoints_and_hides_the_partial_one(store_path):
    script = textwrap.dedent(f"""
        import torch, cas
        with cas.open({str(store_path)!r}) as s:
            s.save({{"w": torch.arange(10.0)}}, step=1)
            s.save_async({{"w": torch.randn(256, 1024)}}, step=2)
            s.wait()
    """)
    env = dict(os.environ, CAS_FAULTS="save.nodes_written=kill@2")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert out.returncode == -9
    with cas.open(store_path) as s:
        assert [ck.step for ck in s.checkpoints()] == [1]
        assert torch.equal(s.load(1)["w"], torch.arange(10.0))
        assert s.verify().ok


def test_restore_in_place_and_plain_values(store):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_tiny(model, opt, 3, seed=0)
    rng = cas.RNGState()
    store.save({"model": model, "optimizer": opt, "rng": rng, "step": 3, "note": "hi"}, step=3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    draw = torch.rand(3)

    fresh = tiny_model(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    pointers = {k: v.data_ptr() for k, v in fresh.state_dict().items()}
    loaded = store.restore({"model": fresh, "optimizer": fresh_opt, "rng": cas.RNGState()})
    assert loaded["step"] == 3 and loaded["note"] == "hi" and loaded["model"] is fresh
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]) and v.data_ptr() == pointers[k]  # decoded in place
    assert_same(fresh_opt.state_dict(), opt.state_dict())
    assert torch.equal(torch.rand(3), draw)  # the RNG was rewound to the save


def test_restore_target_missing_from_checkpoint_is_named(store):
    store.save({"model": tiny_model()}, step=1)
    with pytest.raises(cas.CheckpointNotFoundError, match=r"\['scheduler'\]"):
        store.restore({"model": tiny_model(), "scheduler": torch.optim.lr_scheduler.StepLR(
            torch.optim.SGD(tiny_model().parameters(), lr=0.1), 1)})


def test_sampler_resumes_mid_epoch():
    s = cas.ResumableRandomSampler(10, seed=1)
    it = iter(s)
    head = [next(it) for _ in range(4)]
    state = s.state_dict()
    rest = list(it)
    other = cas.ResumableRandomSampler(10, seed=1)
    other.load_state_dict(state)
    assert list(other) == rest and sorted(head + rest) == list(range(10))


def test_a_failed_async_step_can_be_saved_again_as_soon_as_its_failure_is_seen(store_path):
    """The future completed before the save's step was released: a retry right after
    result() raised was refused as an existing step in about one try in six."""
    with cas.open(store_path, chunk_size=64 << 10, max_inflight=3) as store:
        for step in range(30):
            faults.configure("save.chunks_written=raise")
            try:
                future = store.save_async({"w": torch.randn(64, 1024)}, step=step)
                with pytest.raises(faults.InjectedFault):
                    future.result()
            finally:
                faults.configure("")
            store.save_async({"w": torch.ones(1)}, step=step).result()
        assert len(store.checkpoints()) == 30


def test_meta_is_captured_at_the_call_and_checked_there(store):
    meta = {"note": "before", "lr": [1, 2]}
    future = store.save_async({"w": torch.ones(2)}, step=1, meta=meta)
    meta["note"], meta["lr"][0], meta["bad"] = "after", 99, object()
    assert future.result().meta == {"note": "before", "lr": [1, 2]}
    for bad in ({"lr": np.float32(0.5)}, {"tokens": 2 ** 70}):  # the registry record holds plain msgpack
        with pytest.raises(TypeError, match="meta"):
            store.save_async({"w": torch.ones(2)}, step=2, meta=bad)
    with pytest.raises(TypeError, match="metric 'tokens'"):
        store.save({"w": torch.ones(2)}, step=2, metrics={"tokens": 2 ** 70})
    assert [ck.step for ck in store.checkpoints()] == [1]


def test_close_reports_every_background_failure_nobody_looked_at(store_path):
    store = cas.open(store_path, chunk_size=64 << 10, max_inflight=3)
    faults.configure("save.chunks_written=raise")
    try:
        futures = [store.save_async({"w": torch.randn(64, 1024)}, step=s) for s in (1, 2)]
        concurrent.futures.wait(futures)
    finally:
        faults.configure("")
    with pytest.raises(faults.InjectedFault) as raised:
        store.close()
    assert any("another background save failed too" in note for note in raised.value.__notes__)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_max_inflight_below_one_is_refused_instead_of_spinning(store_path, bad):
    with pytest.raises(cas.CasError, match="max_inflight"):
        cas.open(store_path, max_inflight=bad)


def test_a_restore_that_does_not_fit_changes_nothing(store):
    """load_state_dict refuses a model of another shape, but the decode into its tensors had
    already overwritten the parameters it shares names and sizes with."""
    saved = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    store.save({"model": saved}, step=1)
    for other in (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 5)),
                  torch.nn.Sequential(torch.nn.Linear(8, 8))):
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(cas.StateMismatchError, match="nothing was restored"):
            store.restore({"model": other})
        assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())


def test_saved_restored_and_loaded_tensors_can_still_grow(store):
    """Tensor.numpy() marks a storage as never resizable again: cas reads and writes tensors'
    memory without it."""
    buf, model = torch.arange(50000.0), torch.nn.Linear(64, 64)
    store.save({"buf": buf, "model": model}, step=1)
    future = store.save_async({"buf": buf}, step=2)
    future.result()
    target = torch.nn.Linear(64, 64)
    store.restore({"model": target}, step=1)
    loaded = store.load(1)["buf"]
    for t in (buf, target.weight.data, loaded):
        t.resize_(t.numel() * 4)


def test_stateful_objects_inside_an_ordered_dict_are_saved_as_their_state(store):
    from collections import OrderedDict
    model = torch.nn.Linear(4, 4)
    store.save(OrderedDict(model=model), step=1)
    assert torch.equal(store.load(1)["model"]["weight"], model.weight)


def test_restore_into_a_lazy_module_gives_it_its_shapes(store):
    """An uninitialized parameter has no shape to check or decode into: load_state_dict
    materializes it from freshly decoded tensors."""
    saved = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 2))
    saved(torch.randn(2, 3))
    store.save({"model": saved}, step=1)
    target = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 2))
    store.restore({"model": target})
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), saved.state_dict().values()))


def test_restore_fit_checks_one_entry_and_ignores_extra_state_shapes(store):
    """A sibling entry named "model.ema" is not part of "model" (flat dotted paths made it look
    so), and a module's extra state may change its shape (load_state_dict accepts it)."""

    class WithExtra(torch.nn.Linear):
        def __init__(self, n: int) -> None:
            super().__init__(4, 4)
            self.extra = torch.arange(float(n))

        def get_extra_state(self):
            return self.extra

        def set_extra_state(self, state) -> None:
            self.extra = state

    model, ema = WithExtra(5), torch.nn.Linear(4, 4)
    store.save({"model": model, "model.ema": ema}, step=1)
    target = WithExtra(3)
    store.restore({"model": target})
    assert torch.equal(target.weight, model.weight) and torch.equal(target.extra, torch.arange(5.0))


def test_a_target_that_refuses_its_state_leaves_the_model_untouched(store):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    store.save({"model": model, "opt": opt}, step=1)
    target = torch.nn.Linear(4, 4)
    before = target.weight.detach().clone()
    with pytest.raises(ValueError, match="parameter groups"):
        store.restore({"model": target, "opt": torch.optim.SGD(target.parameters(), lr=0.1)})
    assert torch.equal(target.weight, before)


def test_a_damaged_chunk_never_lands_in_a_restore_target(tmp_path):
    """Restore decodes into the caller's tensors: a damaged chunk is refused before any of its
    bytes reach them (each chunk ends up as it was, or as the checkpoint holds it)."""
    with cas.open(tmp_path / "s", chunk_size=64 << 10, compress=False, pack_max=4096) as store:
        model = torch.nn.Linear(256, 256)  # 256 KiB of weight: 4 chunks as files
        store.save({"model": model}, step=1)
        key = next(t for t in store.tensors(1) if t["path"] == "model.weight")["chunks"][2]
        path = store.objects.files.path(key)
        with open(path, "r+b") as f:
            f.seek(-100, 2)
            f.write(b"\xff" * 50)
        target = torch.nn.Linear(256, 256)
        before = target.weight.detach().clone()
        with pytest.raises(cas.CorruptionError, match=key.hex()):
            store.restore({"model": target})
        rows = slice(2 * 64, 3 * 64)  # the damaged chunk's rows: 64 rows of 256 floats each
        assert torch.equal(target.weight[rows], before[rows])


def test_meta_and_metrics_refusals_name_what_is_wrong(store):
    with pytest.raises(TypeError, match="meta"):
        store.save({"w": torch.ones(1)}, step=1, meta={(1, 2): 3})
    with pytest.raises(TypeError, match="metric 'loss' must be one number"):
        store.save({"w": torch.ones(1)}, step=1, metrics={"loss": torch.zeros(2)})
    assert store.checkpoints() == []


def test_restore_targets_under_int_keys(store):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store.save({0: model, 1: opt, "step": 5}, step=1)
    target = torch.nn.Linear(3, 3)
    loaded = store.restore({0: target, 1: torch.optim.SGD(target.parameters(), lr=0.1)})
    assert list(loaded) == [0, 1, "step"] and loaded["step"] == 5 and torch.equal(target.weight, model.weight)


def test_an_entry_whose_paths_look_like_a_targets_keeps_its_own_values(store):
    """"model" holds a submodule "ema" and the state has an entry "model.ema": flat dotted
    paths coincide, and the entry used to come back holding the module's tensors."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ema = torch.nn.Linear(2, 2)

    net = Net()
    other = {"weight": torch.full((2, 2), 7.0), "bias": torch.full((2,), 7.0)}
    store.save({"model": net, "model.ema": other}, step=1)
    target = Net()
    loaded = store.restore({"model": target})
    assert torch.equal(target.ema.weight, net.ema.weight)
    assert torch.equal(loaded["model.ema"]["weight"], other["weight"])
    assert loaded["model.ema"]["weight"] is not target.ema.weight


def test_a_lazy_module_is_restored_last_too(store):
    model = torch.nn.Sequential(torch.nn.LazyLinear(2))
    model(torch.randn(1, 3))
    opt = torch.optim.SGD([{"params": [model[0].weight]}, {"params": [model[0].bias]}], lr=0.1)
    store.save({"model": model, "opt": opt}, step=1)
    target = torch.nn.Sequential(torch.nn.LazyLinear(2))
    with pytest.raises(cas.StateMismatchError, match="target 'opt' does not fit"):
        store.restore({"model": target, "opt": torch.optim.SGD(target.parameters(), lr=0.1)})
    assert torch.nn.parameter.is_lazy(target[0].weight)  # untouched: still uninitialized


@pytest.mark.parametrize("ending", ["the script ends", "sys.exit(0)", "an exception"])
def test_a_script_that_ends_after_save_async_without_close_still_commits_the_save(tmp_path, ending):
    """A script that ended after save_async, with no wait() or close(), lost the checkpoint and
    said nothing (exit code 0): at exit concurrent.futures stops taking work, and the save's
    hashing and writing could no longer start. Stores still open are now closed at exit, first."""
    path = tmp_path / "s"
    last = {"the script ends": "", "sys.exit(0)": "sys.exit(0)", "an exception": "raise RuntimeError('boom')"}[ending]
    script = textwrap.dedent(f"""
        import sys, torch, cas
        store = cas.open({str(path)!r})
        store.save_async({{"w": torch.arange(3_000_000, dtype=torch.float32)}}, step=1)
        {last}
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert (result.returncode != 0) == (ending == "an exception"), result.stderr
    assert "cas:" not in result.stderr, result.stderr
    with cas.open(path) as store:
        assert [ck.step for ck in store.checkpoints()] == [1]
        assert torch.equal(store.load(1)["w"], torch.arange(3_000_000, dtype=torch.float32))


def test_a_save_async_that_fails_as_the_script_ends_is_reported(tmp_path):
    """A save_async still in flight as the script ended, which then failed (a full disk), was
    reported nowhere: no call of the store was left to raise it (audit of stop 38)."""
    script = textwrap.dedent(f"""
        import torch, cas
        store = cas.open({str(tmp_path / "s")!r})
        store.save({{"w": torch.zeros(10)}}, step=0)
        store.save_async({{"w": torch.arange(3_000_000, dtype=torch.float32)}}, step=1)
    """)
    env = {**os.environ, "CAS_FAULTS": "save.hashed=enospc@2"}  # the first hashing is step 0's
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert "cas: the background save of step 1 into" in result.stderr and "not saved" in result.stderr, result.stderr
    assert "No space left on device" in result.stderr
    with cas.open(tmp_path / "s") as store:
        assert [ck.step for ck in store.checkpoints()] == [0]


def test_a_failure_after_a_timed_out_poll_of_its_future_is_still_raised(tmp_path, injected):
    """result(timeout=...) before the save was done marked the future seen, so its later failure
    was raised by nobody: not wait(), not the next save, not close() (audit of stop 38)."""
    gate = tmp_path / "gate"
    injected(f"save.background_started=pause:{gate}@1,save.hashed=enospc@1")
    store = cas.open(tmp_path / "s")
    future = store.save_async({"w": torch.randn(1000)}, step=1)
    with pytest.raises(concurrent.futures.TimeoutError):
        future.result(timeout=0.05)
    gate.touch()
    with pytest.raises(cas.StoreWriteError, match="No space left on device"):
        store.wait()
    store.close()


def test_a_save_cannot_be_cancelled_and_saves_go_on(store):
    """cancel() said True while the save went on and committed, and the next save_async raised
    CancelledError (asyncio.wrap_future cancels futures so; audit of stop 38)."""
    future = store.save_async({"w": torch.ones(10)}, step=1)
    assert future.cancel() is False and not future.cancelled()
    store.save_async({"w": torch.zeros(10)}, step=2).result()
    assert future.result().step == 1 and [ck.step for ck in store.checkpoints()] == [1, 2]


def test_saves_inside_inference_mode_and_under_another_default_device(store):
    """A save_async inside torch.inference_mode() (after a validation pass) made the reused
    staging buffer an inference tensor: the next save outside it raised RuntimeError. Under
    torch.set_default_device the buffer and loaded tensors followed that device (audit of stop
    38; "meta" stands in for a GPU here)."""
    with torch.inference_mode():
        store.save_async({"w": torch.ones(1000)}, step=1).result()
    store.save_async({"w": torch.zeros(2000)}, step=2).result()
    torch.set_default_device("meta")
    try:
        store.save_async({"w": torch.full((3000,), 2.0, device="cpu")}, step=3).result()
        loaded = store.load(3)["w"]
    finally:
        torch.set_default_device(None)
    assert loaded.device.type == "cpu" and torch.equal(loaded, torch.full((3000,), 2.0))
    assert torch.equal(store.load(2)["w"], torch.zeros(2000))


def test_a_stateful_target_below_the_top_level_is_refused_not_left_as_it_was(store):
    """restore({"nets": {"g": G}}) returned without error and restored nothing into G, though
    the save had reached it (audit of stop 38)."""
    g, fresh = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    store.save({"nets": {"g": g}}, step=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(TypeError, match="restore target 'nets.g' is a Linear below the top level"):
        store.restore({"nets": {"g": fresh}}, step=1)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("groups", ["fewer", "other sizes", "not an optimizer"])
def test_an_optimizer_that_would_refuse_its_state_is_refused_before_anything_is_decoded(store, groups):
    """restore decodes an optimizer's state into its own tensors before load_state_dict takes
    it: an optimizer that then refused the state (other parameter groups) was left holding the
    checkpoint's moments under its own (audit of stop 38). It is refused first, and every
    target (the optimizer's moments, a module, a scheduler) keeps its state."""
    def trained(model, opt):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        return opt
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = trained(model, torch.optim.Adam([{"params": list(model[0].parameters())},
                                           {"params": list(model[1].parameters())}], lr=0.1))
    stepped = torch.optim.lr_scheduler.StepLR(opt, 5)
    for _ in range(3):
        stepped.step()
    saved = {"model": model, "opt": opt, "other": {"lr": 0.1}, "sched": stepped}
    store.save(saved, step=1)
    target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    params = list(target.parameters())
    if groups == "fewer":
        mine = torch.optim.Adam(params, lr=0.1)
    else:
        mine = torch.optim.Adam([{"params": params[:1]}, {"params": params[1:]}], lr=0.1)
    trained(target, mine)
    sched = torch.optim.lr_scheduler.StepLR(mine, 5)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in mine.state.values()]
    key = "other" if groups == "not an optimizer" else "opt"
    with pytest.raises(cas.StateMismatchError, match="parameter groups|parameters per group|no param_groups"):
        store.restore({"model": target, key: mine, "sched": sched})
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(mine.state.values(), moments))
    assert sched.state_dict()["last_epoch"] == 0 and sched.state_dict()["_step_count"] == 1
