"""Trainer hooks: a Lightning CheckpointIO plugin and a Hugging Face TrainerCallback. Each trains a
tiny model, stops, resumes from the cas store and must end bit for bit where an uninterrupted run
ends. The frameworks are test-only dependencies (the `integrations` extra)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def torch_modes_restored():
    """Trainers may switch torch into global modes (Lightning's deterministic=True turns on
    deterministic algorithms for the whole process); later tests must not inherit them."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), f"{name} differs after resume"


# --- Lightning --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def L():
    return pytest.importorskip("lightning")


def _lightning_parts(L):
    """A tiny module and loader. No dropout and no shuffling: Lightning itself saves neither the
    global RNG nor the sampler's generator, so those would differ after any resume."""

    class Tiny(L.LightningModule):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()  # an AttributeDict in the checkpoint
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
            self.losses: list[float] = []

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g))
    return Tiny, torch.utils.data.DataLoader(data, batch_size=8)


def _lightning_trainer(L, epochs: int, dirpath, io=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    return L.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", devices=1, plugins=[io] if io else None,
                     callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)])


def test_lightning_resume_from_the_store_matches_an_uninterrupted_run(L, tmp_path):
    from cas.store.lightning import CasCheckpointIO

    Tiny, loader = _lightning_parts(L)
    torch.manual_seed(0)
    full = Tiny()
    _lightning_trainer(L, 3, tmp_path / "full").fit(full, loader)

    io = CasCheckpointIO(tmp_path / "store")
    torch.manual_seed(0)
    _lightning_trainer(L, 2, tmp_path / "ckpt", io).fit(Tiny(), loader)
    # ModelCheckpoint kept its top-1 and last.ckpt, both at step 8; earlier ones were removed.
    assert [ck.step for ck in io.store.checkpoints()] == [8]
    assert not os.path.exists(tmp_path / "ckpt")  # nothing was written at Lightning's paths

    torch.manual_seed(1)  # a fresh process would start from other weights: they must not matter
    resumed = Tiny()
    _lightning_trainer(L, 3, tmp_path / "ckpt", CasCheckpointIO(io.store)).fit(
        resumed, loader, ckpt_path=io.latest_path())
    assert resumed.losses == full.losses[-4:]
    assert_same_weights(resumed, full)
    assert [ck.step for ck in io.store.checkpoints()] == [12]
    io.close()


def test_lightning_paths_behave_like_files_that_saves_overwrite(L, tmp_path):
    from cas.store.lightning import CasCheckpointIO

    io = CasCheckpointIO(tmp_path / "store")

    from lightning.pytorch.utilities.parsing import AttributeDict

    def save(path, step):
        io.save_checkpoint({"global_step": step, "w": torch.full((2,), float(step)), "hp": AttributeDict(lr=0.1)}, path)

    save("d/epoch=0-step=4.ckpt", 4)
    save("d/last.ckpt", 4)  # the same step again: replaced, now known by both names
    save("d/epoch=1-step=8.ckpt", 8)
    io.remove_checkpoint("d/epoch=0-step=4.ckpt")  # last.ckpt still names step 4
    assert [ck.step for ck in io.store.checkpoints()] == [4, 8]
    save("d/last.ckpt", 8)  # last.ckpt moves on: step 4 has no name left
    assert [ck.step for ck in io.store.checkpoints()] == [8]
    assert io.load_checkpoint("d/last.ckpt")["hp"] == {"lr": 0.1}
    assert torch.equal(io.load_checkpoint("elsewhere/epoch=1-step=8.ckpt")["w"], torch.full((2,), 8.0))
    save("d/last.ckpt", 12)  # monitor-style: only last.ckpt names the newest steps
    save("d/last.ckpt", 16)
    assert [ck.step for ck in io.store.checkpoints()] == [8, 16]
    io.store.set_pinned(8)
    io.remove_checkpoint("d/epoch=1-step=8.ckpt")  # a pinned checkpoint stays
    assert io.step_for("last") == 16 and [ck.step for ck in io.store.checkpoints()] == [8, 16]
    with pytest.raises(Exception, match="no checkpoint"):
        io.load_checkpoint("d/best.ckpt")
    io.close()


def test_hooks_handed_a_path_open_the_store_as_cas_open_does(L, tmp_path):
    """A path and cas.open's options, retention included: the plugin's store applies it."""
    import cas
    from cas.store.hf import CasCallback
    from cas.store.lightning import CasCheckpointIO

    io = CasCheckpointIO(tmp_path / "store", retention=cas.Retention(keep_last=2), chunk_size=64 << 10)
    for step in (1, 2, 3):
        io.save_checkpoint({"global_step": step, "w": torch.full((2,), float(step))}, f"d/epoch=0-step={step}.ckpt")
    assert isinstance(io.store, cas.Store) and [ck.step for ck in io.store.checkpoints()] == [2, 3]
    io.close()
    callback = CasCallback(tmp_path / "store", retention=cas.Retention(keep_last=1))
    assert callback.store.retention == cas.Retention(keep_last=1)
    callback.store.close()


# --- Hugging Face -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def _hf_parts(transformers, tmp_path):
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


def test_hf_callback_resume_matches_an_uninterrupted_run(transformers, tmp_path):
    from cas.store.hf import CasCallback, resume

    dataset, model, args = _hf_parts(transformers, tmp_path)
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
    losses = [h["loss"] for h in again.state.log_history if "loss" in h]
    assert losses == [h["loss"] for h in full.state.log_history if "loss" in h]
    assert_same_weights(again.model, full.model)
    callback.store.close()
