"""The Lightning CheckpointIO plugin under Lightning's own Trainer and ModelCheckpoint: a resume
ends bit for bit where an uninterrupted run ends, a second run into the same dirpath keeps the
first run's checkpoints (versioned names, as with files), save_last="link", and loading without
the plugin (Model.load_from_checkpoint, a plugin-less Trainer) through cas:// URLs. Lightning
is a test-only dependency (the `integrations` extra)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from importlib.metadata import entry_points

import pytest
import torch

from helpers import assert_same

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.utilities.parsing import AttributeDict  # noqa: E402

import cas  # noqa: E402
from cas.errors import CasError, CheckpointNotFoundError  # noqa: E402
from cas.store.lightning import CasCheckpointIO, cas_url  # noqa: E402


@pytest.fixture(autouse=True)
def torch_modes_restored():
    """Trainers may switch torch into global modes (Lightning's deterministic=True turns on
    deterministic algorithms for the whole process); later tests must not inherit them."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


class Tiny(L.LightningModule):
    """No dropout and no shuffling: Lightning itself saves neither the global RNG nor the
    sampler's generator, so those would differ after any resume."""

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


def loader():
    """32 samples in batches of 8: four steps an epoch."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def trainer(epochs: int, io=None, **checkpointing) -> L.Trainer:
    """A CPU Trainer with one ModelCheckpoint(**checkpointing), or none when not given."""
    return L.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", devices=1, plugins=[io] if io else None,
                     callbacks=[ModelCheckpoint(**checkpointing)] if checkpointing else None,
                     enable_checkpointing=bool(checkpointing))


def fitted(seed: int, epochs: int, io=None, ckpt_path=None, **checkpointing) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny()
    trainer(epochs, io, **checkpointing).fit(model, loader(), ckpt_path=ckpt_path)
    return model


def weights(model: torch.nn.Module):
    return model.state_dict()


def test_resume_from_the_store_matches_an_uninterrupted_run(tmp_path):
    full = fitted(0, 3, dirpath=tmp_path / "full", save_last=True)

    io = CasCheckpointIO(tmp_path / "store")
    fitted(0, 2, io, dirpath=tmp_path / "ckpt", save_last=True)
    # ModelCheckpoint kept its top-1 and last.ckpt, both at step 8 (last.ckpt replaced the first
    # save in its commit); earlier ones were removed, markers and checkpoints alike.
    assert [ck.step for ck in io.store.checkpoints()] == [8]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert io.latest_path() == str(tmp_path / "ckpt" / "last.ckpt")

    resumed = fitted(1, 3, CasCheckpointIO(io.store), ckpt_path="last",  # Lightning finds last.ckpt itself
                     dirpath=tmp_path / "ckpt", save_last=True)  # seed 1: other weights, which must not matter
    assert resumed.losses == full.losses[-4:]
    assert_same(weights(resumed), weights(full))
    assert [ck.step for ck in io.store.checkpoints()] == [12]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=2-step=12.ckpt", "last.ckpt"]
    io.close()


class WithHparams(Tiny):
    def __init__(self, lr: float = 0.05, precision=torch.bfloat16, tags=frozenset({"a", "b"}), seen=None) -> None:
        super().__init__(lr)
        self.save_hyperparameters()


def test_hyperparameters_holding_a_dtype_or_a_set_are_saved_and_resumed(tmp_path):
    """`save_hyperparameters()` with a torch dtype (a precision setting) or a set killed
    Trainer.fit at its first checkpoint (TypeError: cannot store torch.dtype), losing the
    training before it; Lightning's own files hold them. Both are values a checkpoint holds now."""
    io = CasCheckpointIO(tmp_path / "store")
    torch.manual_seed(0)
    model = WithHparams(seen={"x", "y"})
    trainer(1, io, dirpath=tmp_path / "ckpt", save_last=True).fit(model, loader())
    hparams = io.store.load(4)["hyper_parameters"]
    assert hparams["precision"] is torch.bfloat16 and hparams["tags"] == frozenset({"a", "b"})
    assert hparams["seen"] == {"x", "y"} and type(hparams["seen"]) is set
    resumed = WithHparams.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert resumed.hparams.precision is torch.bfloat16 and resumed.hparams.seen == {"x", "y"}
    assert_same(weights(resumed), weights(model))
    io.close()


def test_a_run_folder_moved_or_renamed_resumes_its_own_checkpoints(tmp_path):
    """Markers held the store's absolute path, and a load opened that store rather than the
    plugin's: a run renamed to exp_old, with another run then trained in exp, resumed from the
    other run's weights with no error (that run's checkpoint at the same step listed the old
    path); a run folder moved elsewhere could not be resumed or loaded at all. A checkpoint id
    is its content's hash, so a store holding it holds that checkpoint: the plugin's own store
    is asked first, then the store at the marker's relative place, then the one it names."""
    import shutil

    run, old = tmp_path / "exp", tmp_path / "exp_old"
    first = fitted(0, 2, CasCheckpointIO(run / "store"), dirpath=run / "ckpt", save_last=True)
    os.rename(run, old)
    second = fitted(1, 2, CasCheckpointIO(run / "store"), dirpath=run / "ckpt", save_last=True)
    assert not torch.equal(first.net[0].weight, second.net[0].weight)
    for ckpt_path in (str(old / "ckpt" / "last.ckpt"), "last"):
        io = CasCheckpointIO(old / "store")
        resumed = fitted(2, 2, io, ckpt_path=ckpt_path, dirpath=old / "ckpt", save_last=True)
        io.close()
        assert_same(weights(resumed), weights(first))  # two epochs done: nothing trained after the load
    assert_same(weights(Tiny.load_from_checkpoint(old / "ckpt" / "last.ckpt")), weights(first))
    moved = tmp_path / "elsewhere" / "exp"
    shutil.move(old, moved)
    io = CasCheckpointIO(moved / "store")
    resumed = fitted(2, 2, io, ckpt_path="last", dirpath=moved / "ckpt", save_last=True)
    io.close()
    assert_same(weights(resumed), weights(first))
    assert_same(weights(Tiny.load_from_checkpoint(moved / "ckpt" / "last.ckpt")), weights(first))


@pytest.mark.parametrize("naming", [{}, {"filename": "model", "monitor": "step", "mode": "max"}],
                         ids=["default-names", "fixed-filename"])
def test_a_second_run_into_the_same_dirpath_keeps_the_first_runs_checkpoints(tmp_path, naming):
    """Lightning versions a name it finds taken (epoch=0-step=4-v1.ckpt; model.ckpt,
    model-v1.ckpt, ... for a fixed filename). Before the markers it found nothing at the paths,
    so the second run's saves replaced the first run's (and a fixed filename kept only the
    latest). The oracle is Lightning with its own files: the same runs into a folder of
    torch.save files give the same names, each holding what the marker's checkpoint holds."""
    def two_runs(dirpath, store=None):
        for seed in (0, 1):  # other weights each run
            io = CasCheckpointIO(store) if store else None
            fitted(seed, 2, io, dirpath=dirpath, save_top_k=-1, **naming)
            if io:
                io.close()

    two_runs(tmp_path / "files")
    with pytest.warns(UserWarning, match="holds another checkpoint"):
        two_runs(tmp_path / "ckpt", tmp_path / "store")

    names = sorted(os.listdir(tmp_path / "files"))
    assert sorted(os.listdir(tmp_path / "ckpt")) == names and len(names) == 4
    io = CasCheckpointIO(tmp_path / "store")
    # Steps 4 and 8 hold the first run's checkpoints; the second run's are kept above them.
    assert [(ck.step, ck.meta["lightning_global_step"]) for ck in io.store.checkpoints()] == [
        (4, 4), (8, 8), (9, 4), (10, 8)]
    for name in names:
        ours = io.load_checkpoint(tmp_path / "ckpt" / name)
        theirs = torch.load(tmp_path / "files" / name, weights_only=True)
        assert ours["global_step"] == theirs["global_step"]
        assert_same(ours["state_dict"], theirs["state_dict"])
    io.close()


def test_one_async_plugin_for_two_runs_keeps_the_first_runs_checkpoints(tmp_path):
    """One CasCheckpointIO under AsyncCheckpointIO for two fits into one dirpath: AsyncCheckpointIO
    does not pass its teardown on, so the plugin took the second run's saves at steps 4 and 8
    for the first run's own and replaced them (the first run's checkpoints gone). The oracle is
    the same two runs with Lightning's own files."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    io = CasCheckpointIO(tmp_path / "store")
    for seed in (0, 1):
        fitted(seed, 2, None, dirpath=tmp_path / "files", save_top_k=-1)
    with pytest.warns(UserWarning, match="holds another checkpoint"):
        for seed in (0, 1):
            fitted(seed, 2, AsyncCheckpointIO(io), dirpath=tmp_path / "ckpt", save_top_k=-1)
    names = sorted(os.listdir(tmp_path / "files"))
    assert sorted(os.listdir(tmp_path / "ckpt")) == names and len(names) == 4
    assert [(ck.step, ck.meta["lightning_global_step"]) for ck in io.store.checkpoints()] == [
        (4, 4), (8, 8), (9, 4), (10, 8)]
    for name in names:
        theirs = torch.load(tmp_path / "files" / name, weights_only=True)
        ours = io.load_checkpoint(tmp_path / "ckpt" / name)["state_dict"]  # (AsyncCheckpointIO's clone drops
        assert_same(dict(ours), dict(theirs["state_dict"]))  # the OrderedDict's _metadata)
    io.close()


def test_save_last_link_links_last_to_the_checkpoint_it_names(tmp_path):
    """save_last="link": Lightning makes last.ckpt a link to the top-k file instead of saving."""
    ckpt = tmp_path / "ckpt"
    io = CasCheckpointIO(tmp_path / "store")
    model = fitted(0, 2, io, dirpath=ckpt, save_last="link")
    assert os.path.islink(ckpt / "last.ckpt")
    assert os.path.realpath(ckpt / "last.ckpt") == str(ckpt / "epoch=1-step=8.ckpt")
    assert [ck.step for ck in io.store.checkpoints()] == [8]  # the epoch-0 save was rotated out
    assert_same(io.load_checkpoint(ckpt / "last.ckpt")["state_dict"], weights(model))
    assert_same(Tiny.load_from_checkpoint(cas_url(ckpt / "last.ckpt")).state_dict(), weights(model))

    resumed = fitted(1, 3, CasCheckpointIO(io.store), ckpt_path="last", dirpath=ckpt, save_last="link")
    assert len(resumed.losses) == 4 and os.path.realpath(ckpt / "last.ckpt") == str(ckpt / "epoch=2-step=12.ckpt")
    assert [ck.step for ck in io.store.checkpoints()] == [12]
    io.close()


def test_lightning_loads_a_marker_without_the_plugin_through_its_cas_url(tmp_path):
    ckpt = tmp_path / "ckpt"
    io = CasCheckpointIO(tmp_path / "store")
    model = fitted(0, 2, io, dirpath=ckpt, save_last=True)
    full = fitted(0, 3)

    loaded = Tiny.load_from_checkpoint(cas_url(ckpt / "last.ckpt"))
    assert_same(loaded.state_dict(), weights(model))
    assert_same(io.load_checkpoint(cas_url(ckpt / "last.ckpt"))["state_dict"], weights(model))  # the plugin too
    assert loaded.hparams.lr == 0.05
    resumed = fitted(1, 3, ckpt_path=cas_url(ckpt / "epoch=1-step=8.ckpt"))  # a Trainer without the plugin
    assert resumed.losses == full.losses[-4:]
    assert_same(weights(resumed), weights(full))

    # The plain marker path too, once cas.store.lightning is imported: Lightning's own loader
    # reads markers through cas (load_from_checkpoint, and a Trainer without the plugin).
    plain = Tiny.load_from_checkpoint(ckpt / "last.ckpt")
    assert_same(plain.state_dict(), weights(model))
    resumed = fitted(1, 3, ckpt_path=ckpt / "epoch=1-step=8.ckpt")
    assert resumed.losses == full.losses[-4:]
    assert_same(weights(resumed), weights(full))
    io.close()


def test_a_process_that_never_imported_cas_is_told_what_a_marker_is(tmp_path):
    io = CasCheckpointIO(tmp_path / "store")
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    io.close()
    code = "import sys, torch\ntorch.load(sys.argv[1], weights_only=True)\n"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "load it through cas.store.lightning" in out.stderr, out.stderr[-2000:]


def test_a_fresh_process_reads_cas_urls_through_the_entry_point(tmp_path):
    """The package's fsspec entry point: a process that never imports cas reads cas:// files."""
    assert any(ep.name == "cas" and ep.value == "cas.store.lightning:CasFileSystem"
               for ep in entry_points(group="fsspec.specs")), "reinstall the package (pip install -e .)"
    io = CasCheckpointIO(tmp_path / "store")
    w = torch.arange(6.0).reshape(2, 3)
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": w}}, tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    io.close()
    code = ("import sys, fsspec, torch\n"
            "with fsspec.open(sys.argv[1], 'rb') as f:\n"
            "    state = torch.load(f, weights_only=True)\n"
            "print(state['state_dict']['w'].tolist(), state['global_step'], 'cas' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, cas_url(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[[0.0,", "1.0,", "2.0],", "[3.0,", "4.0,", "5.0]]", "3", "True"]


def test_markers_live_where_the_dirpath_is_another_fsspec_filesystem(tmp_path):
    """A dirpath in a bucket (here fsspec's memory://, real fsspec code): Lightning checks and
    lists it through fsspec, so the markers are written there too."""
    import fsspec

    dirpath = f"memory://{tmp_path.name}/ckpt"
    try:
        for seed in (0, 1):
            io = CasCheckpointIO(tmp_path / "store")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the second run's "holds another checkpoint"
                model = fitted(seed, 2, io, dirpath=dirpath, save_top_k=-1, save_last=True)
            io.close()
        names = sorted(os.path.basename(p) for p in fsspec.filesystem("memory").ls(dirpath, detail=False))
        assert names == ["epoch=0-step=4-v1.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=8-v1.ckpt",
                         "epoch=1-step=8.ckpt", "last-v1.ckpt", "last.ckpt"]
        assert_same(Tiny.load_from_checkpoint(cas_url(f"{dirpath}/last-v1.ckpt")).state_dict(), weights(model))
        # Lightning's own loader reads a marker there too (it only looked at local files)
        assert_same(Tiny.load_from_checkpoint(f"{dirpath}/last-v1.ckpt").state_dict(), weights(model))
    finally:
        fsspec.filesystem("memory").rm(f"memory://{tmp_path.name}", recursive=True)


def test_storage_options_are_refused_as_lightnings_own_plugins_refuse_them(tmp_path):
    io = CasCheckpointIO(tmp_path / "store")
    model = Tiny()
    t = trainer(1, io)
    t.fit(model, loader())
    with pytest.raises(TypeError, match="storage_options.*not supported for `CasCheckpointIO`"):
        t.save_checkpoint(tmp_path / "x.ckpt", storage_options={"compression": "zstd"})
    assert io.store.checkpoints() == [] and not os.path.exists(tmp_path / "x.ckpt")
    io.close()


def test_paths_behave_like_files_that_saves_overwrite(tmp_path):
    d = tmp_path / "d"
    io = CasCheckpointIO(tmp_path / "store")

    def save(name, step):
        io.save_checkpoint({"global_step": step, "w": torch.full((2,), float(step)), "hp": AttributeDict(lr=0.1)},
                           d / name)

    save("epoch=0-step=4.ckpt", 4)
    save("last.ckpt", 4)  # the same step of the same run again: replaced, now known by both names
    save("epoch=1-step=8.ckpt", 8)
    io.remove_checkpoint(d / "epoch=0-step=4.ckpt")  # last.ckpt still names step 4
    assert [ck.step for ck in io.store.checkpoints()] == [4, 8]
    assert sorted(os.listdir(d)) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    save("last.ckpt", 8)  # last.ckpt moves on: step 4 has no name left
    assert [ck.step for ck in io.store.checkpoints()] == [8]
    assert io.load_checkpoint(d / "last.ckpt")["hp"] == {"lr": 0.1}
    assert torch.equal(io.load_checkpoint("elsewhere/epoch=1-step=8.ckpt")["w"], torch.full((2,), 8.0))
    save("last.ckpt", 12)  # monitor-style: only last.ckpt names the newest steps
    save("last.ckpt", 16)
    assert [ck.step for ck in io.store.checkpoints()] == [8, 16]
    io.store.set_pinned(8)
    io.remove_checkpoint(d / "epoch=1-step=8.ckpt")  # a pinned checkpoint stays
    assert io.step_for("last") == 16 and [ck.step for ck in io.store.checkpoints()] == [8, 16]
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        io.load_checkpoint(d / "best.ckpt")

    io.teardown()  # the run ended: a save at one of its steps is another run's, kept beside it
    with pytest.warns(UserWarning, match="kept beside it as step 17"):
        save("epoch=3-step=16.ckpt", 16)
    assert [ck.step for ck in io.store.checkpoints()] == [8, 16, 17]
    io.close()


def test_a_marker_whose_checkpoint_is_gone_or_a_file_that_is_no_marker_says_so(tmp_path):
    d = tmp_path / "d"
    io = CasCheckpointIO(cas.open(tmp_path / "store", retention=cas.Retention(keep_last=1)))
    for step in (1, 2):
        io.save_checkpoint({"global_step": step, "w": torch.ones(2)}, d / f"epoch=0-step={step}.ckpt")
    assert [ck.step for ck in io.store.checkpoints()] == [2]  # retention deleted step 1; its marker stays
    with pytest.raises(CheckpointNotFoundError, match="no longer holds it"):
        io.load_checkpoint(d / "epoch=0-step=1.ckpt")
    with pytest.raises(CheckpointNotFoundError, match="no longer holds it"):
        Tiny.load_from_checkpoint(cas_url(d / "epoch=0-step=1.ckpt"))

    torch.save({"w": torch.ones(2)}, d / "plain.ckpt")  # a torch.save file is never unpickled here
    with pytest.raises(CasError, match="is not a cas checkpoint marker"):
        io.load_checkpoint(d / "plain.ckpt")
    io.remove_checkpoint(d / "plain.ckpt")
    assert os.path.exists(d / "plain.ckpt")  # only markers and links are removed
    io.close()


def test_a_plugin_handed_a_path_opens_the_store_as_cas_open_does(tmp_path):
    """A path and cas.open's options, retention included: the plugin's store applies it."""
    io = CasCheckpointIO(tmp_path / "store", retention=cas.Retention(keep_last=2), chunk_size=64 << 10)
    for step in (1, 2, 3):
        io.save_checkpoint({"global_step": step, "w": torch.full((2,), float(step))},
                           tmp_path / "d" / f"epoch=0-step={step}.ckpt")
    assert isinstance(io.store, cas.Store) and [ck.step for ck in io.store.checkpoints()] == [2, 3]
    io.close()


def test_async_checkpoint_io_with_save_top_k_leaves_only_the_kept_checkpoints(tmp_path):
    """Lightning's AsyncCheckpointIO queues saves on a thread but removes at once: with
    save_top_k, ModelCheckpoint removes a path whose save has not run yet. Before, that save
    then wrote its marker and checkpoint after their removal, and they stayed for good."""
    import threading

    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from cas import faults

    gate = str(tmp_path / "gate")
    faults.configure(f"save.planned=pause:{gate}@1")  # the first save waits while training goes on

    def release() -> None:
        while not os.path.exists(gate + ".reached"):
            threading.Event().wait(0.01)
        threading.Event().wait(1.0)  # later checkpoints are queued, and the first one's path removed
        open(gate, "w").close()
    opener = threading.Thread(target=release, daemon=True)
    opener.start()
    d = tmp_path / "ckpts"
    io = CasCheckpointIO(tmp_path / "store")
    try:
        torch.manual_seed(0)
        t = trainer(3, AsyncCheckpointIO(io), dirpath=d, save_top_k=1, every_n_train_steps=2)
        t.fit(Tiny(), loader())
    finally:
        faults.configure("")
        open(gate, "w").close()
        opener.join()
    kept = t.checkpoint_callback.best_model_path
    assert sorted(os.listdir(d)) == [os.path.basename(kept)]
    assert [ck.step for ck in io.store.checkpoints()] == [io.step_for(kept)]
    io.close()


def test_async_save_last_with_save_top_k_keeps_last_while_its_kept_path_is_removed(tmp_path):
    """save_last=True beside save_top_k=1 under AsyncCheckpointIO: the save of last.ckpt at a
    step keeps the top-k path's marker naming the same checkpoint, and ModelCheckpoint removes
    that path on its own thread while the save runs. Before, the removal found no marker naming
    the just-committed checkpoint yet and deleted it; the save then wrote its markers anyway:
    the removed file came back and last.ckpt named a deleted checkpoint (stop 36's audit)."""
    import threading

    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from cas import faults

    d = tmp_path / "ckpts"
    gate = str(tmp_path / "gate")
    # saves run P1, last@1, P2, last@2, ...: the save of last.ckpt at step 1 waits after its commit
    faults.configure(f"save.committed=pause:{gate}@2")

    def release() -> None:
        while not os.path.exists(gate + ".reached"):
            threading.Event().wait(0.01)
        for _ in range(1000):  # until step 2's top-k save has removed step 1's path
            if not os.path.exists(d / "epoch=0-step=1.ckpt"):
                break
            threading.Event().wait(0.01)
        open(gate, "w").close()
    opener = threading.Thread(target=release, daemon=True)
    opener.start()
    class WaitsForTheSave(Tiny):
        def training_step(self, batch, batch_idx):
            for _ in range(1000 if batch_idx == 1 else 0):  # step 1's saves run first
                if os.path.exists(gate + ".reached"):
                    break
                threading.Event().wait(0.01)
            return super().training_step(batch, batch_idx)

    io = CasCheckpointIO(tmp_path / "store")
    try:
        torch.manual_seed(0)
        t = trainer(1, AsyncCheckpointIO(io), dirpath=d, save_top_k=1, save_last=True, every_n_train_steps=1)
        t.fit(WaitsForTheSave(), loader())
    finally:
        faults.configure("")
        open(gate, "w").close()
        opener.join()
    assert sorted(os.listdir(d)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert [ck.step for ck in io.store.checkpoints()] == [4]
    for name in os.listdir(d):
        assert io.load_checkpoint(d / name)["global_step"] == 4
    io.close()


def test_saves_of_one_step_with_other_contents_each_keep_their_own(tmp_path):
    """Two ModelCheckpoints at the same global step, a full one and then a weights-only one: the
    plugin took the second for the same checkpoint and replaced the full one with it, so
    fit(ckpt_path=the full path) failed ("checkpoint contains only the model"; audit of stop 38).
    A save of other content (other top-level entries, or other loop progress) now goes beside."""
    io = CasCheckpointIO(tmp_path / "store")
    dirpath = tmp_path / "ckpt"
    callbacks = [ModelCheckpoint(dirpath=dirpath, filename="full-{step}", save_top_k=-1),
                 ModelCheckpoint(dirpath=dirpath, filename="w-{step}", save_top_k=-1, save_weights_only=True,
                                 monitor="step", mode="max")]
    torch.manual_seed(0)
    L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
              plugins=[io], callbacks=callbacks).fit(Tiny(), loader())
    full, light = io.load_checkpoint(dirpath / "full-step=4.ckpt"), io.load_checkpoint(dirpath / "w-step=4.ckpt")
    assert "optimizer_states" in full and "optimizer_states" not in light
    assert_same(full["state_dict"], light["state_dict"])
    ckpt_path = str(dirpath / "full-step=4.ckpt")
    resumed = fitted(1, 2, CasCheckpointIO(io.store), ckpt_path=ckpt_path, dirpath=tmp_path / "again")
    assert_same(weights(resumed), weights(fitted(0, 2)))
    io.close()


def test_two_runs_sharing_a_store_that_reach_one_step_together_both_keep_it(tmp_path):
    """Run A placed its save at step 4 (free), run B committed its own step 4, then A's commit
    replaced it: B's marker named a checkpoint the store no longer held (audit of stop 38). A
    save now replaces exactly what it was placed over, and is placed again when another run
    took the step. A's save is held at `save.planned` while B runs, in two processes."""
    import time

    child = (
        "import sys, torch, lightning as L\n"
        "from lightning.pytorch.callbacks import ModelCheckpoint\n"
        "from cas.store.lightning import CasCheckpointIO\n"
        "from test_lightning import Tiny, loader\n"
        "torch.manual_seed(int(sys.argv[3]))\n"
        "L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,\n"
        "          accelerator='cpu', plugins=[CasCheckpointIO(sys.argv[1])],\n"
        "          callbacks=[ModelCheckpoint(dirpath=sys.argv[2])]).fit(Tiny(), loader())\n")
    store, gate = tmp_path / "store", tmp_path / "gate"
    here = os.path.dirname(__file__)

    def run(name: str, seed: int, faults: str = ""):
        env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", ""), "CAS_FAULTS": faults}
        return subprocess.Popen([sys.executable, "-c", child, str(store), str(tmp_path / name), str(seed)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    a = run("a", 0, f"save.planned=pause:{gate}@1")
    deadline = time.monotonic() + 120
    while not os.path.exists(f"{gate}.reached") and a.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(f"{gate}.reached"), a.stderr.read()[-2000:] if a.poll() is not None else "no pause"
    b = run("b", 1)
    assert b.wait(120) == 0, b.stderr.read()[-3000:]
    gate.touch()
    assert a.wait(120) == 0, a.stderr.read()[-3000:]
    with cas.open(store) as opened:
        io = CasCheckpointIO(opened)
        assert sorted(ck.step for ck in opened.checkpoints()) == [4, 5]
        loaded = [io.load_checkpoint(tmp_path / run_name / "epoch=0-step=4.ckpt") for run_name in ("a", "b")]
        assert loaded[0]["global_step"] == loaded[1]["global_step"] == 4
        assert not torch.equal(loaded[0]["state_dict"]["net.0.weight"], loaded[1]["state_dict"]["net.0.weight"])


def test_a_store_reached_by_another_spelling_of_its_path_is_its_own(tmp_path):
    """Run 1 opened the store through a symlinked folder, the resume by its real path: the
    plugin compared the markers' store paths as strings, took run 1's checkpoints for another
    store's, and deleted only their markers when Lightning removed them: checkpoints no path
    named stayed for good (audit of stop 38)."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)

    def fit(root, epochs: int, ckpt_path=None) -> list[int]:
        io = CasCheckpointIO(root / "store")
        fitted(0, epochs, io, ckpt_path=ckpt_path, dirpath=root / "ckpt", monitor="step", mode="max", save_top_k=1,
               save_last=True)
        steps = [ck.step for ck in io.store.checkpoints()]
        io.close()
        return steps

    assert fit(link, 1) == [4]
    assert fit(real, 2, ckpt_path="last") == [8]
    assert sorted(os.listdir(real / "ckpt")) == ["epoch=1-step=8.ckpt", "last.ckpt"]


class Configured(Tiny):
    def __init__(self, lr: float = 0.05, data_dir=None, device=None, activation=None, loss_fn=None) -> None:
        super().__init__(lr)
        self.save_hyperparameters()


def test_hyperparameters_a_store_cannot_hold_are_kept_as_text_and_fit_goes_on(tmp_path):
    """save_hyperparameters() holding a Path, a device, a class or a module made the first save
    a TypeError that ended fit (a class's unbound state_dict was even called; a module became
    its state dict; audit of stop 38). They are stored as text, each with a warning."""
    import pathlib

    io = CasCheckpointIO(tmp_path / "store")
    model = Configured(data_dir=pathlib.Path("/data/set"), device=torch.device("cpu"), activation=torch.nn.ReLU,
                       loss_fn=torch.nn.CrossEntropyLoss())
    with pytest.warns(UserWarning, match="hyperparameter 'hyper_parameters.activation' .* 'torch.nn.modules"):
        trainer(1, io, dirpath=tmp_path / "ckpt").fit(model, loader())
    hparams = io.load_checkpoint(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")["hyper_parameters"]
    assert (hparams["data_dir"], hparams["device"], hparams["lr"]) == ("/data/set", "cpu", 0.05)
    assert hparams["activation"] == "torch.nn.modules.activation.ReLU" and hparams["loss_fn"] == "CrossEntropyLoss()"
    io.close()
