"""CLI commands for interop: `cas export`, `cas import`, `cas diff`; the exclusive-bytes column
of `cas ls`.

cas.cli imports this module right before it builds its parser, so these commands register with
its `command` decorator like its own.
"""

from __future__ import annotations

import os
import sys

from .errors import CasError
from .store.interop import STEP_RULE


from . import cli  # noqa: E402  (cli imports this module at its end, after `command` exists)
from .progress import progress_for  # noqa: E402

EXIT_OK, EXIT_USAGE = cli.EXIT_OK, cli.EXIT_USAGE


def _usage_error(message: str) -> int:
    print(f"cas: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _sample(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


# --- ls -------------------------------------------------------------------------------------
def exclusive_column(store, cks, args) -> dict[int, int]:
    """Bytes only each checkpoint holds, for `cas ls`. Empty (shown as "?") with a warning when a
    manifest node cannot be read, so that ls still lists a damaged store."""
    try:
        with progress_for(args) as progress:
            return store.exclusive_bytes(cks, progress=progress)
    except CasError as exc:
        print(f"cas: warning: cannot tell the bytes only each checkpoint holds: {exc}", file=sys.stderr)
        return {}


# --- export ---------------------------------------------------------------------------------
def _add_export(p) -> None:
    p.add_argument("step", type=cli._step)
    p.add_argument("out", help="the .safetensors file to write")
    p.add_argument("--keys", nargs="+", metavar="KEY", help="only these top-level entries (e.g. model)")
    p.add_argument("--relative", action="store_true",
                   help="name tensors relative to the one --keys entry (layer.weight, not model.layer.weight)")
    p.add_argument("--json", action="store_true")


@cli.command("export", "write a checkpoint's tensors to a .safetensors file for serving or evaluation (weights "
             "only: NOT a training checkpoint; optimizer, RNG and other non-tensor state are left out)",
             _add_export, read_only=True)
def cmd_export(store, args) -> int:
    with progress_for(args) as progress:
        report = store.export(args.step, args.out, keys=args.keys, relative=args.relative, progress=progress)
    if args.json:
        cli._emit_json(report.to_json())
        return EXIT_OK
    print(f"exported step {report.step}: {report.tensors} tensors, {cli.human(report.bytes)} to {report.path}")
    if report.skipped:
        print(f"skipped {len(report.skipped)} non-tensor values: {_sample(report.skipped)}")
    print("this is a weights-only file for serving or evaluation, not a training checkpoint")
    return EXIT_OK


# --- import ---------------------------------------------------------------------------------
def _add_import(p) -> None:
    p.add_argument("path", help="a .safetensors or torch.save file (.pt, .pth, .bin, .ckpt), or a folder of them")
    p.add_argument("--step", type=cli._step, help="the step of a single file (default: from its name)")
    p.add_argument("--json", action="store_true")
    p.epilog = (f"Step rule: {STEP_RULE}. A file without a number needs --step; in a folder, such a file "
                "stops the import before anything is imported. torch.save files are read with "
                "torch.load(weights_only=True) only: a file that needs more is refused, never unpickled.")


@cli.command("import", "import .safetensors or torch.save files (read weights-only) as checkpoints; "
             "a folder imports one file per step", _add_import, creates_store=True)
def cmd_import(store, args) -> int:
    folder = os.path.isdir(args.path)
    if folder and args.step is not None:
        return _usage_error("--step applies to a single file; in a folder each file's step comes from its name")
    try:
        with progress_for(args) as progress:
            if folder:
                result = store.import_folder(args.path, progress=progress)
                rows, ignored, before = result.checkpoints, result.ignored, result.already_imported
            else:
                rows, ignored, before = [(args.path, store.import_file(args.path, step=args.step))], [], []
    except TypeError as exc:  # a value the store cannot hold
        return _usage_error(str(exc))
    if args.json:
        cli._emit_json({"imported": _json_rows(rows), "already_imported": _json_rows(before), "ignored": ignored})
        return EXIT_OK
    _print_imported(rows, ignored, before)
    return EXIT_OK


def _json_rows(rows: list) -> list[dict]:
    return [dict(ck.to_json(), file=path) for path, ck in rows]


def _print_imported(rows: list, ignored: list[str], before: list) -> None:
    for path, ck in before:  # an earlier import of this folder, interrupted, committed these
        print(f"already imported {os.path.basename(path)} as step {ck.step} (same values): skipped")
    for path, ck in rows:
        print(f"imported {os.path.basename(path)} as step {ck.step}: {cli.human(ck.logical_bytes)} logical, "
              f"{cli.human(ck.new_bytes)} new on disk")
    logical, new = sum(ck.logical_bytes for _, ck in rows), sum(ck.new_bytes for _, ck in rows)
    if len(rows) > 1:
        print(f"{len(rows)} files: {cli.human(logical)} logical, {cli.human(new)} new on disk "
              f"(dedup saved {cli.human(max(logical - new, 0))}); see `cas du`")
    if ignored:
        print(f"ignored (not checkpoint files): {_sample(ignored)}")


# --- diff -----------------------------------------------------------------------------------
def _add_diff(p) -> None:
    p.add_argument("a", type=cli._step, help="the older checkpoint's step")
    p.add_argument("b", type=cli._step, help="the newer checkpoint's step")
    p.add_argument("--json", action="store_true")


@cli.command("diff", "compare two checkpoints per tensor (unchanged, changed with the share of chunks and the "
             "max abs difference, added, removed) and the stored bytes they share", _add_diff, read_only=True)
def cmd_diff(store, args) -> int:
    with progress_for(args) as progress:
        report = store.diff(args.a, args.b, progress=progress)
    if args.json:
        cli._emit_json(report.to_json())
        return EXIT_OK
    print(f"{'status':9}  {'path':40}  {'dtype':10}  {'shape':18}  detail")
    for t in report.tensors:
        print(f"{t.status:9}  {t.path:40}  {t.dtype:10}  {str(tuple(t.shape)):18}  {_detail(t)}".rstrip())
    print(f"\nstep {report.a} -> {report.b}: " + ", ".join(
        f"{report.count(s)} {s}" for s in ("unchanged", "changed", "added", "removed")))
    print(f"shared on disk {cli.human(report.shared_bytes)}; step {report.a} references "
          f"{cli.human(report.a_stored_bytes)}, step {report.b} {cli.human(report.b_stored_bytes)}")
    return EXIT_OK


def _detail(t) -> str:
    parts = []
    if t.was is not None:
        parts.append(f"was {t.was}")
    elif t.chunks_changed is not None:
        parts.append(f"chunks changed {t.chunks_changed:.0%}")
    if t.max_abs_diff is not None:
        parts.append(f"max abs diff {t.max_abs_diff:.6g}")
    return "  ".join(parts)
