"""What every `cas` command shares: the command registry, argument types, exit statuses, JSON
output, and opening the store a command runs on.

The command modules (commands, interop) import this one and register with `command`; this
module imports none of them, so the package has no import cycle.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from typing import Callable

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
COMMANDS: dict[str, Callable] = {}


def command(name: str, help: str, arguments: Callable | None = None, *, read_only: bool = False,
            opens_store: bool = True, creates_store: bool = False):
    """Register `fn(store, args) -> exit status` as `cas NAME`; `arguments(parser)` adds its
    flags. With opens_store=False it gets the store's path instead (for repair, which must run
    when the store cannot be opened); with creates_store=True a missing or empty folder becomes
    a new store (for import)."""
    def register(fn):
        fn.cli_name, fn.cli_help, fn.cli_arguments, fn.cli_read_only = name, help, arguments, read_only
        fn.cli_opens_store, fn.cli_creates_store = opens_store, creates_store
        COMMANDS[name] = fn
        return fn
    return register


def parse_step(text: str) -> int:
    """An argparse type: a checkpoint's step, an integer."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a step is an integer, not {text!r}") from None


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def print_checkpoint(ck) -> None:
    """The lines `cas show` opens with: a checkpoint's id, flags, sizes, metrics and meta."""
    print(f"checkpoint {ck.step}  id {ck.id}")
    print(f"created {ck.created:%Y-%m-%d %H:%M:%S} UTC  milestone {'yes' if ck.milestone else 'no'}  "
          f"logical {human(ck.logical_bytes)}  new on disk {human(ck.new_bytes)}")
    if ck.metrics:
        print("metrics " + " ".join(f"{shown(k)}={v}" for k, v in ck.metrics.items()))
    if ck.meta:
        print("meta " + json.dumps(ck.meta, default=str))


def shown(value) -> str:
    """A record's value as one line of text: as it is when every character prints, else
    JSON-escaped (as meta is), so a newline or a terminal escape in a metric name or an argv
    cannot forge a line of output (a "signed by" line, say) or drive the terminal."""
    text = str(value)
    return text if text.isprintable() else json.dumps(text)


def usage_error(message: str) -> int:
    """Say what was wrong with the command line or its input, on one line; EXIT_USAGE."""
    print(f"cas: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def emit_json(data) -> None:
    """Standard JSON (what jq and other strict parsers read): a NaN or infinite metric, as a
    diverged run logs, is written as the string "nan", "inf" or "-inf"."""
    json.dump(_finite(data), sys.stdout, indent=2, default=str, allow_nan=False)
    sys.stdout.write("\n")


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def cli_key(fn, path: str):
    """The key to open `path` with for command `fn`: the one in the file $CAS_KEY_FILE names,
    given explicitly only when the command is about to create the store (import), so the new
    store is encrypted under it. Otherwise None: the library itself reads $CAS_KEY_FILE for an
    encrypted store and ignores it for a plain one, so a key file exported once does not lock
    the CLI out of plain stores."""
    from cas.keys import key_from_env

    if not fn.cli_creates_store:
        return None
    from cas.store.location import locate

    try:
        exists = locate(path).has_config()
    except Exception:  # noqa: BLE001 - undecided: the open below reports what is wrong
        exists = False
    return None if exists else key_from_env()


def run_on_store(fn, store_cls, path: str, args) -> int:
    """Run a command on the store at `path`. A command that may create the store (import)
    and fails leaves no store behind that it created: bad input changes nothing."""
    existed = os.path.lexists(path)
    code, created = EXIT_USAGE, False
    key = cli_key(fn, path)
    try:
        with store_cls(path, create=fn.cli_creates_store, readonly=fn.cli_read_only, key=key) as store:
            created = store.created  # by this open, under the creation lock: not another process's
            code = fn(store, args)
    finally:
        if created and code != EXIT_OK:
            remove_if_new_and_empty(store_cls, path, key, existed=existed)
    return code


def remove_if_new_and_empty(store_cls, path: str, key, *, existed: bool) -> None:
    """After a command that created the store at `path` failed: remove it if it holds no
    checkpoint (a store someone saved into meanwhile stays)."""
    with store_cls(path, create=False, key=key) as store:
        empty = not store.checkpoints()
    if empty:
        _remove_new_store(path, remove_folder=not existed)


def _remove_new_store(path: str, *, remove_folder: bool) -> None:
    """Remove a store this command created and left empty: only its own layout, never a file
    the user put there; the folder itself only if this command made it and it is empty. In a
    bucket, the blobs of its layout, the config last (a refused import or pull into a new
    bucket store left it there)."""
    from cas.store.layout import BUCKET_FOLDERS, CONFIG_NAME, CREATE_LOCK, KEYS_FOLDER, LAYOUT_FOLDERS
    from cas.store.location import locate

    where = locate(path)
    if not where.local:
        for folder in BUCKET_FOLDERS:
            for name in where.backend.list(folder + "/"):
                where.backend.delete(name)
        where.backend.delete(CONFIG_NAME)
        return
    for name in (CONFIG_NAME, CREATE_LOCK, *LAYOUT_FOLDERS, KEYS_FOLDER):
        target = os.path.join(path, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target, ignore_errors=True)
        elif os.path.lexists(target):
            os.unlink(target)
    if remove_folder:
        try:
            os.rmdir(path)
        except OSError:
            pass
