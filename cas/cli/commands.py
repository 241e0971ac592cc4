"""The `cas` commands on one store: ls, show, verify, du, rm, pin, unpin, gc, repair, milestone.

Each registers with base.command; the interop commands (export, import, diff) are in interop,
`cas cat` and `cas show --values` in values.
"""

from __future__ import annotations

import json
import sys

from cas.errors import CasError
from cas.progress import progress_for

from .base import (EXIT_OK, EXIT_PROBLEM, command, emit_json, human, parse_step, print_checkpoint, shown,
                   usage_error)
from .values import show_values


# --- arguments -----------------------------------------------------------------------------
def _add_ls(p) -> None:
    p.add_argument("--json", action="store_true", help="print as JSON")

def _add_show(p) -> None:
    p.add_argument("step", type=parse_step)
    p.add_argument("--values", action="store_true",
                   help="list the non-tensor values (step, scheduler, scaler, sampler, RNG, your own) with their "
                        "dotted keys instead of the tensors")
    p.add_argument("--json", action="store_true")

def _add_verify(p) -> None:
    p.add_argument("step", type=parse_step, nargs="?")
    p.add_argument("--quick", action="store_true",
                   help="check chunks for presence, size and header only (a damaged payload passes)")
    p.add_argument("--signatures", metavar="PUBKEY",
                   help="also check that every checkpoint is signed by this ed25519 public key (a file: "
                        "PEM, OpenSSH or 32 raw bytes; or 64 hex digits)")
    p.add_argument("--json", action="store_true")

def _add_du(p) -> None:
    p.add_argument("--json", action="store_true")

def _add_step(p) -> None:
    p.add_argument("step", type=parse_step)

def _add_gc(p) -> None:
    p.add_argument("--keep-last", type=int, metavar="N", help="keep the N newest checkpoints")
    p.add_argument("--keep-milestones", action="store_true", help="keep every milestone")
    p.add_argument("--keep-every", type=int, metavar="K", help="keep steps divisible by K")
    p.add_argument("--keep-best", metavar="METRIC:min|max:N", help="keep the N best by a metric")
    p.add_argument("--keep-within", metavar="DURATION", help="keep those created within e.g. 12h, 2d, 1w")
    p.add_argument("--keep-all", action="store_true", help="remove no checkpoint; only reclaim garbage")
    p.add_argument("--dry-run", action="store_true", help="change nothing; report what would happen")
    p.add_argument("--json", action="store_true")

def _add_milestone(p) -> None:
    p.add_argument("step", type=parse_step)
    p.add_argument("--unset", action="store_true")


# --- commands ------------------------------------------------------------------------------
@command("ls", "list checkpoints; 'exclusive' is the stored bytes only that checkpoint holds "
         "(what deleting it would free)", _add_ls, read_only=True)
def cmd_ls(store, args) -> int:
    cks = store.checkpoints()
    exclusive = exclusive_column(store, cks, args)  # what deleting each would free
    if args.json:
        emit_json([dict(ck.to_json(), exclusive_bytes=exclusive.get(ck.step)) for ck in cks])
        return EXIT_OK
    if not cks:
        print(f"no checkpoints in {store.path}")
        return EXIT_OK
    mirrored = any(ck.mirrored for ck in cks)  # a store with a mirror: which of them it holds
    print(f"{'step':>10}  {'created (UTC)':19}  {'flags':5}  {'logical':>10}  {'new':>10}  {'exclusive':>10}  "
          + ("mirrored  " if mirrored else "") + "metrics")
    for ck in cks:
        flags = ("M" if ck.milestone else "-") + ("P" if ck.pinned else "-")
        metrics = " ".join(f"{shown(k)}={v:g}" if isinstance(v, float) else f"{shown(k)}={shown(v)}"
                           for k, v in ck.metrics.items())
        only = human(exclusive[ck.step]) if ck.step in exclusive else "?"
        column = f"{'yes' if ck.mirrored else 'no':8}  " if mirrored else ""
        print(f"{ck.step:>10}  {ck.created:%Y-%m-%d %H:%M:%S}  {flags:5}  {human(ck.logical_bytes):>10}  "
              f"{human(ck.new_bytes):>10}  {only:>10}  {column}{metrics}")
    return EXIT_OK


def exclusive_column(store, cks, args) -> dict[int, int]:
    """Bytes only each checkpoint holds, for `cas ls`. Empty (shown as "?") with a warning when a
    manifest node cannot be read, so that ls still lists a damaged store."""
    try:
        with progress_for(args) as progress:
            return store.exclusive_bytes(cks, progress=progress)
    except CasError as exc:
        print(f"cas: warning: cannot tell the bytes only each checkpoint holds: {exc}", file=sys.stderr)
        return {}


@command("show", "show one checkpoint's tensors (--values: its other values)", _add_show, read_only=True)
def cmd_show(store, args) -> int:
    ck = store.get(args.step)
    if args.values:
        return show_values(store, ck, args)
    tensors = store.tensors(ck.step)
    prev = store.previous(ck.step)
    before = {k for t in store.tensors(prev.step) for k in t["chunks"]} if prev else set()
    depth = {k: (r.depth if r else 0) for t in tensors for k in t["chunks"] for r in [store.objects.record(k)]}
    rows = [{"path": t["path"], "dtype": t["dtype"], "shape": t["shape"], "bytes": t["bytes"],
             "chunks": len(t["chunks"]), "new_chunks": sum(1 for k in t["chunks"] if k not in before),
             "max_chain_depth": max((depth[k] for k in t["chunks"]), default=0)}
            for t in tensors]
    if args.json:
        emit_json({"checkpoint": ck.to_json(), "compared_with_step": prev.step if prev else None, "tensors": rows})
        return EXIT_OK
    print_checkpoint(ck)
    if ck.provenance:
        print("provenance " + _provenance_line(ck.provenance))
        if isinstance(ck.provenance.get("dcp"), dict):
            dcp = ck.provenance["dcp"]
            print(f"dcp {shown(dcp.get('world_size'))} ranks, sharding " + json.dumps(dcp.get("sharding"), default=str))
    if ck.signature:
        print(_signature_line(ck))
    against = f"not in step {prev.step}" if prev else "first checkpoint"
    print(f"\n{'path':40}  {'dtype':10}  {'shape':18}  {'bytes':>10}  {'chunks':>6}  {'chain':>5}  "
          f"new ({against})")
    for r in rows:
        print(f"{r['path']:40}  {r['dtype']:10}  {str(tuple(r['shape'])):18}  {human(r['bytes']):>10}  "
              f"{r['chunks']:>6}  {r['max_chain_depth']:>5}  {r['new_chunks']}")
    return EXIT_OK


def _signature_line(ck) -> str:
    """Whether the signature a record carries verifies against the key it names: a record
    changed after it was signed says INVALID, never "signed". Valid says who signed, not that
    the key is one you trust: `cas verify --signatures KEY` checks against yours."""
    from cas.store import signing
    from cas.store.registry import add_change

    named = ck.signature.get("public_key") if isinstance(ck.signature, dict) else None
    named = bytes(named) if isinstance(named, (bytes, bytearray)) else b""
    if len(named) != 32:
        verdict = "INVALID, it names no ed25519 public key"
    else:
        try:
            why = signing.problem(add_change(ck), named)
            verdict = ("valid (`cas verify --signatures KEY` checks that it is your key)" if why is None
                       else f"INVALID, {why}")
        except CasError as exc:  # no `cryptography` here
            verdict = f"not checked here ({exc})"
    return f"signature by ed25519 key {named.hex()}: {verdict}"


def _provenance_line(prov: dict) -> str:
    git = prov.get("git") or {}
    parts = [f"cas {shown(prov.get('cas'))}", f"torch {shown(prov.get('torch'))}",
             f"python {shown(prov.get('python'))}", f"numpy {shown(prov.get('numpy'))}",
             f"host {shown(prov.get('host'))}", f"pid {shown(prov.get('pid'))}",
             f"world_size {shown(prov.get('world_size'))}",
             f"devices {shown(','.join(map(str, prov.get('devices') or [])))}"]
    if git.get("commit"):
        parts.append(f"git {shown(str(git['commit'])[:12])}{' (dirty)' if git.get('dirty') else ''}")
    parts.append("argv " + " ".join(shown(arg) for arg in prov.get("argv") or []))
    return "  ".join(parts)


# Opened for writing where it can be (it falls back to read-only by itself): what it finds is
# recorded in the index, so that saves stop building on it.
@command("verify", "check every object of one or all checkpoints against its hash", _add_verify)
def cmd_verify(store, args) -> int:
    unsigned = store.verify_signatures(args.signatures) if args.signatures else {}
    if args.step is not None:
        unsigned = {s: why for s, why in unsigned.items() if s == args.step}
    with progress_for(args) as progress:
        report = store.verify(args.step, quick=args.quick, progress=progress)
    ok = report.ok and not unsigned
    if args.json:
        emit_json({"ok": ok, "quick": report.quick, "checked_checkpoints": report.checked_checkpoints,
                    "whole_steps": report.whole_steps,
                    "checked_objects": report.checked_objects, "checked_chunks": report.checked_chunks,
                    "checked_manifest_nodes": report.checked_nodes, "checked_delta_bases": report.checked_bases,
                    "checked_bytes": report.checked_bytes, "checked_raw_bytes": report.checked_bytes,
                    "checked_stored_bytes": report.checked_stored_bytes,
                    "problems": [vars(p) for p in report.problems], "damaged_steps": report.damaged_steps,
                    "recorded_damaged": report.recorded, "payloads_checked": not report.quick,
                    "removed_checkpoints": report.removed_checkpoints,
                    **({"signatures_checked": True, "unsigned": {str(s): w for s, w in unsigned.items()}}
                       if args.signatures else {})})
        return EXIT_OK if ok else EXIT_PROBLEM
    for step, why in sorted(unsigned.items()):
        print(f"SIGNATURE: checkpoint {step}: {why}")
    if args.signatures and not unsigned:
        print("signatures ok: every checkpoint checked is signed by that key")
    for p in report.problems:
        print(f"PROBLEM: {p}")
    verdict = "DAMAGED" if not report.ok else "UNSIGNED" if unsigned else "ok"  # never "ok" on exit 1
    print(f"{verdict}{' (quick)' if report.quick else ''}: "
          f"{len(report.checked_checkpoints)} checkpoints, {len(report.whole_steps)} whole, "
          f"{len(report.damaged_steps)} damaged {report.damaged_steps or ''}".rstrip())
    roles = _roles(report.checked_chunks, report.checked_nodes, report.checked_bases)
    print(f"checked {report.checked_objects} objects ({roles}): {human(report.checked_bytes)} of tensor data "
          f"in distinct chunks, {human(report.checked_stored_bytes)} stored")
    for line in _verify_notes(report):
        print(line)
    return EXIT_OK if ok else EXIT_PROBLEM


def _verify_notes(report) -> list[str]:
    """What a verify did not check, and what happens to what it found."""
    notes = []
    if report.quick:
        notes.append("quick: presence, sizes and headers only; a damaged payload passes (run `cas verify` "
                     "without --quick to decode every object)")
    if report.removed_checkpoints:
        notes.append(f"{len(report.removed_checkpoints)} checkpoints were removed while this verify ran (steps "
                     f"{report.removed_checkpoints}): not checked, and the objects only they needed are no damage")
    if report.recorded:
        notes.append(f"recorded {len(report.recorded)} damaged objects: saves write them again instead of "
                     "reusing them; `cas repair` moves them to quarantine/")
    elif not report.ok and report.read_only:
        notes.append("the store is read-only here: the damage was not recorded, and saves may still reuse it")
    return notes


@command("du", "disk usage: logical against stored bytes", _add_du, read_only=True)
def cmd_du(store, args) -> int:
    from cas.store.stats import object_counts

    s = store.stats()
    codecs = store.codec_usage()
    counts = object_counts(store)
    data = {"checkpoints": s.num_checkpoints, "logical_bytes": s.logical_bytes, "stored_bytes": s.stored_bytes,
            "objects": s.num_objects, "objects_by_role": counts.to_json(), "dedup_ratio": round(s.dedup_ratio, 3),
            "codecs": codecs}
    if args.json:
        emit_json(data)
        return EXIT_OK
    print(f"checkpoints   {s.num_checkpoints}")
    print(f"logical       {human(s.logical_bytes)}  (tensor bytes: what separate full copies would hold)")
    print(f"stored        {human(s.stored_bytes)}  in {s.num_objects} objects (every object in the index)")
    print(f"referenced    {counts.referenced} objects ({_roles(counts.chunks, counts.nodes, counts.bases)}): "
          "what `cas verify` checks")
    print(f"unreferenced  {counts.unreferenced} objects (no checkpoint reaches them; gc sweeps them, but those in "
          "a pack still half live or more, a bucket's or a local one over 16 MiB, wait until it is not)")
    if counts.unreadable_nodes:
        print(f"cas: warning: {counts.unreadable_nodes} manifest nodes do not read; run `cas verify`", file=sys.stderr)
    print(f"ratio         {s.dedup_ratio:.2f}x  (logical / stored)")
    print(f"\n{'codec':28} {'objects':>8} {'stored':>11} {'headers':>9} {'raw':>11} {'payload/raw':>11} {'chain':>5}")
    for name, u in sorted(codecs.items(), key=lambda kv: -kv[1]["stored_bytes"]):
        payload = u["stored_bytes"] - u["header_bytes"]
        share = f"{payload / u['raw_bytes']:.1%}" if u["raw_bytes"] else "-"
        print(f"{name:28} {u['objects']:>8} {human(u['stored_bytes']):>11} {human(u['header_bytes']):>9} "
              f"{human(u['raw_bytes']):>11} {share:>11} {u['max_depth']:>5}")
    print("(stored = payload + headers; payload/raw is what the codec made of the raw bytes)")
    return EXIT_OK


def _roles(chunks: int, nodes: int, bases: int) -> str:
    return f"{chunks} tensor chunks, {nodes} manifest nodes, {bases} delta bases"


@command("rm", "delete a checkpoint (space returns at the next gc)", _add_step)
def cmd_rm(store, args) -> int:
    store.delete(args.step)
    print(f"removed checkpoint {args.step}; run `cas gc --keep-all` (or with your rules) to reclaim the space only it used")
    return EXIT_OK


@command("pin", "pin a checkpoint: a legal hold that no rule and no rm removes", _add_step)
def cmd_pin(store, args) -> int:
    store.pin(args.step)
    print(f"checkpoint {args.step} is pinned")
    return EXIT_OK


@command("unpin", "release a pin", _add_step)
def cmd_unpin(store, args) -> int:
    store.unpin(args.step)
    print(f"checkpoint {args.step} is no longer pinned")
    return EXIT_OK


@command("gc", "apply retention rules, then reclaim the space of unreferenced objects", _add_gc)
def cmd_gc(store, args) -> int:
    from cas.gc import Retention

    if args.keep_last == 0:  # a rule keeping nothing: only "the newest is never removed" would save one
        return usage_error("--keep-last 0 keeps no checkpoint by that rule (gc would remove all but the newest, "
                           "which it never removes); use --keep-last 1 to keep only the newest, or --keep-all to "
                           "remove no checkpoint and only reclaim garbage")
    rules = dict(keep_last=args.keep_last, keep_milestones=args.keep_milestones, keep_every=args.keep_every,
                 keep_best=args.keep_best, keep_within=args.keep_within)
    retention = Retention(**rules)
    if retention.has_rules and args.keep_all:
        return usage_error("--keep-all removes no checkpoint; it cannot be combined with retention rules")
    if not retention.has_rules and not args.keep_all:
        return usage_error("gc needs at least one rule (--keep-last N, --keep-milestones, --keep-every K, "
                           "--keep-best METRIC:min|max:N, --keep-within 2d, or --keep-all to only reclaim "
                           "garbage); refusing to delete every checkpoint")
    with progress_for(args) as progress:
        report = store.gc(retention if retention.has_rules else None, dry_run=args.dry_run, progress=progress)
    if args.json:
        emit_json(report.to_json())
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    lines = [(ck.step, f"kept     {ck.step:>10}  ({', '.join(rules)})") for ck, rules in report.kept]
    lines += [(ck.step, f"{'remove?' if args.dry_run else 'removed':8} {ck.step:>10}") for ck in report.removed]
    for _, line in sorted(lines):
        print(line)
    print(f"{'would free' if args.dry_run else 'freed'} {human(report.freed_bytes)} in {report.objects_swept} objects; "
          f"{len(report.kept)} checkpoints kept, {len(report.removed)} {verb}"
          + (" (dry run: nothing changed)" if args.dry_run else ""))
    if report.deferred:
        print(f"sweep deferred: {report.deferred}")
    if report.held_for_mirror:
        print(f"kept {len(report.held_for_mirror)} checkpoints no rule keeps: not yet in the store's mirror")
    if report.objects_missing:
        print(f"{report.objects_missing} objects the checkpoints need are missing from the store; "
              "`cas verify` names them and their checkpoints")
    return EXIT_OK


@command("repair", "quarantine damaged objects, then rebuild the index and registry from the objects "
         "on disk (run with no writers)", opens_store=False)
def cmd_repair(path: str, args) -> int:
    from cas.store.repair import repair

    from cas.store.location import parse_target

    # (no key= given: an encrypted store is opened with $CAS_KEY_FILE's key, a plain one ignores it)
    kind, where = parse_target(path)
    if kind == "local":
        _quarantine(where)  # first: the rebuild indexes every file whose header parses, damaged payload or not
    else:
        print("objects in a bucket are not quarantined (`cas verify` names damaged ones); rebuilding this host's "
              "cache of the store")
    report = repair(path)
    if report.moved_aside:
        print(f"the damaged index was moved to {report.moved_aside}" + (f": {report.reason}" if report.reason else ""))
    for item in report.skipped:
        print(f"skipped: {item}")
    if report.config_healed:
        print("the config had one damaged bit or byte: written back as it was written (the damaged copy is in "
              "quarantine/)")
    for seq in report.log_healed:
        print(f"record log entry {seq} had one damaged bit or byte: written back as it was written "
              "(the damaged copy is in quarantine/)")
    for seq in report.log_mended:
        print(f"record log entry {seq} has one damaged bit or byte: read as it was written (cas does not rewrite "
              "a bucket's blobs)")
    print(f"rebuilt: {report.objects} objects in {report.packs} packs and object files; "
          f"{len(report.checkpoints)} checkpoints {report.checkpoints}")
    print("run `cas verify` to check every checkpoint")
    return EXIT_OK


def _quarantine(path: str) -> None:
    """Move the objects verify or a load found damaged to quarantine/ and report them; an index
    that does not open is the rebuild's to handle (its damage records go with it)."""
    from cas.store.quarantine import quarantine_damaged

    try:
        report = quarantine_damaged(path)
    except (CasError, OSError) as exc:
        print(f"skipped the quarantine of damaged objects: {exc}")
        return
    for item in report.moved:
        where = item.moved_to or "nothing left on disk; its index record dropped"
        print(f"quarantined: object {item.key} ({item.reason}) -> {where}")


@command("milestone", "mark a checkpoint as a milestone (or --unset)", _add_milestone)
def cmd_milestone(store, args) -> int:
    ck = store.set_milestone(args.step, not args.unset)
    print(f"checkpoint {ck.step} is {'now' if ck.milestone else 'no longer'} a milestone")
    return EXIT_OK


def _key_args(p) -> None:
    p.add_argument("action", choices=["list", "add", "remove"], help="list the keys, add one, or remove one")
    p.add_argument("id", nargs="?", help="the key to remove (its id, as `cas key list` shows it)")
    p.add_argument("--new-key-file", help="add: the new key's file (32 raw bytes, or a passphrase; default "
                                          "$CAS_NEW_KEY_FILE, else a prompt on a terminal)")
    p.add_argument("--json", action="store_true")


@command("key", "the keys of an encrypted store: list, add (--new-key-file), remove ID; the store opens "
         "with the key in the file $CAS_KEY_FILE names", _key_args)
def cmd_key(store, args) -> int:
    if not store.encrypted:
        return usage_error(f"the store at {store.path} is not encrypted: it has no keys (a store is encrypted "
                           "when created with a key: cas.open(path, key=...), or any command creating one with "
                           "$CAS_KEY_FILE set)")
    if args.action == "list":
        ids, stray = store.key_ids(), store.stray_key_ids()
        if args.json:
            emit_json({"keys": ids, "opened_with": store.key_id, "stray": stray})
        else:
            for key_id in ids:
                print(f"{key_id}{'  (this key)' if key_id == store.key_id else ''}")
            for key_id in stray:
                print(f"{key_id}  (opens nothing: left by a store creation cut short; `cas key remove {key_id}` "
                      "deletes it)")
        return EXIT_OK
    if args.action == "add":
        new_key = _new_key(args)
        key_id = store.add_key(new_key)
        emit_json({"added": key_id}) if args.json else print(f"added key {key_id}")
        return EXIT_OK
    if not args.id:
        return usage_error("cas key remove needs the id of the key to remove (cas key list shows them)")
    store.remove_key(args.id)
    emit_json({"removed": args.id}) if args.json else print(f"removed key {args.id}")
    return EXIT_OK


def _new_key(args):
    import getpass
    import os

    from cas.crypt import read_key_file

    path = args.new_key_file or os.environ.get("CAS_NEW_KEY_FILE")
    if path:
        return read_key_file(path)
    if not sys.stdin.isatty():
        raise CasError("cas key add needs the new key: --new-key-file PATH or $CAS_NEW_KEY_FILE (no terminal to "
                       "prompt on)")
    first = getpass.getpass("new passphrase: ")
    if first != getpass.getpass("again: "):
        raise CasError("the two passphrases differ; no key was added")
    return first
