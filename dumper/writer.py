"""The step writer: one background thread owns the HDF5 file of one step and publishes it."""
from __future__ import annotations

import os
import queue
import threading
import warnings
from pathlib import Path
from typing import Optional

import h5py
import numpy as np

from compare import format as fmt

from .encoding import encode
from .record import Record

_FINISH = object()
_ABORT = object()


class DumpWriteError(RuntimeError):
    """Writing a step file failed (disk full, I/O error); earlier steps are intact."""


def _index_dtype() -> np.dtype:
    vlen = h5py.string_dtype("utf-8")
    return np.dtype([(name, vlen if kind == "str" else kind) for name, kind in fmt.INDEX_COLUMNS])


def _index_row(r: Record, encoding: str) -> tuple:
    c = r.call
    return (r.seq, c.number, c.module, c.cls, c.call_idx, c.group, r.kind, r.index, r.occurrence,
            r.path,
            r.dataset, r.dtype, r.shape, encoding, r.device, int(r.requires_grad), r.status,
            r.value)


class _ByteBudget:
    """Bounds the bytes of snapshots queued but not yet written; ``acquire`` blocks at the limit."""

    def __init__(self, limit: int):
        self.limit = limit
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            # A snapshot larger than the whole budget waits for an empty queue, then goes alone.
            self._cond.wait_for(lambda: self._used == 0 or self._used + n <= self.limit)
            self._used += n

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()


class StepWriter:
    """Writes the records of one step into ``final_path``, atomically.

    The file is written under a hidden temporary name by a dedicated thread (all h5py calls of
    the step happen there) and renamed to ``final_path`` by :meth:`finish`. :meth:`abort`, or an
    error, removes the temporary file; a file under the final name is always complete.
    """

    def __init__(self, final_path: Path, step_group: str, attrs: dict,
                 max_bytes_in_flight: int, fsync: bool = False):
        self.final_path = final_path
        self.temp_path = final_path.with_name(fmt.temp_file_name(final_path.name, os.getpid()))
        self._step_group = step_group
        self._attrs = attrs
        self._fsync = fsync
        self._budget = _ByteBudget(max_bytes_in_flight)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._rows: list[tuple] = []
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"h5cmp-writer:{final_path.name}",
                                        daemon=True)
        self._thread.start()

    # -- producer side (training and autograd threads) --------------------------------
    def submit(self, record: Record) -> None:
        """Queue ``record``; blocks while the bytes in flight are at the limit.

        Never raises: after a write error records are dropped and :meth:`finish` reports it.
        """
        if self.error is not None:
            return
        self._budget.acquire(record.nbytes)
        self._queue.put(record)

    def finish(self) -> Path:
        """Write the index, close and publish the file; raises :class:`DumpWriteError` on failure."""
        self._queue.put(_FINISH)
        self._thread.join()
        if self.error is not None:
            raise DumpWriteError(self._error_message()) from self.error
        return self.final_path

    def abort(self) -> None:
        """Stop writing and remove the temporary file; nothing is published."""
        self._queue.put(_ABORT)
        self._thread.join()

    def _error_message(self) -> str:
        return (f"h5cmp: writing {self.final_path} failed ({self.error}); this step is not saved, "
                f"earlier steps are intact. Free disk space or choose another file_path.")

    # -- writer thread -----------------------------------------------------------------
    def _run(self) -> None:
        ended = False  # whether the producer's FINISH/ABORT has been consumed
        try:
            with h5py.File(self.temp_path, "w", track_order=False) as f:
                step_group = f.create_group(self._step_group)
                while (item := self._queue.get()) is not _FINISH:
                    if item is _ABORT:
                        ended = True
                        raise _Aborted
                    self._write(step_group, item)
                ended = True
                self._write_index(step_group)
                for key, value in self._attrs.items():
                    f.attrs[key] = value
            if self._fsync:
                with open(self.temp_path, "rb+") as fh:
                    os.fsync(fh.fileno())
            os.replace(self.temp_path, self.final_path)
        except _Aborted:
            self._discard()
        except BaseException as exc:  # surfaced to the producer by submit()/finish()
            self.error = exc
            self._discard()
            if not ended:
                self._drain()

    def _write(self, step_group: h5py.Group, record: Record) -> None:
        encoding = fmt.ENC_NONE
        if record.snapshot is not None:
            try:
                group = step_group.require_group(record.call.group)
                array, encoding = encode(record.snapshot)
                group.create_dataset(record.dataset, data=array)
            finally:
                self._budget.release(record.nbytes)
        self._rows.append(_index_row(record, encoding))

    def _write_index(self, step_group: h5py.Group) -> None:
        self._rows.sort(key=lambda row: row[0])  # stable: one event's rows keep their order
        table = np.array(self._rows, dtype=_index_dtype())
        step_group.create_dataset(fmt.INDEX_DATASET, data=table)

    def _drain(self) -> None:
        """After a failure: consume what producers still queue so they never block."""
        while True:
            item = self._queue.get()
            if item is _FINISH or item is _ABORT:
                return
            self._budget.release(item.nbytes)

    def _discard(self) -> None:
        try:
            self.temp_path.unlink(missing_ok=True)
        except OSError as exc:
            warnings.warn(f"h5cmp: could not remove temporary file {self.temp_path}: {exc}")


class _Aborted(Exception):
    pass
