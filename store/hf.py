"""Hugging Face transformers: keep a Trainer's checkpoints in a cas store (incremental,
deduplicated, every byte verified on load). Importing this module imports transformers; nothing
else in cas does.

    from cas.store.hf import CasCallback, resume
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[CasCallback("runs/exp1/ckpt")])
    trainer.train()
    # later, in a fresh process, with a Trainer built the same way:
    resume(trainer, "runs/exp1/ckpt")          # the latest checkpoint; step=N for another; key=... as cas.open

On each save event CasCallback stores the model, optimizer, scheduler, RNG states and the
TrainerState as checkpoint `state.global_step`, with the numbers logged at that step (training
and evaluation entries merged) as its metrics. A checkpoint already at that step (a run resumed
from an earlier step saves those steps again) is replaced in the new one's commit, as the Trainer
overwrites its checkpoint-N folder; a save that fails leaves it, and a pinned one (a legal hold)
is refused. `resume` writes a checkpoint as the folder Trainer.train(resume_from_checkpoint=...)
reads, in a temporary folder, and trains from it, so the Trainer's own resume logic (data
skipping, RNG, schedules) runs unchanged.

The Trainer still writes its checkpoint-N folders; keep_folders=False removes each one once the
store holds it, except the best one while load_best_model_at_end needs it (the Trainer loads the
best model from that folder when training ends; `resume` writes it again from the store when it
is gone). The store's retention (cas.open(path, retention=Retention(keep_last=3))), not
save_total_limit, decides which stored checkpoints stay. A store opens once per process: to
resume in the process that trained, pass the callback's open store (callback.store). Single
process (or data parallel, saved by the main process, with every rank's RNG states gathered
to it and written back as each rank's rng_state_<rank>.pth) only: FSDP and DeepSpeed shard
state that this callback does not gather, and a GradScaler is not saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import tempfile
import warnings
from typing import Iterator

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.training_args import ParallelMode

from cas.errors import CasError

from .opening import given_or_opened
from .store import CheckpointStore

# File names Trainer.train(resume_from_checkpoint=...) reads (transformers.trainer's constants).
WEIGHTS_FILE, OPTIMIZER_FILE, SCHEDULER_FILE = "model.safetensors", "optimizer.pt", "scheduler.pt"
RNG_FILE, TRAINER_STATE_FILE = "rng_state.pth", "trainer_state.json"
RANK_RNG_FILE = "rng_state_{}.pth"  # a distributed run's, one per rank
RANKS_RNG = "rng_ranks"  # the checkpoint's key for every rank's RNG states (distributed runs)


@contextlib.contextmanager
def _opened(store: str | os.PathLike | CheckpointStore, **options) -> Iterator[CheckpointStore]:
    """The store itself, or the one at the path (opened with `options`, never created: a
    mistyped path made an empty store there), closed afterwards."""
    opened, owned = given_or_opened(store, **{"create": False, **options})
    try:
        yield opened
    finally:
        if owned:
            opened.close()


def rng_state(distributed: bool = False) -> dict:
    """The RNG states a Trainer saves in rng_state.pth (rng_state_<rank>.pth in a distributed
    run, with every CUDA device's state), in its layout."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return state


def _ranks_rng_states(args: TrainingArguments) -> list[dict] | None:
    """Every rank's RNG states in rank order, on the main process of a distributed run (each
    rank's Trainer restores its own file, rng_state_<rank>.pth); None in one process, and on
    the other ranks, which only send theirs. Every rank calls this (a collective). Saving rank
    0's alone left every rank's random streams unrestored on resume (the Trainer looked for
    rng_state_<rank>.pth, found none, and said so only at info level: audit of stop 33)."""
    if args.world_size <= 1 or args.parallel_mode != ParallelMode.DISTRIBUTED \
            or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    states = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    # (pickled between this job's own processes, as torch.distributed sends objects; stored as values)
    torch.distributed.gather_object(rng_state(distributed=True), states, dst=0)
    return states


def _metrics(state) -> dict:
    """The numbers logged at the step being saved (loss, learning_rate, eval metrics: a
    training and an evaluation entry may share it), as the checkpoint's metrics. Another step's
    are not this checkpoint's: recorded with saves more frequent than logs, a retention rule
    ranked checkpoints by the scores of models never stored (audit of stop 38)."""
    entries = []
    for entry in reversed(state.log_history):  # in step order: this step's entries are the last ones
        if entry.get("step") != state.global_step:
            break
        entries.append(entry)
    out = {}
    for entry in reversed(entries):
        out.update((k, v) for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    return out


class CasCallback(TrainerCallback):
    """Saves the training state into a cas store on every save event of a Trainer."""

    def __init__(self, store: str | os.PathLike | CheckpointStore, *, keep_folders: bool = True,
                 **options) -> None:
        """`store` is an open store or a path to open one at, with cas.open's `options`
        (retention= included)."""
        self.store, _ = given_or_opened(store, **options)
        self.keep_folders = keep_folders
        self._kept_best: str | None = None  # the best checkpoint's folder, kept for load_best_model_at_end

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        """A resumed run's best folder, kept by the run before it, is this run's to remove once
        another checkpoint is best (it stayed behind for good)."""
        if not self.keep_folders and args.load_best_model_at_end and state.best_model_checkpoint:
            self._kept_best = os.path.realpath(state.best_model_checkpoint)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model=None,
                optimizer=None, lr_scheduler=None, **kwargs) -> None:
        ranks = _ranks_rng_states(args)  # every rank takes part
        if not state.is_world_process_zero:
            return
        if model is None or optimizer is None:
            raise CasError("the Trainer passed no model or optimizer to on_save; cannot store the checkpoint")
        saved = {"model": model, "optimizer": optimizer, "scheduler": lr_scheduler,
                 "rng": rng_state(),  # rank 0's, as one process lays it out (a resume in one process reads it)
                 "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True)}
        if ranks:
            saved[RANKS_RNG] = ranks
        self.store.save(saved, step=state.global_step, metrics=_metrics(state), replace=True)
        if not self.keep_folders:
            self._remove_folders(args, state)

    def _remove_folders(self, args: TrainingArguments, state: TrainerState) -> None:
        """Remove the folder this save wrote, and a best one kept before that is best no more
        (only ever a checkpoint folder of this run's output_dir)."""
        best = state.best_model_checkpoint if args.load_best_model_at_end else None
        best = os.path.realpath(best) if best else None
        root = os.path.realpath(args.output_dir)
        folder = os.path.join(root, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        for old in {folder, self._kept_best} - {best, None}:
            if os.path.dirname(old) == root and os.path.basename(old).startswith(PREFIX_CHECKPOINT_DIR + "-"):
                shutil.rmtree(old, ignore_errors=True)
        self._kept_best = best


def checkpoint_folder(store: str | os.PathLike | CheckpointStore, folder: str, step: int | None = None,
                      **options) -> str:
    """Write the store's checkpoint `step` (the latest by default) into `folder` as the files
    Trainer.train(resume_from_checkpoint=folder) reads; returns `folder`. `store` is an open
    store or the path of one, opened with cas.open's `options` (key=, ...)."""
    from safetensors.torch import save_file

    with _opened(store, **options) as opened:
        state = opened.load(step)
    needed = ("model", "optimizer", "rng", "trainer_state")
    missing = [k for k in needed if k not in state] if isinstance(state, dict) else list(needed)
    if missing:
        raise CasError(f"checkpoint {'step ' + str(step) if step is not None else '(latest)'} was not saved by "
                       f"CasCallback: it lacks {missing}")
    os.makedirs(folder, exist_ok=True)
    save_file(dict(state["model"]), os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    torch.save(state["optimizer"], os.path.join(folder, OPTIMIZER_FILE))
    if state.get("scheduler") is not None:
        torch.save(state["scheduler"], os.path.join(folder, SCHEDULER_FILE))
    torch.save(state["rng"], os.path.join(folder, RNG_FILE))
    for rank, rng in enumerate(state.get(RANKS_RNG) or []):  # a distributed run's: each rank reads its own
        torch.save(rng, os.path.join(folder, RANK_RNG_FILE.format(rank)))
    with open(os.path.join(folder, TRAINER_STATE_FILE), "w", encoding="utf-8") as f:
        f.write(state["trainer_state"])
    return folder


def resume(trainer: Trainer, store: str | os.PathLike | CheckpointStore, step: int | None = None, *, trial=None,
           ignore_keys_for_eval: list[str] | None = None, **options):
    """trainer.train() resumed from the store's checkpoint `step` (the latest by default).
    `store` is an open store or the path of one, opened with cas.open's `options` (key=, ...; a
    missing store is an error, never made). With load_best_model_at_end, the best checkpoint's
    folder the resumed state names is written again from the store when it is gone (a new
    machine, a wiped scratch folder): the Trainer loads the best model from it at the end, and
    without it ends with the last weights, saying so only in a warning."""
    with tempfile.TemporaryDirectory(prefix="cas-resume-") as folder:
        with _opened(store, **options) as opened:
            checkpoint_folder(opened, folder, step)
            if trainer.args.load_best_model_at_end:
                _best_folder_again(opened, folder)
        return trainer.train(resume_from_checkpoint=folder, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)


def _best_folder_again(store: CheckpointStore, folder: str) -> None:
    """Write the folder of the best checkpoint, which the state in `folder` names, again from
    the store when it is gone and the store holds that step."""
    with open(os.path.join(folder, TRAINER_STATE_FILE), encoding="utf-8") as f:
        best = json.load(f).get("best_model_checkpoint")
    if not best or os.path.isdir(best):
        return
    named = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", os.path.basename(os.path.normpath(best)))
    if named is None or int(named.group(1)) not in {ck.step for ck in store.checkpoints()}:
        return
    try:
        checkpoint_folder(store, best, int(named.group(1)))
    except (CasError, OSError) as exc:
        warnings.warn(f"cas: the best checkpoint's folder {best} is gone and could not be written again from the "
                      f"store ({exc}); the Trainer will end with the last weights, not the best", stacklevel=3)
