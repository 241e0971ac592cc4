"""Resume equivalence: stop at step k, restore in a fresh process, train to N; the losses and the
final parameters and optimizer state equal an uninterrupted run bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import cas

WORKER = os.path.join(os.path.dirname(__file__), "resume_worker.py")
N, K = 30, 17  # K is mid-epoch (12 batches an epoch), after the LR warmup


def run(*args) -> dict:
    out = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run("full", tmp_path_factory.mktemp("full") / "unused", N)


@pytest.mark.parametrize("how", ["sync", "async"])
def test_resume_in_a_fresh_process_is_bit_for_bit(tmp_path, uninterrupted, how):
    store = tmp_path / "store"
    first = run("first", store, N, K, how)
    assert first["losses"] == uninterrupted["losses"][:K]
    second = run("second", store, N)
    assert first["losses"] + second["losses"] == uninterrupted["losses"]
    assert second["digest"] == uninterrupted["digest"]
    if how == "async":  # the first process trained on to N while its save ran: same end state
        assert first["digest"] == uninterrupted["digest"]


@pytest.mark.parametrize("length, drop_last", [(48, False), (50, True), (50, False)])
def test_a_sampler_saved_after_an_epochs_last_batch_resumes_the_same_batches(length, drop_last):
    """A DataLoader exhausts its sampler before it yields a partial last batch; the sampler
    advanced its epoch as its indices ran out, so a save right after a partial last batch said
    the next epoch and a per-epoch loop resumed from it ran a whole epoch more (after a full
    last batch it said this epoch; audit of stop 38). Both now say this epoch, handed out."""
    def loader():
        sampler = cas.ResumableRandomSampler(length, seed=0)
        return sampler, torch.utils.data.DataLoader(range(length), batch_size=8, sampler=sampler, drop_last=drop_last)

    sampler, batches = loader()
    per_epoch = len(batches)
    seen, saved = [], None
    for epoch in range(3):
        for batch in batches:
            seen.append(batch.tolist())
            if len(seen) == per_epoch:  # right after the first epoch's last batch
                saved = (sampler.state_dict(), epoch)
    state, epoch_then = saved
    assert (state["epoch"], state["position"]) == (0, per_epoch * 8 if drop_last else length)
    sampler, batches = loader()
    sampler.load_state_dict(state)
    resumed = seen[:per_epoch]
    for _ in range(epoch_then, 3):
        resumed += [batch.tolist() for batch in batches]
    assert resumed == seen
