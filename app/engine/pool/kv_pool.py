"""The node-local KV pool: one shared-memory slab of fixed-size slots, and an index over it.

Layout under ``path`` (normally a folder in /dev/shm):
  slab-index.sqlite       the index (WAL): key -> slot, leases, fan-out pins, LRU, counters
  slab-<B>.data           the slots of blocks of B bytes, one after another (zero-copy views)
  slab-<B>.gen            per slot a 16-byte header: generation (u64), crc32 (u32)
  users.lock, open.lock   who owns the pool (prefillshare.app.engine.pool.pool_owner)

Why this shape: every engine process on the node (producer and decoders, schedulers and
workers) maps the same slab and copies blocks straight between it and its paged KV cache,
batched (:mod:`prefillshare.app.engine.cpu_layout`); the sqlite index gives cross-process transactions,
one per request per side. A slab exists per block size (normally one: every engine of a node
shares the base's layout), created when the first block of that size is saved.

Integrity without hashing every byte: each slot carries a generation (a seqlock). A writer
sets it odd, writes, then sets the even value the index expects; a reader reads it before
and after its copy and accepts the bytes only if both equal the index's value. So a slot
evicted and reused while a reader copies, or one whose writer died half way, is detected
(``SlotReused`` / ``SlotTorn``), never loaded. ``check="crc32"`` adds a crc per slot
(written with it, verified on every read): a debugging and test mode, off the hot path.

Lifetime of the pool itself: its owners are the processes that have it open; the last one to
close it removes it, and a start that finds no live owner reclaims it (:mod:`prefillshare.app.engine.pool.pool_owner`).

Lifetime of blocks: at most ``capacity_bytes`` of blocks; LRU eviction (deepest block of a chain
first), never a block a reader leased or a fan-out still pins (``pins=N``: N decoders load
it), unless that lease or pin is older than ``lease_timeout_s``.

Counters (hits, misses, evictions, bytes moved, seconds, fallbacks by reason) accumulate in
memory per process and are written with that process's next index transaction (or
:meth:`KVPool.flush`), per ``scope`` (an engine label); any process reads them with
:meth:`KVPool.stats`. This module imports torch only for tensor views (the metrics endpoint
reads stats without it).
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from prefillshare.app.config import PoolConfig, default
from prefillshare.app.engine.pool.pool_owner import PoolHold
from prefillshare.app.engine.pool.slab import Slab, SlotOutOfRange
from prefillshare.app.errors import PrefillShareLibraryError

__all__ = ["KVPool", "PoolSpec", "BlockEntry", "PoolStats", "BlockDamaged", "BlockMissing", "PoolMissing",
           "SlotReused", "SlotTorn", "Reservation", "DEFAULT_CAPACITY_BYTES", "MISSING"]

DEFAULT_CAPACITY_BYTES = default(PoolConfig, "capacity_bytes")  # pool.capacity_bytes's (app/config.py)
_INDEX = "slab-index.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
  key TEXT PRIMARY KEY, slab INTEGER NOT NULL, slot INTEGER NOT NULL, gen INTEGER NOT NULL,
  nbytes INTEGER NOT NULL, ntokens INTEGER NOT NULL, layout TEXT NOT NULL, created REAL NOT NULL,
  last_used REAL NOT NULL, pins INTEGER NOT NULL DEFAULT 0, pin_deadline REAL NOT NULL DEFAULT 0,
  depth INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS blocks_lru ON blocks(last_used);
CREATE TABLE IF NOT EXISTS slabs (slot_bytes INTEGER PRIMARY KEY, nslots INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS slots (slab INTEGER NOT NULL, slot INTEGER NOT NULL, gen INTEGER NOT NULL,
  used INTEGER NOT NULL, PRIMARY KEY (slab, slot));
CREATE INDEX IF NOT EXISTS slots_free ON slots(slab, used, slot);
CREATE TABLE IF NOT EXISTS leases (lease TEXT NOT NULL, key TEXT NOT NULL, deadline REAL NOT NULL,
  PRIMARY KEY (lease, key));
CREATE INDEX IF NOT EXISTS leases_key ON leases(key);
CREATE TABLE IF NOT EXISTS counters (scope TEXT NOT NULL, name TEXT NOT NULL, value REAL NOT NULL,
  PRIMARY KEY (scope, name));
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class BlockMissing(PrefillShareLibraryError, KeyError):
    """The block is not (or no longer) in the pool."""


MISSING = (BlockMissing, SlotOutOfRange)  # what a read of a block that is gone raises


class SlotReused(BlockMissing):
    """The block's slot was evicted and reused (its generation changed) before or during a copy."""


class BlockDamaged(PrefillShareLibraryError, ValueError):
    """The block's bytes are not what was written (crc32 mismatch in check mode)."""


class SlotTorn(BlockDamaged):
    """The slot's writer has not finished (or died mid-write): its generation is odd."""


class PoolMissing(PrefillShareLibraryError, FileNotFoundError):
    """:meth:`KVPool.attach` found no pool at the path (no engine has created it yet)."""


@dataclass(frozen=True)
class PoolSpec:
    """The one pool configuration, from ``serve_config.yaml`` (prefillshare.app.config.PoolConfig) to the pool.

    Validated here, once; it crosses vLLM's connector config as ``dataclasses.asdict`` and is
    rebuilt with ``PoolSpec(**d)`` (an unknown field is a TypeError). Its defaults are the ``pool``
    settings' (app/config.py), read from there.
    ``capacity_bytes`` is a property of the pool: the process that creates it writes it to the
    index; later openers use the stored value (:meth:`KVPool.set_capacity` changes it).
    """

    path: str  # directory, normally under /dev/shm
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES
    lease_timeout_s: float = default(PoolConfig, "lease_timeout_s")  # fan-out pins and readers' leases expire after this
    check: Literal["off", "crc32"] = default(PoolConfig, "check")  # crc32: checksum every slot (tests, debugging)
    persist: bool = default(PoolConfig, "persist")  # keep the pool when its last owner closes (prefillshare.app.engine.pool.pool_owner)

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("PoolSpec.path is required")
        if int(self.capacity_bytes) <= 0:
            raise ValueError("PoolSpec.capacity_bytes must be > 0")
        if self.lease_timeout_s <= 0:
            raise ValueError("PoolSpec.lease_timeout_s must be > 0")
        if self.check not in ("off", "crc32"):
            raise ValueError(f"PoolSpec.check: {self.check!r} is not 'off' or 'crc32'")


@dataclass(frozen=True)
class BlockEntry:
    """Index row of one stored block: where its bytes are and what generation they must carry."""

    key: str
    slab: int  # slot size in bytes (names the slab)
    slot: int
    gen: int
    nbytes: int
    ntokens: int
    layout: str


@dataclass
class Reservation:
    """Slots a writer owns until :meth:`KVPool.publish`: ``entries[i]`` is ``keys[i]``'s new slot,
    or None where the key was held already (or did not fit: then ``stored[i]`` is False)."""

    entries: list[BlockEntry | None]
    stored: list[bool]

    @property
    def new(self) -> list[BlockEntry]:
        return [e for e in self.entries if e is not None]


@dataclass
class PoolStats:
    """Snapshot of the pool and its counters (summed over scopes unless one was asked)."""

    capacity_bytes: int
    bytes_held: int
    blocks: int
    pinned_blocks: int
    counters: dict[str, float] = field(default_factory=dict)
    slot_bytes: tuple[int, ...] = ()

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
    """A byte-capacity LRU store of KV blocks in shared slots, used by every process on the node."""


    def __init__(self, spec: PoolSpec, *, create: bool = True):
        """Open the pool ``spec`` names; a new one (``create``) gets ``spec.capacity_bytes``."""
        self.spec = spec
        self.path = os.path.abspath(spec.path)
        self.lease_timeout_s = float(spec.lease_timeout_s)
        self.check = spec.check
        if not create and not os.path.exists(os.path.join(self.path, _INDEX)):
            raise PoolMissing(f"no KV pool at {self.path}")
        # an owner's hold (released by close(), at the latest at exit); readers take none
        hold = PoolHold.take(self.path, spec.persist) if create else None
        self._release = weakref.finalize(self, hold.release) if hold else None
        self._local = threading.local()
        self._slabs: dict[int, Slab] = {}
        self._slab_lock = threading.Lock()
        self._pending: dict[tuple[str, str], float] = {}
        self._pending_lock = threading.Lock()
        self._flusher: threading.Timer | None = None
        # executescript commits implicitly, so it runs outside _tx; every statement is idempotent.
        self._db().executescript(_SCHEMA)
        if create:
            with self._tx() as db:  # the first opener's capacity is the pool's; others keep it
                db.execute("INSERT OR IGNORE INTO meta(name, value) VALUES ('capacity_bytes', ?)",
                           (str(int(spec.capacity_bytes)),))

    @classmethod
    def attach(cls, path: str) -> KVPool:
        """A reader's handle on an existing pool (metrics, tools): never creates one (PoolMissing)."""
        return cls(PoolSpec(path=path), create=False)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity(self._db())

    @staticmethod
    def _capacity(db: sqlite3.Connection) -> int:
        r = db.execute("SELECT value FROM meta WHERE name = 'capacity_bytes'").fetchone()
        return int(r[0]) if r else 0  # only while its creator is between the schema and this row

    def set_capacity(self, capacity_bytes: int) -> None:
        """Change the byte capacity (slabs grow to it; a smaller one is enforced on later saves)."""
        if capacity_bytes <= 0:
            raise ValueError("KVPool capacity_bytes must be > 0")
        with self._tx() as db:
            db.execute("INSERT INTO meta(name, value) VALUES ('capacity_bytes', ?)"
                       " ON CONFLICT(name) DO UPDATE SET value = excluded.value", (str(int(capacity_bytes)),))
            for sb, n in db.execute("SELECT slot_bytes, nslots FROM slabs").fetchall():
                self._grow(db, sb, n, capacity_bytes // sb)

    # -- plumbing ---------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None or getattr(self._local, "pid", None) != os.getpid():
            db = sqlite3.connect(os.path.join(self.path, _INDEX), timeout=60.0,
                                 isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=OFF")
            self._local.db = db
            self._local.pid = os.getpid()
        return db

    @contextlib.contextmanager
    def _tx(self):
        """A write transaction; it also writes this process's pending counters."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            with self._pending_lock:
                pending, self._pending = self._pending, {}
            try:
                self._write_counters(db, pending)
            except BaseException:
                self._merge_pending(pending)
                raise
        except BaseException:
            db.execute("ROLLBACK")
            raise
        else:
            db.execute("COMMIT")

    def _merge_pending(self, pending: dict[tuple[str, str], float]) -> None:
        with self._pending_lock:
            for k, v in pending.items():
                self._pending[k] = self._pending.get(k, 0.0) + v

    def slab(self, slot_bytes: int) -> Slab:
        """This process's mapping of the slab for blocks of ``slot_bytes`` (SlotOutOfRange if it does not exist)."""
        s = self._slabs.get(slot_bytes)
        if s is None:
            with self._slab_lock:
                s = self._slabs.get(slot_bytes)
                if s is None:
                    s = self._slabs[slot_bytes] = Slab(self.path, slot_bytes)
        return s

    def _grow(self, db: sqlite3.Connection, slot_bytes: int, have: int, want: int) -> None:
        if want <= have:
            return
        Slab.create(self.path, slot_bytes, want)
        db.executemany("INSERT OR IGNORE INTO slots(slab, slot, gen, used) VALUES (?,?,0,0)",
                       [(slot_bytes, i) for i in range(have, want)])
        db.execute("INSERT INTO slabs(slot_bytes, nslots) VALUES (?,?) ON CONFLICT(slot_bytes)"
                   " DO UPDATE SET nslots = excluded.nslots", (slot_bytes, want))

    @staticmethod
    def _check_key(key: str) -> None:
        if len(key) < 8 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"KVPool: malformed block key {key!r}")

    # -- writes -----------------------------------------------------------------------------
    def reserve(self, keys: Sequence[str], nbytes: int, ntokens: Sequence[int], layout: str, pins: int = 0,
                scope: str = "", depth0: int = 0, depths: Sequence[int] | None = None) -> Reservation:
        """Slots for a chain of blocks of ``nbytes`` each, in one index transaction.

        Keys already held only gain ``pins`` (fan-out) and recency. New keys get a slot whose
        index row already names the generation the writer will publish; readers treat the slot
        as absent until :meth:`publish`. Blocks that do not fit (everything else pinned or
        leased) are dropped from the first one that does not on (a chain with a hole is useless)
        and counted; never raises for space. Depths (eviction order within a chain) are
        ``depth0 + i`` unless ``depths`` gives them.
        """
        for k in keys:
            self._check_key(k)
        if len(ntokens) != len(keys):
            raise ValueError("KVPool.reserve: one ntokens per key")
        now = time.time()
        deadline = now + self.lease_timeout_s if pins > 0 else 0.0
        entries: list[BlockEntry | None] = [None] * len(keys)
        stored = [False] * len(keys)
        with self._tx() as db:
            held = self._existing(db, keys)
            if held and pins > 0:
                db.executemany(
                    "UPDATE blocks SET pins = CASE WHEN pin_deadline < ? THEN ? ELSE pins + ? END,"
                    " pin_deadline = ?, last_used = ? WHERE key = ?",
                    [(now, pins, pins, deadline, now, k) for k in held])
            elif held:
                db.executemany("UPDATE blocks SET last_used = ? WHERE key = ?", [(now, k) for k in held])
            todo = [i for i, k in enumerate(keys) if k not in held]
            for i, k in enumerate(keys):
                stored[i] = k in held
            if todo:
                cap = self._capacity(db)
                row = db.execute("SELECT nslots FROM slabs WHERE slot_bytes = ?", (nbytes,)).fetchone()
                if row is None:
                    self._grow(db, nbytes, 0, cap // nbytes)
                    nslots = cap // nbytes
                else:
                    nslots = row[0]
                fit = self._make_room(db, nbytes, len(todo), cap, now, protect=held) if nslots else 0
                if fit < len(todo):
                    self._bump(db, scope, {"dropped_blocks": len(todo) - fit})
                todo = todo[:fit]
                if todo:
                    free = db.execute("SELECT slot, gen FROM slots WHERE slab = ? AND used = 0 ORDER BY slot LIMIT ?",
                                      (nbytes, len(todo))).fetchall()
                    rows = []
                    for i, (slot, gen) in zip(todo, free, strict=True):
                        e = BlockEntry(keys[i], nbytes, slot, gen + 2, nbytes, int(ntokens[i]), layout)
                        entries[i] = e
                        stored[i] = True
                        rows.append((e.key, nbytes, slot, e.gen, nbytes, e.ntokens, layout, now, now, pins,
                                     deadline, depths[i] if depths is not None else depth0 + i))
                    db.executemany("UPDATE slots SET used = 1, gen = ? WHERE slab = ? AND slot = ?",
                                   [(r[3], nbytes, r[2]) for r in rows])
                    db.executemany(
                        "INSERT INTO blocks(key, slab, slot, gen, nbytes, ntokens, layout, created, last_used,"
                        " pins, pin_deadline, depth) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
                    self._add_held(db, nbytes * len(rows))
                    self._bump(db, scope, {"saved_blocks": len(rows), "saved_bytes": nbytes * len(rows)})
        res = Reservation(entries, stored)
        if res.new:
            slab = self.slab(nbytes)
            for e in res.new:
                slab.ensure(e.slot)
                slab.set_gen(e.slot, e.gen - 1)  # odd: being written
        return res

    def publish(self, res: Reservation) -> None:
        """The reserved slots are written: make them readable (memory stores, no transaction)."""
        for e in res.new:
            slab = self.slab(e.slab)
            if slab.gen(e.slot) != e.gen - 1:
                continue  # the slot was taken from us (our writer outlived lease_timeout_s): not ours to publish
            if self.check == "crc32":
                slab.set_crc(e.slot, zlib.crc32(slab.view(e.slot, e.nbytes)))
            slab.set_gen(e.slot, e.gen)

    @staticmethod
    def _existing(db: sqlite3.Connection, keys: Sequence[str]) -> set[str]:
        out: set[str] = set()
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            q = f"SELECT key FROM blocks WHERE key IN ({','.join('?' * len(chunk))})"
            out.update(r[0] for r in db.execute(q, chunk))
        return out

    @staticmethod
    def _held(db: sqlite3.Connection) -> int:
        r = db.execute("SELECT value FROM meta WHERE name = 'held_bytes'").fetchone()
        return int(r[0]) if r else 0

    @staticmethod
    def _add_held(db: sqlite3.Connection, delta: int) -> None:
        db.execute("INSERT INTO meta(name, value) VALUES ('held_bytes', ?) ON CONFLICT(name)"
                   " DO UPDATE SET value = CAST(value AS INTEGER) + ?", (str(delta), delta))

    def _make_room(self, db: sqlite3.Connection, nbytes: int, count: int, cap: int, now: float,
                   protect: frozenset[str] | set[str] = frozenset()) -> int:
        """Evict LRU blocks (not pinned, not leased, not in ``protect``) so that as many of
        ``count`` new blocks of ``nbytes`` as possible fit (byte budget and free slots of their
        slab); returns how many fit. Among equally recent blocks the deepest go first, so a
        chain shrinks from its tail and its prefix stays usable.
        """
        held = self._held(db)
        free = db.execute("SELECT COUNT(*) FROM slots WHERE slab = ? AND used = 0", (nbytes,)).fetchone()[0]

        def fits(held_b: int, free_s: int) -> int:
            return max(0, min(count, free_s, (cap - held_b) // nbytes))

        if fits(held, free) == count:
            return count
        expired = db.execute("DELETE FROM leases WHERE deadline < ?", (now,)).rowcount
        if expired > 0:  # a reader that died (or gave up) holding them
            self._bump(db, "", {"expired_leases": expired})
        rows = db.execute(
            "SELECT b.key, b.slab, b.slot, b.nbytes, b.gen, b.created, b.pins FROM blocks b"
            " WHERE (b.pins <= 0 OR b.pin_deadline < ?)"
            " AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.key = b.key AND l.deadline >= ?)"
            " ORDER BY b.last_used, b.depth DESC", (now, now)).fetchall()
        # Simulate first: evict only what the number of blocks that can fit needs.
        best, h, f, steps = fits(held, free), held, free, []
        for key, slab, slot, n, gen, created, pins in rows:
            if key in protect:
                continue
            if created >= now - self.lease_timeout_s and self._writing(slab, slot, gen):
                continue  # its writer is still at work: reusing the slot would mix two writers' bytes
            h -= n
            f += slab == nbytes
            steps.append((key, slab, slot, n, pins))
            best = max(best, fits(h, f))
            if best == count:
                break
        target = best
        victims, h, f = [], held, free
        for v in steps:
            if fits(h, f) >= target:
                break
            victims.append(v)
            h -= v[3]
            f += v[1] == nbytes
        if victims:
            db.executemany("DELETE FROM blocks WHERE key = ?", [(v[0],) for v in victims])
            db.executemany("DELETE FROM leases WHERE key = ?", [(v[0],) for v in victims])
            db.executemany("UPDATE slots SET used = 0 WHERE slab = ? AND slot = ?", [(v[1], v[2]) for v in victims])
            freed = sum(v[3] for v in victims)
            self._add_held(db, -freed)
            self._bump(db, "", {"evictions": len(victims), "evicted_bytes": freed,
                                "expired_pins": sum(1 for v in victims if v[4] > 0)})
        return target

    def _writing(self, slot_bytes: int, slot: int, gen: int) -> bool:
        """Whether the slot is reserved for ``gen`` but not yet published."""
        try:
            slab = self.slab(slot_bytes)
            slab.ensure(slot)
        except MISSING:
            return False
        return slab.gen(slot) == gen - 1

    # -- reads ------------------------------------------------------------------------------
    _COLS = "key, slab, slot, gen, nbytes, ntokens, layout"

    def find(self, keys: Sequence[str]) -> list[BlockEntry]:
        """Longest leading run of ``keys`` held and readable now; a read, no side effects."""
        db = self._db()
        rows: dict[str, BlockEntry] = {}
        for i in range(0, len(keys), 500):
            chunk = list(keys[i : i + 500])
            q = f"SELECT {self._COLS} FROM blocks WHERE key IN ({','.join('?' * len(chunk))})"
            rows.update((r[0], BlockEntry(*r)) for r in db.execute(q, chunk))
        out: list[BlockEntry] = []
        for k in keys:
            e = rows.get(k)
            if e is None:
                break
            out.append(e)
        return out[: self.ready(out)]

    def ready(self, entries: Sequence[BlockEntry]) -> int:
        """How many leading entries' slots carry their published generation now."""
        for i, e in enumerate(entries):
            try:
                slab = self.slab(e.slab)
                slab.ensure(e.slot)
            except MISSING:
                return i
            if slab.gen(e.slot) != e.gen:
                return i
        return len(entries)

    def lease(self, entries: Sequence[BlockEntry], lease_s: float | None = None) -> str | None:
        """Protect ``entries`` from eviction until released or ``lease_s``; touches them (LRU)."""
        if not entries:
            return None
        now = time.time()
        lease = uuid.uuid4().hex
        dl = now + (lease_s or self.lease_timeout_s)
        with self._tx() as db:
            db.executemany("INSERT INTO leases(lease, key, deadline) VALUES (?,?,?)",
                           [(lease, e.key, dl) for e in entries])
            db.executemany("UPDATE blocks SET last_used = ? WHERE key = ?", [(now, e.key) for e in entries])
        return lease

    def fetch(self, keys: Sequence[str], lease_s: float | None = None) -> tuple[list[BlockEntry], str | None]:
        """Longest leading run of ``keys`` held, leased (protected from eviction).

        Returns (entries, lease id or None when nothing matched). Release the lease with
        :meth:`release` once the blocks are loaded (or given up).
        """
        entries = self.find(keys)
        if not entries:
            return [], None
        lease = self.lease(entries, lease_s)
        # a block evicted between the read and the lease is dropped from the run here
        held = self._existing(self._db(), [e.key for e in entries])
        n = next((i for i, e in enumerate(entries) if e.key not in held), len(entries))
        return entries[:n], lease

    def check_entries(self, entries: Sequence[BlockEntry]) -> None:
        """Raise SlotTorn/SlotReused unless every slot carries its entry's generation (seqlock read)."""
        if entries and all(e.slab == entries[0].slab for e in entries):  # the usual case: one vector read
            slab = self.slab(entries[0].slab)
            slab.ensure(max(e.slot for e in entries))
            if (slab.gens([e.slot for e in entries]) == [e.gen for e in entries]).all():
                return
        for e in entries:
            slab = self.slab(e.slab)
            slab.ensure(e.slot)
            g = slab.gen(e.slot)
            if g != e.gen:
                if g == e.gen - 1:
                    raise SlotTorn(f"block {e.key[:12]}: slot {e.slot} is being written or its writer died")
                raise SlotReused(f"block {e.key[:12]}: slot {e.slot} was reused (generation {g} != {e.gen})")

    def verify(self, entries: Sequence[BlockEntry]) -> None:
        """In check mode: raise BlockDamaged where a slot's bytes differ from its crc32."""
        if self.check != "crc32":
            return
        for e in entries:
            slab = self.slab(e.slab)
            if zlib.crc32(slab.view(e.slot, e.nbytes)) != slab.crc(e.slot):
                raise BlockDamaged(f"block {e.key[:12]}: checksum mismatch")

    def view(self, entry: BlockEntry) -> memoryview:
        """The slot's bytes in place (for writers that damage them on purpose in tests, and transports)."""
        slab = self.slab(entry.slab)
        slab.ensure(entry.slot)
        return slab.view(entry.slot, entry.nbytes)

    def release(self, lease: str | None, consumed: Iterable[str] = ()) -> None:
        """End a lease (from :meth:`lease` or :meth:`fetch`); each key in ``consumed`` was loaded once (fan-out pin -1).
        Pending counters go with it (one transaction)."""
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
        """Drop blocks found damaged or torn, so that the next producer save replaces them."""
        keys = list(keys)
        if not keys:
            return
        with self._tx() as db:
            rows = []
            for k in keys:
                r = db.execute("SELECT slab, slot, nbytes FROM blocks WHERE key = ?", (k,)).fetchone()
                if r is not None:
                    rows.append(r)
            db.executemany("DELETE FROM blocks WHERE key = ?", [(k,) for k in keys])
            db.executemany("UPDATE slots SET used = 0 WHERE slab = ? AND slot = ?", [(r[0], r[1]) for r in rows])
            self._add_held(db, -sum(r[2] for r in rows))

    def entry(self, key: str) -> BlockEntry | None:
        r = self._db().execute(f"SELECT {self._COLS} FROM blocks WHERE key = ?", (key,)).fetchone()
        return BlockEntry(*r) if r else None

    def pins(self, key: str) -> int:
        """Live fan-out pins of a block (0 when absent or its pin deadline passed)."""
        r = self._db().execute("SELECT pins, pin_deadline FROM blocks WHERE key = ?", (key,)).fetchone()
        return int(r[0]) if r and r[1] >= time.time() else 0

    # -- counters ---------------------------------------------------------------------------
    @staticmethod
    def _bump(db: sqlite3.Connection, scope: str, deltas: dict[str, float]) -> None:
        db.executemany(
            "INSERT INTO counters(scope, name, value) VALUES (?,?,?)"
            " ON CONFLICT(scope, name) DO UPDATE SET value = value + excluded.value",
            [(scope, k, float(v)) for k, v in deltas.items() if v])

    @staticmethod
    def _write_counters(db: sqlite3.Connection, pending: dict[tuple[str, str], float]) -> None:
        if pending:
            db.executemany(
                "INSERT INTO counters(scope, name, value) VALUES (?,?,?)"
                " ON CONFLICT(scope, name) DO UPDATE SET value = value + excluded.value",
                [(s, n, float(v)) for (s, n), v in pending.items() if v])

    def add(self, scope: str, deltas: Mapping[str, float]) -> None:
        """Add to named counters in memory (fallback reasons go as ``fallback:<reason>``): the hot
        path's way; they are written with this process's next transaction or :meth:`flush`."""
        with self._pending_lock:
            for k, v in deltas.items():
                if v:
                    self._pending[(scope, k)] = self._pending.get((scope, k), 0.0) + float(v)

    def flush(self) -> None:
        """Write pending counters now (one transaction; nothing when there are none)."""
        if self._pending:
            with self._tx():
                pass

    def flush_soon(self, delay_s: float = 0.2) -> None:
        """Write pending counters from a background thread within ``delay_s`` (off the hot path;
        counters of several requests in that window share one transaction)."""
        with self._pending_lock:
            if self._flusher is not None and self._flusher.is_alive():
                return
            self._flusher = threading.Timer(delay_s, self._flush_quietly)
            self._flusher.daemon = True
            self._flusher.start()

    def close(self) -> None:
        """This process is done with the pool: its pending counters are written, and the last
        owner removes the pool (unless ``persist``)."""
        self.flush()
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
        if self._release is not None:
            self._release()

    def _flush_quietly(self) -> None:
        try:
            self.flush()
        except sqlite3.Error as e:  # counters are best effort; the next transaction retries them
            import logging

            logging.getLogger(__name__).warning("KVPool: counter flush failed: %s", e)

    def stats(self, scope: str | None = None) -> PoolStats:
        """Current holdings and counters (with this process's unwritten ones); ``scope`` limits
        counters to one engine label."""
        db = self._db()
        now = time.time()
        n = db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
        pinned = db.execute("SELECT COUNT(*) FROM blocks WHERE pins > 0 AND pin_deadline >= ?",
                            (now,)).fetchone()[0]
        if scope is None:
            rows = db.execute("SELECT name, SUM(value) FROM counters GROUP BY name").fetchall()
        else:
            rows = db.execute("SELECT name, value FROM counters WHERE scope = ?", (scope,)).fetchall()
        slabs = tuple(r[0] for r in db.execute("SELECT slot_bytes FROM slabs ORDER BY slot_bytes"))
        counters = {k: v for k, v in rows}
        with self._pending_lock:  # this process's own counters not yet written
            for (sc, k), v in self._pending.items():
                if scope is None or sc == scope:
                    counters[k] = counters.get(k, 0.0) + v
        return PoolStats(self._capacity(db), self._held(db), int(n), int(pinned), counters, slabs)

    def scopes(self) -> list[str]:
        return [r[0] for r in self._db().execute("SELECT DISTINCT scope FROM counters")]
