"""Encryption at rest (cas/crypt.py): no plaintext in any byte a store writes, keyed object names,
keys added and removed without rewriting data, clear key errors, tampering named, and kills at
the fault points of a save and of key changes losing nothing. Real files, real LMDB, the real
SeaweedFS server; scrypt runs with small parameters here ($CAS_SCRYPT_LOG_N)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import assert_same
from s3server import s3_bucket, s3_prefix, s3_server, s3_url  # noqa: F401 - fixtures

import cas
from cas import crypt
from cas.keys import read_key_file, removal_marks
from cas.localfs import MAP_FROM
from cas.errors import (CasError, CorruptionError, KeyRemovalRefusedError, KeyRequiredError, NotEncryptedError,
                        WrongKeyError)

MARK_TENSOR = b"MARKER-xyz-tensor-0123456789-"
MARK_VALUE = "MARKER-xyz-value-abcdefghij"
MARK_META = "MARKER-xyz-meta-klmnopqrst"
MARK_METRIC = "MARKER_xyz_metric_uvwxyz"
MARKS = [MARK_TENSOR, MARK_VALUE.encode(), MARK_META.encode(), MARK_METRIC.encode()]
RAW_KEY = bytes(range(32))


@pytest.fixture(autouse=True)
def fast_kdf(monkeypatch):
    monkeypatch.setenv(crypt.SCRYPT_ENV, "10")  # tests only: the default is 2^17 (128 MiB, ~0.4 s)


def marked_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    marker = torch.frombuffer(bytearray(MARK_TENSOR * 4000), dtype=torch.uint8)
    return {"model": {"w": torch.randn(256, 512, generator=g), "marker": marker, "small": torch.arange(10)},
            "note": MARK_VALUE, "step": seed}


def save_marked(store, step: int = 1):
    return store.save(marked_state(), step=step, meta={"note": MARK_META}, metrics={MARK_METRIC: 1.5})


def found_marks(files) -> set[bytes]:
    hits = set()
    for data in files:
        hits |= {m for m in MARKS if m in data}
    return hits


def folder_bytes(root) -> list[bytes]:
    out = []
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                out.append(f.read())
    return out


def test_no_plaintext_anywhere_in_an_encrypted_folder(tmp_path):
    # compress=False: unencrypted, the marker would lie in the chunks as it is (the control shows it)
    plain, enc = tmp_path / "plain", tmp_path / "enc"
    with cas.open(plain, compress=False, chunk_size=64 << 10) as store:
        save_marked(store)
    assert found_marks(folder_bytes(plain)) == set(MARKS)  # the scan finds them where they are
    with cas.open(enc, key="a passphrase", compress=False, chunk_size=64 << 10) as store:
        assert store.created and store.encrypted
        save_marked(store, 1)
        save_marked(store, 2)
        store.delete(1)
        store.gc()  # rewrites packs, writes a gc entry
        assert_same(store.load(2), marked_state())
        assert store.verify().ok
    with cas.open(enc, key="a passphrase") as store:
        assert store.get(2).meta == {"note": MARK_META} and store.get(2).metrics == {MARK_METRIC: 1.5}
        assert_same(store.load(2), marked_state())
    assert found_marks(folder_bytes(enc)) == set()  # every file: objects, packs, log, LMDB, keys, config


def test_no_plaintext_in_a_bucket_store(s3_url, tmp_path):
    from cas.s3 import S3Backend

    cache = tmp_path / "cache"
    with cas.open(s3_url, key=RAW_KEY, compress=False, chunk_size=64 << 10, cache_dir=str(cache)) as store:
        save_marked(store, 1)
        save_marked(store, 2)
        assert_same(store.load(1), marked_state())
    with cas.open(s3_url, key=RAW_KEY, cache_dir=str(tmp_path / "fresh")) as fresh:  # another host, no cache
        assert_same(fresh.load(2), marked_state())
        assert fresh.get(1).meta == {"note": MARK_META}
        fresh.save(marked_state(3), step=3)
        report = fresh.gc(keep_last=2)  # the bucket's gc protocol: intent, delete, rewritten segments
        assert [ck.step for ck in report.removed] == [1] and fresh.verify().ok
        assert_same(fresh.load(3), marked_state(3))
    bucket = S3Backend.from_url(s3_url)  # the bucket as it is, no keys
    names = bucket.list("")
    assert any(n.startswith("packs/") for n in names) and any(n.startswith("keys/") for n in names)
    assert found_marks(bytes(bucket.get(n)) for n in names) == set()
    assert found_marks(folder_bytes(cache)) == set()  # the host's LMDB cache holds sealed records
    with pytest.raises(KeyRequiredError):
        cas.open(s3_url, cache_dir=str(tmp_path / "c2"))


def _names(store) -> set[bytes]:
    with store.index.read() as txn:
        return {k for k, _ in store.index.iter_records(txn)}


def test_two_keys_share_no_object_names_and_one_store_dedups(tmp_path):
    state = {"w": torch.randn(1 << 21), "b": torch.ones(5), "s": "same"}  # 8 MiB
    stores = [cas.open(tmp_path / "a", key="key one"), cas.open(tmp_path / "b", key="key two"),
              cas.open(tmp_path / "p")]
    try:
        cks = [s.save(state, step=1) for s in stores]
        names = [_names(s) for s in stores]
        assert not names[0] & names[1] and not names[0] & names[2] and not names[1] & names[2]
        assert len({ck.id for ck in cks}) == 3
        blobs = [set(s.backend.list("objects/")) | set(s.backend.list("packs/")) for s in stores]
        assert not blobs[0] & blobs[1]
        again = stores[0].save(state, step=2)  # unchanged: only a commit node is new
        assert again.new_bytes < 0.01 * again.logical_bytes
        assert again.id != cks[0].id and _names(stores[0]) - names[0]  # its commit node
        assert_same(stores[0].load(2), state)
    finally:
        for s in stores:
            s.close()


@pytest.mark.parametrize("body", [
    {"kdf": "argon2id", "salt": b"s" * 16},  # a newer cas's blob
    {"kdf": "scrypt", "n": 1 << 40, "r": 8, "p": 1, "salt": b"s" * 16},  # would ask for 128 TiB
    {"kdf": "scrypt", "n": 1 << 10, "r": 1, "p": 1 << 22, "salt": b"s" * 16},  # would run for minutes
    {"kdf": "scrypt", "n": "x", "r": 8, "p": 1, "salt": b"s" * 16},
])
def test_a_key_blob_whose_kdf_this_cas_will_not_run_is_skipped(tmp_path, body):
    """A well-formed blob planted beside the real one, sorting first, with a KDF unknown or out of
    bounds: the right key still opens the store, at once; a wrong key's error names the blob."""
    from cas.bitrot import with_digest
    from cas.keys import KEY_MAGIC

    path = tmp_path / "s"
    with cas.open(path, key="right") as store:
        store.save({"w": torch.ones(4)}, step=1)
    blob = dict(format=1, aead="aes-256-gcm", nonce=b"n" * 12, wrapped=b"w" * 48, created=1.0, **body)
    (path / "keys" / "0000000000000000").write_bytes(with_digest(KEY_MAGIC, blob))
    with cas.open(path, key="right") as store:
        assert torch.equal(store.load(1)["w"], torch.ones(4))
    with pytest.raises(WrongKeyError, match="key 0000000000000000 was not tried"):
        cas.open(path, key="wrong")


def test_a_config_rewritten_as_plain_beside_keys_is_refused(tmp_path, monkeypatch):
    """Someone with write access but no key rewrites an encrypted store's config as a plain one
    (its digest is plain blake3): a trainer opening it with $CAS_KEY_FILE saved plaintext into it.
    The keys/ beside it show the store is encrypted: the open is refused, nothing written."""
    from cas.store.layout import config_bytes

    path = tmp_path / "s"
    with cas.open(path, key="right") as store:
        chunk_size = store.config.chunk_size
    (path / "config").write_bytes(config_bytes(chunk_size=chunk_size))
    (tmp_path / "k").write_text("right")
    monkeypatch.setenv("CAS_KEY_FILE", str(tmp_path / "k"))
    before = sorted(p.name for p in path.rglob("*"))
    with pytest.raises(CorruptionError, match="says it is not encrypted, but its keys/ holds 1 key blob"):
        cas.open(path)
    assert sorted(p.name for p in path.rglob("*")) == before


def test_key_errors_are_clear(tmp_path):
    path = tmp_path / "s"
    with cas.open(path, key="right") as store:
        store.save({"a": torch.ones(3)}, step=1)
    with pytest.raises(KeyRequiredError, match="encrypted: give its key"):
        cas.open(path)
    with pytest.raises(WrongKeyError, match="wrong, or it was removed"):
        cas.open(path, key="wrong")
    with pytest.raises(WrongKeyError):
        cas.open(path, key=RAW_KEY)
    with pytest.raises(CasError, match="raw key is 32 bytes"):
        cas.open(path, key=b"short")
    with cas.open(tmp_path / "plain") as plain:
        plain.save({"a": torch.ones(3)}, step=1)
    with pytest.raises(NotEncryptedError):
        cas.open(tmp_path / "plain", key="right")
    for exc in (KeyRequiredError, WrongKeyError, NotEncryptedError, KeyRemovalRefusedError):
        assert issubclass(exc, CasError) and getattr(cas, exc.__name__) is exc  # cas.WrongKeyError too


def test_the_library_opens_with_the_key_file_named_by_the_environment(tmp_path, monkeypatch):
    """Without key=, an encrypted store opens with the key in the file $CAS_KEY_FILE names (the
    library and DCP's load alike); a plain store ignores it, and a new store is made plain
    unless key= is given."""
    from cas.store.dcp import load, save

    save({"a": torch.ones(3)}, tmp_path / "d", step=1, no_dist=True, key="right")
    with cas.open(tmp_path / "s", key="right") as store:
        store.save({"a": torch.ones(3)}, step=1)
    with cas.open(tmp_path / "plain") as store:
        store.save({"a": torch.ones(3)}, step=1)
    key_file = tmp_path / "key"
    key_file.write_text("right\n")
    monkeypatch.setenv("CAS_KEY_FILE", str(key_file))
    with cas.open(tmp_path / "s") as store:
        assert torch.equal(store.load(1)["a"], torch.ones(3))
    out = {"a": torch.zeros(3)}
    load(out, tmp_path / "d", no_dist=True)
    assert torch.equal(out["a"], torch.ones(3))
    with cas.open(tmp_path / "plain") as store:  # the key is for encrypted stores only
        assert not store.encrypted
    with cas.open(tmp_path / "new") as store:
        assert not store.encrypted
    key_file.write_text("wrong")
    with pytest.raises(WrongKeyError):
        cas.open(tmp_path / "s")
    monkeypatch.setenv("CAS_KEY_FILE", str(tmp_path / "absent"))
    with pytest.raises(KeyRequiredError, match="absent"):
        cas.open(tmp_path / "s")
    key_file.write_text("\n")  # named: it said "an empty passphrase is not a key", naming no file
    monkeypatch.setenv("CAS_KEY_FILE", str(key_file))
    with pytest.raises(cas.KeyFileError, match=f"the key file {key_file} is empty"):
        cas.open(tmp_path / "s")


def test_a_key_file_of_32_printable_bytes_opens_a_store_made_with_them_as_a_passphrase_or_raw(tmp_path, monkeypatch):
    """cas.open(key=) tells a passphrase (str) from a raw key (bytes) by type; a file cannot, so
    32 printable bytes in it (a hex token, say) open the store whichever of the two made it,
    with or without a trailing newline. A new store made from such a file takes a passphrase."""
    text = "0123456789abcdef0123456789abcdef"
    with cas.open(tmp_path / "raw", key=text.encode()) as store:
        store.save({"a": torch.ones(3)}, step=1)
    with cas.open(tmp_path / "phrase", key=text) as store:
        store.save({"a": torch.ones(3)}, step=1)
    key_file = tmp_path / "key"
    monkeypatch.setenv("CAS_KEY_FILE", str(key_file))
    for content in (text, text + "\n"):
        key_file.write_text(content)
        for name in ("raw", "phrase"):
            with cas.open(tmp_path / name) as store:
                assert torch.equal(store.load(1)["a"], torch.ones(3))
    key_file.write_text(text[:-1] + "0")
    with pytest.raises(WrongKeyError):
        cas.open(tmp_path / "raw")
    made = tmp_path / "made"
    key_file.write_text(text)
    with cas.open(made, key=read_key_file(str(key_file))) as store:
        store.save({"a": torch.ones(3)}, step=1)
    with cas.open(made, key=text) as store:
        assert torch.equal(store.load(1)["a"], torch.ones(3))
    with pytest.raises(WrongKeyError):
        cas.open(made, key=text.encode())


def test_a_passphrase_written_by_echo_is_text_even_when_the_file_is_32_bytes(tmp_path, monkeypatch):
    """31 characters and echo's newline (or 30 and CRLF) make 32 bytes: the text is read first,
    so they open the store made with that passphrase; only 32 bytes that are not one line of
    text are a raw key."""
    key_file = tmp_path / "key"
    monkeypatch.setenv("CAS_KEY_FILE", str(key_file))
    for phrase, end in (("correct horse battery staple 31", b"\n"), ("correct horse battery staple 3", b"\r\n")):
        path = tmp_path / str(len(phrase))
        with cas.open(path, key=phrase) as store:
            store.save({"a": torch.ones(3)}, step=1)
        key_file.write_bytes(phrase.encode() + end)
        assert len(phrase.encode() + end) == 32 and read_key_file(str(key_file)) == phrase
        with cas.open(path) as store:
            assert torch.equal(store.load(1)["a"], torch.ones(3))
    raw = bytes(range(31)) + b"\n"  # 32 bytes, not text: raw, newline and all
    key_file.write_bytes(raw)
    assert read_key_file(str(key_file)) == raw


def test_a_key_file_over_64_kib_is_refused_not_cut_short(tmp_path, monkeypatch):
    """A key past the first 64 KiB was dropped silently: a store made with the whole passphrase
    did not open, and one made with its first 64 KiB opened from a different file."""
    with cas.open(tmp_path / "s", key="x" * (64 << 10)) as store:
        store.save({"a": torch.ones(3)}, step=1)
    key_file = tmp_path / "key"
    key_file.write_text("x" * (64 << 10))  # exactly 64 KiB: read whole
    monkeypatch.setenv("CAS_KEY_FILE", str(key_file))
    with cas.open(tmp_path / "s") as store:
        assert torch.equal(store.load(1)["a"], torch.ones(3))
    key_file.write_text("x" * (64 << 10) + "SOMETHING ELSE")
    with pytest.raises(cas.KeyFileError, match=f"key file {key_file} is over 65536 bytes"):
        cas.open(tmp_path / "s")
    with pytest.raises(cas.KeyFileError):
        read_key_file(str(key_file))


def test_adding_a_key_that_already_opens_the_store_is_refused_naming_its_id(tmp_path, cli):
    """A second id for a key outlives `cas key remove` of the first: the user believes the key
    revoked while it still opens the store. Passphrases, raw keys and the key the store was
    opened with alike."""
    path, admin, bob = tmp_path / "s", tmp_path / "admin", tmp_path / "bob"
    with cas.open(path, key="admin") as store:
        store.save({"a": torch.ones(3)}, step=1)
        admin_id = store.key_id
        bob_id = store.add_key("bob's passphrase")
        raw_id = store.add_key(RAW_KEY)
        for key, key_id in (("admin", admin_id), ("bob's passphrase", bob_id), (RAW_KEY, raw_id)):
            with pytest.raises(cas.DuplicateKeyError, match=f"already opens the store at .* as key {key_id}"):
                store.add_key(key)
        assert sorted(store.key_ids()) == sorted([admin_id, bob_id, raw_id])
    admin.write_text("admin\n")
    bob.write_text("bob's passphrase\n")
    again = cli("--store", path, "key", "add", "--new-key-file", bob, key_file=admin)
    assert again.returncode == 2 and bob_id in again.stderr and "already opens" in again.stderr, again.stderr
    assert cli("--store", path, "key", "remove", bob_id, key_file=admin).returncode == 0
    with pytest.raises(WrongKeyError):
        cas.open(path, key="bob's passphrase")  # revoked: no second id kept it


def test_keys_added_and_removed_without_rewriting_data(tmp_path):
    path = tmp_path / "s"
    with cas.open(path, key="first") as store:
        store.save({"a": torch.arange(100)}, step=1)
        first = store.key_id
        before = {n: store.backend.inner.get(n) for n in store.backend.list("objects/") + store.backend.list("packs/")}
        raw_id = store.add_key(RAW_KEY)
        second = store.add_key("second")
        assert set(store.key_ids()) == {first, raw_id, second}
        with pytest.raises(KeyRemovalRefusedError, match="opened with"):
            store.remove_key(first)
    with cas.open(path, key=RAW_KEY) as store:  # a raw key: no KDF
        assert store.key_id == raw_id
        assert_same(store.load(1), {"a": torch.arange(100)})
        store.remove_key(first)
        store.remove_key(second)
        with pytest.raises(KeyRemovalRefusedError):
            store.remove_key(raw_id)  # the last one, and the one it was opened with
        after = {n: store.backend.inner.get(n) for n in before}
        assert after == before  # not one byte of data rewritten
    with pytest.raises(WrongKeyError, match="removed"):
        cas.open(path, key="first")
    with cas.open(path, key=RAW_KEY) as store:
        assert store.key_ids() == [raw_id]


class _Ran:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(monkeypatch, capsys):
    """`cas ...` run in this process (cas.cli.main, exit status and output), $CAS_KEY_FILE set
    to `key_file`: a process per command costs seconds of torch imports on this machine."""
    from cas.cli import main

    def run(*args, key_file=None) -> _Ran:
        if key_file is None:
            monkeypatch.delenv("CAS_KEY_FILE", raising=False)
        else:
            monkeypatch.setenv("CAS_KEY_FILE", str(key_file))
        capsys.readouterr()
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return _Ran(code, out.out, out.err)
    return run


def test_the_cli_reads_the_key_file_and_manages_keys(tmp_path, cli):
    path, k1, k2, raw = tmp_path / "s", tmp_path / "k1", tmp_path / "k2", tmp_path / "raw"
    k1.write_text("passphrase one\n")  # one trailing newline is stripped
    k2.write_text("passphrase two")
    raw.write_bytes(RAW_KEY)
    with cas.open(path, key="passphrase one") as store:
        store.save({"a": torch.ones(4)}, step=7)
    out = cli("--store", path, "ls", key_file=k1)
    assert out.returncode == 0 and "7" in out.stdout
    env = {k: v for k, v in os.environ.items() if k != "CAS_KEY_FILE"}
    missing = subprocess.run([sys.executable, "-m", "cas", "--store", str(path), "ls"], env=env,
                             capture_output=True, text=True, timeout=120)  # the real command, once
    assert missing.returncode == 2 and "encrypted" in missing.stderr and "CAS_KEY_FILE" in missing.stderr
    wrong = cli("--store", path, "ls", key_file=k2)
    assert wrong.returncode == 2 and "does not open" in wrong.stderr
    added = cli("--store", path, "key", "add", "--new-key-file", raw, key_file=k1)
    assert added.returncode == 0, added.stderr
    raw_id = added.stdout.split()[-1]
    listed = cli("--store", path, "key", "list", "--json", key_file=raw)
    assert listed.returncode == 0 and raw_id in listed.stdout
    first = [line.split()[0] for line in cli("--store", path, "key", "list", key_file=k1).stdout.splitlines()
             if "this key" in line][0]
    refused = cli("--store", path, "key", "remove", first, key_file=k1)
    assert refused.returncode == 2 and "opened with" in refused.stderr
    assert cli("--store", path, "key", "remove", first, key_file=raw).returncode == 0
    assert cli("--store", path, "ls", key_file=k1).returncode == 2
    assert cli("--store", path, "verify", key_file=raw).returncode == 0
    new = cli("--store", tmp_path / "new", "import", tmp_path / "none.pt", key_file=k1)
    assert new.returncode == 2 and not (tmp_path / "new").exists()  # a failed first command leaves no store
    made = cli("--store", tmp_path / "plain", "import", tmp_path / "none.pt")
    assert made.returncode == 2


def test_a_key_file_exported_once_leaves_plain_stores_usable_from_the_cli(tmp_path, cli, monkeypatch):
    """$CAS_KEY_FILE opens encrypted stores and is ignored by plain ones, in the CLI as in the
    library; only a command that creates a store (import) creates it encrypted under it."""
    key_file, plain, made = tmp_path / "k", tmp_path / "plain", tmp_path / "made"
    key_file.write_text("the passphrase\n")
    with cas.open(plain) as store:
        store.save({"a": torch.ones(4)}, step=3)
    for command in (["ls"], ["verify"], ["show", "3"], ["repair"]):
        ran = cli("--store", plain, *command, key_file=key_file)
        assert ran.returncode == 0, (command, ran.stderr)
    torch.save({"w": torch.arange(6.0)}, tmp_path / "w.pt")
    assert cli("--store", plain, "import", "--step", 4, tmp_path / "w.pt", key_file=key_file).returncode == 0
    assert not cas.open(plain).encrypted
    assert cli("--store", made, "import", "--step", 4, tmp_path / "w.pt", key_file=key_file).returncode == 0
    monkeypatch.delenv("CAS_KEY_FILE")
    with pytest.raises(KeyRequiredError):
        cas.open(made)
    with cas.open(made, key="the passphrase") as store:
        assert store.encrypted and torch.equal(store.load()["w"], torch.arange(6.0))


def test_a_flipped_byte_is_a_corruption_error_naming_the_object(tmp_path, cli):
    path = tmp_path / "s"
    with cas.open(path, key="k", chunk_size=64 << 10, pack_max=1024) as store:
        store.save({"big": torch.randn(1 << 16), "small": torch.arange(8)}, step=1)
        files = store.backend.list("objects/")
        target = files[0]
        key_hex = target.rpartition("/")[2]
        blob = store.backend.path(target)
    data = bytearray(open(blob, "rb").read())
    data[len(data) // 2] ^= 0x01
    with open(blob, "wb") as f:
        f.write(data)
    with cas.open(path, key="k") as store:
        with pytest.raises(CorruptionError, match=key_hex) as err:
            store.load(1)
        assert "authentication" in str(err.value)
        report = store.verify()
        assert not report.ok and any(key_hex in str(p) for p in report.problems)
    key_file = tmp_path / "key"
    key_file.write_text("k")
    out = cli("--store", path, "verify", key_file=key_file)
    assert out.returncode == 1 and key_hex in out.stdout + out.stderr
    repaired = cli("--store", path, "repair", key_file=key_file)  # quarantines it, rebuilds the cache
    assert repaired.returncode == 0 and key_hex in repaired.stdout, repaired.stdout + repaired.stderr
    assert (path / "quarantine" / key_hex).exists()


def test_a_tampered_pack_or_a_moved_blob_is_named(tmp_path):
    path = tmp_path / "s"
    with cas.open(path, key="k") as store:
        store.save({"a": torch.arange(50), "b": torch.arange(60)}, step=1)
        pack = store.backend.list("packs/")[0]
        objs = None
        pack_file = store.backend.path(pack)
    data = bytearray(open(pack_file, "rb").read())
    # inside the first entry's object: slot 0 splits after the pack's 8-byte magic (message A
    # and its tag), then come the entry's 36-byte header and its object
    data[crypt.HEADER + 8 + crypt.TAG + 36 + 5] ^= 0x80
    open(pack_file, "wb").write(data)
    with cas.open(path, key="k") as store:
        with pytest.raises(CorruptionError, match=r"object [0-9a-f]{64}"):
            store.load(1)
    # a sealed blob under another name fails: its name is its associated data
    with cas.open(tmp_path / "m", key="k", chunk_size=64 << 10, pack_max=1024) as store:
        store.save({"x": torch.randn(1 << 15), "y": torch.randn(1 << 15)}, step=1)
        objs = [store.backend.path(n) for n in store.backend.list("objects/")]
    a, b = open(objs[0], "rb").read(), open(objs[1], "rb").read()
    open(objs[0], "wb").write(b)
    open(objs[1], "wb").write(a)
    with cas.open(tmp_path / "m", key="k") as store, pytest.raises(CorruptionError, match="authentication"):
        store.load(1)


# new stores' layout (scheme 4: split slots), scheme 3's (whole 1 MiB segments), schemes 1 and 2's
LAYOUTS = [crypt.Layout(crypt.SEGMENT, True), crypt.Layout(crypt.SEGMENT, False), crypt.Layout(crypt.SEGMENT_V1, False)]


def _sizes(*multiples):
    """(layout, size) pairs: sizes as (segments, bytes more) of each layout, plus sizes read
    through a mapping."""
    return [(lay, k * lay.segment + extra) for lay in LAYOUTS for k, extra in multiples] + \
        [(lay, 2 * MAP_FROM + 12345) for lay in LAYOUTS]


@pytest.mark.parametrize("version", [4, 3])
def test_a_load_decrypts_each_pack_entry_without_its_neighbours_bytes(tmp_path, monkeypatch, version):
    """Scheme 3 sealed a pack in 1 MiB segments, so a load decrypted each entry's first and last
    segments whole, its neighbours' bytes with them: here a third more than the packs hold.
    Scheme 4 splits a segment where entries meet, and a load of new stores decrypts each byte
    of their packs about once; a scheme-3 store still loads, as before."""
    from cas import keys

    monkeypatch.setattr(keys, "ENCRYPTION_VERSION", version)
    tensors = {f"t{i}": torch.frombuffer(bytearray(os.urandom(3_300_000)), dtype=torch.uint8).clone()
               for i in range(6)}
    with cas.open(tmp_path / "s", key=RAW_KEY, compress=False) as store:
        store.save(tensors, step=1)
        packs = sum(size for _, size in store.backend.list_sizes("packs/"))
    decrypted = []
    opened = crypt.StoreKeys.blob_aead

    class Counting:
        def __init__(self, cipher):
            self.cipher = cipher

        def decrypt_into(self, nonce, data, aad, out):
            decrypted.append(len(data) - crypt.TAG)
            return self.cipher.decrypt_into(nonce, data, aad, out)

        def __getattr__(self, name):
            return getattr(self.cipher, name)
    monkeypatch.setattr(crypt.StoreKeys, "blob_aead", lambda self, salt: Counting(opened(self, salt)))
    with cas.open(tmp_path / "s", key=RAW_KEY) as store:
        assert store.config.encryption["version"] == version
        out = store.load(1)
    assert all(torch.equal(out[k], t) for k, t in tensors.items())
    if version == 4:
        assert sum(decrypted) <= packs * 1.01
    else:
        assert sum(decrypted) > packs * 1.2


@pytest.mark.parametrize("cuts", [(), (0,), (1,), (15, 16, 17), (100, 4096, 4097, 70000), (65535,)])
def test_a_segment_sealed_from_several_buffers_is_the_one_shot_seal_of_their_bytes(cuts):
    """A write's segment is sealed straight from the buffers it spans (GCM's incremental form,
    no gather copy): the stored bytes must be exactly what the one-shot seal of the joined bytes
    gives, which every reader, this one and older ones, opens."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from cas.keys import BlobCipher

    key, nonce, aad = os.urandom(32), crypt.nonce(3, False), b"cas-blob-2\0packs"
    data = os.urandom(65536)
    bounds = [0, *cuts, len(data)]
    parts = [memoryview(data)[a:b] for a, b in zip(bounds, bounds[1:])]
    out = bytearray(len(data) + crypt.TAG)
    BlobCipher(key).seal_parts_into(nonce, parts, aad, memoryview(out))
    assert bytes(out) == AESGCM(key).encrypt(nonce, data, aad)


@pytest.mark.parametrize("lay,size", _sizes((0, 0), (0, 1), (1, -1), (1, 0), (1, 1), (3, 7)))
def test_sealed_blobs_round_trip_by_range_and_refuse_cuts(tmp_path, lay, size):
    seg = lay.segment
    backend = _sealed_backend(tmp_path, lay)
    data = os.urandom(size)
    parts = [data[:size // 3], data[size // 3:size // 2], data[size // 2:]]
    assert backend.put_if_absent("log/x", parts)
    assert backend.stat("log/x") == size and os.path.getsize(tmp_path / "log" / "x") == lay.sealed_size(size)
    assert backend.get("log/x") == data
    for start, length in [(0, 10), (size // 2, 100), (seg - 3, 10), (max(size - 5, 0), 50), (seg - 3, 2 * seg + 10),
                          (seg, seg), (5, size), (seg + 1, MAP_FROM + 3)]:
        assert backend.get("log/x", start, length) == data[start:start + length]
        given = []  # into a caller's buffer (of the size asked): whole segments decrypt straight into it

        def into(n: int) -> memoryview:
            given.append(bytearray(n + 1))
            return memoryview(given[-1])
        got = backend.get("log/x", start, length, buffer=into)
        assert bytes(got) == data[start:start + length]
        assert got.obj is given[-1]
    buf = bytearray(size + 10)
    assert bytes(backend.get("log/x", buffer=lambda n: memoryview(buf))) == data
    staged = backend.stage("objects/ab/" + "ab" * 32, [data])
    assert backend.peek(staged, 64) == (size, data[:64])
    backend.discard(staged)
    sealed = (tmp_path / "log" / "x").read_bytes()
    if size >= seg:  # cut at a segment boundary: the last segment left does not say it is last
        (tmp_path / "log" / "y").write_bytes(sealed[:lay.at(1)])
        with pytest.raises(CorruptionError):
            backend.get("log/y")
    (tmp_path / "log" / "z").write_bytes(sealed)  # the same bytes under another name
    with pytest.raises(CorruptionError):
        backend.get("log/z")
    if size:  # also by range, right after reading the same range of the original (its segments opened)
        assert backend.get("log/x", size // 2, 1) == data[size // 2:size // 2 + 1]
        with pytest.raises(CorruptionError):
            backend.get("log/z", size // 2, 1)


def _sealed_backend(tmp_path, layout=LAYOUTS[0]):
    from cas.localfs import LocalBackend

    (tmp_path / "tmp").mkdir(exist_ok=True)
    return crypt.EncryptedBackend(LocalBackend(str(tmp_path)), crypt.StoreKeys(os.urandom(32), "k", ("raw", RAW_KEY)),
                                  segment=layout.segment, split=layout.split)


@pytest.mark.parametrize("lay,size", _sizes((0, 9), (1, 0), (3, 0), (5, 77)))
def test_a_streamed_pack_is_sealed_as_written_in_any_order_by_many_threads(tmp_path, lay, size):
    """Writes of any size and place, split into parts, arriving in any order from several
    threads (as a save's workers stream a pack): what reads back is what was written, whole and
    by range; the file holds no plaintext; a segment cut, a byte flipped or the blob moved out of
    packs/ fails its check."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    backend, seg = _sealed_backend(tmp_path, lay), lay.segment
    rng = random.Random(size)
    data = (MARK_TENSOR * (size // len(MARK_TENSOR) + 1))[:size - 1] + b"!"
    cuts = sorted({0, size, *(rng.randrange(size) for _ in range(12)), *(i * seg for i in range(1, 4))})
    writes = [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if lo < hi <= size]
    rng.shuffle(writes)
    stream = backend.stream("packs/00/" + "00" * 32)

    def write(span):
        lo, hi = span
        mid = lo + (hi - lo) // 3
        assert stream.write_at(lo, [data[lo:mid], memoryview(data)[mid:hi]]) == hi - lo
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, writes))
    name = "packs/ab/" + "ab" * 32
    assert backend.publish(stream.close(name))
    path = tmp_path / "packs" / "ab" / ("ab" * 32)
    sealed = path.read_bytes()
    assert sealed.startswith(crypt.STREAM_MAGIC) and MARK_TENSOR not in sealed
    assert backend.stat(name) == size and backend.get(name) == data
    for start, length in [(0, 5), (size // 2, 100), (seg - 3, 10), (max(size - 7, 0), 7), (1, size - 1)]:
        assert backend.get(name, start, length) == data[start:start + length]
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "x").write_bytes(sealed)  # the same bytes as a blob of another kind
    with pytest.raises(CorruptionError):
        backend.get("log/x")
    if size > seg:  # cut after a whole segment: the one left does not say it is the last
        path.write_bytes(sealed[:lay.at(1)])
        with pytest.raises(CorruptionError):
            backend.get(name)
    flipped = bytearray(sealed)
    flipped[crypt.HEADER + 3] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(CorruptionError, match="authentication"):
        backend.get(name)


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_ranges_of_a_streamed_pack_of_mixed_entries_read_back_exactly(tmp_path, lay, seed):
    """Entries of every size (bytes to segments) streamed in any order, then read back by
    random ranges, one after another in one open (small reads share opened segments through the
    cache, which for split segments holds only the messages a read opened): every range is the
    written bytes, with or without a caller's buffer."""
    import random

    backend, seg = _sealed_backend(tmp_path, lay), lay.segment
    rng = random.Random(seed)
    sizes = [rng.choice([1, 36, 700, seg // 3, seg - 5, seg + 36, 2 * seg + 999, 3 * seg // 2]) for _ in range(12)]
    data = os.urandom(sum(sizes))
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    writes = list(zip(bounds, bounds[1:]))
    rng.shuffle(writes)
    stream = backend.stream("packs/00/" + "00" * 32)
    for lo, hi in writes:
        cut = min(lo + 36, hi)  # (an entry header, then its object)
        stream.write_at(lo, [data[lo:cut], memoryview(data)[cut:hi]])
    name = "packs/ab/" + "ab" * 32
    assert backend.publish(stream.close(name))
    for _ in range(150):
        if rng.random() < 0.5:
            a, b = sorted(rng.sample(bounds, 2))  # an entry (or several) as the index places it
        else:
            a = rng.randrange(len(data))
            b = min(len(data), a + rng.choice([1, 17, seg // 2, seg, 2 * seg + 3]))
        buffer = (lambda n: memoryview(bytearray(n))) if rng.random() < 0.5 else None
        assert bytes(backend.get(name, a, b - a, buffer=buffer)) == data[a:b]
    assert backend.get(name) == data


def test_a_streamed_pack_closed_with_bytes_missing_is_refused(tmp_path):
    backend = _sealed_backend(tmp_path)
    stream = backend.stream("packs/00/" + "00" * 32)
    stream.write_at(0, [b"a" * 100])
    stream.write_at(200, [b"b" * 100])  # 100..200 never written
    with pytest.raises(OSError, match="never written"):
        stream.close("packs/ab/" + "ab" * 32)
    assert not [p for p in (tmp_path / "tmp").iterdir() if not p.name.startswith(".owner.")]  # the stream's file went


@pytest.mark.parametrize("version", [1, 2, 3])
def test_new_stores_seal_split_1_mib_slots_and_older_stores_keep_their_scheme(tmp_path, monkeypatch, version):
    """New stores (scheme 4) stream packs sealed in 1 MiB slots split where entries meet; a store
    made by an older cas (scheme 1: packs sealed whole, 64 KiB segments; 2: streamed; 3: streamed,
    1 MiB segments of one message) is read and written with its own scheme, so that cas still
    reads it."""
    state = {"w": torch.randn(1 << 19), "s": torch.arange(5)}
    with cas.open(tmp_path / "new", key="k") as store:
        store.save(state, step=1)
        assert store.config.encryption["version"] == 4 and store.config.encryption["segment"] == 1 << 20
        packs = [store.backend.path(n) for n in store.backend.list("packs/")]
        assert packs and all(open(p, "rb").read(8) == crypt.STREAM_MAGIC for p in packs)
        _opens_only_with(store.backend, LAYOUTS[0])
    from cas import keys
    monkeypatch.setattr(keys, "ENCRYPTION_VERSION", version)  # a store made by an older cas
    with cas.open(tmp_path / "old", key="k") as store:
        store.save(state, step=1)
    monkeypatch.undo()
    monkeypatch.setenv(crypt.SCRYPT_ENV, "10")
    old = LAYOUTS[1] if version == 3 else LAYOUTS[2]
    with cas.open(tmp_path / "old", key="k") as store:
        assert store.config.encryption["version"] == version and store.config.encryption["segment"] == old.segment
        store.save({"w": state["w"] + 1, "s": state["s"]}, step=2)
        packs = [store.backend.path(n) for n in store.backend.list("packs/")]
        out = store.load(1)
        assert torch.equal(out["w"], state["w"]) and torch.equal(out["s"], state["s"])
        assert torch.equal(store.load(2)["w"], state["w"] + 1)
        assert store.verify().ok
        _opens_only_with(store.backend, old)
    magic = crypt.BLOB_MAGIC if version == 1 else crypt.STREAM_MAGIC
    assert packs and all(open(p, "rb").read(8) == magic for p in packs)


def _opens_only_with(backend, layout) -> None:
    """Every pack over one segment opens with its store's layout and fails with the others."""
    assert isinstance(backend, crypt.EncryptedBackend) and backend.layout == layout
    names = [n for n, size in backend.list_sizes("packs/") if size > layout.segment + 1]
    assert names
    for other in LAYOUTS:
        if other != layout:
            wrong = crypt.EncryptedBackend(backend.inner, backend.keys, segment=other.segment, split=other.split)
            for name in names:
                with pytest.raises(CorruptionError):
                    wrong.get(name)
    for name in names:
        assert len(backend.get(name)) == backend.stat(name)


def test_a_store_whose_segment_size_does_not_fit_its_scheme_is_refused(tmp_path):
    with cas.open(tmp_path / "s", key="k") as store:
        store.save({"w": torch.randn(10)}, step=1)
    from cas.keys import check_fields
    with cas.open(tmp_path / "s", key="k") as store:
        fields = dict(store.config.encryption)
    check_fields(fields, "here")
    with pytest.raises(CasError, match="parameters this cas does not read"):
        check_fields({**fields, "segment": 64 << 10}, "here")
    with pytest.raises(CasError, match="does not know"):
        check_fields({**fields, "version": 5}, "here")


def test_push_and_pull_between_stores_of_one_master_key_and_refused_across_keys(tmp_path):
    state = {"w": torch.randn(1000), "n": "x"}
    with cas.open(tmp_path / "src", key="k") as src:
        src.save(state, step=1)
        report = src.push(tmp_path / "copy")  # created encrypted with the source's master key
        assert [ck.step for ck in report.copied] == [1]
        src.save({"w": torch.randn(1000)}, step=2)
        with cas.open(tmp_path / "other", key="k") as other:  # the same passphrase, its own master key
            with pytest.raises(CasError, match="master key"):
                src.push(other)
        with cas.open(tmp_path / "plain") as plain:
            with pytest.raises(CasError, match="both stores plain"):
                src.push(plain)
            with pytest.raises(CasError, match="cannot copy"):
                plain.pull(tmp_path / "src")
    with cas.open(tmp_path / "copy", key="k") as copy:
        assert copy.encrypted and copy.verify().ok
        assert_same(copy.load(1), state)
        assert copy.pull(tmp_path / "src").copied[0].step == 2
    assert found_marks(folder_bytes(tmp_path / "copy")) == set()


def test_copies_between_stores_of_one_master_key_go_on_after_either_changes_its_keys(tmp_path):
    """A push made "copy" with the source's master key; then `cas key add/remove` on the copy
    left it without the source's key, and every push and pull between the two was refused as
    across keys (copies opened the other store with the user key; audit of stop 38). The master
    key both share opens it; a store of another master key is still refused."""
    with cas.open(tmp_path / "src", key="k") as src:
        src.save({"w": torch.randn(100)}, step=1)
        src.push(tmp_path / "copy")
    with cas.open(tmp_path / "copy", key="k") as copy:
        old = copy.key_id
        copy.add_key("k2")
    with cas.open(tmp_path / "copy", key="k2") as copy:
        copy.remove_key(old)
    with pytest.raises(cas.WrongKeyError):
        cas.open(tmp_path / "copy", key="k")
    with cas.open(tmp_path / "src", key="k") as src:
        src.save({"w": torch.randn(100)}, step=2)
        assert [ck.step for ck in src.push(tmp_path / "copy").copied] == [2]
        with cas.open(tmp_path / "other", key="k2") as other:  # k2 opens it, but its master key is its own
            other.save({"w": torch.randn(100)}, step=7)
        with pytest.raises(CasError, match="cannot copy|another master key"):
            src.pull(tmp_path / "other")
    with cas.open(tmp_path / "copy", key="k2") as copy:
        assert [ck.step for ck in copy.checkpoints()] == [1, 2] and copy.verify().ok
        copy.save({"w": torch.randn(100)}, step=3)
        assert [ck.step for ck in copy.push(tmp_path / "src").copied] == [3]
    with cas.open(tmp_path / "src", key="k") as src:
        assert [ck.step for ck in src.checkpoints()] == [1, 2, 3] and src.verify().ok


def test_a_mirror_of_an_encrypted_store_is_encrypted_alike(tmp_path):
    with cas.open(tmp_path / "src", key="k", mirror=tmp_path / "mirror") as src:
        src.save({"w": torch.randn(500), "note": MARK_VALUE}, step=1)
        src.wait(30)
        assert src.mirror_status().pending == []
    with cas.open(tmp_path / "mirror", key="k") as mirror:
        assert mirror.encrypted and [ck.step for ck in mirror.checkpoints()] == [1]
    assert found_marks(folder_bytes(tmp_path / "mirror")) == set()


def test_dcp_save_and_load_into_an_encrypted_store(tmp_path):
    from cas.store.dcp import load, save

    state = {"w": torch.randn(64, 64), "marker": torch.frombuffer(bytearray(MARK_TENSOR * 100), dtype=torch.uint8)}
    save(state, tmp_path / "d", step=1, no_dist=True, key=RAW_KEY, compress=False)
    out = {"w": torch.zeros(64, 64), "marker": torch.zeros(len(MARK_TENSOR) * 100, dtype=torch.uint8)}
    load(out, tmp_path / "d", no_dist=True, key=RAW_KEY)
    assert_same(out, state)
    assert found_marks(folder_bytes(tmp_path / "d")) == set()
    with cas.open(tmp_path / "d", key=RAW_KEY) as store:
        assert store.verify().ok


def test_dcps_own_save_and_load_say_a_missing_or_wrong_key_as_cas_errors(tmp_path):
    """Through DCP's own dcp.save and dcp.load a key error raised inside DCP reached the caller
    as DCP's CheckpointException (a BaseException, not even an Exception); the reader and the
    writer now check the key when they are made, and the right key still saves and loads."""
    import torch.distributed.checkpoint as dcp

    from cas.store.dcp import CasReader, CasWriter

    dcp.save({"w": torch.ones(4)}, storage_writer=CasWriter(tmp_path / "d", step=1, key="right"))
    for options, error in (({}, KeyRequiredError), ({"key": "wrong"}, WrongKeyError)):
        with pytest.raises(error):
            dcp.load({"w": torch.zeros(4)}, storage_reader=CasReader(tmp_path / "d", **options))
        with pytest.raises(error):
            dcp.save({"w": torch.ones(4)}, storage_writer=CasWriter(tmp_path / "d", step=2, **options))
    dcp.save({"w": torch.ones(4)}, storage_writer=CasWriter(tmp_path / "plain", step=1))
    with pytest.raises(NotEncryptedError):
        dcp.load({"w": torch.zeros(4)}, storage_reader=CasReader(tmp_path / "plain", key="right"))
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=CasReader(tmp_path / "d", key="right"))
    assert torch.equal(out["w"], torch.ones(4))
    with cas.open(tmp_path / "d", key="right") as store:
        assert [ck.step for ck in store.checkpoints()] == [1]


WORKER = r"""
import sys, torch, cas
path, what = sys.argv[1], sys.argv[2]
with cas.open(path, key="old", chunk_size=64 << 10, pack_max=None if what == "stream" else 4096) as store:
    if what in ("save", "stream"):
        store.save({"w": torch.randn(40000, generator=torch.Generator().manual_seed(3)), "s": torch.arange(9)}, step=3)
    elif what == "add":
        store.add_key("new")
    else:
        store.remove_key([k for k in store.key_ids() if k != store.key_id][0])
"""


def _w(step: int) -> torch.Tensor:
    return torch.randn(40000, generator=torch.Generator().manual_seed(step))


def _killed(path, what, point) -> int:
    env = dict(os.environ, CAS_FAULTS=f"{point}=kill")
    return subprocess.run([sys.executable, "-c", WORKER, str(path), what], env=env, capture_output=True,
                          timeout=120).returncode


@pytest.mark.parametrize("what,point", [("save", "session.file_written"), ("save", "commit.in_txn"),
                                        ("stream", "session.pack_written"), ("stream", "commit.in_txn"),
                                        ("add", "keys.adding"), ("add", "keys.added"),
                                        ("remove", "keys.removing"), ("remove", "keys.removed")])
def test_killed_at_a_fault_point_loses_nothing(tmp_path, what, point):
    path = tmp_path / "s"
    with cas.open(path, key="old", chunk_size=64 << 10, pack_max=4096) as store:
        for step in (1, 2):
            store.save({"w": _w(step), "s": torch.arange(9)}, step=step)
        extra = store.add_key("extra") if what == "remove" else None
    assert _killed(path, what, point) == -signal.SIGKILL
    with cas.open(path, key="old") as store:
        steps = [ck.step for ck in store.checkpoints()]
        assert steps[:2] == [1, 2] and (steps == [1, 2, 3]) == (point == "commit.in_txn")
        for step in steps:
            assert torch.equal(store.load(step)["w"], _w(step))
        assert store.verify().ok
        ids = store.key_ids()
    if what == "add":
        opened = True
        try:
            cas.open(path, key="new").close()
        except WrongKeyError:
            opened = False
        assert opened == (point == "keys.added") and len(ids) == 1 + opened
    if what == "remove":
        assert (extra in ids) == (point == "keys.removing")


def test_two_processes_adding_the_same_key_at_once_add_it_once(tmp_path):
    """Both checked that the key did not open the store yet, then each wrote it under a random
    id: two ids, and removing one left the key working (an audit of stop 36, 6 of 6 rounds). The
    id now comes from the key: the second add finds its name taken and is refused."""
    path = tmp_path / "s"
    with cas.open(path, key="alice") as store:
        store.save({"w": _w(1)}, step=1)
    gate = tmp_path / "gate"
    add = "import cas, sys; s = cas.open(sys.argv[1], key='alice'); print(s.add_key('bob')); s.close()"
    first = subprocess.Popen([sys.executable, "-c", add, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, CAS_FAULTS=f"keys.adding=pause:{gate}"))
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{gate}.reached"):  # checked bob is not a key yet, paused before writing it
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.05)
    with cas.open(path, key="alice") as store:
        bob = store.add_key("bob")
    gate.touch()
    out, err = first.communicate(timeout=60)
    assert first.returncode != 0 and "DuplicateKeyError" in err and bob in err, out + err
    with cas.open(path, key="alice") as store:
        assert len(store.key_ids()) == 2
        store.remove_key(bob)
    with pytest.raises(WrongKeyError):
        cas.open(path, key="bob")


@pytest.mark.parametrize("leftover", [False, True])
def test_two_hosts_removing_each_others_key_leave_one(tmp_path, leftover):
    """Each store opened with its own key removes the other's: both saw two keys and both
    deleted one, leaving a store no key opens (an audit hit it on S3 in 4 of 4 rounds). One is
    refused now, whichever lists last, and the store keeps the other's key. `leftover`: keys/
    also holds a blob that wraps another master key (a killed creation leaves one): it opens
    nothing here, and counted as a key that stays it let both removals through (audit, stop 36)."""
    path = tmp_path / "s"
    with cas.open(path, key="alice") as store:
        store.save({"w": _w(1)}, step=1)
        alice, bob = store.key_id, store.add_key("bob")
    if leftover:
        with cas.open(tmp_path / "other", key="carol") as other:
            shutil.copy(tmp_path / "other" / "keys" / other.key_id, path / "keys" / other.key_id)
    gate = tmp_path / "gate"
    remove = "import cas, sys; s = cas.open(sys.argv[1], key=sys.argv[2]); s.remove_key(sys.argv[3]); s.close()"
    first = subprocess.Popen([sys.executable, "-c", remove, str(path), "alice", bob],
                             env=dict(os.environ, CAS_FAULTS=f"keys.removing=pause:{gate}"))
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{gate}.reached"):  # alice marked bob's key as going, paused
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.05)
    with cas.open(path, key="bob") as store, pytest.raises(KeyRemovalRefusedError, match="being removed too"):
        store.remove_key(alice)
    gate.touch()
    assert first.wait(timeout=60) == 0
    with cas.open(path, key="alice") as store:
        assert alice in store.key_ids() and bob not in store.key_ids() and torch.equal(store.load(1)["w"], _w(1))
    with pytest.raises(WrongKeyError):
        cas.open(path, key="bob")
    assert not os.listdir(path / "removing-keys")


def test_repair_of_an_encrypted_pack_drops_only_the_entries_a_damaged_segment_covers(tmp_path, cli):
    """One flipped byte in an encrypted pack: repair read each pack whole, so the one damaged
    segment failed the read and it dropped every object of the pack, undamaged tensors and
    manifest nodes too. It now reads each entry on its own (the footer lists them)."""
    path, key_file = tmp_path / "s", tmp_path / "k"
    key_file.write_text("k")
    a = torch.frombuffer(bytearray(os.urandom(3_000_000)), dtype=torch.uint8).clone()
    with cas.open(path, key="k", compress=False, chunk_size=64 << 10) as store:
        store.save({"a": a, "b": torch.arange(10)}, step=1)
        keys = [k for t in store.tensors(1) for k in t["chunks"]]
    (pack,) = [os.path.join(d, name) for d, _, names in os.walk(path / "packs") for name in names]
    data = bytearray(open(pack, "rb").read())
    data[crypt.SEGMENT + 200_000] ^= 1  # inside a's chunks, in the pack's second segment
    open(pack, "wb").write(bytes(data))
    assert cli("--store", path, "repair", key_file=key_file).returncode == 0
    with cas.open(path, key="k") as store:
        assert torch.equal(store.reader(1).read_tensor("b"), torch.arange(10))
        lost = [k for k in keys if store.objects.record(k) is None]
        assert 1 <= len(lost) <= crypt.SEGMENT // (64 << 10) + 1  # the chunks the damaged segment covers
        assert store.verify().damaged_steps == [1]


def test_repair_of_an_encrypted_pack_whose_last_segment_is_damaged_keeps_the_entries_before_it(tmp_path, cli):
    """The footer lies in a pack's last segment: with that segment damaged, repair walked the
    pack from a whole read, which fails at the damaged segment, and dropped every entry of it
    (audit of stop 39). It walks entry by entry now, up to the damage."""
    path, key_file = tmp_path / "s", tmp_path / "k"
    key_file.write_text("k")
    import threading

    tensors = {f"t{i}": torch.frombuffer(bytearray(os.urandom(700_000)), dtype=torch.uint8).clone() for i in range(8)}
    keys: list = []

    def save() -> None:
        with cas.open(path, key="k", compress=False, chunk_size=64 << 10) as store:
            store.save(tensors, step=1)
            keys.extend(k for t in store.tensors(1) for k in t["chunks"])

    def in_a_new_thread(fn) -> None:  # (no segment opened by the save's threads may answer for the disk)
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join()
    in_a_new_thread(save)
    (pack,) = [os.path.join(d, name) for d, _, names in os.walk(path / "packs") for name in names]
    data = bytearray(open(pack, "rb").read())
    data[-1] ^= 1  # the trailer: in the last segment
    open(pack, "wb").write(bytes(data))
    assert cli("--store", path, "repair", key_file=key_file).returncode == 0
    found = []

    def check() -> None:
        with cas.open(path, key="k") as store:
            found.append([k for k in keys if store.objects.record(k) is not None])
            found.append(bytes(store.objects.get(keys[0])))  # verified on read
    in_a_new_thread(check)
    kept, first = found
    assert len(keys) - crypt.SEGMENT // (64 << 10) - 1 <= len(kept) < len(keys)
    assert first == bytes(tensors["t0"][:64 << 10].numpy())


def test_a_pack_sealed_under_another_master_key_never_opens_from_the_segment_cache(tmp_path):
    """Opened segments are kept, keyed by salt and associated data, which a streamed pack shares
    with its copy in another store: a copy of store A's pack put in store B opened there from
    the cache, under no check of B's key (audit of stop 39). The cache is keyed by the master
    key's check too, and is each open store's own."""
    import shutil

    from cas.localfs import LocalBackend

    def backend(folder):
        os.makedirs(folder / "tmp")
        return crypt.EncryptedBackend(LocalBackend(str(folder)),
                                      crypt.StoreKeys(os.urandom(32), "k", ("raw", RAW_KEY)))
    a, b = backend(tmp_path / "a"), backend(tmp_path / "b")
    name = "packs/ab/" + "ab" * 32
    stream = a.stream("packs/x")
    stream.write_at(0, [MARK_TENSOR * (3 * crypt.SEGMENT // len(MARK_TENSOR))])
    a.publish(stream.close(name))
    assert a.get(name, 100, 20) == (MARK_TENSOR * 10)[100 % len(MARK_TENSOR):][:20]  # opened, cached
    os.makedirs(os.path.dirname(b.inner.path(name)))
    shutil.copy(a.inner.path(name), b.inner.path(name))
    with pytest.raises(CorruptionError, match="authentication"):
        b.get(name, 100, 20)


def test_verify_reads_what_is_on_disk_not_what_this_process_decrypted_before(tmp_path):
    """Each thread keeps the plain bytes of the segments it opened lately (a pack's small
    objects read one after another). A verify after the pack was damaged on disk found them
    there and reported ok, in the same open and after a reopen in the same process."""
    path = tmp_path / "s"
    with cas.open(path, key="k", compress=False) as store:
        store.save({"w": _w(1)[:1000].clone(), "b": _w(2)[:10].clone()}, step=1)
        assert store.verify().ok and store.reader(1).read_tensor("b").numel() == 10
        for folder, _, names in os.walk(path / "packs"):
            for name in names:
                data = bytearray(open(os.path.join(folder, name), "rb").read())
                data[len(data) // 2] ^= 1
                data[-1] ^= 1
                open(os.path.join(folder, name), "wb").write(bytes(data))
        assert not store.verify().ok
    with cas.open(path, key="k") as store:
        assert not store.verify().ok


def test_a_verify_opens_each_segment_once_and_nothing_opened_before_it(tmp_path):
    """A verify read every small object's segment from disk again (nothing opened before it may
    answer it): 800 small tensors took 5x their plain store's verify, reading their pack 3204
    times. What a verify opens now answers its own later reads (the read generation): the pack
    is read once; and damage made after a load opened the segments is still found."""
    g = torch.Generator().manual_seed(0)
    state = {f"l{i}": {"w": torch.randn(8, 16, generator=g), "b": torch.randn(8, generator=g)} for i in range(400)}
    with cas.open(tmp_path / "s", key="k") as store:
        store.save(state, step=1)
        inner, reads = store.backend.inner, []
        real_get = inner.get

        def counting_get(name, *args, **kwargs):
            if name.startswith("packs/"):
                reads.append(name)
            return real_get(name, *args, **kwargs)
        inner.get = counting_get
        assert_same(store.load(1), state)  # (its segments opened and kept)
        reads.clear()
        assert store.verify().ok
        assert 0 < len(reads) <= 4, len(reads)  # (1200 objects, nodes and chunks, in one pack: it was 3204 reads)
        packs = [os.path.join(folder, name) for folder, _, names in os.walk(tmp_path / "s" / "packs") for name in names]
        for path in packs:
            data = bytearray(open(path, "rb").read())
            data[len(data) // 2] ^= 1
            open(path, "wb").write(bytes(data))
        assert not store.verify().ok


def test_a_bucket_store_whose_creation_stopped_after_its_key_blob_is_created_at_the_next_open(s3_url, tmp_path):
    """A kill between the first key blob's PUT and the config's left a prefix holding one key
    blob: every later open was "not a cas store: open an empty prefix to create one", and the
    prefix could be neither opened nor created."""
    from cas.s3 import S3Backend

    bucket = S3Backend.from_url(s3_url)
    key_id = crypt.new_key_id()
    bucket.put_if_absent(crypt.KEYS_PREFIX + key_id,
                         [crypt.key_blob("0123456789abcdef", key_id, os.urandom(32), crypt.user_key("k"))])
    with cas.open(s3_url, key="k", cache_dir=str(tmp_path / "c")) as store:
        store.save({"w": _w(1)}, step=1)
    with cas.open(s3_url, key="k", cache_dir=str(tmp_path / "other")) as store:
        assert torch.equal(store.load(1)["w"], _w(1))


def test_lightning_saves_into_an_encrypted_store_and_a_marker_loads_with_the_key_file(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    from test_lightning import Tiny, fitted

    from cas.store.lightning import CasCheckpointIO, load_marked

    io = CasCheckpointIO(tmp_path / "store", key="k")
    model = fitted(0, 1, io, dirpath=tmp_path / "ckpt", save_last=True)
    io.store.close()
    assert found_marks(folder_bytes(tmp_path / "store")) == set()
    marker = tmp_path / "ckpt" / "last.ckpt"
    with pytest.raises(KeyRequiredError):
        load_marked(marker)
    (tmp_path / "key").write_text("k\n")
    monkeypatch.setenv("CAS_KEY_FILE", str(tmp_path / "key"))
    loaded = load_marked(marker)  # read without the plugin: the store opened with $CAS_KEY_FILE's key
    assert_same(loaded["state_dict"], model.state_dict())
    assert isinstance(Tiny.load_from_checkpoint(str(marker)), Tiny)


def test_delta_chains_in_an_encrypted_store(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1 << 16, generator=g)
    states = [{"w": w + i * 1e-6} for i in range(4)]
    with cas.open(tmp_path / "d", key="k", delta=True, max_chain=2, chunk_size=64 << 10) as store:
        for step, state in enumerate(states):
            store.save(state, step=step)
        assert store.stats().stored_bytes < sum(s["w"].numel() * 4 for s in states)  # deltas paid
    with cas.open(tmp_path / "d", key="k", delta=True) as store:  # a fresh open reads its bases back
        store.save({"w": w + 9e-6}, step=9)
        for step, state in enumerate(states):
            assert_same(store.load(step), state)
        assert store.verify().ok


@pytest.mark.parametrize("key", ["a passphrase", bytes(range(32))])
def test_a_key_blob_with_one_damaged_byte_still_opens_the_store(tmp_path, key):
    """A store has one key blob unless keys are added: one damaged byte of it (its scrypt salt,
    its wrapped master key, its msgpack) locked every checkpoint for good (a stop 33 sweep: 8 of
    10 such damages). Key blobs now end with the digest of their other bytes, which proves the
    original one bit or byte away; verify names the blob and how to replace it."""
    path = tmp_path / "s"
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with cas.open(path, key=key) as store:
        store.save(state, step=1)
        key_id = store.location.keys.key_id
    blob = path / "keys" / key_id
    written = blob.read_bytes()
    for at in (0, 20, len(written) // 2, len(written) - 50, len(written) - 1):
        damaged = bytearray(written)
        damaged[at] ^= 0xFF
        os.chmod(blob, 0o644)
        blob.write_bytes(bytes(damaged))
        with cas.open(path, key=key) as store:
            assert torch.equal(store.load(1)["w"], state["w"])
            assert [p.message for p in store.verify().problems] == [
                f"the key blob keys/{key_id} that opened the store is damaged (one bit or byte); it is read as "
                f"written, which the digest it ends with proves; `cas key add` a key, then with it `cas key remove "
                f"{key_id}`"]
    with cas.open(path, key=key) as store:  # the remedy verify names
        new_id = store.add_key("another passphrase")
    with cas.open(path, key="another passphrase") as store:
        store.remove_key(key_id)
        assert store.location.keys.key_id == new_id and store.verify().ok
    with pytest.raises(cas.WrongKeyError):
        cas.open(path, key=key)


@pytest.mark.parametrize("which", ["an older entry", "the newest entry"])
def test_a_sealed_log_entry_with_one_damaged_byte_is_read_as_written_and_repaired(tmp_path, cli, which):
    """A sealed record-log entry fails its AEAD tag on any damage, so with the index lost one
    flipped byte in any entry refused every writable open (a stop 33 sweep: all 35 such cases).
    The tag is a proof too: the one-bit or one-byte change of the ciphertext that opens is the
    entry as written. verify names it; `cas repair` writes it back, sealed again."""
    path, key_file = tmp_path / "s", tmp_path / "k"
    key_file.write_text("k")
    with cas.open(path, key="k") as store:
        for step in (1, 2, 3):
            store.save({"w": torch.full((100,), float(step))}, step=step)
        store.pin(2)
    names = sorted(os.listdir(path / "log"))
    entry = path / "log" / (names[1] if which == "an older entry" else names[-1])
    sealed = entry.read_bytes()
    damaged = bytearray(sealed)
    damaged[len(sealed) // 2] ^= 0x5A
    os.chmod(entry, 0o644)
    entry.write_bytes(bytes(damaged))
    shutil.rmtree(path / "index")
    with cas.open(path, key="k") as store:
        assert [(ck.step, ck.pinned) for ck in store.checkpoints()] == [(1, False), (2, True), (3, False)]
        assert torch.equal(store.load(2)["w"], torch.full((100,), 2.0))
        assert [p.message for p in store.verify().problems] == [
            f"record log entry log/{entry.name} is damaged (one bit or byte); it is read as written, which the digest "
            "the store holds of it proves; `cas repair` writes it back"]
    result = cli("--store", path, "repair", key_file=key_file)
    assert result.returncode == 0 and f"record log entry {int(entry.name, 16)} had one damaged" in result.stdout
    assert entry.read_bytes() != bytes(damaged)
    shutil.rmtree(path / "index")
    with cas.open(path, key="k") as store:
        assert store.verify().ok and [ck.step for ck in store.checkpoints()] == [1, 2, 3]


def test_a_key_blob_from_before_the_digest_with_one_damaged_byte_of_its_wrapped_key_still_opens(tmp_path):
    """Key blobs written before stop 33 end with no digest of their own. The AES-GCM tag of the
    wrapped master key proves a one-byte fix of it (or of its nonce) under the key given; a wrong
    key finds none and is refused as before."""
    import msgpack

    from cas.keys import KEY_MAGIC

    path = tmp_path / "s"
    with cas.open(path, key=bytes(range(32))) as store:
        store.save({"w": torch.arange(10)}, step=1)
        key_id = store.location.keys.key_id
    blob = path / "keys" / key_id
    fields = msgpack.unpackb(blob.read_bytes()[len(KEY_MAGIC):])
    del fields["digest"]  # as written before
    for field, at in (("wrapped", 5), ("wrapped", -1), ("nonce", 0)):
        damaged = dict(fields, **{field: bytes(b ^ 0x3C if i == at % len(fields[field]) else b
                                               for i, b in enumerate(fields[field]))})
        os.chmod(blob, 0o644)
        blob.write_bytes(KEY_MAGIC + msgpack.packb(damaged, use_bin_type=True))
        with cas.open(path, key=bytes(range(32))) as store:
            assert torch.equal(store.load(1)["w"], torch.arange(10))
            assert "key blob" in str(store.verify().problems[0])
        with pytest.raises(cas.WrongKeyError):
            cas.open(path, key=bytes(range(1, 33)))


def test_a_key_blob_damaged_beyond_mending_is_named_when_no_key_opens_the_store(tmp_path):
    """The right key met only "it is wrong, or it was removed" when the store's one key blob was
    zeroed: the error now names the blob it could not read."""
    path = tmp_path / "s"
    with cas.open(path, key="right") as store:
        key_id = store.key_id
    blob = path / "keys" / key_id
    blob.write_bytes(bytes(len(blob.read_bytes())))
    with pytest.raises(WrongKeyError, match=f"key {key_id} was not tried: it is a blob that cannot be read"):
        cas.open(path, key="right")


def test_a_removal_killed_after_its_delete_finishes_when_run_again_and_its_key_can_come_back(tmp_path):
    """Killed after deleting keys/<id> and before dropping its mark: running the removal again
    said the store "has no key", and the same key added again (its id comes from the key) kept
    counting as going, so removing the other key was refused as if it were the last."""
    path = tmp_path / "s"
    with cas.open(path, key="old", chunk_size=64 << 10, pack_max=4096) as store:
        store.save({"w": _w(1)}, step=1)
        old, new = store.key_id, store.add_key("new")
    assert _killed(path, "remove", "keys.removed") == -signal.SIGKILL  # removes "new"
    with cas.open(path, key="old") as store:
        assert store.key_ids() == [old] and removal_marks(store.backend) == [new]
        store.remove_key(new)  # finishes it
        assert removal_marks(store.backend) == []
        assert store.add_key("new") == new
    assert _killed(path, "remove", "keys.removed") == -signal.SIGKILL
    with cas.open(path, key="old") as store:
        assert store.add_key("new") == new and removal_marks(store.backend) == []
    with cas.open(path, key="new") as store:
        store.remove_key(old)
        assert store.key_ids() == [new] and torch.equal(store.load(1)["w"], _w(1))
    with pytest.raises(WrongKeyError):
        cas.open(path, key="old")


def test_a_key_blob_a_creation_cut_short_left_is_listed_apart_and_removable(tmp_path, cli):
    """A blob wrapping another master key (left by a creation killed before its config, then
    another creation made the store there) opens nothing here: `cas key list` showed it as a
    key of the store."""
    path, key_file = tmp_path / "s", tmp_path / "k"
    key_file.write_text("alice")
    with cas.open(path, key="alice") as store:
        store.save({"w": _w(1)}, step=1)
        alice = store.key_id
    with cas.open(tmp_path / "other", key="carol") as other:
        stray = other.key_id
        shutil.copy(tmp_path / "other" / "keys" / stray, path / "keys" / stray)
    with cas.open(path, key="alice") as store:
        assert store.key_ids() == [alice] and store.stray_key_ids() == [stray]
    listed = cli("--store", path, "key", "list", key_file=key_file)
    assert listed.returncode == 0 and listed.stdout.splitlines() == [
        f"{alice}  (this key)", f"{stray}  (opens nothing: left by a store creation cut short; `cas key remove "
        f"{stray}` deletes it)"]
    assert cli("--store", path, "key", "remove", stray, key_file=key_file).returncode == 0
    with cas.open(path, key="alice") as store:
        assert store.key_ids() == [alice] and store.stray_key_ids() == []


def test_a_closed_store_gives_the_segments_it_opened_back_to_the_buffer_pool(tmp_path):
    """An encrypted store keeps the edge segments of small objects it opened in pool buffers;
    a closed store dropped them with itself, so every new store's load faulted in fresh pages
    (4 new buffers, 7 MiB, per load of a small model: slow to touch on a VM). Once the pool is
    warm, an open, load and close makes no new buffer."""
    from cas.buffers import POOL

    g = torch.Generator().manual_seed(0)
    state = {f"l{i}": {"w": torch.randn(300 + 97 * i, 40, generator=g), "b": torch.randn(40, generator=g)}
             for i in range(12)}
    path = tmp_path / "s"
    with cas.open(path, key="k") as store:
        store.save(state, step=1)
    made = []
    for _ in range(5):
        before = POOL.made
        with cas.open(path, key="k", workers=1) as store:  # (one read thread: the same reads each load)
            assert_same(store.load(1), state)
        made.append(POOL.made - before)
    assert sum(made[2:]) == 0, made  # (the first loads fill the pool; it was 2 new buffers every load)


def _pack_bytes_read(backend) -> list[int]:
    """The bytes each read of a pack brings from `backend` from now on (an encrypted store's
    inner one: under the cipher, a bucket's GETs)."""
    sizes, real_get = [], backend.get

    def counting_get(name, *args, **kwargs):
        got = real_get(name, *args, **kwargs)
        if name.startswith("packs/"):
            sizes.append(len(memoryview(got).cast("B")))
        return got
    backend.get = counting_get
    return sizes


def test_a_bucket_load_of_an_encrypted_store_fetches_its_chunks_not_their_edge_slots(s3_url, tmp_path):
    """Each large read fetched every 1 MiB slot it touched whole, its neighbours' bytes in the
    first and last with it: a fresh host's load of 1-4 MiB chunks made the bucket send 27-65%
    more bytes than the plain store's load of the same state (a 256 MiB load 284 MB against
    224). Now only the edge slots' messages that hold the chunk come."""
    from cas.slots import LEAD

    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn((3 << 17) + 4099 * i, generator=g) for i in range(8)}  # 1.5-1.6 MiB each
    fetched = {}
    for kind, key in (("plain", None), ("sealed", RAW_KEY)):
        url = f"{s3_url}-{kind}"
        with cas.open(url, key=key, cache_dir=str(tmp_path / f"{kind}-a")) as store:
            store.save(state, step=1)
        with cas.open(url, key=key, cache_dir=str(tmp_path / f"{kind}-b")) as fresh:  # another host
            sizes = _pack_bytes_read(fresh.backend if key is None else fresh.backend.inner)
            assert_same(fresh.load(1), state)
            fetched[kind] = sum(sizes)
    # a slot more (the message holding the checkpoint's small objects, opened whole) and up to
    # LEAD before each chunk (its entry's header and what precedes it): 1.5 MB; it was 7.3 MB more
    assert fetched["sealed"] <= fetched["plain"] + crypt.SEGMENT + (len(state) + 1) * LEAD, fetched


@pytest.mark.parametrize("key", [None, RAW_KEY], ids=["plain", "encrypted"])
def test_a_saves_small_objects_enter_its_streamed_pack_together(tmp_path, key):
    """A streamed pack (a local store's) took each object as the save's threads finished it, so
    a layer's bias and norm lay between two weights, and in an encrypted store each small read
    opened the message holding it: up to a slot of a weight's bytes, which the weight's own
    read decrypted again (a small model's load: 48 small reads cost 3-7 ms of its threads
    against 10 ms for its 23 MB of chunks; 1 ms now). A save's small objects now enter the pack
    together, as one run, after its chunks; and they load."""
    from cas.readahead import SMALL

    g = torch.Generator().manual_seed(0)
    state = {f"l{i}": {"weight": torch.randn(300_000 + 1000 * i, generator=g), "bias": torch.randn(512, generator=g),
                       "norm": torch.randn(512, generator=g)} for i in range(6)}
    with cas.open(str(tmp_path / "s"), key=key) as store:
        store.save(state, step=1)
        packs = store.objects.packs
        (pack,) = list(packs.iterate())
        small = [length <= SMALL for _, _, length in sorted(packs.entries(pack), key=lambda e: e[1])]
    assert small.count(False) == 6 and small == sorted(small), small  # the 6 weights, then every small object
    with cas.open(str(tmp_path / "s"), key=key) as store:
        assert_same(store.load(1), state)


def test_a_large_read_fetches_its_own_messages_and_damage_at_its_edges_is_named(tmp_path):
    """A streamed pack of entries of 1-3 slots each, a 36-byte header before each object (as
    packs are), written last to first: reading an object fetches its bytes and at most 64 KiB
    before them (its header and what precedes it in its slot), not its edge slots whole; a byte
    flipped in the message of its first or last slot that holds it fails the read, naming the
    blob, never returning data."""
    from cas.slots import LEAD

    backend, seg = _sealed_backend(tmp_path), crypt.SEGMENT
    sizes = [36 + 700, 36 + seg + 5000, 36 + 2 * seg + 999, 36 + 3 * seg // 2, 36 + 9, 36 + seg + 1]
    data = os.urandom(sum(sizes))
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    stream = backend.stream("packs/00/" + "00" * 32)
    for lo, hi in reversed(list(zip(bounds, bounds[1:]))):
        stream.write_at(lo, [data[lo:lo + 36], memoryview(data)[lo + 36:hi]])
    name = "packs/ab/" + "ab" * 32
    assert backend.publish(stream.close(name))
    backend.get(name, 0, 100)  # (its salt read: as a load's first small reads do)
    read = _pack_bytes_read(backend.inner)
    objects = [(lo + 36, hi - lo - 36) for lo, hi in zip(bounds, bounds[1:]) if hi - lo - 36 >= seg]
    fetched = []
    for start, length in objects:
        read.clear()
        assert bytes(backend.get(name, start, length, buffer=lambda n: memoryview(bytearray(n)))) == \
            data[start:start + length]
        fetched.append(sum(read) - length - LEAD - (length // seg + 2) * crypt.slots.OVERHEAD)
    # each its own bytes, but for the one before the 9-byte entry: that slot's split is where the
    # entry after it begins (written first), so its last slot's rest came too (two slots each before)
    assert sorted(fetched)[:-1] <= [0] * (len(fetched) - 1) and max(fetched) < seg, fetched
    path = tmp_path / "packs" / "ab" / ("ab" * 32)
    sealed = path.read_bytes()
    start, length = objects[1]
    first, last = start // seg, (start + length - 1) // seg
    for where in (crypt.Layout().at(first) + (start - first * seg) + 100,  # B of its first slot
                  crypt.Layout().at(last) + 10):  # A of its last
        flipped = bytearray(sealed)
        flipped[where] ^= 1
        path.write_bytes(bytes(flipped))
        with pytest.raises(CorruptionError, match="authentication"):
            backend.get(name, start, length)
    path.write_bytes(sealed)
    assert backend.get(name, start, length) == data[start:start + length]
