"""Provenance on every save, signed checkpoints, and the audit trail (`cas log`): the parts of
"Security and provenance" built so far."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import cas
from cas.store.records import RecordLog
from cas.store.registry import step_key

ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
from cryptography.hazmat.primitives import serialization  # noqa: E402

PROVENANCE_KEYS = {"cas", "torch", "python", "numpy", "host", "pid", "world_size", "devices", "git", "argv"}


def cli(*args, path, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cas.cli", "--store", str(path), *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def public_pem(key, path) -> str:
    with open(path, "wb") as f:
        f.write(key.public_key().public_bytes(serialization.Encoding.PEM,
                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    return str(path)


def test_every_save_records_its_provenance_and_a_copy_keeps_it(tmp_path):
    with cas.open(tmp_path / "s") as store:
        ck = store.save({"w": torch.ones(4)}, step=1, meta={"mine": 1})
        assert PROVENANCE_KEYS <= ck.provenance.keys()
        assert ck.provenance["pid"] == os.getpid() and ck.provenance["world_size"] == 1
        assert ck.provenance["torch"] == torch.__version__ and ck.meta == {"mine": 1}  # meta stays the user's
        store.push(tmp_path / "copy")
    with cas.open(tmp_path / "s") as store:  # read back from the registry, and from the log alone
        assert store.get(1).provenance == ck.provenance
    os.rename(tmp_path / "s" / "index", tmp_path / "index.old")
    with cas.open(tmp_path / "s") as store:
        assert store.get(1).provenance == ck.provenance
    with cas.open(tmp_path / "copy") as copy:
        assert copy.get(1).provenance == ck.provenance
    shown = cli("show", "1", path=tmp_path / "s")
    assert shown.returncode == 0 and f"pid {ck.provenance['pid']}" in shown.stdout and "provenance" in shown.stdout
    as_json = json.loads(cli("show", "1", "--json", path=tmp_path / "s").stdout)
    assert as_json["checkpoint"]["provenance"]["host"] == ck.provenance["host"]


def test_provenance_names_the_git_commit_and_whether_the_tree_is_dirty(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    (repo / "train.py").write_text("print('hi')\n")
    git("add", "train.py")
    git("-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", "first")
    commit = git("rev-parse", "HEAD").stdout.strip()
    save = ("import sys, torch, cas\n"
            "with cas.open(sys.argv[1]) as s: print(s.save({'w': torch.ones(2)}, step=int(sys.argv[2])).step)")
    subprocess.run([sys.executable, "-c", save, str(tmp_path / "s"), "1", "--lr", "3"], cwd=repo, check=True)
    (repo / "train.py").write_text("print('changed')\n")
    subprocess.run([sys.executable, "-c", save, str(tmp_path / "s"), "2"], cwd=repo, check=True)
    with cas.open(tmp_path / "s") as store:
        first, second = store.get(1).provenance, store.get(2).provenance
    assert first["git"] == {"commit": commit, "dirty": False} and first["argv"][-2:] == ["--lr", "3"]
    assert second["git"] == {"commit": commit, "dirty": True}
    outside = tmp_path / "not-a-repo"  # (pytest's tmp folders lie in no git work tree)
    outside.mkdir()
    subprocess.run([sys.executable, "-c", save, str(tmp_path / "s"), "3"], cwd=outside, check=True)
    with cas.open(tmp_path / "s") as store:
        assert store.get(3).provenance["git"] == {"commit": None, "dirty": None}  # the same shape everywhere
    shown = subprocess.run([sys.executable, "-m", "cas", "--store", str(tmp_path / "s"), "show", "3"],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "provenance" in shown.stdout, shown.stderr


def test_provenance_never_writes_the_users_git_index(tmp_path):
    """Reading whether the tree is dirty must not take .git/index.lock: `git status` refreshes
    the index and rewrites it when a file's stat changed, and a git killed at GIT_TIMEOUT under
    load would leave the lock behind, so the user's next git command fails. Seen in this
    repository during a test run."""
    from cas.store.provenance import _git
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    (repo / "train.py").write_text("print('hi')\n")
    git("add", "train.py")
    git("-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", "first")
    index = repo / ".git" / "index"
    before = os.stat(index)
    os.utime(repo / "train.py", ns=(before.st_mtime_ns + 5_000_000_000,) * 2)  # stat changed, content not
    assert _git(str(repo))["dirty"] is False
    after = os.stat(index)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    git("status", "--porcelain")  # plain git does rewrite it here: the check above can fail
    assert os.stat(index).st_ino != before.st_ino


def test_signed_checkpoints_verify_and_a_changed_or_resigned_record_fails(tmp_path):
    key, other = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    pub = public_pem(key, tmp_path / "key.pub")
    with cas.open(tmp_path / "s", signing_key=key) as store:
        for step in (1, 2, 3):
            store.save({"w": torch.full((4,), float(step))}, step=step, metrics={"loss": 1.0 / step})
        store.set_milestone(2)  # flags set later are not what was signed, and do not break it
        assert store.verify_signatures(key.public_key()) == {}
        assert set(store.verify_signatures(other.public_key())) == {1, 2, 3}
    ok = cli("verify", "--signatures", pub, path=tmp_path / "s")
    assert ok.returncode == 0 and "signatures ok" in ok.stdout, ok.stdout + ok.stderr
    # a record changed after it was signed (its metrics), and one signed again by another key:
    # each written as a `replace` entry, as a forger with write access to the store could
    backend = cas.open(tmp_path / "s").backend
    log = RecordLog(backend, str(tmp_path / "s"))
    adds = {c["step"]: c for e in log.entries() for c in e.changes if c["op"] == "add"}
    forged = dict(adds[1], metrics={"loss": 0.0})
    from cas.store.signing import sign
    resigned = dict(adds[3])
    resigned["signature"] = sign(resigned, other)
    last = log.read(log.last_seq())
    for change in (forged, resigned):
        remove = {"op": "remove", "step": change["step"], "id": change["id"]}
        last = log.append(last.seq + 1, last.digest, "replace", [remove, change])
    with cas.open(tmp_path / "s") as store:
        problems = store.verify_signatures(pub)
    assert set(problems) == {1, 3} and "changed after it was signed" in problems[1] and "another key" in problems[3]
    bad = cli("verify", "--signatures", pub, path=tmp_path / "s")
    assert bad.returncode == 1 and "SIGNATURE: checkpoint 1" in bad.stdout and "checkpoint 3" in bad.stdout
    assert "checkpoint 2" not in bad.stdout
    assert "\nUNSIGNED: " in bad.stdout and "\nok" not in bad.stdout  # the summary line does not read as a pass


def test_checking_signatures_while_another_process_saves_and_removes_finds_nothing_unsigned(tmp_path):
    """`cas verify --signatures` read the record log, then listed the checkpoints: a signed save
    committed between the two was listed without its log entry ("its record is not in the record
    log"), and a pin or milestone set between them made a record "not the signed one". Now it
    reads the index as of the log entry the index holds, and the log up to that entry. Another
    process saves step 4, removes step 2, pins step 1 and marks step 3 while it pauses."""
    import time

    key = ed25519.Ed25519PrivateKey.generate()
    pub = public_pem(key, tmp_path / "key.pub")
    with cas.open(tmp_path / "s", signing_key=key) as store:
        for step in (1, 2, 3):
            store.save({"w": torch.full((4,), float(step))}, step=step)
    gate = tmp_path / "gate"
    check = subprocess.Popen([sys.executable, "-m", "cas.cli", "--store", str(tmp_path / "s"), "verify",
                              "--signatures", pub, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, CAS_FAULTS=f"signatures.listed=pause:{gate}"))
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{gate}.reached") and time.monotonic() < deadline:
            time.sleep(0.02)
        with cas.open(tmp_path / "s", signing_key=key) as store:
            store.save({"w": torch.full((4,), 4.0)}, step=4)
            store.delete([2])
            store.pin(1)
            store.set_milestone(3)
    finally:
        gate.touch()
    out, err = check.communicate(timeout=120)
    assert check.returncode == 0, out + err
    assert json.loads(out)["unsigned"] == {}
    ok = cli("verify", "--signatures", pub, path=tmp_path / "s")
    assert ok.returncode == 0 and "signatures ok" in ok.stdout, ok.stdout + ok.stderr


def test_a_nan_metric_or_meta_value_is_neither_damage_nor_a_broken_signature(tmp_path):
    """A diverged run logs a NaN loss; NaN is not == itself, which made verify call the record in
    the index different from the log's, and signature checks call it not the signed one."""
    key = ed25519.Ed25519PrivateKey.generate()
    with cas.open(tmp_path / "s", signing_key=key) as store:
        store.save({"w": torch.ones(4)}, step=1, metrics={"loss": float("nan")}, meta={"lr": float("nan")})
        assert store.verify().ok
        assert store.verify_signatures(key.public_key()) == {}
    ok = cli("verify", "--signatures", public_pem(key, tmp_path / "key.pub"), path=tmp_path / "s")
    assert ok.returncode == 0 and "signatures ok" in ok.stdout, ok.stdout + ok.stderr


def test_signatures_fail_where_the_index_serves_another_record_than_the_signed_one(tmp_path):
    """The signatures were checked against the record log, while `cas ls`/`show` and loads read
    the index: an index edited to show other metrics, meta or provenance passed the check."""
    import dataclasses

    key = ed25519.Ed25519PrivateKey.generate()
    pub = public_pem(key, tmp_path / "key.pub")
    with cas.open(tmp_path / "s", signing_key=key) as store:
        for step in (1, 2):
            store.save({"w": torch.full((4,), float(step))}, step=step, metrics={"val_loss": 1.0})
        with store.index.write() as txn:  # as an edit of the LMDB file would leave it
            forged = dataclasses.replace(store.registry.get(txn, 2), metrics={"val_loss": 0.01})
            txn.put(step_key(2), store.registry._dump(forged), db=store.registry.db)
        problems = store.verify_signatures(pub)
        assert set(problems) == {2} and "metrics" in problems[2]
        report = store.verify()
        assert not report.ok and report.damaged_steps == [2] and "metrics" in str(report.problems[0])
    with cas.open(tmp_path / "s") as store:  # an open checks the index's records: rebuilt from the log
        assert store.checkpoints()[1].metrics == {"val_loss": 1.0} and store.verify_signatures(pub) == {}


def test_unsigned_checkpoints_and_bad_keys_are_named(tmp_path):
    key = ed25519.Ed25519PrivateKey.generate()
    with cas.open(tmp_path / "s") as store:
        store.save({"w": torch.ones(2)}, step=1)
        assert store.verify_signatures(key.public_key()) == {1: "not signed"}
    with pytest.raises(cas.CasError, match="signing key"):
        cas.open(tmp_path / "s", signing_key=b"too short")
    garbage = tmp_path / "garbage.pub"
    garbage.write_bytes(b"not a key at all")
    out = cli("verify", "--signatures", str(garbage), path=tmp_path / "s")
    assert out.returncode == 2 and "public key" in out.stderr and "Traceback" not in out.stderr
    missing = cli("verify", "--signatures", str(tmp_path / "nope.pub"), path=tmp_path / "s")
    assert missing.returncode == 2 and "nope.pub does not exist" in missing.stderr
    for name in ("key.pub", "k" * 32):  # a bare name, in the store's folder as cwd: a file, not PEM or a raw key
        bare = cli("verify", "--signatures", name, path=tmp_path / "s", cwd=tmp_path)
        assert bare.returncode == 2 and f"{name} does not exist" in bare.stderr, bare.stdout + bare.stderr
    with pytest.raises(cas.CasError, match="signing key file .*missing.pem does not exist"):
        cas.open(tmp_path / "s", signing_key=tmp_path / "missing.pem")


def _raw_public(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _key_with_whitespace_at(index: int):
    """A private key whose raw public key has an ASCII whitespace byte at `index` (1 in ~42)."""
    while True:
        key = ed25519.Ed25519PrivateKey.generate()
        if _raw_public(key)[index:][:1] in (b" ", b"\t", b"\n", b"\r", b"\x0b", b"\x0c"):
            return key


def test_a_raw_public_key_with_a_whitespace_byte_at_either_end_is_read_raw(tmp_path):
    """The 32 raw bytes are taken before any strip (which only the text forms get): a key
    beginning or ending with a whitespace byte was refused."""
    for index in (0, -1):
        key = _key_with_whitespace_at(index)
        path = tmp_path / f"s{index}"
        with cas.open(path, signing_key=key) as store:
            store.save({"w": torch.ones(2)}, step=1)
            assert store.verify_signatures(_raw_public(key)) == {}
        (tmp_path / "raw.pub").write_bytes(_raw_public(key))
        with cas.open(path) as store:
            assert store.verify_signatures(str(tmp_path / "raw.pub")) == {}
            assert store.verify_signatures(_raw_public(key).hex() + "\n") == {}  # text forms are still stripped


def test_signing_and_public_key_paths_expand_the_home_folder(tmp_path, monkeypatch):
    """signing_key="~/k.pem" and `cas verify --signatures=~/k.pub` (no shell to expand it)
    read the files, as $CAS_KEY_FILE does."""
    from cas.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    key = ed25519.Ed25519PrivateKey.generate()
    (tmp_path / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    public_pem(key, tmp_path / "k.pub")
    with cas.open(tmp_path / "s", signing_key="~/k.pem") as store:
        store.save({"w": torch.ones(2)}, step=1)
        assert store.verify_signatures("~/k.pub") == {}
    assert main(["--store", str(tmp_path / "s"), "verify", "--signatures=~/k.pub"]) == 0
    with pytest.raises(cas.CasError, match="~/missing.pem does not exist"):
        cas.open(tmp_path / "s", signing_key="~/missing.pem")


def test_show_checks_the_signature_and_escapes_provenance(tmp_path, monkeypatch, capsys):
    """`cas show` said "signed by" for any record carrying a signature, one changed after it was
    signed too; and printed argv raw, so a newline in it forged such a line."""
    from cas.cli import main
    from cas.store import provenance
    from cas.store.signing import problem

    def show(step: int) -> str:
        capsys.readouterr()
        assert main(["--store", str(tmp_path / "s"), "show", str(step)]) == 0
        return capsys.readouterr().out

    key = ed25519.Ed25519PrivateKey.generate()
    pub = _raw_public(key).hex()
    with cas.open(tmp_path / "s", signing_key=key) as store:
        store.save({"w": torch.ones(2)}, step=1, metrics={"acc": 0.5})
    assert f"signature by ed25519 key {pub}: valid" in show(1)
    log = RecordLog(cas.open(tmp_path / "s").backend, str(tmp_path / "s"))
    change = [c for e in log.entries() for c in e.changes if c["op"] == "add"][0]
    forged = dict(change, metrics={"acc": 0.99})
    assert problem(forged, _raw_public(key)) is not None
    last = log.read(log.last_seq())
    log.append(last.seq + 1, last.digest, "replace", [{"op": "remove", "step": 1, "id": change["id"]}, forged])
    out = show(1)
    assert "acc=0.99" in out and f"signature by ed25519 key {pub}: INVALID" in out and ": valid" not in out
    assert "signed by" not in out
    monkeypatch.setattr(sys, "argv", ["train.py", f"--tag\nsigned by ed25519 key {pub}", "\x1b[2J"])
    provenance._static.cache_clear()  # argv is read once per process
    try:
        with cas.open(tmp_path / "s") as store:
            store.save({"w": torch.ones(3)}, step=2, metrics={"bad\nsigned by x": 1.0})
    finally:
        provenance._static.cache_clear()
    out = show(2)
    assert "\x1b" not in out and not any(line.startswith(("signed by", "signature by")) for line in out.splitlines())
    assert '"--tag\\nsigned by ed25519 key' in out and '"\\u001b[2J"' in out and '"bad\\nsigned by x"=1.0' in out
    capsys.readouterr()
    assert main(["--store", str(tmp_path / "s"), "ls"]) == 0
    listed = capsys.readouterr().out  # `cas ls` prints metric names escaped too
    assert '"bad\\nsigned by x"=1' in listed and not any(line.startswith("signed by") for line in listed.splitlines())


def test_the_audit_trail_names_every_removal_and_flag_change_and_gc_keeps_it(tmp_path):
    with cas.open(tmp_path / "s") as store:
        for step in range(5):
            store.save({"w": torch.full((4,), float(step))}, step=step)
        store.set_pinned(1)
        store.set_pinned(1, False)
        store.set_milestone(2)
        store.delete([0])
        store.gc(keep_last=2, keep_milestones=True)
        entries = store.log()
    assert [e.why for e in entries][:5] == ["save"] * 5
    rows = json.loads(cli("log", "--json", path=tmp_path / "s").stdout)
    whys = [r["why"] for r in rows]
    assert whys[:5] == ["pin", "unpin", "milestone", "delete", "retention"], whys
    removed = [c for r in rows for c in r["changes"] if "removed" in c]
    assert any("step 0" in c for c in removed) and any("step 1" in c for c in removed)  # rm, then retention
    assert all(r["user"] and r["host"] and r["time"] for r in rows)
    text = cli("log", path=tmp_path / "s").stdout
    assert "pinned=on" in text and "pinned=off" in text and "milestone=on" in text
    with cas.open(tmp_path / "s") as store:
        store.gc()
        assert len(store.log()) == len(entries)  # gc removed nothing of the trail
    assert len(json.loads(cli("log", "--saves", "--json", path=tmp_path / "s").stdout)) == len(entries)


def test_the_audit_trail_names_the_account_of_the_process_not_the_one_its_environment_claims(tmp_path):
    import pwd

    with cas.open(tmp_path / "s") as store:
        store.save({"w": torch.ones(4)}, step=1)
    env = dict(os.environ, LOGNAME="someone-else", USER="someone-else")
    subprocess.run([sys.executable, "-m", "cas.cli", "--store", str(tmp_path / "s"), "rm", "1"], env=env, check=True,
                   capture_output=True, timeout=120)
    rows = json.loads(cli("log", "--json", path=tmp_path / "s").stdout)
    assert rows[0]["why"] == "delete" and rows[0]["user"].startswith(pwd.getpwuid(os.getuid()).pw_name), rows[0]
