"""Who owns a node's KV pool folder, and who gives it back.

The owners of a pool are the processes that have it open: each holds a shared ``flock`` on
``users.lock`` in the folder for as long as it does, and the kernel drops that lock when the
process ends, however it ends. Opens and closes take ``open.lock`` (exclusive) around their
check, so no two of them race:

- **open** (:meth:`PoolHold.take`): if nobody holds ``users.lock`` (an exclusive try that does
  not wait succeeds), the folder's earlier owners are all gone: a crash, or a clean stop of a
  pool kept with ``persist``. Unless ``persist`` is set, its files are removed and the opener
  makes the pool afresh (its capacity is then the opener's); with ``persist`` it is adopted.
  Either way the same folder is reused, never a second one mapped beside it.
- **close** (:meth:`PoolHold.release`, at the latest when the process exits): if this process
  is the last owner (the same exclusive try), the folder is removed, unless ``persist``.

If every owner was killed (a stop that ended in SIGKILL) and nothing opens the folder again, it
stays: :func:`reclaim` (``prefillshare pool-reclaim``, what scripts/serve.sh and the overload run
do after their app stops) removes a folder that no live process owns.

Readers that never create a pool (metrics, tools) take no hold. The pool creates no
semaphore or other shared-memory object of its own: its files are the folder's.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil

log = logging.getLogger(__name__)

__all__ = ["PoolHold", "reclaim"]

_USERS, _OPEN = "users.lock", "open.lock"


@contextlib.contextmanager
def _serialised(path: str):
    """Hold ``open.lock`` of ``path`` exclusively (retrying if the folder was removed meanwhile)."""
    while True:
        os.makedirs(path, exist_ok=True)
        name = os.path.join(path, _OPEN)
        fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.stat(name).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # the last owner removed the folder while we waited
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def _alone(fd: int) -> bool:
    """Whether no other open file holds ``users.lock`` (turns this one's lock exclusive if so)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _remove_contents(path: str, keep: tuple[str, ...]) -> None:
    for name in os.listdir(path):
        if name not in keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))


class PoolHold:
    """This process's share in a pool folder (see the module doc)."""

    def __init__(self, path: str, persist: bool, fd: int):
        self.path, self.persist, self._fd, self._pid = path, persist, fd, os.getpid()

    @classmethod
    def take(cls, path: str, persist: bool) -> PoolHold:
        """Become one of the pool's owners, reclaiming a folder whose owners are all gone."""
        with _serialised(path):
            fd = os.open(os.path.join(path, _USERS), os.O_RDWR | os.O_CREAT, 0o600)
            if _alone(fd) and not persist and len(os.listdir(path)) > 2:
                log.warning("KV pool %s has no live owner (a crash?): reclaimed", path)
                _remove_contents(path, keep=(_USERS, _OPEN))
            fcntl.flock(fd, fcntl.LOCK_SH)  # never waits: exclusive locks are taken only under open.lock
        return cls(path, persist, fd)

    def release(self) -> None:
        """Stop owning the pool; the last owner removes it unless it persists."""
        if self._fd < 0 or os.getpid() != self._pid:  # a forked child shares its parent's lock
            return
        with _serialised(self.path):
            if _alone(self._fd) and not self.persist:
                shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._fd)
            self._fd = -1


def reclaim(path: str) -> bool:
    """Remove the pool folder ``path`` if no live process owns it; whether it was removed."""
    if not os.path.isfile(os.path.join(path, _USERS)):
        return False
    with _serialised(path):
        fd = os.open(os.path.join(path, _USERS), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not _alone(fd):
                return False
            shutil.rmtree(path, ignore_errors=True)
            return True
        finally:
            os.close(fd)


def configure(parser) -> None:
    """``prefillshare pool-reclaim CONFIG``: this node's pool folder of an app config (or a Serve
    config holding one), removed if no live process owns it and the config does not persist it."""
    parser.add_argument("config", help="serve_config.yaml, or an app config")
    parser.set_defaults(func=_reclaim_command)


def _reclaim_command(args) -> int:
    from prefillshare.app.config import load_config

    pool = load_config(args.config).pool
    if pool.persist:
        print(f"{pool.path}: pool.persist is set: kept")
        return 0
    removed = reclaim(pool.path)
    print(f"{pool.path}: " + ("no live owner: removed" if removed else
                              "owned by a live process: kept" if os.path.exists(pool.path) else "absent"))
    return 0
