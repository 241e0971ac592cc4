"""The CLI as a user runs it: subprocesses, output and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import cas

CAS = [sys.executable, "-m", "cas.cli"]


def run(*args, store=None, env_store=None, cwd=None):
    env = dict(os.environ)
    env.pop("CAS_STORE", None)
    if env_store is not None:
        env["CAS_STORE"] = str(env_store)
    argv = CAS + (["--store", str(store)] if store else []) + [str(a) for a in args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


@pytest.fixture
def filled(tmp_path):
    path = tmp_path / "store"
    with cas.open(path, chunk_size=64 << 10, pack_max=4096) as s:
        base = torch.randn(256, 256)
        for step in (100, 200, 300):
            s.save({"model": {"base": base, "head": torch.randn(64, 64)}, "step": step}, step=step,
                   metrics={"val_loss": 3.0 - step / 100})
    return path


def test_ls_plain_and_json(filled):
    out = run("ls", store=filled)
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()[1:]] == ["100", "200", "300"]
    data = json.loads(run("ls", "--json", store=filled).stdout)
    assert [d["step"] for d in data] == [100, 200, 300]
    assert data[0]["metrics"] == {"val_loss": 2.0}


def test_store_flag_after_the_command_and_from_environment(filled, tmp_path):
    assert run("ls", "--json", "--store", filled).returncode == 0
    out = run("ls", "--json", env_store=filled)
    assert out.returncode == 0 and len(json.loads(out.stdout)) == 3
    out = run("ls", "--json", cwd=filled)  # the current folder
    assert out.returncode == 0 and len(json.loads(out.stdout)) == 3


def test_show_lists_tensors_with_new_chunks(filled):
    data = json.loads(run("show", 200, "--json", store=filled).stdout)
    rows = {r["path"]: r for r in data["tensors"]}
    assert rows["model.base"]["shape"] == [256, 256] and rows["model.base"]["dtype"] == "float32"
    assert rows["model.base"]["chunks"] == 4 and rows["model.base"]["new_chunks"] == 0
    assert rows["model.head"]["new_chunks"] == 1
    text = run("show", 200, store=filled).stdout
    assert "model.head" in text and "(256, 256)" in text


def test_du_reports_dedup(filled):
    data = json.loads(run("du", "--json", store=filled).stdout)
    assert data["checkpoints"] == 3 and data["logical_bytes"] > data["stored_bytes"]
    assert data["dedup_ratio"] > 2
    assert "ratio" in run("du", store=filled).stdout


def test_verify_clean_then_damaged(filled):
    out = run("verify", store=filled)
    assert out.returncode == 0 and out.stdout.startswith("ok")
    with cas.open(filled) as s:
        key = next(t for t in s.tensors(300) if t["path"] == "model.base")["chunks"][0]
        path = s.objects.files.path(key)
    with open(path, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = run("verify", store=filled)
    assert out.returncode == 1
    assert key.hex() in out.stdout and "model.base" in out.stdout and "DAMAGED" in out.stdout
    assert run("verify", 300, store=filled).returncode == 1


def test_rm_and_milestone(filled):
    assert run("milestone", 200, store=filled).returncode == 0
    assert json.loads(run("ls", "--json", store=filled).stdout)[1]["milestone"] is True
    assert run("milestone", 200, "--unset", store=filled).returncode == 0
    assert json.loads(run("ls", "--json", store=filled).stdout)[1]["milestone"] is False
    assert run("rm", 100, store=filled).returncode == 0
    assert [d["step"] for d in json.loads(run("ls", "--json", store=filled).stdout)] == [200, 300]


@pytest.mark.parametrize("args", [("show", 7), ("rm", 7), ("milestone", 7), ("show", "abc"), ("frobnicate",), ()])
def test_usage_errors_and_missing_steps_exit_2_without_traceback(filled, args):
    out = run(*args, store=filled)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip()


def test_a_folder_that_is_not_a_store(tmp_path):
    (tmp_path / "x.txt").write_text("x")
    out = run("ls", store=tmp_path)
    assert out.returncode == 2 and "not a cas store" in out.stderr and "Traceback" not in out.stderr
    assert sorted(os.listdir(tmp_path)) == ["x.txt"]
    out = run("ls", store=tmp_path / "missing")
    assert out.returncode == 2 and not (tmp_path / "missing").exists()


def test_installed_console_script(filled):
    exe = os.path.join(os.path.dirname(sys.executable), "cas")
    if not os.path.exists(exe):
        pytest.skip("the cas console script is not installed in this environment")
    out = subprocess.run([exe, "ls", "--store", str(filled)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "300" in out.stdout


def test_du_counts_an_object_path_that_is_a_folder_as_unreadable(filled):
    with cas.open(filled) as store:
        key = next(k for t in store.tensors(300) for k in t["chunks"] if store.objects.files.has(k))
        path = store.objects.files.path(key)
    os.unlink(path)
    os.mkdir(path)
    out = run("du", "--json", store=filled)
    assert out.returncode == 0, out.stderr
    assert "unreadable" in json.loads(out.stdout)["codecs"]
