"""The Hugging Face TrainerCallback under transformers' own Trainer: a resume from the store ends
bit for bit where an uninterrupted run ends, and a run resumed from an earlier step with the
callback attached trains on and saves over the later steps, as the Trainer overwrites its
folders. transformers is a test-only dependency (the `integrations` extra)."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_same

transformers = pytest.importorskip("transformers")

import cas  # noqa: E402
from cas.store.hf import CasCallback, resume  # noqa: E402


def hf_parts(tmp_path):
    """A tiny GPT-2 built from a config (no download), with dropout on and a shuffled sampler:
    the Trainer restores both through the RNG and data-skipping state the callback saves."""
    data = torch.randint(0, 64, (24, 8), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row.clone()} for row in data]

    def model(seed: int = 0):
        torch.manual_seed(seed)
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
        return transformers.GPT2LMHeadModel(config)

    def args(name: str):
        return transformers.TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2,
            warmup_steps=2, save_strategy="steps", save_steps=3, logging_steps=1, report_to=[], use_cpu=True,
            disable_tqdm=True, seed=0, dataloader_num_workers=0)

    return dataset, model, args


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_resume_from_the_store_matches_an_uninterrupted_run(tmp_path):
    dataset, model, args = hf_parts(tmp_path)
    full = transformers.Trainer(model(), args("full"), train_dataset=dataset)
    full.train()

    class StopAt3(transformers.TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    callback = CasCallback(tmp_path / "store", keep_folders=False)
    transformers.Trainer(model(), args("part"), train_dataset=dataset, callbacks=[callback, StopAt3()]).train()
    assert [ck.step for ck in callback.store.checkpoints()] == [3]
    assert not os.path.exists(tmp_path / "part" / "checkpoint-3")  # the store holds it instead
    assert "loss" in callback.store.get(3).metrics

    again = transformers.Trainer(model(seed=1), args("again"), train_dataset=dataset)  # weights come from the store
    resume(again, callback.store)
    assert losses(again) == losses(full)
    assert_same(again.model.state_dict(), full.model.state_dict())
    callback.store.close()


def test_without_folders_the_trainer_still_loads_the_best_model_at_the_end(tmp_path):
    """keep_folders=False removed every checkpoint-N folder, the best one too, so
    load_best_model_at_end only logged that it could not find it and the run ended with the
    last model. The best one's folder is kept while it is the best."""
    dataset, model, args = hf_parts(tmp_path)

    def run(name: str, keep_folders: bool):
        arguments = args(name)
        arguments.eval_strategy, arguments.eval_steps = "steps", 3
        # greater_is_better on eval_loss: the best is the first checkpoint, not the last
        arguments.load_best_model_at_end, arguments.metric_for_best_model = True, "eval_loss"
        arguments.greater_is_better = True
        callback = CasCallback(tmp_path / f"{name}-store", keep_folders=keep_folders)
        trainer = transformers.Trainer(model(), arguments, train_dataset=dataset, eval_dataset=dataset[:8],
                                       callbacks=[callback])
        trainer.train()
        best = int(trainer.state.best_model_checkpoint.rsplit("-", 1)[1])
        stored = callback.store.load(best)["model"]
        callback.store.close()
        return trainer, best, stored

    trainer, best, stored = run("dropped", keep_folders=False)
    assert best == 3 and trainer.state.global_step == 6
    assert_same(trainer.model.state_dict(), stored)
    assert sorted(os.listdir(tmp_path / "dropped")) == ["checkpoint-3"]  # only the best one's folder stays
    kept, _, _ = run("kept", keep_folders=True)
    assert_same(trainer.model.state_dict(), kept.model.state_dict())


def test_a_run_resumed_from_an_earlier_step_with_the_callback_attached_saves_over_the_later_steps(tmp_path):
    """The store holds steps 3 and 6; a Trainer built the same way (callback attached) resumes
    from step 3. Its save at step 6 replaces the stored one instead of stopping the training
    with CheckpointExistsError, and it ends where the first run ended."""
    dataset, model, args = hf_parts(tmp_path)
    callback = CasCallback(tmp_path / "store")
    first = transformers.Trainer(model(), args("first"), train_dataset=dataset, callbacks=[callback])
    first.train()
    before = {ck.step: ck for ck in callback.store.checkpoints()}
    assert sorted(before) == [3, 6]

    again = transformers.Trainer(model(seed=1), args("again"), train_dataset=dataset,
                                 callbacks=[CasCallback(callback.store)])
    resume(again, callback.store, step=3)
    assert again.state.global_step == 6 and losses(again) == losses(first)  # its log history goes on from step 3
    assert os.path.isdir(tmp_path / "again" / "checkpoint-6")  # the Trainer's own save ran too
    after = {ck.step: ck for ck in callback.store.checkpoints()}
    assert sorted(after) == [3, 6] and after[3] == before[3]
    assert after[6].seq > before[6].seq  # step 6 is the resumed run's save
    assert_same(callback.store.load(6, keys=["model"])["model"], again.model.state_dict())
    assert_same(again.model.state_dict(), first.model.state_dict())
    callback.store.close()


def test_a_callback_handed_a_path_opens_the_store_as_cas_open_does(tmp_path):
    callback = CasCallback(tmp_path / "store", retention=cas.Retention(keep_last=1))
    assert isinstance(callback.store, cas.Store) and callback.store.retention == cas.Retention(keep_last=1)
    callback.store.close()


class StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, _args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


def test_a_checkpoints_metrics_are_those_logged_at_its_step(tmp_path):
    """The callback recorded the last log entry whatever step it came from: with saves more
    frequent than logs and evals, checkpoint 4 carried step 3's eval_loss (its "step" said 3),
    and a keep_best retention ranked checkpoints by scores of models never stored. A
    training and an evaluation entry of the same step were not merged (the loss was lost)."""
    dataset, model, args = hf_parts(tmp_path)
    arguments = args("run")
    arguments.save_steps, arguments.logging_steps, arguments.eval_strategy, arguments.eval_steps = 2, 3, "steps", 3
    callback = CasCallback(tmp_path / "store")
    transformers.Trainer(model(), arguments, train_dataset=dataset, eval_dataset=dataset[:8],
                         callbacks=[callback]).train()
    metrics = {ck.step: ck.metrics for ck in callback.store.checkpoints()}
    assert sorted(metrics) == [2, 4, 6] and metrics[2] == metrics[4] == {}
    assert metrics[6]["step"] == 6 and {"loss", "learning_rate", "eval_loss"} <= metrics[6].keys()
    callback.store.close()


@pytest.mark.parametrize("best", ["first", "last"])
def test_a_resume_without_its_folders_ends_with_the_best_model_and_only_its_folder(tmp_path, best):
    """keep_folders=False and load_best_model_at_end, a run stopped at step 3 and resumed from
    the store. When step 3 stays best and its folder is gone (a new machine, a wiped scratch
    folder), the Trainer dropped it with a warning and ended with the last weights: resume now
    writes the best folder again from the store. When step 6 becomes best, the resumed run's
    callback did not know the folder the run before kept, and left it behind for good."""
    dataset, model, args = hf_parts(tmp_path)

    def arguments(name: str):
        out = args(name)
        out.eval_strategy, out.eval_steps, out.load_best_model_at_end = "steps", 3, True
        out.metric_for_best_model, out.greater_is_better = "eval_loss", best == "first"  # the loss falls
        return out

    full = transformers.Trainer(model(), arguments("full"), train_dataset=dataset, eval_dataset=dataset[:8])
    full.train()
    callback = CasCallback(tmp_path / "store", keep_folders=False)
    transformers.Trainer(model(), arguments("run"), train_dataset=dataset, eval_dataset=dataset[:8],
                         callbacks=[callback, StopAt(3)]).train()
    assert os.listdir(tmp_path / "run") == ["checkpoint-3"]  # the best so far
    callback.store.close()
    if best == "first":
        import shutil

        shutil.rmtree(tmp_path / "run")  # only the store is left
    again = transformers.Trainer(model(seed=1), arguments("run"), train_dataset=dataset, eval_dataset=dataset[:8],
                                 callbacks=[CasCallback(tmp_path / "store", keep_folders=False)])
    resume(again, tmp_path / "store")
    assert again.state.best_model_checkpoint.endswith("checkpoint-3" if best == "first" else "checkpoint-6")
    assert_same(again.model.state_dict(), full.model.state_dict())
    assert os.listdir(tmp_path / "run") == [os.path.basename(again.state.best_model_checkpoint)]


def test_resume_opens_a_path_with_store_options_and_never_makes_a_store(tmp_path, monkeypatch):
    """resume(trainer, path, key=K) handed key= to Trainer.train() (a TypeError), and without it
    the store opened keyless (KeyRequiredError); a mistyped path got an empty store made there."""
    monkeypatch.setenv("CAS_SCRYPT_LOG_N", "10")  # a cheap passphrase KDF for the test
    dataset, model, args = hf_parts(tmp_path)
    callback = CasCallback(tmp_path / "store", key="a passphrase")
    transformers.Trainer(model(), args("first"), train_dataset=dataset, callbacks=[callback, StopAt(3)]).train()
    callback.store.close()
    again = transformers.Trainer(model(seed=1), args("again"), train_dataset=dataset)
    resume(again, tmp_path / "store", key="a passphrase")
    assert again.state.global_step == 6
    with pytest.raises(cas.NotAStoreError):
        resume(transformers.Trainer(model(), args("other"), train_dataset=dataset), tmp_path / "no-such-store")
    assert not os.path.exists(tmp_path / "no-such-store")


HF_DDP_WORKER = r'''
import json, os, sys
import torch, torch.distributed as dist, transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from cas.store.hf import CasCallback, resume

role, work = sys.argv[1], sys.argv[2]
transformers.set_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                   resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3))  # dropout draws random numbers
g = torch.Generator().manual_seed(1)
data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 64, (200, 12), generator=g)]
args = TrainingArguments(output_dir=os.path.join(work, role), max_steps=14, per_device_train_batch_size=4,
                         save_steps=5, logging_steps=1, report_to=[], learning_rate=1e-3, seed=0, data_seed=0,
                         use_cpu=True, disable_tqdm=True, ddp_backend="gloo", save_strategy="steps")

class Stop(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 12:
            control.should_training_stop = True

callbacks = [CasCallback(os.path.join(work, "store")), Stop()] if role == "first" else []
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
if role == "first":
    trainer.train()
else:
    resume(trainer, os.path.join(work, "store"), step=10)
losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
with open(os.path.join(work, f"{role}-{dist.get_rank()}.json"), "w") as f:
    json.dump(losses, f)
if role == "first":
    callbacks[0].store.close()  # (its background work, the recode of the checkpoint before, done)
# end the group, then the process, before the interpreter's teardown: gloo's at exit died of
# "terminate called without an active exception" (SIGABRT) now and then, failing a run that had
# passed, even after the group was destroyed (stop 44's CI)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


def test_a_data_parallel_run_resumes_every_ranks_random_streams(tmp_path):
    """Under DDP the callback saved rank 0's RNG states alone, as rng_state.pth; each rank's
    Trainer looks for rng_state_<rank>.pth, found none and said so only at info level, so a
    model with dropout resumed on other random streams than it trained on (audit of stop 33).
    Two gloo processes train a GPT-2 with dropout to step 12, saving at 5 and 10; a resume from
    10 must repeat the losses of steps 11 and 12 exactly on every rank."""
    import json
    import subprocess
    import sys

    from s3server import free_ports

    script = tmp_path / "worker.py"
    script.write_text(HF_DDP_WORKER)
    for role in ("first", "resumed"):
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                 f"--master_port={free_ports(1)[0]}", str(script), role, str(tmp_path)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    with cas.open(tmp_path / "store") as store:
        assert len(store.load(10)["rng_ranks"]) == 2
    first = json.loads((tmp_path / "first-0.json").read_text())
    resumed = json.loads((tmp_path / "resumed-0.json").read_text())
    assert [resumed[s] for s in ("11", "12")] == [first[s] for s in ("11", "12")]
    assert "13" in resumed
