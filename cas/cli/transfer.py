"""The transfer commands: `cas push DEST [STEP...]` and `cas pull SRC [STEP...]`.

They copy checkpoints between the store (`--store`, $CAS_STORE) and another store, a path or
URL, with only the objects the receiving store lacks; checkpoint ids are preserved. They
register with base.command like the commands of cas.cli.commands; cas.cli imports all of them.
"""

from __future__ import annotations

from cas.progress import progress_for

from .base import EXIT_OK, command, emit_json, human, parse_step, remove_if_new_and_empty


def _add_transfer(other: str, what: str):
    def add(p) -> None:
        p.add_argument(other, help=what)
        p.add_argument("steps", type=parse_step, nargs="*", metavar="STEP", help="only these steps (default: all)")
        p.add_argument("--json", action="store_true")
    return add


@command("push", "copy checkpoints to another store (a path or URL, created when missing) with only the "
         "objects it lacks; checkpoint ids are preserved",
         _add_transfer("dest", "the store to copy into"), read_only=True)
def cmd_push(store, args) -> int:
    with progress_for(args) as progress:
        report = store.push(args.dest, args.steps or None, progress=progress)
    return _print(report, "pushed", args)


@command("pull", "copy checkpoints of another store (a path or URL) into this one with only the objects "
         "it lacks; checkpoint ids are preserved",
         _add_transfer("src", "the store to copy from"), opens_store=False)
def cmd_pull(path: str, args) -> int:
    """Into a store that is not there yet, the source pushes: the new store gets the source's
    chunk size and master key, as a push makes its destination (made with defaults, it was
    encrypted under $CAS_KEY_FILE's own new master key, which no copy could share, and saves
    resumed from it did not dedup against what it copied), and a refused copy makes none."""
    import os

    from cas.api import Store
    from cas.store.location import locate
    from cas.store.opening import copy_key

    with progress_for(args) as progress:
        if locate(path).has_config():
            with Store(path, create=False) as store:
                report = store.pull(args.src, args.steps or None, progress=progress)
        else:
            existed = os.path.lexists(path)
            with Store(args.src, create=False, readonly=True) as source:
                try:
                    report = source.push(path, args.steps or None, progress=progress)
                except BaseException:  # a store the push made and left empty is removed, bucket or folder
                    if locate(path).has_config():
                        remove_if_new_and_empty(Store, path, copy_key(source), existed=existed)
                    raise
    return _print(report, "pulled", args)


def _print(report, verb: str, args) -> int:
    if args.json:
        emit_json(report.to_json())
        return EXIT_OK
    for ck in report.already_there:
        print(f"already there  {ck.step:>10}  {ck.id}")
    for ck in report.copied:
        print(f"{verb:14} {ck.step:>10}  {ck.id}")
    for ck in report.removed_meanwhile:
        print(f"{'removed':14} {ck.step:>10}  {ck.id}  (removed from {report.source} while it was copied)")
    print(f"{verb} {len(report.copied)} checkpoints from {report.source} to {report.destination}, "
          f"{len(report.already_there)} already there; {report.objects_copied} objects copied "
          f"({human(report.bytes_copied)}), {report.objects_skipped} already there")
    return EXIT_OK
