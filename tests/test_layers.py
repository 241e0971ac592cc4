"""The layering the architecture promises, checked: the storage layer (cas/ but the API and the
CLI) imports without torch, cas.store or cas.gc; `import cas` alone loads none of them; and no
library module reaches into another's private names (`from m import _x`, `obj._x`)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "cas.store", "cas.gc")
NOT_STORAGE = {"__init__", "__main__", "api"}  # the public API composes the layers; cli/ is a folder

# Private-looking names that are another library's public convention, allowed across modules,
# each with its reason.
ALLOWED_PRIVATE = frozenset({
    "_metadata",  # torch's state_dict metadata (per-module versions), which load_state_dict reads back
})


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def storage_modules() -> list[str]:
    return sorted(f"cas.{p.stem}" for p in (ROOT / "cas").glob("*.py") if p.stem not in NOT_STORAGE)


def test_storage_layer_imports_without_torch_store_or_gc():
    modules = storage_modules()
    assert {"cas.hashing", "cas.objectfiles", "cas.objectstore", "cas.index", "cas.progress"} <= set(modules)
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"the storage layer loaded {result.stdout.strip()}"


def test_the_checkpoint_layer_imports_without_gc():
    """cas.store knows nothing of retention: none of its modules loads cas.gc when imported
    (the trainer hooks and DCP's writer reach the public cas.open only when handed a path)."""
    modules = sorted("cas.store." + ".".join(p.relative_to(ROOT / "store").with_suffix("").parts)
                     for p in (ROOT / "store").rglob("*.py") if p.stem != "__init__")
    assert {"cas.store.reader", "cas.store.dcp.writer", "cas.store.lightning", "cas.store.hf"} <= set(modules)
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in ('cas.gc', 'cas.api') if m in sys.modules))")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"cas.store loaded {result.stdout.strip()}"


def test_import_cas_is_light_and_its_names_still_resolve():
    code = f"""
import sys
import cas
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
assert set(cas.__all__) <= set(dir(cas)), set(cas.__all__) - set(dir(cas))
import cas.api
assert cas.Store is cas.api.Store and callable(cas.open) and cas.open.__doc__
for name in cas.__all__:
    getattr(cas, name)
assert "torch" in sys.modules and cas.store.CheckpointStore and cas.gc.Retention is cas.Retention
"""
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"import cas loaded {result.stdout.strip()}"


def test_unknown_attribute_of_cas_is_an_attribute_error():
    import cas

    assert not hasattr(cas, "no_such_name")


@pytest.mark.parametrize("module", ["cas", "cas.cli"])
def test_python_dash_m_runs_the_cli(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "usage: cas" in result.stdout and "export" in result.stdout and "gc" in result.stdout


def test_cli_commands_that_read_a_store_do_not_import_torch(tmp_path):
    """Importing torch was most of a CLI command's start-up (1-2 s of its 2.2 s); listing,
    showing, verifying, collecting and reading the log touch chunk bytes and records only."""
    import numpy as np
    import torch

    import cas

    with cas.open(tmp_path / "s") as store:
        for step in (1, 2):
            store.save({"w": torch.randn(300, 300), "h": torch.randn(70_000).to(torch.bfloat16),
                        "a": np.arange(10.0), "step": step}, step=step)
    commands = [["ls"], ["show", "2"], ["du"], ["verify"], ["gc", "--keep-last", "1"], ["log"], ["ls", "--json"]]
    code = f"""
import sys
from cas.cli import main
for argv in {commands!r}:
    assert main(["--store", {str(tmp_path / "s")!r}, *argv]) == 0, argv
print("torch imported:", "torch" in sys.modules)
"""
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("torch imported: False"), result.stdout[-2000:]
    with cas.open(tmp_path / "s") as store:  # the commands ran (gc kept the last one)
        assert [c.step for c in store.checkpoints()] == [2]


def test_the_torch_dtype_table_agrees_with_torch():
    """Manifests are checked against a table of dtypes (so that reading one needs no torch);
    it must say what torch says."""
    from cas.store import tensors as T

    assert set(T.torch_dtypes()) == set(T.TORCH_DTYPE_LAYOUT), "a dtype of the table is missing from torch"
    for name, dtype in T.torch_dtypes().items():
        size = dtype.itemsize
        group = T.group_size(dtype) if T.is_floating(dtype) else 0
        assert T.TORCH_DTYPE_LAYOUT[name] == (size, group), name
        assert T.TORCH_DTYPES[name] is dtype and T.TORCH_DTYPE_NAMES[dtype] == name


# --- private names across modules -----------------------------------------------------------
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in ALLOWED_PRIVATE


def _own(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: an object's own attributes, which are its to touch."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_uses(source: str, filename: str) -> list[str]:
    """file:line for each private name taken from another module or object, in line order."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"from {'.' * node.level}{node.module or ''} import {alias.name}")
                      for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{filename}:{line}: {what}" for line, what in sorted(found)]


def _library_files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_the_private_name_check_finds_what_it_looks_for():
    bad = "from .a import _x\nfrom . import _w\nimport m\nm._y()\nother._z = 1\nself.pool._q\n"
    good = "from .a import x, __version__\nself._a = super()._b + cls._c\nt.__dict__\n"
    assert private_uses(bad, "f.py") == ["f.py:1: from .a import _x", "f.py:2: from . import _w", "f.py:4: m._y",
                                         "f.py:5: other._z", "f.py:6: self.pool._q"]
    assert private_uses(good, "f.py") == []


@pytest.mark.parametrize("folder", ["cas", "store", "gc"])
def test_no_module_uses_another_modules_private_names(folder):
    found = [use for path in _library_files(folder)
             for use in private_uses(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "private names used across modules:\n" + "\n".join(found)
