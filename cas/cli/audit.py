"""`cas log`: the store's audit trail, which is its record log (store/records.py): every save,
removal (rm, gc, retention), pin, unpin, milestone change and copy, with when, where and who.
gc never removes it."""

from __future__ import annotations

import datetime as _dt

from .base import EXIT_OK, command, emit_json

WHAT = {"add": "added", "remove": "removed", "set": "set"}


def _add_log(p) -> None:
    p.add_argument("--step", type=int, help="only the changes to this step")
    p.add_argument("--saves", action="store_true", help="include saves and a bucket store's recodes (by default only removals, flags and gc)")
    p.add_argument("--json", action="store_true")


def _describe(change: dict) -> str:
    if change["op"] == "set":
        flags = ", ".join(f"{k}={'on' if change[k] else 'off'}" for k in ("milestone", "pinned", "mirrored")
                          if k in change)
        return f"step {change['step']}: {flags}"
    return f"step {change['step']} {WHAT[change['op']]} (id {bytes(change['id']).hex()[:16]})"


def _rows(entries, step: int | None, saves: bool) -> list[dict]:
    rows = []
    for e in entries:
        changes = [c for c in e.changes if step is None or c["step"] == step]
        if step is not None and not changes:
            continue
        if not saves and e.why in ("save", "push", "pull", "copy", "mirror", "recode") and step is None:
            continue
        rows.append({"seq": e.seq, "time": _dt.datetime.fromtimestamp(e.time, _dt.timezone.utc).isoformat(),
                     "why": e.why, "host": e.host, "pid": e.pid, "user": e.user,
                     "changes": [_describe(c) for c in changes],
                     **({"gc": {"phase": e.gc["phase"], "packs": len(e.gc["packs"])}} if e.gc else {}),
                     **({"recoded": len(e.recoded)} if e.recoded else {})})
    return rows


@command("log", "who removed or changed what, and when: the store's record log (--saves: saves too)",
         _add_log, read_only=True)
def cmd_log(store, args) -> int:
    rows = _rows(store.log(), args.step, args.saves)
    if args.json:
        emit_json(rows)
        return EXIT_OK
    for r in rows:
        what = "; ".join(r["changes"]) or (f"gc {r['gc']['phase']}: {r['gc']['packs']} packs" if "gc" in r else
                                           f"older chunks coded as deltas into {r['recoded']} packs" if "recoded" in r
                                           else "")
        print(f"{r['seq']:>6}  {r['time'][:19]}  {r['why']:12} {r['user']}@{r['host']} (pid {r['pid']})  {what}")
    if not rows:
        print("no changes recorded" + ("" if args.saves else " but saves (--saves lists them)"))
    return EXIT_OK
