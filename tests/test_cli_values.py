"""The CLI points a newcomer's run found, as a user runs them: non-tensor state (`cas show STEP
--values`, `cas cat STEP KEY`), du's and verify's counts agreeing and labelled, exports' file
mode, negative steps and `cas gc --keep-last 0` refused. Each point runs `cas` as a subprocess at
least once; the further calls of a test run the same `main` in this process (a subprocess costs
seconds of start-up on the shared cores)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import cas
from cas.cli import main

CAS = [sys.executable, "-m", "cas.cli"]


def run(*args, store, umask: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("CAS_STORE", None)
    return subprocess.run(CAS + ["--store", str(store)] + [str(a) for a in args], capture_output=True, text=True,
                          env=env, timeout=120, preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


def run_json(*args, store):
    out = run(*args, "--json", store=store)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def cli(capsys):
    """`cas ...` in this process: (exit status, stdout, stderr)."""
    def call(*args, store) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["--store", str(store), *map(str, args)])
        out, err = capsys.readouterr()
        return code, out, err
    return call


@pytest.fixture
def cli_json(cli):
    def call(*args, store):
        code, out, err = cli(*args, "--json", store=store)
        assert code == 0, err
        return json.loads(out)
    return call


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A store with one checkpoint of a real training step: model, AdamW, a scheduler, a scaler,
    the sampler, every RNG, and values of the user's own."""
    path = tmp_path_factory.mktemp("values") / "store"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    sampler = cas.ResumableRandomSampler(40, seed=3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(40, 8)), batch_size=4,
                                         sampler=sampler)
    for _, (x,) in zip(range(3), loader):  # range first: zip stops before taking a 4th batch
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    user = {"note": "warm start", "blob": b"\x00\xff", "nan": float("nan"), "half": np.float32(0.5),
            "tags": [], "extra": {}, "big": 2**70}
    with cas.open(path) as store:
        store.save({"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "loader": sampler,
                    "rng": cas.RNGState(), "step": 3, "user": user}, step=3)
    return path, model


def test_show_values_lists_every_non_tensor_value_with_its_dotted_key(trained, cli):
    path, _ = trained
    data = run_json("show", 3, "--values", store=path)
    values = {v["key"]: v for v in data["values"]}
    assert data["checkpoint"]["step"] == 3
    assert values["step"] == {"key": "step", "type": "int", "value": 3}
    assert values["scheduler.last_epoch"]["value"] == 3 and values["scheduler.base_lrs"]["value"] == [1e-3]
    assert values["scaler.scale"]["value"] == 1024.0 and values["scaler.growth_interval"]["value"] == 2000
    assert values["loader.position"]["value"] == 12 and values["loader.epoch"]["value"] == 0
    assert values["optimizer.param_groups.0.betas"] == {"key": "optimizer.param_groups.0.betas", "type": "tuple",
                                                        "value": [0.9, 0.999]}
    assert values["rng.numpy.0"]["value"] == "MT19937" and len(values["rng.python.1"]["value"]) == 625
    assert values["user.note"]["value"] == "warm start"
    assert values["user.blob"] == {"key": "user.blob", "type": "bytes", "value": "00ff"}
    assert values["user.nan"]["value"] == "nan" and values["user.half"]["type"] == "numpy.float32"
    assert values["user.tags"]["value"] == [] and values["user.extra"]["value"] == {}
    assert values["user.big"]["value"] == 2**70
    assert not any(k.startswith("model.") or k == "rng.torch" for k in values)  # tensors are `cas show`'s
    code, text, err = cli("show", 3, "--values", store=path)
    assert code == 0, err
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert lines["loader.position"].split()[1:] == ["int", "12"]
    assert lines["user.note"].split(None, 2)[2] == "'warm start'"
    assert lines["rng.python.1"].endswith("...")  # shortened; `cas cat` prints it whole


def test_cat_prints_a_value_a_tensor_summary_or_what_is_under_a_key(trained, cli, cli_json):
    path, model = trained
    out = run("cat", 3, "user.note", store=path)
    assert out.returncode == 0 and out.stdout == "warm start\n", out.stderr
    assert cli("cat", 3, "loader.position", store=path)[1] == "12\n"
    assert cli_json("cat", 3, "scheduler.base_lrs.0", store=path)["value"] == 1e-3  # an item of a list value
    assert len(cli("cat", 3, "rng.python.1", store=path)[1].split(",")) == 625  # whole
    weight = model[0].weight.detach()
    summary = cli_json("cat", 3, "model.0.weight", store=path)
    assert summary["type"] == "tensor" and summary["dtype"] == "float32" and summary["shape"] == [16, 8]
    assert summary["bytes"] == 16 * 8 * 4 and summary["chunks"] == 1
    assert summary["min"] == weight.min().item() and summary["max"] == weight.max().item()
    assert summary["first"] == weight.reshape(-1)[:8].tolist()
    under = cli_json("cat", 3, "scheduler", store=path)
    assert [v["key"] for v in under["values"]][:3] == ["scheduler.step_size", "scheduler.gamma",
                                                      "scheduler.base_lrs"]
    missing = run("cat", 3, "schedular", store=path)
    assert missing.returncode == 2 and missing.stdout == ""
    assert "no key 'schedular'" in missing.stderr and "'scheduler'" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_a_commit_node_in_the_state_is_reported_as_damage_not_a_traceback(tmp_path, cli):
    from cas.store.commit import SaveRecord, commit_save
    from cas.store.values import Ref, pack

    path = tmp_path / "store"
    with cas.open(path) as store:
        first = store.save({"w": torch.ones(2)}, step=1)
        value = pack({"k": "value", "v": {"x": Ref(bytes.fromhex(first.id))}})  # names step 1's commit node
        key = store.objects.namer.key(value)
        with store.objects.session("craft") as session:
            commit_save(store, session, SaveRecord(2, time.time(), False, {}, {}, 0), Ref(key), {key: value},
                        store._pool, "craft")
    for args in (("show", 2, "--values"), ("cat", 2, "x")):
        code, out, err = cli(*args, store=path)
        assert code == 2 and "a commit node appears inside a state tree" in err and first.id in err, err
        assert len(err.strip().splitlines()) == 1


@pytest.fixture
def with_garbage(tmp_path):
    """Deltas (older checkpoints recoded against newer ones, so deleting the newest leaves its
    chunks kept only as bases), then checkpoints deleted (their own objects are garbage until gc)."""
    path = tmp_path / "store"
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 256, generator=g)
    with cas.open(path, chunk_size=64 << 10, delta=True) as store:
        for step in (1, 2, 3):
            w = w + 1e-4 * torch.randn(128, 256, generator=g)
            store.save({"model": {"w": w, "b": torch.zeros(8)}, "step": step, "note": f"s{step}"}, step=step)
        store.save({"other": torch.randn(64, 64, generator=g)}, step=4)
        store.wait()
        store.delete([3, 4])
    return path


def test_du_and_verify_count_the_same_objects_by_role(with_garbage, cli, cli_json):
    du = run_json("du", store=with_garbage)
    verify = run_json("verify", store=with_garbage)
    roles = du["objects_by_role"]
    assert roles["total"] == du["objects"] and roles["unreferenced"] > 0 and roles["delta_bases"] > 0
    assert verify["checked_objects"] == roles["referenced"]
    assert (verify["checked_chunks"], verify["checked_manifest_nodes"], verify["checked_delta_bases"]) == \
        (roles["chunks"], roles["manifest_nodes"], roles["delta_bases"])
    assert verify["checked_raw_bytes"] == verify["checked_bytes"] < du["logical_bytes"]  # distinct chunks once
    assert 0 < verify["checked_stored_bytes"] < du["stored_bytes"]  # without the garbage
    assert cli_json("verify", "--quick", store=with_garbage)["checked_objects"] == roles["referenced"]
    raw = du["codecs"]["raw"]
    assert raw["stored_bytes"] - raw["header_bytes"] == raw["raw_bytes"]  # a raw payload is its raw bytes
    text = cli("du", store=with_garbage)[1]
    assert f"referenced    {roles['referenced']} objects ({roles['chunks']} tensor chunks" in text
    assert f"unreferenced  {roles['unreferenced']} objects" in text
    raw_row = next(line for line in text.splitlines() if line.startswith("raw "))
    assert "100.0%" in raw_row.split()
    checked = cli("verify", store=with_garbage)[1]
    assert f"checked {roles['referenced']} objects ({roles['chunks']} tensor chunks" in checked
    assert "of tensor data in distinct chunks" in checked and " stored" in checked
    assert cli("gc", "--keep-all", store=with_garbage)[0] == 0
    after = cli_json("du", store=with_garbage)
    assert after["objects"] == roles["referenced"] and after["objects_by_role"]["unreferenced"] == 0


def test_export_takes_the_umask_mode(tmp_path):
    """safetensors creates its file 0o600; an export is the user's file, made as others are."""
    path = tmp_path / "store"
    with cas.open(path) as store:
        store.save({"model": {"w": torch.ones(4)}}, step=1)
        store.export(1, tmp_path / "here.safetensors")
    here = os.umask(0o022)
    os.umask(here)
    assert stat.S_IMODE(os.stat(tmp_path / "here.safetensors").st_mode) == 0o666 & ~here
    out = run("export", 1, tmp_path / "model.safetensors", store=path, umask=0o027)
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(os.stat(tmp_path / "model.safetensors").st_mode) == 0o640


def test_a_negative_step_is_refused_at_save(tmp_path, cli_json):
    path = tmp_path / "store"
    with cas.open(path) as store:
        with pytest.raises(cas.CasError, match=r"step -1 is refused: a step is an int from 0"):
            store.save({"w": torch.ones(2)}, step=-1)
        with pytest.raises(cas.CasError, match="step -3 is refused"):
            store.save_async({"w": torch.ones(2)}, step=-3)
        store.save({"w": torch.ones(2)}, step=0)
        assert [ck.step for ck in store.checkpoints()] == [0]
    torch.save({"w": torch.ones(3)}, tmp_path / "ckpt.pt")
    out = run("import", tmp_path / "ckpt.pt", "--step", "-5", store=path)
    assert out.returncode == 2 and "step -5 is refused" in out.stderr and "Traceback" not in out.stderr
    assert [ck["step"] for ck in cli_json("ls", store=path)] == [0]


def test_gc_keep_last_zero_is_refused_saying_what_to_use(tmp_path, cli, cli_json):
    path = tmp_path / "store"
    with cas.open(path) as store:
        for step in (1, 2, 3):
            store.save({"w": torch.full((4,), float(step))}, step=step)
    out = run("gc", "--keep-last", "0", store=path)
    assert out.returncode == 2 and out.stdout == ""
    assert "--keep-last 1" in out.stderr and "--keep-all" in out.stderr
    assert [ck["step"] for ck in cli_json("ls", store=path)] == [1, 2, 3]
    assert cli("gc", "--keep-last", "1", store=path)[0] == 0
    assert [ck["step"] for ck in cli_json("ls", store=path)] == [3]


def test_ints_of_up_to_32767_bits_print_and_an_export_that_cannot_hold_them_writes_nothing(tmp_path, cli):
    """A checkpoint may hold ints of up to 32767 bits; `cas show --values` and `cas cat` failed
    on them with a traceback (Python's 4,300-digit limit on int-to-str), and `cas export` to a
    torch.save file wrote a file torch.load(weights_only=True) cannot read, then failed reading it
    back, leaving it behind. Export now refuses before it writes, naming the key."""
    huge = -(2**32766)
    with cas.open(tmp_path / "s") as store:
        store.save({"w": torch.ones(2), "n": huge, "fits": 2**2039 - 1}, step=1)
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # (this test's own str() of it)
    try:
        digits = str(huge)
    finally:
        sys.set_int_max_str_digits(limit)
    for args in (("cat", 1, "n"), ("cat", 1, "n", "--json"), ("show", 1, "--values"), ("show", 1, "--values", "--json")):
        code, out, err = cli(*args, store=tmp_path / "s")
        assert code == 0 and "Traceback" not in err, (args, err)
        assert args[0] == "show" or digits in out
    assert sys.get_int_max_str_digits() == limit  # the CLI put the process's limit back
    out_file = tmp_path / "x.pt"
    code, _, err = cli("export", 1, out_file, store=tmp_path / "s")
    assert code == 2 and "'n'" in err and "weights_only" in err and not out_file.exists()
    code, _, err = cli("export", 1, out_file, "--keys", "w", "fits", store=tmp_path / "s")
    assert code == 0, err
    assert torch.load(out_file, weights_only=True)["fits"] == 2**2039 - 1
