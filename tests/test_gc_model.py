"""A hypothesis state machine over save, delete, milestone, pin, gc and reopen, checked against a
plain model: every checkpoint that should exist loads bit for bit, and after gc the objects in
the store are exactly the reachable set. A second machine runs the same with delta chains: a
drifting weight saved with delta=True, so retention and gc cut through chains at random."""

from __future__ import annotations

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
        self.next_step = 1

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

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def delete(self, data):
        step = data.draw(st.sampled_from(sorted(self.expected)))
        if self.store.get(step).pinned:
            return
        self.store.delete(step)
        del self.expected[step]

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), flag=st.booleans())
    def milestone(self, data, flag):
        self.store.set_milestone(data.draw(st.sampled_from(sorted(self.expected))), flag)

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), flag=st.booleans())
    def pin(self, data, flag):
        self.store.set_pinned(data.draw(st.sampled_from(sorted(self.expected))), flag)

    @rule(retention=rules)
    def gc(self, retention):
        decided = retention.decide(self.store.checkpoints()) if retention.has_rules else None
        report = self.store.gc(retention if retention.has_rules else None)
        if decided is not None:
            for step, why in decided.items():
                if not why:
                    del self.expected[step]
        assert sorted(ck.step for ck in self.store.checkpoints()) == sorted(self.expected)
        assert report.objects_swept >= 0
        assert_exactly_reachable(self.store)

    @rule()
    def reopen(self):
        self.store.close()
        self.store = self._open()

    @invariant()
    def every_expected_checkpoint_loads_bit_for_bit(self):
        assert [ck.step for ck in self.store.checkpoints()] == sorted(self.expected)
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


TestDeltaStoreModel = DeltaStoreModel.TestCase
TestDeltaStoreModel.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)
