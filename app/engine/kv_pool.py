"""The node-local KV pool: blocks in shared memory, safe across processes.

Layout under ``path`` (normally a folder in /dev/shm):
  index.sqlite     the index (WAL): one row per block, leases, fan-out pins, counters
  blocks/<k[:2]>/<key>   the block's bytes, written to tmp/ then renamed into place (atomic)

Why this shape: the producer's and consumers' workers and schedulers are separate processes
(several engines, several replicas). sqlite gives cross-process transactions with file locks;
renamed files are never seen half written; a crc32 per block catches damage.

Lifetime: the pool holds at most ``capacity_bytes``; it evicts least recently used blocks,
but never a block that a reader has leased (looked up, not yet loaded) or that a fan-out
still pins (a producer's save with ``pins=N`` stays until N consumers loaded it), unless
that lease or pin is older than ``lease_timeout_s``.

Counters (hits, misses, evictions, bytes moved, load time, fallbacks by reason) live in the
same index, per ``scope`` (an engine label), so any process can read them with ``stats()``.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["KVPool", "BlockEntry", "PoolStats", "BlockDamaged", "BlockMissing", "PutItem"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
  key TEXT PRIMARY KEY, nbytes INTEGER NOT NULL, ntokens INTEGER NOT NULL,
  checksum INTEGER NOT NULL, layout TEXT NOT NULL, created REAL NOT NULL,
  last_used REAL NOT NULL, pins INTEGER NOT NULL DEFAULT 0, pin_deadline REAL NOT NULL DEFAULT 0,
  depth INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS blocks_lru ON blocks(last_used);
CREATE TABLE IF NOT EXISTS leases (lease TEXT NOT NULL, key TEXT NOT NULL, deadline REAL NOT NULL,
  PRIMARY KEY (lease, key));
CREATE INDEX IF NOT EXISTS leases_key ON leases(key);
CREATE TABLE IF NOT EXISTS counters (scope TEXT NOT NULL, name TEXT NOT NULL, value REAL NOT NULL,
  PRIMARY KEY (scope, name));
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class BlockMissing(KeyError):
    """The block is not (or no longer) in the pool."""


class BlockDamaged(ValueError):
    """The block's bytes do not match its checksum (or its recorded size)."""


@dataclass(frozen=True)
class BlockEntry:
    """Index row of one stored block."""

    key: str
    nbytes: int
    ntokens: int
    checksum: int
    layout: str


@dataclass(frozen=True)
class PutItem:
    """One block to store: its key, its bytes (buffer protocol) and what they describe."""

    key: str
    data: object  # bytes, bytearray, memoryview, numpy array (C-contiguous)
    ntokens: int
    layout: str
    depth: int = 0  # block index in its chain: eviction takes deeper blocks first


@dataclass
class PoolStats:
    """Snapshot of the pool and its counters (summed over scopes unless one was asked)."""

    capacity_bytes: int
    bytes_held: int
    blocks: int
    pinned_blocks: int
    counters: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.counters.get(name, 0.0)

    @property
    def load_seconds_per_token(self) -> float:
        toks = self.get("load_tokens")
        return self.get("load_seconds") / toks if toks else 0.0

    @property
    def fallbacks(self) -> dict[str, float]:
        return {k.split(":", 1)[1]: v for k, v in self.counters.items() if k.startswith("fallback:")}


class KVPool:
    """A byte-capacity LRU store of KV blocks shared by every process on the node."""

    def __init__(self, path: str, capacity_bytes: int | None = None, lease_timeout_s: float = 60.0):
        """Open (creating if needed) the pool at ``path``.

        ``capacity_bytes`` is a property of the pool, kept in its index: given, it is (re)set;
        None keeps the stored value (1 GiB for a new pool).
        """
        if not path:
            raise ValueError("KVPool path is required")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError("KVPool capacity_bytes must be > 0")
        if lease_timeout_s <= 0:
            raise ValueError("KVPool lease_timeout_s must be > 0")
        self.path = os.path.abspath(path)
        self.lease_timeout_s = float(lease_timeout_s)
        os.makedirs(os.path.join(self.path, "blocks"), exist_ok=True)
        os.makedirs(os.path.join(self.path, "tmp"), exist_ok=True)
        self._local = threading.local()
        # executescript commits implicitly, so it runs outside _tx; every statement is idempotent.
        self._db().executescript(_SCHEMA)
        if capacity_bytes is not None:
            self.set_capacity(capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        r = self._db().execute("SELECT value FROM meta WHERE name = 'capacity_bytes'").fetchone()
        return int(r[0]) if r else 1 << 30

    def set_capacity(self, capacity_bytes: int) -> None:
        """Change the byte capacity; later saves evict down to it."""
        if capacity_bytes <= 0:
            raise ValueError("KVPool capacity_bytes must be > 0")
        with self._tx() as db:
            db.execute("INSERT INTO meta(name, value) VALUES ('capacity_bytes', ?)"
                       " ON CONFLICT(name) DO UPDATE SET value = excluded.value", (str(int(capacity_bytes)),))

    # -- plumbing ---------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None or getattr(self._local, "pid", None) != os.getpid():
            db = sqlite3.connect(os.path.join(self.path, "index.sqlite"), timeout=60.0,
                                 isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=OFF")
            self._local.db = db
            self._local.pid = os.getpid()
        return db

    @contextlib.contextmanager
    def _tx(self):
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        else:
            db.execute("COMMIT")

    def _file(self, key: str) -> str:
        if len(key) < 8 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"KVPool: malformed block key {key!r}")
        return os.path.join(self.path, "blocks", key[:2], key)

    # -- writes -----------------------------------------------------------------------------
    def put_many(self, items: Sequence[PutItem], pins: int = 0, scope: str = "") -> list[bool]:
        """Store blocks (skipping keys already held, whose pins grow by ``pins``).

        Returns, per item, whether the block is in the pool afterwards. Items that do not fit
        (everything else pinned or leased) are dropped and counted; never raises for space.
        """
        now = time.time()
        deadline = now + self.lease_timeout_s if pins > 0 else 0.0
        keys = [it.key for it in items]
        for k in keys:
            self._file(k)
        with self._tx() as db:
            held = self._existing(db, keys)
            if held and pins > 0:
                db.executemany(
                    "UPDATE blocks SET pins = CASE WHEN pin_deadline < ? THEN ? ELSE pins + ? END,"
                    " pin_deadline = ?, last_used = ? WHERE key = ?",
                    [(now, pins, pins, deadline, now, k) for k in held])
            elif held:
                db.executemany("UPDATE blocks SET last_used = ? WHERE key = ?", [(now, k) for k in held])
        todo = [it for it in items if it.key not in held]
        written: list[tuple[PutItem, int, int]] = []
        cap = self.capacity_bytes
        for it in todo:
            mv = memoryview(it.data).cast("B")
            n = mv.nbytes
            if n > cap:
                continue
            crc = zlib.crc32(mv)
            tmp = os.path.join(self.path, "tmp", f"{it.key}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
            with open(tmp, "wb") as f:
                f.write(mv)
            final = self._file(it.key)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(tmp, final)
            written.append((it, n, crc))
        stored: set[str] = set(held)
        evicted_files: list[str] = []
        with self._tx() as db:
            full = False
            for it, n, crc in written:
                if self._existing(db, [it.key]):  # another writer won the race: same content
                    stored.add(it.key)
                    continue
                # Blocks of this put never evict each other, and once one does not fit the rest
                # of the chain is dropped too (a chain with a hole is useless to a decoder).
                victims = None if full else self._make_room(db, n, now, protect=stored)
                if victims is None:
                    full = True
                    self._bump(db, scope, {"dropped_blocks": 1})
                    continue
                evicted_files.extend(victims)
                db.execute(
                    "INSERT INTO blocks(key, nbytes, ntokens, checksum, layout, created, last_used,"
                    " pins, pin_deadline, depth) VALUES (?,?,?,?,?,?,?,?,?,?)",
                    (it.key, n, it.ntokens, crc, it.layout, now, now, pins, deadline, it.depth))
                stored.add(it.key)
                self._bump(db, scope, {"saved_blocks": 1, "saved_bytes": n})
        for it, _, _ in written:
            if it.key not in stored:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._file(it.key))
        for f in evicted_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)
        return [it.key in stored for it in items]

    @staticmethod
    def _existing(db: sqlite3.Connection, keys: Sequence[str]) -> set[str]:
        out: set[str] = set()
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            q = f"SELECT key FROM blocks WHERE key IN ({','.join('?' * len(chunk))})"
            out.update(r[0] for r in db.execute(q, chunk))
        return out

    def _make_room(self, db: sqlite3.Connection, nbytes: int, now: float,
                   protect: set[str] = frozenset()) -> list[str] | None:
        """Evict LRU blocks (not pinned, not leased, not in ``protect``) until ``nbytes`` fit.

        Among equally recent blocks the deepest go first, so a chain shrinks from its tail and
        its prefix stays usable. Returns the files to unlink, or None if it cannot fit.
        """
        held = db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM blocks").fetchone()[0]
        cap = db.execute("SELECT value FROM meta WHERE name = 'capacity_bytes'").fetchone()
        need = held + nbytes - (int(cap[0]) if cap else 1 << 30)
        if need <= 0:
            return []
        rows = db.execute(
            "SELECT b.key, b.nbytes FROM blocks b WHERE (b.pins <= 0 OR b.pin_deadline < ?)"
            " AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.key = b.key AND l.deadline >= ?)"
            " ORDER BY b.last_used, b.depth DESC", (now, now)).fetchall()
        victims, freed = [], 0
        for key, n in rows:
            if freed >= need:
                break
            if key in protect:
                continue
            victims.append(key)
            freed += n
        if freed < need:
            return None
        db.executemany("DELETE FROM blocks WHERE key = ?", [(k,) for k in victims])
        db.executemany("DELETE FROM leases WHERE key = ?", [(k,) for k in victims])
        self._bump(db, "", {"evictions": len(victims), "evicted_bytes": freed})
        return [self._file(k) for k in victims]

    # -- reads ------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[str], lease_s: float | None = None) -> tuple[list[BlockEntry], str | None]:
        """Longest leading run of ``keys`` held; leases that run (protects it from eviction).

        Returns (entries, lease id or None when nothing matched). Release the lease with
        :meth:`release` once the blocks are loaded (or given up).
        """
        now = time.time()
        lease = None
        with self._tx() as db:
            entries: list[BlockEntry] = []
            for k in keys:
                r = db.execute("SELECT key, nbytes, ntokens, checksum, layout FROM blocks WHERE key = ?",
                               (k,)).fetchone()
                if r is None:
                    break
                entries.append(BlockEntry(*r))
            if entries:
                lease = uuid.uuid4().hex
                dl = now + (lease_s or self.lease_timeout_s)
                db.executemany("INSERT INTO leases(lease, key, deadline) VALUES (?,?,?)",
                               [(lease, e.key, dl) for e in entries])
                db.executemany("UPDATE blocks SET last_used = ? WHERE key = ?", [(now, e.key) for e in entries])
        return entries, lease

    def read(self, entry: BlockEntry) -> bytearray:
        """The block's bytes, checked against its size and checksum."""
        buf = bytearray(entry.nbytes)
        try:
            with open(self._file(entry.key), "rb", buffering=0) as f:
                got = f.readinto(buf)
                extra = f.read(1)
        except FileNotFoundError as e:
            raise BlockMissing(entry.key) from e
        if got != entry.nbytes or extra:
            raise BlockDamaged(f"block {entry.key[:12]}: size differs from the index")
        if zlib.crc32(buf) != entry.checksum:
            raise BlockDamaged(f"block {entry.key[:12]}: checksum mismatch")
        return buf

    def release(self, lease: str | None, consumed: Iterable[str] = ()) -> None:
        """End a lookup's lease; each key in ``consumed`` was loaded once (fan-out pin -1)."""
        consumed = list(consumed)
        if lease is None and not consumed:
            return
        with self._tx() as db:
            if lease is not None:
                db.execute("DELETE FROM leases WHERE lease = ?", (lease,))
            if consumed:
                db.executemany("UPDATE blocks SET pins = MAX(pins - 1, 0) WHERE key = ?",
                               [(k,) for k in consumed])

    def discard(self, keys: Iterable[str]) -> None:
        """Drop blocks found damaged, so the next producer save replaces them."""
        keys = list(keys)
        with self._tx() as db:
            db.executemany("DELETE FROM blocks WHERE key = ?", [(k,) for k in keys])
        for k in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file(k))

    # -- counters ---------------------------------------------------------------------------
    @staticmethod
    def _bump(db: sqlite3.Connection, scope: str, deltas: dict[str, float]) -> None:
        db.executemany(
            "INSERT INTO counters(scope, name, value) VALUES (?,?,?)"
            " ON CONFLICT(scope, name) DO UPDATE SET value = value + excluded.value",
            [(scope, k, float(v)) for k, v in deltas.items() if v])

    def count(self, scope: str = "", **deltas: float) -> None:
        """Add to named counters (fallback reasons go as ``fallback:<reason>``)."""
        self.count_map(scope, deltas)

    def count_map(self, scope: str, deltas: dict[str, float]) -> None:
        if not any(deltas.values()):
            return
        with self._tx() as db:
            self._bump(db, scope, deltas)

    def stats(self, scope: str | None = None) -> PoolStats:
        """Current holdings and counters; ``scope`` limits counters to one engine label."""
        db = self._db()
        now = time.time()
        held, n = db.execute("SELECT COALESCE(SUM(nbytes),0), COUNT(*) FROM blocks").fetchone()
        pinned = db.execute("SELECT COUNT(*) FROM blocks WHERE pins > 0 AND pin_deadline >= ?",
                            (now,)).fetchone()[0]
        if scope is None:
            rows = db.execute("SELECT name, SUM(value) FROM counters GROUP BY name").fetchall()
        else:
            rows = db.execute("SELECT name, value FROM counters WHERE scope = ?", (scope,)).fetchall()
        return PoolStats(self.capacity_bytes, int(held), int(n), int(pinned), {k: v for k, v in rows})

    def scopes(self) -> list[str]:
        return [r[0] for r in self._db().execute("SELECT DISTINCT scope FROM counters")]

    def entry(self, key: str) -> BlockEntry | None:
        r = self._db().execute("SELECT key, nbytes, ntokens, checksum, layout FROM blocks WHERE key = ?",
                               (key,)).fetchone()
        return BlockEntry(*r) if r else None

    def pins(self, key: str) -> int:
        """Live fan-out pins of a block (0 when absent or its pin deadline passed)."""
        r = self._db().execute("SELECT pins, pin_deadline FROM blocks WHERE key = ?", (key,)).fetchone()
        return int(r[0]) if r and r[1] >= time.time() else 0

    def block_path(self, key: str) -> str:
        """Where a block's bytes live (for transports that map the file)."""
        return self._file(key)
