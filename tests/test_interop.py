"""Interop: weights-only safetensors export, import of safetensors and torch.save files (never
unpickling more than weights), per-tensor diff, exclusive bytes in `cas ls`, progress bars."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import cas
from cas.errors import CasError
from cas.gc import Marker
from cas.store.compare import max_abs_diff
from cas.store.interop import ImportRefusedError, safetensors_dtypes, step_from_name
from helpers import assert_same

CAS = [sys.executable, "-m", "cas.cli"]
CHUNK = 64 << 10


def run(*args, store=None, **kw):
    env = {k: v for k, v in os.environ.items() if k != "CAS_STORE"}
    argv = CAS + (["--store", str(store)] if store else []) + [str(a) for a in args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, **kw)


def random_bits(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """n values of `dtype` with random bit patterns (NaNs and infinities included)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def open_store(path):
    return cas.open(path, chunk_size=CHUNK)


# --- export and import round trips ------------------------------------------------------------
def test_the_safetensors_dtypes_include_what_serving_needs():
    have = safetensors_dtypes()
    expected = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.int16,
                torch.int32, torch.int64, torch.uint8}
    expected |= {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
                 if hasattr(torch, n)}
    assert expected <= have
    assert torch.complex128 not in have  # safetensors has no C128


def test_export_then_import_round_trips_every_safetensors_dtype_bit_for_bit(tmp_path):
    tensors = {dtype_name(d): random_bits(d, 40_000 if d.itemsize > 1 else 70_000, seed=i)
               for i, d in enumerate(sorted(safetensors_dtypes(), key=str))}
    state = {"model": tensors, "step": 7, "opt": {"lr": 0.1, "betas": (0.9, 0.99)}}
    out = tmp_path / "w.safetensors"
    with open_store(tmp_path / "s") as store:
        ck = store.save(state, step=7)
        report = store.export(7, out)
        assert report.tensors == len(tensors) and report.skipped == ["step", "opt.lr", "opt.betas.0", "opt.betas.1"]
        loaded = load_file(out)
        assert sorted(loaded) == sorted(f"model.{n}" for n in tensors)
        for name, t in tensors.items():
            assert_same(loaded[f"model.{name}"], t, name)
        with safe_open(out, framework="pt") as f:
            meta = f.metadata()
        assert meta["cas.step"] == "7" and meta["cas.checkpoint_id"] == ck.id and meta["format"] == "pt"
        assert "not a training checkpoint" in meta["cas.note"]

        imported = store.import_file(out, step=8)
        assert imported.meta["import_format"] == "safetensors"
        assert imported.meta["safetensors_metadata"]["cas.step"] == "7"
        assert imported.new_bytes < 16 << 10  # every chunk deduplicated: only manifest nodes are new
        restored = store.load(8)
        assert sorted(restored) == sorted(loaded)
        for name in loaded:
            assert_same(restored[name], loaded[name], name)


def test_export_of_selected_keys_with_relative_names_loads_into_the_model(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    out = tmp_path / "model.safetensors"
    with open_store(tmp_path / "s") as store:
        store.save({"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}, step=1)
        report = store.export(1, out, keys=["model"], relative=True)
        with pytest.raises(CasError, match="exactly one"):
            store.export(1, tmp_path / "x.safetensors", relative=True)
    assert report.skipped == [] and report.tensors == 4
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fresh.load_state_dict(load_file(out), strict=True)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_export_refuses_a_dtype_safetensors_cannot_hold_before_writing(tmp_path):
    with open_store(tmp_path / "s") as store:
        store.save({"model": {"w": torch.ones(3)}, "extra": {"z": torch.ones(2, dtype=torch.complex128)}}, step=1)
        with pytest.raises(CasError, match="'extra.z'.*complex128"):
            store.export(1, tmp_path / "a.safetensors")
        assert not (tmp_path / "a.safetensors").exists()
        store.export(1, tmp_path / "b.safetensors", keys="model")
    assert list(load_file(tmp_path / "b.safetensors")) == ["model.w"]


def _training_state(narrow=("bfloat16", "float16", "float8_e4m3fn")) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "tag": "run-a",
            "extras": [torch.arange(5, dtype=torch.int16), (1.5, None, True)],
            "narrow": {d: random_bits(getattr(torch, d), 1000) for d in narrow}}


@pytest.mark.parametrize("zipfile_format", [True, False], ids=["zip", "legacy"])
def test_torch_save_file_imports_under_the_step_in_its_name(tmp_path, zipfile_format):
    # torch's legacy format cannot read float8 back (torch.load fails on it): leave it out there
    state = _training_state() if zipfile_format else _training_state(("bfloat16", "float16"))
    path = tmp_path / "ckpt-500.pt"
    torch.save(state, path, _use_new_zipfile_serialization=zipfile_format)
    with open_store(tmp_path / "s") as store:
        ck = store.import_file(path)
        assert ck.step == 500 and ck.meta == {"imported_from": "ckpt-500.pt", "import_format": "torch.save"}
        assert_same(store.load(500), state)


class Payload:
    """A pickle that, when unpickled in full, creates a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_a_malicious_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt-100.pt"
    torch.save({"model": {"w": torch.ones(2)}, "evil": Payload(str(marker))}, path)
    # The payload is live: a full unpickle would run it (checked in a throwaway process).
    check = subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(path)!r}, weights_only=False)"],
                           capture_output=True, timeout=120)
    assert check.returncode == 0 and marker.exists()
    marker.unlink()

    with open_store(tmp_path / "s") as store:
        with pytest.raises(ImportRefusedError, match="ckpt-100.pt.*weights-only"):
            store.import_file(path)
        assert store.checkpoints() == []
    out = run("import", path, store=tmp_path / "s")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert str(path) in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not marker.exists()


@pytest.mark.parametrize("name, content, message", [
    ("bad-1.pt", b"garbage", "weights-only"),
    ("bad-1.pt", b"PK\x03\x04garbage", "cannot read"),
    ("bad-1.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}", "cannot read"),
    ("notes-1.txt", b"hello", "not a checkpoint file"),
])
def test_unreadable_files_are_refused_with_their_name(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with open_store(tmp_path / "s") as store:
        with pytest.raises(CasError, match=message) as err:
            store.import_file(path)
        assert name in str(err.value)


@pytest.mark.parametrize("name, step", [
    ("ckpt-500.pt", 500), ("step_1000.safetensors", 1000), ("epoch=3-step=1200.ckpt", 1200),
    ("model.bin", None), ("final.safetensors", None), ("run2_ckpt_00042.pth", 42),
])
def test_the_step_is_the_last_number_in_the_name(name, step):
    assert step_from_name(name) == step


# --- folder import and dedup ------------------------------------------------------------------
def _fine_tuning_run(folder) -> None:
    """Four checkpoints of a run that only trains its head: the backbone is shared by all."""
    torch.manual_seed(0)
    backbone = {"emb": torch.randn(256, 512), "block": torch.randn(512, 512)}
    folder.mkdir()
    for step in (100, 200, 300, 400):
        head = torch.randn(16, 512)
        if step in (200, 400):
            flat = {"backbone.emb": backbone["emb"], "backbone.block": backbone["block"], "head": head}
            save_file(flat, folder / f"step_{step}.safetensors")
        else:
            torch.save({"backbone": backbone, "head": head, "step": step}, folder / f"ckpt-{step}.pt")
    (folder / "README.md").write_text("not a checkpoint")


def test_folder_import_shows_the_dedup_in_du(tmp_path):
    _fine_tuning_run(tmp_path / "run")
    open_store(tmp_path / "s").close()
    out = run("import", tmp_path / "run", store=tmp_path / "s")
    assert out.returncode == 0, out.stderr
    assert "as step 400" in out.stdout and "README.md" in out.stdout and "dedup saved" in out.stdout
    du = json.loads(run("du", "--json", store=tmp_path / "s").stdout)
    assert du["checkpoints"] == 4
    assert du["dedup_ratio"] > 3  # the backbone is stored once, not four times
    with open_store(tmp_path / "s") as store:
        assert [ck.step for ck in store.checkpoints()] == [100, 200, 300, 400]
        assert set(store.load(300)) == {"backbone", "head", "step"}  # a torch.save file keeps its nesting
        assert set(store.load(400)) == {"backbone.emb", "backbone.block", "head"}  # safetensors is flat


def test_folder_import_refuses_unnumbered_and_clashing_files_before_importing_anything(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "ckpt-1.pt")
    torch.save({"w": torch.ones(2)}, folder / "final.pt")
    open_store(tmp_path / "s").close()
    out = run("import", folder, store=tmp_path / "s")
    assert out.returncode == 2 and "final.pt" in out.stderr and "Traceback" not in out.stderr
    (folder / "final.pt").rename(folder / "step1.pt")
    with open_store(tmp_path / "s") as store:
        with pytest.raises(ImportRefusedError, match="ckpt-1.pt, step1.pt"):
            store.import_folder(folder)
        assert store.checkpoints() == []
    single = run("import", folder / "step1.pt", "--step", 9, store=tmp_path / "s")
    assert single.returncode == 0, single.stderr
    (folder / "ckpt-1.pt").unlink()
    (folder / "step1.pt").rename(folder / "step9.pt")
    with open_store(tmp_path / "s") as store:
        with pytest.raises(ImportRefusedError, match="already holds steps \\[9\\]"):
            store.import_folder(folder)


# --- diff -------------------------------------------------------------------------------------
def _pair(store):
    """Two checkpoints with known differences (chunks of 64 KiB = 16384 float32 values)."""
    torch.manual_seed(0)
    base = torch.randn(4 * 16384)
    base[20_000], base[60_000] = 1.0, 2.0
    moved = base.clone()
    moved[20_000], moved[60_000] = 1.75, 1.5  # chunks 1 and 3 of 4 change; max |diff| 0.75
    half_a, half_b = torch.full((8,), 1.0, dtype=torch.bfloat16), torch.full((8,), 1.0, dtype=torch.bfloat16)
    half_b[3] = 1.5
    nan_a = torch.tensor([float("nan"), 1.0, float("inf")])
    nan_b = torch.tensor([float("nan"), 1.25, float("inf")])
    same = torch.randn(128, 128)
    cast = torch.tensor([1.0, 2.0, 3.1])  # 3.1 is 3.09375 in bfloat16
    store.save({"same": same, "w": base, "half": half_a, "nan": nan_a, "ids": torch.arange(10),
                "shape": torch.zeros(4, 4), "cast": cast, "gone": torch.ones(3), "meta": 1}, step=1)
    store.save({"same": same, "w": moved, "half": half_b, "nan": nan_b, "ids": torch.arange(10) * 2,
                "shape": torch.zeros(4, 5), "cast": cast.bfloat16(), "new": torch.ones(2), "meta": 2}, step=2)


def test_diff_reports_each_kind_of_change(store):
    _pair(store)
    report = store.diff(1, 2)
    rows = {t.path: t for t in report.tensors}
    assert {p: t.status for p, t in rows.items()} == {
        "same": "unchanged", "w": "changed", "half": "changed", "nan": "changed", "ids": "changed",
        "shape": "changed", "cast": "changed", "new": "added", "gone": "removed"}
    assert rows["w"].chunks_changed == 0.5 and rows["w"].max_abs_diff == 0.75
    assert rows["half"].max_abs_diff == 0.5 and rows["half"].dtype == "bfloat16"
    assert rows["nan"].max_abs_diff == 0.25  # NaN against NaN and inf against inf count as equal
    assert rows["ids"].chunks_changed == 1.0 and rows["ids"].max_abs_diff is None  # not floating
    assert rows["shape"].was == "float32 [4, 4]" and rows["shape"].shape == [4, 5]
    assert rows["shape"].max_abs_diff is None  # shapes differ: nothing to compare element-wise
    assert rows["cast"].was == "float32 [3]" and rows["cast"].dtype == "bfloat16"
    assert rows["cast"].max_abs_diff == 3.0999999046325684 - 3.09375  # float32(3.1) - bfloat16(3.1)

    assert rows["same"].max_abs_diff is None and rows["gone"].shape == [3]
    # Only these two checkpoints are in the store: what is not shared is stored once for each.
    assert report.shared_bytes == report.a_stored_bytes + report.b_stored_bytes - store.stats().stored_bytes
    assert report.shared_bytes > 128 * 128 * 4 * 0.8 + 2 * CHUNK * 0.8  # "same" and two chunks of "w"


def test_max_abs_diff_of_wide_and_narrow_types():
    assert max_abs_diff(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 0.0])) == float("inf")
    assert max_abs_diff(torch.tensor([1 + 1j]), torch.tensor([1 + 0j])) == 1.0
    e4 = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    assert max_abs_diff(e4, torch.tensor([1.0, 3.0]).to(torch.float8_e4m3fn)) == 1.0
    assert max_abs_diff(torch.empty(0), torch.empty(0)) == 0.0


def test_diff_from_the_command_line(store_path):
    with open_store(store_path) as store:
        _pair(store)
    out = run("diff", 1, 2, "--json", store=store_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["summary"] == {"unchanged": 1, "changed": 6, "added": 1, "removed": 1}
    assert {t["path"]: t["max_abs_diff"] for t in data["tensors"]}["w"] == 0.75
    text = run("diff", 1, 2, store=store_path)
    assert text.returncode == 0 and "chunks changed 50%" in text.stdout and "shared on disk" in text.stdout
    assert run("diff", 1, 3, store=store_path).returncode == 2


# --- exclusive bytes and ls -------------------------------------------------------------------
def _exclusive_by_counting(store) -> dict[int, int]:
    """The brute-force reference: each checkpoint's reachable set, a count per object."""
    count: dict[bytes, int] = {}
    live = {}
    for ck in store.checkpoints():
        m = Marker(store)
        m.mark([ck.key])
        live[ck.step] = m.live
        for k in m.live:
            count[k] = count.get(k, 0) + 1
    with store.index.read() as txn:
        size = {k: r.stored_size for k, r in store.index.iter_records(txn)}
    return {step: sum(size[k] for k in keys if count[k] == 1) for step, keys in live.items()}


def test_exclusive_bytes_match_counting_and_what_gc_frees(store):
    torch.manual_seed(0)
    shared, ab = torch.randn(64, 256), torch.randn(64, 256)
    store.save({"s": shared, "x": torch.randn(64, 256)}, step=1)
    store.save({"s": shared, "x": ab}, step=2)
    store.save({"s": shared, "x": ab, "y": torch.randn(64, 256)}, step=3)
    store.save({"s": shared}, step=4)
    store.wait()  # the background recode may re-encode older whole chunks (their sizes change)
    exclusive = store.exclusive_bytes()
    assert exclusive == _exclusive_by_counting(store)
    assert exclusive[1] > 64 * 256 * 4 * 0.8 and exclusive[3] > 64 * 256 * 4 * 0.8
    store.delete(1)
    assert store.gc().freed_bytes == exclusive[1]


def test_ls_shows_exclusive_bytes_and_keeps_its_json_fields(store_path):
    with open_store(store_path) as store:
        base = torch.randn(256, 256)
        for step in (1, 2):
            store.save({"base": base, "own": torch.randn(64, 256)}, step=step)
        store.wait()  # the background recode may re-encode step 1's chunks (their sizes change)
        expected = store.exclusive_bytes()
    data = json.loads(run("ls", "--json", store=store_path).stdout)
    assert [d["exclusive_bytes"] for d in data] == [expected[1], expected[2]]
    assert {"step", "id", "created", "milestone", "pinned", "metrics", "meta", "logical_bytes",
            "new_bytes"} <= set(data[0])
    text = run("ls", store=store_path).stdout
    assert "exclusive" in text.splitlines()[0]


# --- the CLI: export, progress ----------------------------------------------------------------
def test_export_from_the_command_line(store_path, tmp_path):
    with open_store(store_path) as store:
        store.save({"model": {"w": torch.randn(300, 300)}, "step": 5}, step=5)
    out = run("export", 5, tmp_path / "w.safetensors", store=store_path)
    assert out.returncode == 0, out.stderr
    assert "not a training checkpoint" in out.stdout and "skipped 1 non-tensor values: step" in out.stdout
    assert list(load_file(tmp_path / "w.safetensors")) == ["model.w"]
    assert out.stderr == ""  # no progress bar when stderr is not a terminal
    assert "NOT a training checkpoint" in run("export", "--help").stdout
    missing = run("export", 6, tmp_path / "x.safetensors", store=store_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_export_torch_round_trips_the_whole_state_for_a_weights_only_load(store_path, tmp_path):
    state = _training_state(narrow=("bfloat16",))
    with open_store(store_path) as store:
        store.save(state, step=5)
        expected = store.load(5)
    out = run("export", 5, tmp_path / "full.pt", "--json", store=store_path)  # .pt: the torch format
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["format"] == "torch" and report["needs_safe_globals"] == [] and report["skipped"] == []
    loaded = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_same(loaded, expected)  # every value, not only the tensors
    assert_same(loaded["model"], state["model"])
    params = len(state["model"])  # each with exp_avg, exp_avg_sq and a step tensor; one in extras, one in narrow
    assert report["tensors"] == params + 3 * params + 2
    model = run("export", 5, tmp_path / "model.bin", "--format", "torch", "--keys", "model", "--relative",
                store=store_path)
    assert model.returncode == 0 and "its state dict" in model.stdout
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 10))
    fresh.load_state_dict(torch.load(tmp_path / "model.bin", weights_only=True), strict=True)
    for (name, a), b in zip(state["model"].items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    as_safetensors = run("export", 5, tmp_path / "w.pt", "--format", "safetensors", store=store_path)
    assert as_safetensors.returncode == 0 and list(load_file(tmp_path / "w.pt"))[0].startswith("model.")


def run_on_terminal(*args, store) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal; returns (exit status, what stderr showed).
    The parent keeps the terminal open until it has read everything, so no output is lost."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty has 0 columns
    proc = subprocess.Popen(CAS + ["--store", str(store)] + [str(a) for a in args],
                            stdout=subprocess.DEVNULL, stderr=slave)
    chunks = []
    try:
        while True:
            if select.select([master], [], [], 0.1)[0]:
                chunks.append(os.read(master, 65536))
            elif proc.poll() is not None:
                break
    finally:
        os.close(slave)
        os.close(master)
    return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_only_and_never_with_json(store_path, tmp_path):
    with open_store(store_path) as store:
        store.save({f"t{i}": torch.randn(64, 64) for i in range(20)}, step=1)
    code, shown = run_on_terminal("export", 1, tmp_path / "a.safetensors", store=store_path)
    assert code == 0 and "export" in shown and "/20" in shown
    code, shown = run_on_terminal("export", 1, tmp_path / "b.safetensors", "--json", store=store_path)
    assert code == 0 and shown == ""


def test_a_value_the_store_cannot_hold_is_refused_with_the_file_and_path(tmp_path):
    path = tmp_path / "ckpt-3.pt"
    torch.save({"w": torch.ones(2), "shape": torch.Size([2, 3])}, path)  # weights-only loads a torch.Size
    with open_store(tmp_path / "s") as store:
        with pytest.raises(TypeError, match="ckpt-3.pt.*torch.Size.*'shape'"):
            store.import_file(path)
    out = run("import", path, store=tmp_path / "s")
    assert out.returncode == 2 and "ckpt-3.pt" in out.stderr and "Traceback" not in out.stderr
