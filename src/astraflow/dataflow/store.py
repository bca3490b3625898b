"""SQLite (WAL) persistence of the dataflow service: one transaction per acknowledged change.

``synchronous=NORMAL`` in WAL mode makes every commit durable against ``kill -9`` of the
process (the OS holds the written WAL); only a power loss can drop the last commits. Sample
payloads are stored once, as blobs (the msgpack of each sample, concatenated), apart from the
small rows whose state changes. A checkpointer thread with its own connection copies the WAL
into the database, so the writer never stalls on it.

    tasks        task_id → body, attempt, failures, state (pending|leased|done|failed), lease
    submissions  (task_id, attempt) → reply          idempotent submit
    groups       gid → policy, group_id, ..., state (buffered|served|acked), batch_id
    blobs        gid → packed samples                deleted once acked (unless kept for replay)
    batches      batch_id → policy, gids, deadline, state (open|acked|expired)
    versions     (policy, version) → manifest
    round_tasks  task_id → round                 sync mode: which round a task belongs to
    meta         plug-in states; counters; sync round; desired pool sizes; lease key  key → JSON
"""

from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

__all__ = ["BatchRow", "GroupRow", "Store", "TaskRow"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tasks(
  task_id TEXT PRIMARY KEY, source TEXT NOT NULL, body TEXT NOT NULL,
  attempt INTEGER NOT NULL, failures INTEGER NOT NULL, state TEXT NOT NULL,
  node_id TEXT, pool TEXT, deadline REAL, queued_at REAL NOT NULL, error TEXT);
CREATE INDEX IF NOT EXISTS tasks_open ON tasks(state) WHERE state IN ('pending', 'leased');
CREATE TABLE IF NOT EXISTS submissions(
  task_id TEXT NOT NULL, attempt INTEGER NOT NULL, reply TEXT NOT NULL,
  PRIMARY KEY(task_id, attempt)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS groups(
  gid INTEGER PRIMARY KEY, policy TEXT NOT NULL, group_id TEXT NOT NULL,
  task_id TEXT NOT NULL, source TEXT NOT NULL, num_samples INTEGER NOT NULL,
  num_tokens INTEGER NOT NULL, behaviour_version INTEGER NOT NULL, reward_mean REAL NOT NULL,
  reward_std REAL NOT NULL, created_at REAL NOT NULL, state TEXT NOT NULL, batch_id TEXT,
  times_served INTEGER NOT NULL, acked_at REAL);
CREATE TABLE IF NOT EXISTS blobs(gid INTEGER PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches(
  batch_id TEXT PRIMARY KEY, policy TEXT NOT NULL, trainer_id TEXT NOT NULL,
  trainer_version INTEGER NOT NULL, fresh TEXT NOT NULL, replay TEXT NOT NULL,
  deadline REAL NOT NULL, state TEXT NOT NULL, created_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS batches_open ON batches(state) WHERE state = 'open';
CREATE TABLE IF NOT EXISTS versions(
  policy TEXT NOT NULL, version INTEGER NOT NULL, manifest TEXT NOT NULL,
  created_at REAL NOT NULL, final INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY(policy, version)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS round_tasks(
  task_id TEXT PRIMARY KEY, round INTEGER NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS round_tasks_round ON round_tasks(round);
"""

SCHEMA_VERSION = "1"

#: How often the checkpointer thread copies committed WAL frames into the database.
CHECKPOINT_INTERVAL_S = 0.2
_BACKSTOP_PAGES = 4000  # 16 MiB of 4 KiB pages

log = logging.getLogger(__name__)


@dataclass
class TaskRow:
    """A task delivery's durable state."""

    task_id: str
    source: str
    body: str
    """The task as JSON (attempt 0)."""
    attempt: int
    failures: int
    state: str
    node_id: str | None
    pool: str | None
    deadline: float | None
    queued_at: float
    error: str | None = None


@dataclass
class GroupRow:
    """One group of one policy's samples (payload in ``blobs``)."""

    gid: int
    policy: str
    group_id: str
    task_id: str
    source: str
    num_samples: int
    num_tokens: int
    behaviour_version: int
    reward_mean: float
    reward_std: float
    created_at: float
    state: str
    batch_id: str | None
    times_served: int
    acked_at: float | None = None


@dataclass
class BatchRow:
    """A served batch: fresh groups (first serving) and replayed groups."""

    batch_id: str
    policy: str
    trainer_id: str
    trainer_version: int
    fresh: list[int]
    replay: list[int]
    deadline: float
    state: str
    created_at: float


class Store:
    """The service's SQLite database; every method runs inside :meth:`transaction`."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        # Python's bundled SQLite zeroes freed pages by default, which doubles the write cost
        # of dropping acked sample blobs; the data is local to the run directory anyway.
        self._db.execute("PRAGMA secure_delete=OFF")
        # the checkpointer thread copies the WAL into the database off the writer's path; this
        # is only the backstop should it fall behind
        self._db.execute(f"PRAGMA wal_autocheckpoint={_BACKSTOP_PAGES}")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(versions)")}
        if "final" not in columns:  # run directories made before final versions existed
            self._db.execute("ALTER TABLE versions ADD COLUMN final INTEGER NOT NULL DEFAULT 0")
        with self.transaction():
            if self.get_meta("schema") is None:
                self.set_meta("schema", SCHEMA_VERSION)
            if self.get_meta("lease_key") is None:  # signs lease secrets; kept across restarts
                self.set_meta("lease_key", secrets.token_hex(32))
        self._stop = threading.Event()
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, name="dataflow-checkpoint", daemon=True
        )
        self._checkpointer.start()

    def _checkpoint_loop(self) -> None:
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            while not self._stop.wait(CHECKPOINT_INTERVAL_S):
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error as exc:  # retried next interval; the backstop still holds
                    log.warning("wal checkpoint failed path=%s error=%s", self.path, exc)
        finally:
            db.close()

    def close(self) -> None:
        """Stop the checkpointer and close (committed state is on disk already); idempotent."""
        self._stop.set()
        self._checkpointer.join()
        self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic change: committed on exit, rolled back on an exception. Inside another
        it is a savepoint: its exception takes back its own changes only, and what it kept
        is committed with the outer transaction (or rolled back with it)."""
        if self._db.in_transaction:
            # one name at every depth: ROLLBACK TO and RELEASE act on the newest savepoint
            # of that name, which is this one
            self._db.execute("SAVEPOINT change")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK TO change")
                self._db.execute("RELEASE change")
                raise
            self._db.execute("RELEASE change")
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @property
    def in_transaction(self) -> bool:
        """A transaction is open (a change made now is part of it)."""
        return self._db.in_transaction

    # ------------------------------------------------------------------ meta

    def get_meta(self, key: str) -> Any:
        """The JSON value stored under ``key`` (None if absent)."""
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: Any) -> None:
        """Store a JSON value under ``key``."""
        self._db.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value, separators=(",", ":"))),
        )

    # ------------------------------------------------------------------ tasks

    def insert_tasks(self, rows: Iterable[TaskRow]) -> None:
        """Store new task deliveries."""
        self._db.executemany(
            "INSERT INTO tasks VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [tuple(vars(r).values()) for r in rows],  # astuple deep-copies: 0.5 ms a lease
        )

    def update_task(self, row: TaskRow) -> None:
        """Write back a task's mutable fields."""
        self._db.execute(
            "UPDATE tasks SET attempt = ?, failures = ?, state = ?, node_id = ?, pool = ?, "
            "deadline = ?, queued_at = ?, error = ? WHERE task_id = ?",
            (
                row.attempt, row.failures, row.state, row.node_id, row.pool,
                row.deadline, row.queued_at, row.error, row.task_id,
            ),
        )  # fmt: skip

    def renew_tasks(self, task_ids: Sequence[str], deadline: float) -> None:
        """Extend the deadline of leased tasks."""
        self._db.executemany(
            "UPDATE tasks SET deadline = ? WHERE task_id = ?", [(deadline, t) for t in task_ids]
        )

    def get_task(self, task_id: str) -> TaskRow | None:
        """One task, whatever its state."""
        row = self._db.execute("SELECT * FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
        return None if row is None else TaskRow(*row)

    def open_tasks(self) -> list[TaskRow]:
        """Pending and leased tasks, oldest queued first."""
        cur = self._db.execute(
            "SELECT * FROM tasks WHERE state IN ('pending', 'leased') ORDER BY queued_at, rowid"
        )
        return [TaskRow(*r) for r in cur]

    def task_counts(self) -> dict[str, int]:
        """Tasks per state."""
        cur = self._db.execute("SELECT state, COUNT(*) FROM tasks GROUP BY state")
        return {str(s): int(n) for s, n in cur}

    # ------------------------------------------------------------------ submissions

    def get_submission(self, task_id: str, attempt: int) -> str | None:
        """The stored reply of an accepted submission."""
        row = self._db.execute(
            "SELECT reply FROM submissions WHERE task_id = ? AND attempt = ?", (task_id, attempt)
        ).fetchone()
        return None if row is None else str(row[0])

    def insert_submission(self, task_id: str, attempt: int, reply: str) -> None:
        """Record an accepted submission and its reply."""
        self._db.execute("INSERT INTO submissions VALUES(?, ?, ?)", (task_id, attempt, reply))

    # ------------------------------------------------------------------ groups

    def insert_group(self, row: GroupRow, blob: bytes | memoryview) -> int:
        """Store a group and its samples; returns its gid."""
        values = (
            row.policy, row.group_id, row.task_id, row.source, row.num_samples, row.num_tokens,
            row.behaviour_version, row.reward_mean, row.reward_std, row.created_at, row.state,
            row.batch_id, row.times_served, row.acked_at,
        )  # fmt: skip
        cur = self._db.execute(
            "INSERT INTO groups(policy, group_id, task_id, source, num_samples, num_tokens, "
            "behaviour_version, reward_mean, reward_std, created_at, state, batch_id, "
            "times_served, acked_at) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            values,
        )
        gid = int(cur.lastrowid or 0)
        self._db.execute("INSERT INTO blobs VALUES(?, ?)", (gid, blob))
        return gid

    def set_groups(
        self, gids: Sequence[int], state: str, batch_id: str | None, acked_at: float | None = None
    ) -> None:
        """Move groups to ``state`` (and batch)."""
        self._db.executemany(
            "UPDATE groups SET state = ?, batch_id = ?, acked_at = COALESCE(?, acked_at) "
            "WHERE gid = ?",
            [(state, batch_id, acked_at, g) for g in gids],
        )

    def count_served(self, gids: Sequence[int]) -> None:
        """Add one to ``times_served`` of each group."""
        self._db.executemany(
            "UPDATE groups SET times_served = times_served + 1 WHERE gid = ?", [(g,) for g in gids]
        )

    def live_groups(self) -> list[GroupRow]:
        """Buffered and served groups, and acked groups whose samples are kept."""
        cur = self._db.execute(
            "SELECT * FROM groups WHERE state != 'acked' "
            "OR gid IN (SELECT gid FROM blobs) ORDER BY gid"
        )
        return [GroupRow(*r) for r in cur]

    def read_blobs(self, gids: Sequence[int]) -> dict[int, bytes]:
        """Sample payloads of groups."""
        out: dict[int, bytes] = {}
        for i in range(0, len(gids), 500):
            chunk = list(gids[i : i + 500])
            marks = ",".join("?" * len(chunk))
            cur = self._db.execute(f"SELECT gid, data FROM blobs WHERE gid IN ({marks})", chunk)
            out.update((int(g), bytes(d)) for g, d in cur)
        return out

    def delete_groups(self, gids: Sequence[int]) -> None:
        """Forget groups and their samples."""
        self._db.executemany("DELETE FROM blobs WHERE gid = ?", [(g,) for g in gids])
        self._db.executemany("DELETE FROM groups WHERE gid = ?", [(g,) for g in gids])

    # ------------------------------------------------------------------ batches

    def insert_batch(self, row: BatchRow) -> None:
        """Record a served batch."""
        values = list(astuple(row))
        values[4], values[5] = json.dumps(row.fresh), json.dumps(row.replay)
        self._db.execute("INSERT INTO batches VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?)", values)

    def set_batch_state(self, batch_id: str, state: str) -> None:
        """Mark a batch acked or expired."""
        self._db.execute("UPDATE batches SET state = ? WHERE batch_id = ?", (state, batch_id))

    def get_batch(self, batch_id: str) -> BatchRow | None:
        """One batch, whatever its state."""
        row = self._db.execute("SELECT * FROM batches WHERE batch_id = ?", (batch_id,)).fetchone()
        return None if row is None else _batch(row)

    def open_batches(self) -> list[BatchRow]:
        """Batches served and not yet acked or expired."""
        cur = self._db.execute("SELECT * FROM batches WHERE state = 'open' ORDER BY created_at")
        return [_batch(r) for r in cur]

    # ------------------------------------------------------------------ versions

    def insert_version(
        self, policy: str, version: int, manifest: str, created_at: float, final: bool = False
    ) -> None:
        """Record an announced version (again with ``final`` set, when a trainer finishes)."""
        self._db.execute(
            "INSERT OR REPLACE INTO versions VALUES(?, ?, ?, ?, ?)",
            (policy, version, manifest, created_at, int(final)),
        )

    def latest_versions(self) -> dict[str, tuple[int, str, float, bool]]:
        """Highest announced version per policy: (version, manifest, created_at, final)."""
        cur = self._db.execute(
            "SELECT policy, version, manifest, created_at, final FROM versions v WHERE version = "
            "(SELECT MAX(version) FROM versions w WHERE w.policy = v.policy)"
        )
        return {str(p): (int(v), str(m), float(t), bool(f)) for p, v, m, t, f in cur}

    # ------------------------------------------------------------------ sync rounds

    def set_round(self, task_ids: Iterable[str], round_: int) -> None:
        """Make tasks members of round ``round_`` (new members, or carried over)."""
        self._db.executemany(
            "INSERT INTO round_tasks VALUES(?, ?) ON CONFLICT(task_id) DO UPDATE SET "
            "round = excluded.round",
            [(t, round_) for t in task_ids],
        )

    def round_tasks(self, round_: int) -> list[str]:
        """Task ids of round ``round_``."""
        cur = self._db.execute("SELECT task_id FROM round_tasks WHERE round = ?", (round_,))
        return [str(r[0]) for r in cur]


def _batch(row: Sequence[Any]) -> BatchRow:
    values = list(row)
    values[4], values[5] = json.loads(values[4]), json.loads(values[5])
    return BatchRow(*values)
