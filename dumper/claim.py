"""Who may write a step file: one writer at a time, and never over another dumper's step.

Two dumpers that write the same step file (two in one process, or two processes dumping into
one directory) would otherwise replace each other's steps without a word. A writer therefore
*claims* the step file before it writes it and keeps the claim until the file is published or
discarded:

- in this process, a registry of the claimed paths;
- across processes, an exclusive ``flock`` on a lock file next to it
  (:func:`compare.format.lock_file_name`), which the kernel releases if the process dies, so
  a crash leaves no stale claim.

A step file that another dumper published after this one started (:class:`PublishedFiles`)
is not replaced either.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Optional

from compare import format as fmt

try:
    import fcntl
except ImportError:  # not POSIX: the in-process registry only
    fcntl = None

_claimed: set[str] = set()
_claimed_lock = threading.Lock()

# What a lock file holds: the writer's pid, padded to a fixed width so that writing it over a
# stale lock file's pid needs no truncation (ext4 flushes a file truncated to zero when it is
# closed, which cost ~2 ms of every dumped step; docs/benchmarks.md, "Dump")
_HOLDER_BYTES = 32


def _holder_text() -> bytes:
    return str(os.getpid()).ljust(_HOLDER_BYTES - 1).encode() + b"\n"


class StepConflictError(RuntimeError):
    """Another dumper writes, or has published, the same step file."""


def _conflict(path: Path, problem: str) -> StepConflictError:
    return StepConflictError(f"h5cmp: {path}: {problem}; give each dumper its own file_path "
                             f"(or run under torch.distributed, which names files by rank)")


class StepClaim:
    """The exclusive right to write ``final_path``; :meth:`release` gives it up (idempotent).

    Raises :class:`StepConflictError` if another writer holds it, ``OSError`` if the lock file
    cannot be created (e.g. a full disk).
    """

    def __init__(self, final_path: Path):
        self.path = final_path
        self._key = os.path.realpath(final_path)
        self._lock_path = final_path.with_name(fmt.lock_file_name(final_path.name))
        self._fd: Optional[int] = None
        with _claimed_lock:
            if self._key in _claimed:
                raise _conflict(final_path, "another dumper in this process is writing this step")
            _claimed.add(self._key)
        try:
            if fcntl is not None:
                self._fd = self._lock()
        except BaseException:
            with _claimed_lock:
                _claimed.discard(self._key)
            raise

    def _lock(self) -> int:
        while True:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, _HOLDER_BYTES, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise _conflict(self.path, f"another process (pid {holder}) is writing this step")
            except BaseException:
                os.close(fd)
                raise
            try:  # the holder before us may have removed the file we opened: lock the new one
                same = os.stat(self._lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.pwrite(fd, _holder_text(), 0)
                return fd
            os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            try:  # removed while locked: a writer that opened it sees that and retries
                self._lock_path.unlink(missing_ok=True)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None
        with _claimed_lock:
            _claimed.discard(self._key)


class PublishedFiles:
    """The step files of a directory as a dumper found them when it started, and those it
    published since: any other change is another dumper's step, which it does not replace."""

    def __init__(self, directory: Path):
        try:
            names = os.listdir(directory)
        except OSError:  # e.g. a directory one may write but not list: nothing to go by
            names = None
        self._found = None if names is None else {
            name: _identity(directory / name) for name in names if fmt.parse_step_file_name(name)}
        self._ours: set[str] = set()

    def check(self, path: Path) -> None:
        """Raise :class:`StepConflictError` if ``path`` is another dumper's since we started."""
        if self._found is None or path.name in self._ours:
            return
        now = _identity(path)
        if now is not None and now != self._found.get(path.name):
            raise _conflict(path, "another dumper published this step after this one started, "
                                  "and it is not replaced")

    def published(self, path: Path) -> None:
        self._ours.add(path.name)


def _identity(path: Path) -> Optional[tuple[int, int, int]]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
