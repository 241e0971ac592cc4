"""A hypothesis state machine over save, delete, milestone, pin, gc and reopen, and over losing the
LMDB cache or putting an older copy of it back, checked against a plain model: every checkpoint
that should exist loads bit for bit with its flags as last set, and after gc the objects in
the store are exactly the reachable set. A second machine runs the same with delta chains: a
drifting weight saved with delta=True, so retention and gc cut through chains at random."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_gc import assert_exactly_reachable

import cas
from cas.gc import Retention

# A pool of tensors that saves draw from, so checkpoints overlap at random; some span chunks.
POOL = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in
        enumerate([10, 3000, 20_000, 20_000, 40_000, 1, 0, 16_384])]
rules = st.builds(Retention, keep_last=st.none() | st.integers(0, 4), keep_milestones=st.booleans(),
                  keep_every=st.none() | st.sampled_from([2, 3, 5]),
                  keep_best=st.none() | st.sampled_from([("m", "min", 1), ("m", "max", 2)]))


class StoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="cas-model-")
        self.store = self._open()
        self.expected: dict[int, dict] = {}  # step -> state
        self.flags: dict[int, tuple[bool, bool]] = {}  # step -> (milestone, pinned)
        self.next_step = 1
        self.old_cache: str | None = None  # a copy of the index taken earlier

    def _open(self):
        return cas.open(self.dir + "/s", chunk_size=64 << 10, pack_max=2048)

    @rule(picks=st.lists(st.integers(0, len(POOL) - 1), max_size=5), fresh=st.booleans(),
          milestone=st.booleans(), metric=st.integers(0, 9))
    def save(self, picks, fresh, milestone, metric):
        state = {f"p{i}": POOL[i] for i in picks}
        if fresh:
            state["fresh"] = torch.randn(5000)
        step = self.next_step
        self.next_step += 1
        self.store.save(state, step=step, milestone=milestone, metrics={"m": metric})
        self.expected[step] = state
        self.flags[step] = (milestone, False)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def delete(self, data):
        step = data.draw(st.sampled_from(sorted(self.expected)))
        if self.store.get(step).pinned:
            return
        self.store.delete(step)
        del self.expected[step]
        del self.flags[step]

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), flag=st.booleans())
    def milestone(self, data, flag):
        step = data.draw(st.sampled_from(sorted(self.expected)))
        self.store.set_milestone(step, flag)
        self.flags[step] = (flag, self.flags[step][1])

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), flag=st.booleans())
    def pin(self, data, flag):
        step = data.draw(st.sampled_from(sorted(self.expected)))
        self.store.set_pinned(step, flag)
        self.flags[step] = (self.flags[step][0], flag)

    @rule(retention=rules)
    def gc(self, retention):
        decided = retention.decide(self.store.checkpoints()) if retention.has_rules else None
        report = self.store.gc(retention if retention.has_rules else None)
        if decided is not None:
            for step, why in decided.items():
                if not why:
                    del self.expected[step]
                    del self.flags[step]
        assert sorted(ck.step for ck in self.store.checkpoints()) == sorted(self.expected)
        assert report.objects_swept >= 0
        assert_exactly_reachable(self.store)

    @rule()
    def reopen(self):
        self.store.close()
        self.store = self._open()

    @rule()
    def lose_the_cache(self):
        self.store.close()
        index = os.path.join(self.dir, "s", "index")
        for name in os.listdir(index):
            os.unlink(os.path.join(index, name))
        self.store = self._open()

    @rule()
    def copy_the_cache(self):
        self.store.close()
        self.old_cache = os.path.join(self.dir, f"cache-{self.next_step}")
        shutil.rmtree(self.old_cache, ignore_errors=True)
        shutil.copytree(os.path.join(self.dir, "s", "index"), self.old_cache)
        self.store = self._open()

    @precondition(lambda self: self.old_cache is not None)
    @rule()
    def put_an_old_cache_back(self):
        self.store.close()
        index = os.path.join(self.dir, "s", "index")
        shutil.rmtree(index)
        shutil.copytree(self.old_cache, index)
        self.store = self._open()

    @invariant()
    def every_expected_checkpoint_loads_bit_for_bit(self):
        assert [ck.step for ck in self.store.checkpoints()] == sorted(self.expected)
        assert {ck.step: (ck.milestone, ck.pinned) for ck in self.store.checkpoints()} == self.flags
        for step, state in self.expected.items():
            loaded = self.store.load(step)
            assert list(loaded) == list(state)
            for k, t in state.items():
                assert torch.equal(loaded[k], t), (step, k)

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestStoreModel = StoreModel.TestCase
TestStoreModel.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)


class DeltaStoreModel(StoreModel):
    """The same rules on a store with delta=True and short chains, plus saves of a weight that
    drifts a little each time (two chunks, coded as deltas of the previous save's)."""

    def __init__(self) -> None:
        self.w = torch.randn(40_000, generator=torch.Generator().manual_seed(99))
        super().__init__()

    def _open(self):
        return cas.open(self.dir + "/s", chunk_size=64 << 10, pack_max=2048, delta=True, max_chain=2)

    @rule(scale=st.sampled_from([1e-6, 1e-4, 1.0]), milestone=st.booleans(), metric=st.integers(0, 9))
    def save_drifted(self, scale, milestone, metric):
        step = self.next_step
        self.next_step += 1
        noise = torch.randn(self.w.shape, generator=torch.Generator().manual_seed(step))
        self.w = self.w + scale * noise
        state = {"w": self.w, "half": self.w.to(torch.bfloat16)}
        self.store.save(state, step=step, milestone=milestone, metrics={"m": metric})
        self.expected[step] = state
        self.flags[step] = (milestone, False)


TestDeltaStoreModel = DeltaStoreModel.TestCase
TestDeltaStoreModel.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)
