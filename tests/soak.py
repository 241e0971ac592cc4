"""A randomized multi-process soak of one store: writers, a gc loop, random SIGKILLs, full checks.

    .venv/bin/python tests/soak.py --seconds 600 --seed N --store DIR [--json FILE]

Processes, all on one store at once (each a real `python tests/soak.py worker ...` process):
  plain        store.save, whole objects; tensors shared between steps (dedup) and new ones
  delta        delta=True, a drifting fp32 weight and a bf16 one, so chains (and `linear` deltas) form
  async        store.save_async, two in flight
  async_delta  save_async with delta=True and delta_memory=256 KiB (the other bases are read back)
  collider     re-saves pinned steps of the plain writer with other contents: must get
               CheckpointExistsError every time
  gcloop       store.gc with retention rules drawn at random, `cas verify` (full and --quick) and
               `cas repair` through the CLI, and `rm index/*.mdb` while the others run
Each writer owns a disjoint step range (BASE[kind] + i); every 7th i is a milestone, some are
pinned after the save. A state is a pure function of (kind, i), so a checkpoint that committed but
was never journaled (killed in between) is still checked. After a save returns, the writer
appends a line to its journal (append, fsync): step, checkpoint id, blake3 of every tensor's
bytes and the non-tensor values. The gc loop journals each gc's rules before it starts and the
steps it removed after it ends.

The killer (this process) SIGKILLs a random process group (a writer, or the gc loop with the CLI
command it runs) at random seeded moments and restarts it, some restarts with a fault point
armed (CAS_FAULTS=point=kill@N). Every --check-every seconds and at the end it kills everything
and checks the store: every checkpoint loads bit for bit and equals its deterministic state and
its journal line; every journaled checkpoint is present unless a gc whose rules allowed it
removed it (pinned ones never; milestones never while keep_milestones was in force; steps
divisible by keep_every neither); verify is clean; after a gc the store holds exactly the
reachable objects. It prints the figures, "committed checkpoints lost: N" among them, and exits 1
when N > 0 or anything else failed.

With --key-file FILE the store is encrypted with the key in FILE (every process opens it with
that key, the CLI through $CAS_KEY_FILE), and the gc loop also adds keys (`cas key add`, each
from a file of 32 random bytes) and removes the ones it added (`cas key remove`), under the same
SIGKILLs and with the keys.* fault points armed at some restarts (the next change is then of
that kind, and each `cas key` process dies at that point). Each check then also opens the
store with every key journaled added and not being removed (it must open, as that key), with
every key journaled removed (it must be refused), and with any other it began to add (a change
cut short: either).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cas  # noqa: E402
from cas.crypt import read_key_file  # noqa: E402
from cas.hashing import hash_bytes  # noqa: E402


def store_opts() -> dict:
    """Every process's store options: an encrypted soak's processes open the store with the key
    in the file $SOAK_KEY_FILE names (set by --key-file; the processes inherit it)."""
    opts = dict(chunk_size=64 << 10, pack_max=16 << 10, workers=2)
    if os.environ.get("SOAK_KEY_FILE"):
        opts["key"] = read_key_file(os.environ["SOAK_KEY_FILE"])
    return opts


STORE_OPTS = store_opts()
BASE = {"plain": 1_000_000, "delta": 2_000_000, "async": 3_000_000, "async_delta": 4_000_000}
WRITERS = list(BASE)
PROCS = WRITERS + ["collider", "gcloop"]
KEEP_EVERY = (None, None, 5, 10, 20)  # every BASE is divisible by each

WRITER_FAULTS = ["save.planned", "save.hashed", "session.before_file_write", "session.file_written",
                 "save.chunks_written", "save.nodes_written", "commit.synced", "commit.in_txn",
                 "registry.logged", "save.committed", "objects.placing", "cache.rebuilding"]
ASYNC_FAULTS = WRITER_FAULTS + ["save.staged"]
GC_FAULTS = ["gc.forgotten", "gc.marking", "gc.marked", "gc.sweep_batch", "gc.repack", "gc.repack_reading",
             "registry.logged", "cache.rebuilding"]
KEY_FAULTS = ["keys.adding", "keys.added", "keys.removing", "keys.removed"]  # an encrypted soak's gc loop's too


# --- deterministic states --------------------------------------------------------------------
def _randn(seed: int, rows: int = 32) -> torch.Tensor:
    return torch.randn(rows, 1024, generator=torch.Generator().manual_seed(seed))


def milestone_of(i: int) -> bool:
    return i % 7 == 0


def pinned_of(i: int) -> bool:
    return i % 11 == 5


def kind_of(step: int) -> tuple[str, int]:
    for kind, base in BASE.items():
        if base <= step < base + 1_000_000:
            return kind, step - base
    raise ValueError(f"step {step} is in no writer's range")


def state_for(kind: str, i: int) -> dict:
    """The state writer `kind` saves at its i-th step: a pure function of (kind, i)."""
    step = BASE[kind] + i
    values = {"step": step, "i": i, "name": f"{kind}-{i}", "lr": 0.1 / (i + 1), "flags": [i % 2 == 0, None],
              "blob": bytes([i % 256]) * (i % 5)}
    if kind in ("plain", "async"):
        k = 0 if kind == "plain" else 1
        model = {"shared": _randn(k * 100 + i % 5),  # the same 5 tensors over and over: dedup
                 "slow": _randn(k * 100 + 50 + i // 6),  # changes every 6th step
                 "own": _randn(k * 1_000_000 + 10_000 + i, rows=16),
                 "ints": torch.arange(i, i + 300, dtype=torch.int64)}
        return {"model": model, "opt": {"count": torch.tensor(i), "np": np.arange(i % 13, dtype=np.float32)},
                "values": values}
    k = 3 if kind == "delta" else 4
    g = torch.Generator().manual_seed(k)
    w0 = torch.randn(64, 1024, generator=g)
    v = 1e-6 * torch.randn(64, 1024, generator=g)
    b0 = torch.randn(32, 1024, generator=g)
    u = 2e-3 * torch.randn(32, 1024, generator=g)
    return {"model": {"w": w0 + i * v,  # fp32 drifting a few ulps a step: sub and linear deltas
                      "b": (b0 + i * u).to(torch.bfloat16),
                      "noise": _randn(k * 1_000_000 + i, rows=8)},  # new every step: deltas lose
            "values": values}


def flatten(state, prefix: str = "") -> tuple[dict, dict]:
    """(path -> blake3 hex of the tensor's bytes, path -> JSON-able value) of a state."""
    tensors, values = {}, {}
    if isinstance(state, dict):
        for k, v in state.items():
            t, x = flatten(v, f"{prefix}{k}.")
            tensors.update(t)
            values.update(x)
    elif isinstance(state, torch.Tensor):
        from helpers import tensor_bytes
        tensors[prefix[:-1]] = f"{state.dtype}{tuple(state.shape)}:" + hash_bytes(tensor_bytes(state)).hex()
    elif isinstance(state, np.ndarray):
        tensors[prefix[:-1]] = f"np.{state.dtype}{state.shape}:" + hash_bytes(np.ascontiguousarray(state).tobytes()).hex()
    elif isinstance(state, bytes):
        values[prefix[:-1]] = "bytes:" + state.hex()
    elif isinstance(state, list):
        values[prefix[:-1]] = json.dumps(state)
    else:
        values[prefix[:-1]] = state
    return tensors, values


# --- journals -----------------------------------------------------------------------------------
class Journal:
    def __init__(self, path: str) -> None:
        self.path = path

    def append(self, **entry) -> None:
        entry.setdefault("t", time.time())
        line = json.dumps(entry) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> list[dict]:
        try:
            with open(self.path) as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            return []
        out = []
        for n, line in enumerate(lines):
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:  # a line torn by a kill (one write() of a few KiB: not seen so far)
                print(f"soak: skipped a torn line {n + 1} of {self.path}", file=sys.stderr)
        return out


def journal_for(workdir: str, name: str) -> Journal:
    return Journal(os.path.join(workdir, "journal", name + ".jsonl"))


# --- workers ------------------------------------------------------------------------------------
def refused_uncommitted(exc: Exception) -> str | None:
    """The journal event for a change refused with nothing committed, which the soak retries: the
    record log kept moving ("contention"), or the index was deleted or replaced under the process
    ("index_replaced"; its next operation opens the index again). None for anything else."""
    if isinstance(exc, cas.IndexReplacedError):
        return "index_replaced"
    return "contention" if "kept moving" in str(exc) else None


def run_writer(kind: str, store_path: str, workdir: str, seed: int, max_steps: int) -> None:
    journal = journal_for(workdir, kind)
    done = [e["i"] for e in journal.read() if e["event"] in ("saved", "existed")]
    i = max(done) + 1 if done else 0
    rng = random.Random(seed * 7919 + i)
    opts = dict(STORE_OPTS)
    if kind in ("delta", "async_delta"):
        opts["delta"] = True
    if kind == "async_delta":
        opts["delta_memory"] = 256 << 10
    if kind.startswith("async"):
        opts["max_inflight"] = 2
    with cas.open(store_path, **opts) as store:
        def existed(j: int) -> bool:
            """Journal step j as committed by the killed predecessor after its last journal line;
            False where it is not there (a retention gc may have removed it since)."""
            try:
                ck = store.get(BASE[kind] + j)
            except cas.CheckpointNotFoundError:
                return False
            tensors, values = flatten(state_for(kind, j))
            journal.append(event="existed", i=j, step=ck.step, id=ck.id.hex() if isinstance(ck.id, bytes) else str(ck.id),
                           tensors=tensors, values=values, milestone=ck.milestone)
            return True

        while existed(i):
            i += 1
        pending = []

        def record(j: int, ck, t0: float) -> None:
            tensors, values = flatten(state_for(kind, j))
            journal.append(event="saved", i=j, step=ck.step, id=ck.id.hex() if isinstance(ck.id, bytes) else str(ck.id),
                           t0=t0, tensors=tensors, values=values, milestone=ck.milestone)
            if pinned_of(j):
                try:
                    store.pin(ck.step)
                except cas.CheckpointNotFoundError:  # a retention gc removed it first: allowed
                    journal.append(event="pin_refused", i=j, step=ck.step)
                else:
                    journal.append(event="pinned", i=j, step=ck.step)

        def contended(j: int, exc: Exception) -> None:
            """A save refused, saying nothing was committed, because the record log kept moving
            (other caches committing) or the index was deleted under it (the gc loop's `rm`):
            journal it and save the step again."""
            why = refused_uncommitted(exc)
            if why is None:
                raise exc
            journal.append(event=why, i=j, error=str(exc))
            time.sleep(rng.uniform(0, 0.5))

        def finish(j: int, fut, t: float) -> None:
            try:
                ck = fut.result()
            except cas.StoreWriteError as exc:
                contended(j, exc)
                while True:
                    try:
                        ck = store.save_async(state_for(kind, j), step=BASE[kind] + j, milestone=milestone_of(j)).result()
                        break
                    except cas.StoreWriteError as exc:
                        contended(j, exc)
            record(j, ck, t)

        while i < max_steps:
            state, step, t0 = state_for(kind, i), BASE[kind] + i, time.time()
            try:
                if kind.startswith("async"):
                    pending.append((i, store.save_async(state, step=step, milestone=milestone_of(i)), t0))
                    if len(pending) >= 2 or rng.random() < 0.3:
                        finish(*pending.pop(0))
                else:
                    while True:
                        try:
                            ck = store.save(state, step=step, milestone=milestone_of(i))
                            break
                        except cas.StoreWriteError as exc:
                            contended(i, exc)
                    record(i, ck, t0)
            except cas.CheckpointExistsError:
                # the predecessor's other save in flight committed it after one that failed (a
                # gap the restart's prefix check does not see): its steps are this writer's alone
                if not existed(i):
                    raise
            i += 1
            time.sleep(rng.uniform(0, 0.25))
        for j, fut, t in pending:
            finish(j, fut, t)


def run_collider(store_path: str, workdir: str, seed: int) -> None:
    journal = journal_for(workdir, "collider")
    rng = random.Random(seed * 31 + len(journal.read()))
    plain = journal_for(workdir, "plain")
    with cas.open(store_path, **STORE_OPTS) as store:
        while True:
            time.sleep(rng.uniform(0.5, 2.0))
            pinned = [e["i"] for e in plain.read() if e["event"] == "pinned"]
            if not pinned:
                continue
            i = rng.choice(pinned)
            other = state_for("plain", i + 1)  # other contents at a step that exists
            try:
                if rng.random() < 0.5:
                    store.save(other, step=BASE["plain"] + i)
                else:
                    store.save_async(other, step=BASE["plain"] + i).result()
            except cas.CheckpointExistsError:
                journal.append(event="refused", i=i, step=BASE["plain"] + i)
            else:
                journal.append(event="collision_committed", i=i, step=BASE["plain"] + i)
                raise SystemExit(f"a second save of pinned step {BASE['plain'] + i} committed")


def cli(store_path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from cas.cli import main; sys.exit(main())",
                           "--store", store_path, *args], capture_output=True, text=True, timeout=600)


def run_gcloop(store_path: str, workdir: str, seed: int) -> None:
    journal = journal_for(workdir, "gcloop")
    n = len(journal.read())
    rng = random.Random(seed * 104729 + n)
    journal.append(event="started")
    keyed = "key" in STORE_OPTS
    armed = os.environ.get("CAS_FAULTS", "").partition("=")[0]
    armed = armed if armed in KEY_FAULTS else None  # a keys.* point: the next change is of its kind
    while True:
        time.sleep(rng.uniform(0.2, 1.5))
        # an encrypted store's first operation adds a key (so even a short soak has one), then 15% are
        # key changes (a plain soak draws as it always did)
        if keyed and (armed or not any(e["event"] == "key_adding" for e in journal.read()) or rng.random() < 0.15):
            churn_key(store_path, workdir, journal, rng, removal=armed and armed.startswith("keys.remov"))
            armed = None
            continue
        r = rng.random()
        if r < 0.45:
            rules = {"keep_last": rng.randint(2, 8)}
            if rng.random() < 0.85:
                rules["keep_milestones"] = True
            every = rng.choice(KEEP_EVERY)
            if every:
                rules["keep_every"] = every
            n += 1
            journal.append(event="gc_start", n=n, rules=rules)
            try:
                with cas.open(store_path, **STORE_OPTS) as store:
                    report = store.gc(**rules)
            except cas.StoreWriteError as exc:
                if refused_uncommitted(exc) is None:
                    raise
                journal.append(event="gc_failed", n=n, error=str(exc))  # "nothing was committed": taken at its word
                continue
            journal.append(event="gc_end", n=n, removed=[ck.step for ck in report.removed],
                           swept=report.objects_swept, deferred=report.deferred)
        elif r < 0.55:
            journal.append(event="sweep_start")
            with cas.open(store_path, **STORE_OPTS) as store:
                report = store.gc()
            journal.append(event="sweep_end", swept=report.objects_swept, removed=[ck.step for ck in report.removed])
        elif r < 0.75:
            # a whole-store full verify takes long on a big store (and is often killed first): mostly
            # the whole store --quick and one checkpoint in full
            what = rng.choice(["quick", "step", "step", "all"])
            args = ["--quick"] if what == "quick" else []
            if what == "step":
                with cas.open(store_path, **STORE_OPTS) as store:
                    steps = [ck.step for ck in store.checkpoints()]
                if not steps:
                    continue
                args = [str(rng.choice(steps))]
            journal.append(event="verify_start", what=what, args=args)
            p = cli(store_path, "verify", *args)
            if p.returncode and what == "step" and "no checkpoint" in p.stdout + p.stderr:
                journal.append(event="verify_end", what=what, rc=0, out="removed meanwhile")
                continue
            journal.append(event="verify_end", what=what, rc=p.returncode,
                           out=(p.stdout + p.stderr)[-2000:] if p.returncode else "")
        elif r < 0.87:
            journal.append(event="repair_start")
            p = cli(store_path, "repair")
            journal.append(event="repair_end", rc=p.returncode, out=(p.stdout + p.stderr)[-2000:])
        elif os.environ.get("SOAK_INDEX_DELETIONS") == "0":
            continue
        else:
            deleted = []
            for name in ("data.mdb", "lock.mdb"):
                try:
                    os.unlink(os.path.join(store_path, "index", name))
                    deleted.append(name)
                except FileNotFoundError:
                    pass
            journal.append(event="index_deleted", files=deleted)


def extra_key_file(workdir: str, n: int) -> str:
    return os.path.join(workdir, "keys", f"extra-{n}")


def keys_in_force(events: list[dict]) -> dict[str, int]:
    """The extra keys the gc loop journaled added and never began to remove: id -> n."""
    added = {e["id"]: e["n"] for e in events if e["event"] == "key_added"}
    for e in events:
        if e["event"] == "key_removing":
            added.pop(e["id"], None)
    return added


def churn_key(store_path: str, workdir: str, journal: Journal, rng: random.Random,
              removal: bool | None = None) -> None:
    """`cas key remove` an extra key added before, or `cas key add` a new one (32 random bytes in
    a file of the workdir); which one at random unless `removal` says (a removal only when a key
    is there to remove). A CLI killed by its fault point leaves that change unknown, and the key
    is never used again; any other failure is a finding."""
    events = journal.read()
    in_force = keys_in_force(events)
    if in_force and (rng.random() < 0.5 if removal is None else removal):
        key_id = rng.choice(sorted(in_force))
        journal.append(event="key_removing", id=key_id)
        p = cli(store_path, "key", "remove", key_id)
        done = {"event": "key_removed", "id": key_id}
    else:
        n = sum(e["event"] == "key_adding" for e in events)
        path = extra_key_file(workdir, n)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(rng.randbytes(32))
            f.flush()
            os.fsync(f.fileno())
        journal.append(event="key_adding", n=n)
        p = cli(store_path, "key", "add", "--new-key-file", path, "--json")
        done = {"event": "key_added", "n": n, "id": json.loads(p.stdout)["added"] if p.returncode == 0 else None}
    if p.returncode == -signal.SIGKILL:  # its fault point fired (CAS_FAULTS is inherited)
        journal.append(event="key_op_killed", op=done["event"])
    elif p.returncode:
        raise RuntimeError(f"cas key {done['event'][4:-1]} exited {p.returncode}: {p.stdout}{p.stderr}")
    else:
        journal.append(**done)


# --- the killer and the checks ------------------------------------------------------------------
class Soak:
    def __init__(self, args) -> None:
        self.args = args
        self.store = os.path.abspath(args.store)
        self.workdir = os.path.abspath(args.workdir or self.store + ".soak")
        self.rng = random.Random(args.seed)
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed_by_us: set[int] = set()
        self.finished: set[str] = set()
        self.figures = {"seed": args.seed, "kills": 0, "fault_restarts": 0, "fault_kills": 0, "restarts": 0,
                        "failures": [], "checks": 0, "checkpoints_checked": 0, "bytes_checked": 0,
                        "lost": 0, "lost_detail": [], "removed_by_retention": 0, "verify_ok": True,
                        "exactly_reachable": True, "problems": [], "fault_outcomes": {}, "keys_ok": True}
        self.starts = 0

    # processes
    def start(self, name: str, faults: str = "") -> None:
        self.starts += 1
        log = open(os.path.join(self.workdir, "logs", f"{name}.{self.starts}.log"), "w")
        env = dict(os.environ, CAS_FAULTS=faults, PYTHONUNBUFFERED="1",
                   SOAK_INDEX_DELETIONS="1" if self.args.index_deletions else "0")
        cmd = [sys.executable, os.path.abspath(__file__), "worker", name, self.store, self.workdir,
               str(self.args.seed * 1000 + self.starts), str(self.args.max_steps)]
        self.procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.procs[name].log_path = log.name
        self.procs[name].faults = faults
        log.close()

    def restart(self, name: str) -> None:
        faults = ""
        if self.rng.random() < 0.3:
            points = (GC_FAULTS if name == "gcloop" else
                      ASYNC_FAULTS if name.startswith("async") else WRITER_FAULTS)
            if name == "gcloop" and "key" in STORE_OPTS and self.rng.random() < 0.5:
                # each `cas key` is a process of its own, counting from 1: kill its first change
                faults = f"{self.rng.choice(KEY_FAULTS)}=kill@1"
            else:
                faults = f"{self.rng.choice(points)}=kill@{self.rng.randint(1, 6)}"
            self.figures["fault_restarts"] += 1
        self.figures["restarts"] += 1
        self.start(name, faults)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.killed_by_us.add(proc.pid)
        proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.kill(name)
            self.reap(name, restart=False)

    def reap(self, name: str, restart: bool = True) -> None:
        """Look at a process that ended; restart it unless it finished its steps."""
        proc = self.procs[name]
        rc = proc.returncode
        if proc.faults:
            outcome = "killed by the soak first" if proc.pid in self.killed_by_us else \
                "fired" if rc == -signal.SIGKILL else f"exited {rc}"
            self.figures["fault_outcomes"].setdefault(f"{name} {proc.faults.split('=')[0]}: {outcome}", 0)
            self.figures["fault_outcomes"][f"{name} {proc.faults.split('=')[0]}: {outcome}"] += 1
        if proc.pid in self.killed_by_us:
            self.killed_by_us.discard(proc.pid)
        elif rc == -signal.SIGKILL:
            self.figures["fault_kills"] += 1  # its fault point fired
        elif rc == 0 and name in WRITERS:
            self.finished.add(name)
            del self.procs[name]
            return
        else:
            with open(proc.log_path) as f:
                tail = f.read()[-3000:]
            self.figures["failures"].append({"process": name, "rc": rc, "faults": proc.faults, "log": proc.log_path,
                                             "tail": tail})
            print(f"!! {name} exited {rc} (faults {proc.faults!r}):\n{tail}", flush=True)
        if restart:
            self.restart(name)

    def run(self) -> dict:
        if self.args.fresh:
            shutil.rmtree(self.store, ignore_errors=True)
            shutil.rmtree(self.workdir, ignore_errors=True)
        for sub in ("journal", "logs"):
            os.makedirs(os.path.join(self.workdir, sub), exist_ok=True)
        t_start = time.monotonic()
        deadline = t_start + self.args.seconds
        next_check = t_start + (self.args.check_every or self.args.seconds * 10)
        for name in PROCS:
            self.start(name)
        next_kill = time.monotonic() + self.rng.uniform(1.0, self.args.kill_every * 2)
        while True:
            now = time.monotonic()
            for name in list(self.procs):
                if self.procs[name].poll() is not None:
                    self.reap(name)
            if now >= deadline and self.saved() < self.args.min_saves and now < t_start + 4 * self.args.seconds:
                deadline = now + 1.0  # a loaded machine: run on until the writers committed some (bounded)
            if now >= deadline or len(self.finished) == len(WRITERS):
                break
            if now >= next_kill and self.procs:
                names = sorted(self.procs)  # the gc loop at half the weight: its operations take longest
                name = self.rng.choices(names, [0.5 if n == "gcloop" else 1 for n in names])[0]
                self.kill(name)
                self.figures["kills"] += 1
                self.figures.setdefault("kills_by_process", {}).setdefault(name, 0)
                self.figures["kills_by_process"][name] += 1
                self.reap(name)
                next_kill = now + self.rng.uniform(0.2, self.args.kill_every * 2)
            if now >= next_check:
                self.stop_all()
                paused = time.monotonic()
                self.check(final=False)
                print(f".. check {self.figures['checks']} at {now - t_start:.0f} s: "
                      f"lost {self.figures['lost']}", flush=True)
                deadline += time.monotonic() - paused  # the check's time is not the soak's
                for name in PROCS:
                    if name not in self.finished:
                        self.start(name)
                next_check = time.monotonic() + self.args.check_every
            time.sleep(0.05)
        self.stop_all()
        self.figures["seconds"] = round(time.monotonic() - t_start, 1)
        self.check(final=True)
        return self.figures

    def saved(self) -> int:
        """Saves the writers have journaled so far (each line after a committed save)."""
        return sum(1 for name in WRITERS for e in journal_for(self.workdir, name).read() if e["event"] == "saved")

    # checks
    def check(self, final: bool) -> None:
        from helpers import assert_same
        from test_gc import assert_exactly_reachable

        f = self.figures
        f["checks"] += 1
        journals = {name: journal_for(self.workdir, name).read() for name in PROCS}
        saved = {}  # step -> latest journal entry of a save (or of a commit found after a restart)
        pinned = set()
        for kind in WRITERS:
            for e in journals[kind]:
                if e["event"] in ("saved", "existed"):
                    saved[e["step"]] = e
                elif e["event"] == "pinned":
                    pinned.add(e["step"])
        lost = []
        f["removed_by_retention"] = 0  # recounted by each check
        with cas.open(self.store, **STORE_OPTS) as store:
            present = {ck.step: ck for ck in store.checkpoints()}
            for step, ck in sorted(present.items()):
                kind, i = kind_of(step)
                try:
                    expected = state_for(kind, i)
                    loaded = store.load(step)
                    assert_same(loaded, expected)
                    assert ck.milestone == milestone_of(i), f"milestone flag {ck.milestone}"
                    e = saved.get(step)
                    if e is not None:
                        tensors, values = flatten(loaded)
                        assert tensors == e["tensors"], "tensor hashes differ from the journal"
                        assert values == e["values"], "values differ from the journal"
                        ck_id = ck.id.hex() if isinstance(ck.id, bytes) else str(ck.id)
                        assert ck_id == e["id"], f"id {ck_id} != journaled {e['id']}"
                    if step in pinned:
                        assert ck.pinned, "journaled pinned, not pinned"
                    f["checkpoints_checked"] += 1
                    f["bytes_checked"] += ck.logical_bytes
                except Exception as exc:  # noqa: BLE001 - every failure is a finding
                    lost.append({"step": step, "why": f"present but wrong: {type(exc).__name__}: {exc}"})
            gc_events = journals["gcloop"]
            removed_by = {}  # step -> rules of the gcs that reported removing it
            unfinished = []  # (rules, t_start, t_bound) of gcs killed before their end line
            for n, e in enumerate(gc_events):
                if e["event"] == "gc_end":
                    start = next(s for s in gc_events if s["event"] == "gc_start" and s["n"] == e["n"])
                    for step in e["removed"]:
                        removed_by.setdefault(step, []).append(start["rules"])
                elif e["event"] == "gc_start" and not any(x["event"] in ("gc_end", "gc_failed") and x["n"] == e["n"]
                                                          for x in gc_events[n + 1:]):
                    bound = gc_events[n + 1]["t"] if n + 1 < len(gc_events) else float("inf")
                    unfinished.append((e["rules"], bound))
                elif e["event"] == "sweep_end" and e["removed"]:
                    lost.append({"step": None, "why": f"a gc without rules removed {e['removed']}"})
            for step, e in sorted(saved.items()):
                if step in present:
                    continue
                kind, i = kind_of(step)

                def allows(rules) -> bool:
                    return not (milestone_of(i) and rules.get("keep_milestones")) and \
                        not (rules.get("keep_every") and step % rules["keep_every"] == 0)
                if step in pinned:
                    lost.append({"step": step, "why": "pinned, missing"})
                elif step in removed_by:
                    if all(allows(r) for r in removed_by[step]):
                        f["removed_by_retention"] += 1
                    else:
                        lost.append({"step": step, "why": f"removed by a gc whose rules keep it: {removed_by[step]}"})
                elif any(allows(r) and e.get("t0", e["t"]) < bound for r, bound in unfinished):
                    f["removed_by_retention"] += 1  # by a gc killed before it could journal what it removed
                else:
                    lost.append({"step": step, "why": "missing, no gc removed it"})
            report = store.verify()
            if not report.ok:
                f["verify_ok"] = False
                f["problems"].append(f"check {f['checks']}: verify: {[str(p) for p in report.problems][:10]}")
            if "key" in STORE_OPTS:
                self.check_keys(journals["gcloop"])
            if final:
                swept = store.gc()
                try:
                    assert_exactly_reachable(store)
                except AssertionError as exc:
                    f["exactly_reachable"] = False
                    f["problems"].append(f"not exactly the reachable objects after gc: {exc}; the gc: deferred "
                                         f"{swept.deferred!r}, swept {swept.objects_swept}, held {swept.objects_held}, "
                                         f"index orphaned {store.index.orphaned()}")
                from helpers import tmp_files
                if tmp_files(store):
                    f["problems"].append(f"temporary files left after the final gc: {tmp_files(store)[:5]}")
                quarantine = os.path.join(self.store, "quarantine")
                f["quarantined"] = sorted(os.listdir(quarantine)) if os.path.isdir(quarantine) else []
                if f["quarantined"]:
                    f["problems"].append(f"objects quarantined (a repair found them damaged): {f['quarantined'][:5]}")
                f["store_bytes"] = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(self.store)
                                       for n in names)
                f["checkpoints_at_end"] = len(present)
        if lost or not f["verify_ok"]:
            self.classify(lost)
        seen = {(x["step"], x["why"]) for x in f["lost_detail"]}
        new = [x for x in lost if (x["step"], x["why"]) not in seen]
        f["lost_detail"].extend(new)
        healed = {x["step"] for x in f["lost_detail"] if x.get("after cas repair") == "loads bit for bit"}
        f["unloadable_until_repair"] = len(healed)
        f["lost"] = len({x["step"] for x in f["lost_detail"]} - healed)
        for x in new:
            print(f"!! LOST: {x}", flush=True)
        if final:
            self.tally(journals)

    def check_keys(self, events: list[dict]) -> None:
        """Open the store with each key the gc loop began to add: one journaled added and not being
        removed opens it as itself, one journaled removed is refused (WrongKeyError), and one whose
        change was cut short does either (as itself, when its id is known). The soak's own key
        opened it already."""
        f = self.figures
        id_of = {e["n"]: e["id"] for e in events if e["event"] == "key_added"}
        removing = {e["id"] for e in events if e["event"] == "key_removing"}
        removed = {e["id"] for e in events if e["event"] == "key_removed"}
        for n in sorted({e["n"] for e in events if e["event"] == "key_adding"}):
            key_id = id_of.get(n)
            if key_id in removed:
                allowed = {None}
            elif key_id is not None and key_id not in removing:
                allowed = {key_id}
            else:  # an add or a removal killed before it journaled its end
                allowed = {None, key_id} if key_id is not None else None
            try:
                key = read_key_file(extra_key_file(self.workdir, n))
                with cas.open(self.store, **dict(STORE_OPTS, key=key)) as store:
                    opened = store.key_id
            except cas.WrongKeyError:
                opened = None
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                opened, allowed = f"{type(exc).__name__}: {exc}", set()
            f["keys_checked"] = f.get("keys_checked", 0) + 1
            if allowed is not None and opened not in allowed:
                f["keys_ok"] = False
                f["problems"].append(f"check {f['checks']}: key {n} ({key_id}): opened the store as {opened!r}, "
                                     f"expected one of {sorted(allowed, key=str)}")

    def classify(self, lost: list[dict]) -> None:
        """Keep a copy of the store as evidence; on the copy run `cas repair` (a rebuild from the
        object files, packs and record log) and load each failed step again: one that loads then
        was unloadable through a cache that lacked its objects, one that does not is lost for good."""
        evidence = os.path.join(self.workdir, f"evidence-check{self.figures['checks']}")
        if os.path.exists(evidence):
            return
        shutil.copytree(self.store, evidence, symlinks=True)
        shutil.copytree(evidence, evidence + "-repaired", symlinks=True)
        p = cli(evidence + "-repaired", "repair")
        with cas.open(evidence + "-repaired", **STORE_OPTS) as store:
            for x in lost:
                step = x.get("step")
                if step is None or not x["why"].startswith("present but wrong"):
                    continue
                try:
                    from helpers import assert_same
                    assert_same(store.load(step), state_for(*kind_of(step)))
                    x["after cas repair"] = "loads bit for bit"
                except Exception as exc:  # noqa: BLE001
                    x["after cas repair"] = f"still fails: {type(exc).__name__}: {exc}"[:400]
                x["evidence"] = evidence
            self.figures["problems"].append(f"check {self.figures['checks']}: evidence in {evidence}; repair rc "
                                            f"{p.returncode}; verify after repair ok: {store.verify().ok}")

    def tally(self, journals) -> None:
        f = self.figures
        f["saves"] = {k: sum(e["event"] == "saved" for e in journals[k]) for k in WRITERS}
        f["found_after_restart"] = {k: sum(e["event"] == "existed" for e in journals[k]) for k in WRITERS}
        f["pinned"] = sum(e["event"] == "pinned" for k in WRITERS for e in journals[k])
        f["collisions_refused"] = sum(e["event"] == "refused" for e in journals["collider"])
        f["collisions_committed"] = sum(e["event"] == "collision_committed" for e in journals["collider"])
        g = journals["gcloop"]
        count = lambda ev: sum(e["event"] == ev for e in g)  # noqa: E731
        f["gcs"] = {"retention started": count("gc_start"), "retention finished": count("gc_end"),
                    "sweeps finished": count("sweep_end"),
                    "removed": sum(len(e["removed"]) for e in g if e["event"] == "gc_end"),
                    "deferred": sum(bool(e.get("deferred")) for e in g if e["event"] == "gc_end"),
                    "failed, nothing committed (record log kept moving, index replaced)": count("gc_failed")}
        f["saves_failed_log_kept_moving"] = {k: sum(e["event"] == "contention" for e in journals[k]) for k in WRITERS}
        f["saves_refused_index_replaced"] = {k: sum(e["event"] == "index_replaced" for e in journals[k])
                                             for k in WRITERS}
        f["verifies"] = {"finished": count("verify_end"), "not ok": sum(e["event"] == "verify_end" and e["rc"] != 0
                                                                         for e in g)}
        f["verify_findings"] = [e["out"] for e in g if e["event"] == "verify_end" and e["rc"] != 0][:5]
        f["repairs"] = {"finished": count("repair_end"), "failed": sum(e["event"] == "repair_end" and e["rc"] != 0
                                                                       for e in g)}
        f["index_deletions"] = count("index_deleted")
        f["keys"] = {"added": count("key_added"), "removed": count("key_removed"),
                     "killed by a fault point": count("key_op_killed"), "checked": f.get("keys_checked", 0)}


def print_figures(f: dict) -> None:
    print(f"soak seed {f['seed']}: {f['seconds']} s")
    print(f"  saves committed: {f['saves']} (+ found committed after a kill, unjournaled: {f['found_after_restart']})")
    print(f"  saves refused, 'the record log kept moving' (retried): {f['saves_failed_log_kept_moving']}")
    print(f"  saves refused, the index deleted under them (retried): {f.get('saves_refused_index_replaced')}")
    print(f"  pins {f['pinned']}; re-saves of pinned steps refused {f['collisions_refused']}, "
          f"committed {f['collisions_committed']}")
    print(f"  kills {f['kills']} {f.get('kills_by_process', {})}; restarts with a fault point {f['fault_restarts']}, "
          f"fired {f['fault_kills']}")
    print(f"  fault points armed at restarts: {f['fault_outcomes']}")
    print(f"  gcs {f['gcs']}; verifies {f['verifies']}; repairs {f['repairs']}; index deletions {f['index_deletions']}")
    if f["keys"]["added"] or f["keys"]["checked"]:
        print(f"  keys (an encrypted store) {f['keys']}; every key opened as journaled {f['keys_ok']}")
    print(f"  checks {f['checks']}, checkpoints checked (over all checks) {f['checkpoints_checked']} "
          f"({f['bytes_checked'] / 2**20:.0f} MiB logical); at the end {f.get('checkpoints_at_end')} checkpoints, "
          f"{f.get('store_bytes', 0) / 2**20:.1f} MiB on disk; removed by retention {f['removed_by_retention']}")
    print(f"  worker failures {len(f['failures'])}; verify clean {f['verify_ok']}; "
          f"exactly the reachable objects {f['exactly_reachable']}")
    for p in f["problems"]:
        print(f"  problem: {p}")
    print(f"committed checkpoints that failed to load and loaded after `cas repair` (the cache lacked their "
          f"objects): {f.get('unloadable_until_repair', 0)}")
    for x in f["lost_detail"]:
        print(f"  {x}")
    print(f"committed checkpoints lost: {f['lost']}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        name, store, workdir, seed, max_steps = argv[1:6]
        if name in WRITERS:
            run_writer(name, store, workdir, int(seed), int(max_steps))
        elif name == "collider":
            run_collider(store, workdir, int(seed))
        else:
            run_gcloop(store, workdir, int(seed))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", required=True)
    p.add_argument("--workdir", help="journals and logs (default: STORE.soak)")
    p.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between kills")
    p.add_argument("--min-saves", type=int, default=0,
                   help="run past --seconds (up to 4x) until the writers journaled this many saves")
    p.add_argument("--check-every", type=float, default=150, help="seconds between full checks (0: only at the end)")
    p.add_argument("--max-steps", type=int, default=20000, help="steps per writer at most")
    p.add_argument("--no-index-deletions", dest="index_deletions", action="store_false",
                   help="the gc loop never deletes index/*.mdb (the paths of the two known bugs, see test_soak.py)")
    p.add_argument("--no-fresh", dest="fresh", action="store_false", help="keep an existing store and journals")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--key-file", help="an encrypted store, with the key this file holds (32 raw bytes or a "
                                      "passphrase); the gc loop also adds and removes keys")
    args = p.parse_args(argv)
    if args.key_file:  # the processes inherit both: the workers' stores, their CLI commands
        os.environ["SOAK_KEY_FILE"] = os.environ["CAS_KEY_FILE"] = os.path.abspath(args.key_file)
        STORE_OPTS.update(store_opts())
    soak = Soak(args)
    try:
        figures = soak.run()
    except BaseException:
        soak.stop_all()
        traceback.print_exc()
        return 2
    print_figures(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1, default=str)
    bad = figures["lost"] or figures.get("unloadable_until_repair") or figures["failures"] or not figures["verify_ok"] or not figures["exactly_reachable"] \
        or figures["collisions_committed"] or not figures["keys_ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
