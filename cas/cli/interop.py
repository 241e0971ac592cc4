"""The interop commands: `cas export`, `cas import`, `cas diff`.

They register with base.command like the commands of cas.cli.commands; cas.cli imports both.
"""

from __future__ import annotations

import os

from cas.progress import progress_for
from cas.store.interop import DCP_STEP_RULE, EXPORT_FORMATS, STEP_RULE, is_dcp_folder

from .base import EXIT_OK, command, emit_json, human, parse_step, usage_error


def _sample(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


# --- export ---------------------------------------------------------------------------------
def _add_export(p) -> None:
    p.add_argument("step", type=parse_step)
    p.add_argument("out", help="the file to write (.safetensors; .pt, .pth, .bin or .ckpt for --format torch)")
    p.add_argument("--format", choices=EXPORT_FORMATS,
                   help="safetensors: the tensors, weights only; torch: the whole state dict as one torch.save file "
                        "(dcp_to_torch_save's equivalent; DCP checkpoints put together from their shards). "
                        "Default: torch for a .pt/.pth/.bin/.ckpt file, else safetensors")
    p.add_argument("--keys", nargs="+", metavar="KEY", help="only these top-level entries (e.g. model)")
    p.add_argument("--relative", action="store_true",
                   help="name tensors relative to the one --keys entry (layer.weight, not model.layer.weight)")
    p.add_argument("--json", action="store_true")


@command("export", "write a checkpoint's tensors to a .safetensors file for serving or evaluation (weights "
         "only: NOT a training checkpoint; optimizer, RNG and other non-tensor state are left out), or with "
         "--format torch its whole state dict to a torch.save file", _add_export, read_only=True)
def cmd_export(store, args) -> int:
    with progress_for(args) as progress:
        report = store.export(args.step, args.out, keys=args.keys, relative=args.relative, progress=progress,
                              format=args.format)
    if args.json:
        emit_json(report.to_json())
        return EXIT_OK
    if report.format == "torch":
        print(f"exported step {report.step}: its state dict ({report.tensors} tensors, {human(report.bytes)}, and "
              f"its values) to {report.path} (torch.save)")
        if report.needs_safe_globals:
            print(f"torch.load(weights_only=True) needs these allowed: {', '.join(report.needs_safe_globals)} "
                  "(torch.serialization.safe_globals)")
        return EXIT_OK
    print(f"exported step {report.step}: {report.tensors} tensors, {human(report.bytes)} to {report.path}")
    if report.skipped:
        print(f"skipped {len(report.skipped)} non-tensor values: {_sample(report.skipped)}")
    print("this is a weights-only file for serving or evaluation, not a training checkpoint")
    return EXIT_OK


# --- import ---------------------------------------------------------------------------------
def _add_import(p) -> None:
    p.add_argument("path", help="a .safetensors or torch.save file (.pt, .pth, .bin, .ckpt), a folder of them, "
                                "or a DCP folder (FileSystemWriter's .metadata and *.distcp files)")
    p.add_argument("--step", type=parse_step, help="the step of a single file or DCP folder (default: from its name)")
    p.add_argument("--json", action="store_true")
    p.epilog = (f"Step rule: {STEP_RULE}. A file without a number needs --step; in a folder, such a file "
                "stops the import before anything is imported. torch.save files are read with "
                "torch.load(weights_only=True) only: a file that needs more is refused, never unpickled. A DCP folder becomes "
                f"one DCP checkpoint that CasReader loads; {DCP_STEP_RULE}. Its .metadata is read with DCP's "
                "metadata classes allowed and nothing else, its items weights-only.")


@command("import", "import .safetensors or torch.save files (read weights-only) as checkpoints; "
         "a folder imports one file per step; a DCP folder imports as one DCP checkpoint", _add_import,
         creates_store=True)
def cmd_import(store, args) -> int:
    folder = os.path.isdir(args.path)
    dcp = folder and is_dcp_folder(args.path)
    if folder and not dcp and args.step is not None:
        return usage_error("--step applies to a single file; in a folder each file's step comes from its name")
    try:
        with progress_for(args) as progress:
            if dcp:
                rows, ignored, before = [(args.path, store.import_dcp(args.path, step=args.step))], [], []
            elif folder:
                result = store.import_folder(args.path, progress=progress)
                rows, ignored, before = result.checkpoints, result.ignored, result.already_imported
            else:
                rows, ignored, before = [(args.path, store.import_file(args.path, step=args.step))], [], []
    except TypeError as exc:  # a value the store cannot hold
        return usage_error(str(exc))
    if args.json:
        emit_json({"imported": _json_rows(rows), "already_imported": _json_rows(before), "ignored": ignored})
        return EXIT_OK
    _print_imported(rows, ignored, before)
    return EXIT_OK


def _json_rows(rows: list) -> list[dict]:
    return [dict(ck.to_json(), file=path) for path, ck in rows]


def _print_imported(rows: list, ignored: list[str], before: list) -> None:
    for path, ck in before:  # an earlier import of this folder, interrupted, committed these
        print(f"already imported {os.path.basename(path)} as step {ck.step} (same values): skipped")
    for path, ck in rows:
        print(f"imported {os.path.basename(path)} as step {ck.step}: {human(ck.logical_bytes)} logical, "
              f"{human(ck.new_bytes)} new on disk")
    logical, new = sum(ck.logical_bytes for _, ck in rows), sum(ck.new_bytes for _, ck in rows)
    if len(rows) > 1:
        print(f"{len(rows)} files: {human(logical)} logical, {human(new)} new on disk "
              f"(dedup saved {human(max(logical - new, 0))}); see `cas du`")
    if ignored:
        print(f"ignored (not checkpoint files): {_sample(ignored)}")


# --- diff -----------------------------------------------------------------------------------
def _add_diff(p) -> None:
    p.add_argument("a", type=parse_step, help="the older checkpoint's step")
    p.add_argument("b", type=parse_step, help="the newer checkpoint's step")
    p.add_argument("--json", action="store_true")


@command("diff", "compare two checkpoints per tensor (unchanged, changed with the share of chunks and the "
         "max abs difference, added, removed) and the stored bytes they share", _add_diff, read_only=True)
def cmd_diff(store, args) -> int:
    with progress_for(args) as progress:
        report = store.diff(args.a, args.b, progress=progress)
    if args.json:
        emit_json(report.to_json())
        return EXIT_OK
    print(f"{'status':9}  {'path':40}  {'dtype':10}  {'shape':18}  detail")
    for t in report.tensors:
        print(f"{t.status:9}  {t.path:40}  {t.dtype:10}  {str(tuple(t.shape)):18}  {_detail(t)}".rstrip())
    print(f"\nstep {report.a} -> {report.b}: " + ", ".join(
        f"{report.count(s)} {s}" for s in ("unchanged", "changed", "added", "removed")))
    print(f"shared on disk {human(report.shared_bytes)}; step {report.a} references "
          f"{human(report.a_stored_bytes)}, step {report.b} {human(report.b_stored_bytes)}")
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
