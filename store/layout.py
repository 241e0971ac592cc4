"""The store's folder layout and its config file, read first on every open.

    <root>/config        b"cas-store\\n" + msgpack {"format", "chunk_size", "created", "store_id"}
    <root>/index/        the LMDB environment (cas.index)
    <root>/objects/ab/…  large objects, one file each (cas.objectfiles)
    <root>/packs/ab/…    small objects, many to a pack file (cas.packs)
    <root>/log/…         the record log: every registry change, one immutable entry each (store/records.py)
    <root>/leases/…      writers in progress, each a file its holder keeps flock'd (cas.localfs)
    <root>/tmp/          temporary files of writes in progress
    <root>/create.lock   flock'd while a store is created (processes may open a new path at once)

Opening a folder that is not a store, or a store of another format version, fails before
anything is created or changed.

The config file, `create.lock` and the folders made at creation are the store's bootstrap:
they are read or made before any backend exists (the config says what the store is), so they
stay here, outside the backend contract. Everything under objects/, packs/, log/, leases/ and
tmp/ is reached only through the backend (cas.localfs for a folder); the Layout properties
naming those folders remain for tests and tools.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator

import msgpack

from cas.bitrot import claims_a_digest, proves_itself, undo_own_error, with_digest
from cas.crypt import check_fields
from cas.errors import CasError, FormatVersionError, NotAStoreError
from cas.fsutil import atomic_write, fsync_dir, read_file
from cas.hashing import hash_bytes

STORE_FORMAT = 2  # 2: the registry is the record log; 1: it lived only in LMDB (migrated on a writable open)
ENCRYPTED_FORMAT = 3  # 2 + encryption at rest (cas/crypt.py): a cas without it refuses the store by version
READABLE_FORMATS = (1, 2, 3)
CONFIG_MAGIC = b"cas-store\n"
CONFIG_NAME = "config"
CREATE_LOCK = "create.lock"
LAYOUT_FOLDERS = ("index", "objects", "packs", "log", "leases", "tmp")
KEYS_FOLDER = "keys"  # an encrypted store's wrapped master keys (cas/crypt.py), made only for one
# a bucket store's blobs, by the first part of their names (docs/format.md, "In a bucket"): it
# has no index/, tmp/ or create.lock (a host's cache and spool live elsewhere)
BUCKET_FOLDERS = ("objects", "packs", "log", "snapshots", "leases", "quarantine", KEYS_FOLDER, "removing-keys")
DEFAULT_CHUNK_SIZE = 4 << 20  # see README, "Chunk size": dedup granularity vs. per-object cost
MIN_CHUNK_SIZE = 64 << 10
MAX_CHUNK_SIZE = 256 << 20


@dataclass(frozen=True)
class Config:
    format: int
    chunk_size: int
    created: float
    store_id: str
    encryption: dict | None = None  # format 3: cas/crypt.encryption_fields (aead, naming, key check)
    # the config's bytes as written, where the stored ones differ from them in one bit or byte
    # (proven by the digest the config ends with); `cas repair` writes them back
    written: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def encrypted(self) -> bool:
        return self.encryption is not None


@dataclass(frozen=True)
class Layout:
    root: str

    @property
    def config(self) -> str:
        return os.path.join(self.root, CONFIG_NAME)

    @property
    def index(self) -> str:
        return os.path.join(self.root, "index")

    @property
    def objects(self) -> str:
        return os.path.join(self.root, "objects")

    @property
    def packs(self) -> str:
        return os.path.join(self.root, "packs")

    @property
    def log(self) -> str:
        return os.path.join(self.root, "log")

    @property
    def tmp(self) -> str:
        return os.path.join(self.root, "tmp")


def read_config(layout: Layout) -> Config:
    try:
        data = read_file(layout.config, 1 << 16)
    except FileNotFoundError:
        raise NotAStoreError(f"{layout.root} is not a cas store (it has no {CONFIG_NAME} file); "
                             "open an empty or missing folder to create one") from None
    except NotADirectoryError:
        what = "it is a file" if os.path.lexists(layout.root) else "a part of its path is a file"
        raise NotAStoreError(f"{layout.root} is not a cas store: {what}, not a folder") from None
    except (ValueError, OSError) as exc:  # a directory named config, no permission, an I/O error
        raise NotAStoreError(f"{layout.root} is not a readable cas store: {exc}") from None
    return parse_config(data, layout.root, layout.config)


MAX_MENDED_CONFIG = 4096


def parse_config(data: bytes, root: str, where: str) -> Config:
    """The config a store's config blob holds (`root`, `where`: the store and the blob, for
    messages). One that is damaged in one bit or byte is read as written where its digest
    proves the original (cas/bitrot.py); `written` then holds those bytes."""
    try:
        return _parse_config(data, root, where)
    except (NotAStoreError, FormatVersionError):
        written = undo_own_error(data, CONFIG_MAGIC) if len(data) <= MAX_MENDED_CONFIG else None
        if written is None:
            raise
    return replace(_parse_config(written, root, where), written=written)


def _parse_config(data: bytes, root: str, where: str) -> Config:
    if not data.startswith(CONFIG_MAGIC):
        raise NotAStoreError(f"{root} is not a cas store: its {CONFIG_NAME} file is not a cas config")
    try:
        raw = msgpack.unpackb(data[len(CONFIG_MAGIC):], raw=False)
        fmt = raw["format"]
    except (ValueError, TypeError, KeyError, msgpack.UnpackException):
        raise NotAStoreError(f"the cas config at {where} is damaged") from None
    if claims_a_digest(raw) and not proves_itself(data):
        raise NotAStoreError(f"the cas config at {where} is damaged: its bytes do not match the digest it ends with")
    _check_field(raw, "format", (int,), where)  # True or 2.0 is no format: it must not be read (or upgraded)
    if fmt not in READABLE_FORMATS:
        raise FormatVersionError(f"the store at {root} has format version {fmt!r}; this cas "
                                 f"reads versions {READABLE_FORMATS} (upgrade cas to open it)")
    for name, types in (("chunk_size", (int,)), ("created", (int, float)), ("store_id", (str,))):
        _check_field(raw, name, types, where)
    try:
        config = Config(fmt, raw["chunk_size"], float(raw["created"]), raw["store_id"],
                        check_fields(raw["encryption"], root) if fmt == ENCRYPTED_FORMAT else None)
    except (KeyError, TypeError, ValueError):
        raise NotAStoreError(f"the cas config at {where} is damaged") from None
    if not MIN_CHUNK_SIZE <= config.chunk_size <= MAX_CHUNK_SIZE:
        raise NotAStoreError(f"the cas config at {where} has an implausible chunk size {config.chunk_size}")
    return config


def _check_field(raw: dict, name: str, types: tuple, where: str) -> None:
    """Refuse a config field of the wrong type (exactly: a bool is not an int), naming it; a
    lenient read would take a damaged config for a store's, and might rewrite it."""
    if name not in raw:
        raise NotAStoreError(f"the cas config at {where} is damaged: it has no {name!r}")
    if type(raw[name]) not in types:
        raise NotAStoreError(f"the cas config at {where} is damaged: its {name!r} is {raw[name]!r}, "
                             f"not {' or '.join(t.__name__ for t in types)}")


def config_bytes(*, chunk_size: int, store_id: str | None = None, created: float | None = None,
                 encryption: dict | None = None) -> bytes:
    """A new store's config blob (`encryption`: an encrypted store's fields, format 3)."""
    body = {"format": STORE_FORMAT if encryption is None else ENCRYPTED_FORMAT, "chunk_size": chunk_size,
            "created": time.time() if created is None else created, "store_id": store_id or secrets.token_hex(8)}
    if encryption is not None:
        body["encryption"] = encryption
    return with_digest(CONFIG_MAGIC, body)


def can_create(root: str) -> bool:
    """A store may be created where nothing exists, in an empty folder, or in one that only
    a creation in progress or cut short could have made: our folders and lock file, with no
    object or pack in them (anything else without a config is not ours to touch)."""
    if not os.path.lexists(root):
        return True
    if not os.path.isdir(root) or os.path.islink(root):
        return False
    try:
        return _only_ours(root)
    except OSError:  # a folder we may not list: not ours to touch (reading its config then says why)
        return False


def _only_ours(root: str) -> bool:
    """Whether folder `root` holds only what a creation cut short leaves (see can_create)."""
    entries = set(os.listdir(root))
    if not entries <= {*LAYOUT_FOLDERS, KEYS_FOLDER, CREATE_LOCK}:
        return False
    lock = os.path.join(root, CREATE_LOCK)
    if CREATE_LOCK in entries and not stat.S_ISREG(os.lstat(lock).st_mode):  # a link or a folder: not ours
        return False
    return not any(os.path.isdir(os.path.join(root, f)) and os.listdir(os.path.join(root, f))
                   for f in ("objects", "packs"))


@contextmanager
def creation_lock(root: str) -> Iterator[None]:
    """Held while a store is created at `root`: processes that open a new path at once (every
    rank of a job, say) create it once, and the others then open it."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as exc:  # a file where a folder of the path should be, a parent we may not write
        raise NotAStoreError(f"cannot create a store at {root}: {exc}") from None
    try:
        fd = os.open(os.path.join(root, CREATE_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:  # a folder or a symlink in its place, no permission
        raise NotAStoreError(f"cannot create a store at {root}: its {CREATE_LOCK} cannot be opened ({exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def wait_for_creation(root: str) -> None:
    """Wait while another process holds `root`'s creation lock: a store being created there
    shows its folders and a temporary config file before its config, which makes the folder
    look like someone else's to a process that looks in between (two DCP or DDP ranks opening
    a new store at once: one of them got NotAStoreError)."""
    try:
        fd = os.open(os.path.join(root, CREATE_LOCK), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # no lock file: nothing is being created here
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)


def check_chunk_size(chunk_size: int) -> None:
    if type(chunk_size) is not int or not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise CasError(f"chunk_size must be an int between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} bytes, "
                       f"got {chunk_size!r}")


def heal_config(layout: Layout, config: Config) -> bool:
    """Write a mended config back as it was written (the damaged bytes first kept in
    quarantine/config-<16 hex of their blake3>); whether it was still damaged on disk."""
    if config.written is None:
        return False
    damaged = read_file(layout.config, 1 << 16)
    if damaged == config.written:
        return False
    os.makedirs(os.path.join(layout.root, "quarantine"), exist_ok=True)
    atomic_write(os.path.join(layout.root, "quarantine", f"config-{hash_bytes(damaged).hex()[:16]}"), [damaged])
    atomic_write(layout.config, [config.written])
    fsync_dir(layout.root)
    return True


def write_config(layout: Layout, *, chunk_size: int, store_id: str | None = None,
                 created: float | None = None, encryption: dict | None = None) -> None:
    """Write the config of a new store: the last step of creating one, so that a half-made
    store is not a store. (Rewritten once more, with the same id, when a format-1 store is
    upgraded: an atomic replace, so it holds one format or the other.)"""
    atomic_write(layout.config, [config_bytes(chunk_size=chunk_size, store_id=store_id, created=created,
                                              encryption=encryption)])
    fsync_dir(layout.root)
