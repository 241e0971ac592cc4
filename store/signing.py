"""Signed checkpoints: an ed25519 signature (the `cryptography` package; never our own crypto)
over what a checkpoint record says of itself, in its `add` change of the record log.

The signature covers the step, the checkpoint id (the root of its Merkle tree, so every byte of
its state), its creation time, metrics, meta, logical size and provenance: the fields a copy
(push, pull, mirror) keeps, so a copied checkpoint keeps its signature. It does not cover what
each store says of its own copy (new_bytes, packs) or flags set later. A record that was changed,
or signed again by another key, fails `cas verify --signatures PUBKEY`.
"""

from __future__ import annotations

import os

import msgpack

from cas import faults
from cas.errors import CasError

from .registry import differences, fold_records

SIGNATURE_DOMAIN = b"cas-checkpoint-signature-1"


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise CasError("signed checkpoints need the `cryptography` package: pip install 'cas-checkpoint[crypto]'") \
            from None
    return ed25519, serialization, InvalidSignature


def _canonical(value):
    """The same value with every map's keys sorted, so equal records sign equal bytes."""
    if isinstance(value, dict):
        return [[k, _canonical(value[k])] for k in sorted(value, key=repr)]
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def signed_bytes(change: dict) -> bytes:
    fields = [change["step"], bytes(change["id"]), float(change["created"]), change.get("metrics") or {},
              change.get("meta") or {}, int(change["logical_bytes"]), change.get("provenance") or {}]
    return SIGNATURE_DOMAIN + msgpack.packb(_canonical(fields), use_bin_type=True)


def private_key(key):
    """An ed25519 private key from 32 raw bytes, PEM or OpenSSH bytes, a path to such a file, or
    a cryptography Ed25519PrivateKey."""
    ed25519, serialization, _ = _crypto()
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    data = _read(key, "signing key")
    if len(data) == 32:
        return ed25519.Ed25519PrivateKey.from_private_bytes(data)
    try:
        loaded = (serialization.load_ssh_private_key(data, None) if data.startswith(b"-----BEGIN OPENSSH")
                  else serialization.load_pem_private_key(data, None))
    except (ValueError, TypeError) as exc:
        raise CasError(f"the signing key is not an ed25519 private key ({exc})") from None
    if not isinstance(loaded, ed25519.Ed25519PrivateKey):
        raise CasError("the signing key is not an ed25519 key")
    return loaded


def public_key_bytes(key) -> bytes:
    """32 raw bytes of an ed25519 public key given as raw bytes, 64 hex digits, PEM or OpenSSH
    text, a path to such a file, a private key (its public half) or a cryptography key."""
    ed25519, serialization, _ = _crypto()
    if isinstance(key, ed25519.Ed25519PrivateKey):
        key = key.public_key()
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    data = _read(key, "public key")
    if len(data) == 32:  # raw, before any strip: a raw key may begin or end with a whitespace byte
        return data
    data = data.strip()  # the text forms only: hex, PEM, OpenSSH
    if len(data) == 64:
        try:
            return bytes.fromhex(data.decode())
        except ValueError:
            pass
    try:
        loaded = (serialization.load_ssh_public_key(data) if data.startswith(b"ssh-")
                  else serialization.load_pem_public_key(data))
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise CasError(f"the public key is not an ed25519 public key: 32 bytes, 64 hex digits, PEM or "
                       f"OpenSSH ({exc})") from None
    if not isinstance(loaded, ed25519.Ed25519PublicKey):
        raise CasError("the public key is not an ed25519 key")
    return public_key_bytes(loaded)


def _hex64(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def _read(key, what: str) -> bytes:
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, (str, os.PathLike)):
        path = os.path.expanduser(key)  # "~/key.pem", as key files ($CAS_KEY_FILE) are read
        if os.path.isfile(path):
            with open(path, "rb") as f:
                return f.read()
        # PEM or OpenSSH text, or 64 hex digits; any other string names a file (a missing
        # "key.pub" had been parsed as PEM, and a 32-character name taken for a raw key)
        text = isinstance(key, str) and (key.lstrip().startswith(("-----", "ssh-")) or _hex64(key.strip()))
        if not text:
            raise CasError(f"the {what} file {os.fspath(key)} does not exist (or is not a file)")
        return key.encode()
    raise CasError(f"the {what} must be bytes, a path or a cryptography ed25519 key, not {type(key).__name__}")


def sign(change: dict, key) -> dict:
    """The `signature` of an `add` change: {"alg", "public_key", "sig"}."""
    private = private_key(key)
    return {"alg": "ed25519", "public_key": public_key_bytes(private), "sig": private.sign(signed_bytes(change))}


def problem(change: dict | None, public_key: bytes) -> str | None:
    """None when `change` is signed by `public_key` and unchanged since; else what is wrong."""
    ed25519, _, InvalidSignature = _crypto()
    sig = (change or {}).get("signature")
    if not isinstance(sig, dict) or sig.get("alg") != "ed25519":
        return "not signed"
    if bytes(sig.get("public_key") or b"") != public_key:
        return f"signed by another key ({bytes(sig.get('public_key') or b'').hex()[:16]}...)"
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public_key).verify(bytes(sig["sig"]), signed_bytes(change))
    except (InvalidSignature, KeyError, TypeError, ValueError):
        return "the signature does not match the record (changed after it was signed)"
    return None


def check_store(store, public_key) -> dict[int, str]:
    """step -> problem for every checkpoint of the store that is not signed by `public_key` as
    its record now stands (read from the record log, the store's truth), or whose record as
    the index serves it (to `cas ls`, `show`, loads) is not the signed one. The index is read
    as of the log entry it holds, and the log up to that entry: what other processes save,
    remove, pin or mark meanwhile lies past it and is neither checked nor taken for a forgery."""
    expected = public_key_bytes(public_key)
    store.ensure_cache()  # (the cache brought up to the log as it is now, as registry_problems does)
    with store.index.read() as txn:
        head, _ = store.registry.head(txn)
        listed = store.registry.all(txn)
    faults.point("signatures.listed")
    adds: dict[int, dict] = {}
    entries = [entry for entry in store.records.entries() if entry.seq <= head]
    for entry in entries:
        for change in entry.changes:
            if change["op"] == "add":
                adds[change["step"]] = change
            elif change["op"] == "remove":
                adds.pop(change["step"], None)
    truth = fold_records(entries, store.path)
    out = {}
    for ck in listed:
        change = adds.get(ck.step)
        if change is None or bytes(change["id"]) != ck.key:
            out[ck.step] = "its record is not in the record log"
            continue
        why = problem(change, expected)
        fields = differences(ck, truth[ck.step]) if why is None and ck.step in truth else []
        if fields:
            why = (f"the index serves a record that is not the signed one ({', '.join(fields)} differ); "
                   "`cas repair` rebuilds the index from the record log")
        if why is not None:
            out[ck.step] = why
    return out
