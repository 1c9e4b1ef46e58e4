"""The step writer: one background thread owns the HDF5 file of one step and publishes it."""
from __future__ import annotations

import collections
import errno
import os
import queue
import secrets
import threading
import warnings
import zlib
from collections import deque
from pathlib import Path
from typing import Callable, Optional

import h5py
import numpy as np
import torch

from compare import format as fmt

from .claim import StepClaim, StepConflictError
from .consumers import StepConsumers
from .encoding import dtype_name, encode
from .hdf5 import LowLevelGroup, write_attributes
from .memory import trim_heap
from .record import CallInfo, Record, unreadable

WRITE_AHEAD_BYTES = 16 << 20  # held bytes that make the thread write during the step
# Paged file space with a page buffer: HDF5 gathers the small metadata and raw-data writes of
# many small datasets into 64 KiB pages (closing a small dataset: 24 -> 13 us); large datasets
# are written directly, as before.
FILE_OPTIONS = dict(fs_strategy="page", fs_page_size=1 << 16, page_buf_size=4 << 20)
_FINISH = object()
_ABORT = object()
_FLUSH = object()
_NO_STATS = (float("nan"),) * len(fmt.STAT_COLUMNS)
_NO_SKETCH = (float("nan"),) * len(fmt.SKETCH_COLUMNS)
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
TRIM_AFTER_BYTES = 64 << 20  # a step that held this much gives the C heap's free pages back


class DumpWriteError(RuntimeError):
    """Writing a step file failed (disk full, I/O error); earlier steps are intact."""


def _index_table(columns: dict[str, list]) -> np.ndarray:
    """The step's index as a structured array, from its columns (``fmt.INDEX_COLUMNS`` by name),
    rows sorted by ``seq`` (stable: one event's rows keep their order). Strings are fixed-length
    UTF-8, as wide as the column's longest value: writing them costs a fraction of
    variable-length strings (per-string heap objects), e.g. 1.5 ms instead of 5 ms for 600 rows.
    """
    order = np.argsort(np.asarray(columns["seq"], dtype=np.int64), kind="stable")
    arrays = {}
    for name, kind in fmt.INDEX_COLUMNS:
        values = columns[name]
        if kind == "str":
            encoded = _encoded(values)
            width = max(map(len, encoded), default=0) or 1
            arrays[name] = np.array(encoded, dtype=h5py.string_dtype("utf-8", width))[order]
        else:
            arrays[name] = np.asarray(values, dtype=kind)[order]
    table = np.empty(len(order), dtype=[(name, arrays[name].dtype) for name in arrays])
    for name, array in arrays.items():
        table[name] = array
    return table


def _encoded(values) -> list[bytes]:
    """``fmt.name_bytes`` of each value, each distinct value encoded once (columns repeat)."""
    cache: dict[str, bytes] = {}
    return [cache[v] if v in cache else cache.setdefault(v, fmt.name_bytes(v)) for v in values]


# An index row as the writer keeps it until the index is written: the scalar columns by name
# (fmt.INDEX_COLUMNS), the statistics and sketch as tuples (fmt.STAT_COLUMNS, .SKETCH_COLUMNS
# order) and the sharding (None: not sharded).
_SCALARS = tuple(name for name in fmt.INDEX_COLUMN_NAMES
                 if name not in fmt.STAT_COLUMNS + fmt.SKETCH_COLUMNS + fmt.SHARDING_COLUMNS)
_Row = collections.namedtuple("_Row", _SCALARS + ("stats", "sketch", "sharding"))


class _IndexRows:
    """The index rows of one step, kept as compact rows (a record's values and buffers are
    not kept) and turned into columns (``fmt.INDEX_COLUMNS``) once, when the index is written.
    The strings that repeat from row to row (a call's group, a tensor's dtype, shape and
    device) are formatted once per step instead of once per row."""

    def __init__(self):
        self._rows: list[_Row] = []
        self._groups: dict[int, str] = {}
        self._described: dict[tuple, tuple[str, str, str]] = {}

    def group(self, call: CallInfo) -> str:
        name = self._groups.get(call.number)
        if name is None:
            name = self._groups[call.number] = call.group
        return name

    def add(self, r: Record, group: str, dataset: str, encoding: str, stats: tuple,
            sketch: tuple, checksum: int, digest: int) -> None:
        key = (r.dtype, r.shape, r.device)
        described = self._described.get(key)
        if described is None:
            dtype = r.dtype if isinstance(r.dtype, str) else dtype_name(r.dtype)
            described = self._described[key] = (dtype, fmt.format_shape(tuple(r.shape)),
                                                 str(r.device))
        dtype, shape, device = described
        c = r.call
        self._rows.append(_Row(
            seq=r.seq, call=c.number, module=c.module, cls=c.cls, call_idx=c.call_idx,
            micro_batch=r.micro_batch, group=group, kind=r.kind, index=r.index,
            occurrence=r.occurrence, path=r.path, dataset=dataset, dtype=dtype, shape=shape,
            encoding=encoding, device=device, requires_grad=int(r.requires_grad),
            status=r.status, value=r.value, producer=r.producer, addends=r.addends,
            injected=int(r.injected), grad_scale=float(r.grad_scale),
            checksum=checksum, digest=digest, stats=stats, sketch=sketch, sharding=r.sharding))

    def columns(self) -> dict[str, list]:
        """The rows as columns, every name of ``fmt.INDEX_COLUMNS``."""
        rows = self._rows
        columns = dict(zip(_Row._fields, map(list, zip(*rows)))) if rows else {
            name: [] for name in _Row._fields}
        for names, part in ((fmt.STAT_COLUMNS, "stats"), (fmt.SKETCH_COLUMNS, "sketch")):
            numbers = np.array(columns.pop(part), dtype=np.float64).reshape(-1, len(names))
            columns.update(zip(names, numbers.T))
        shards = [_NOT_SHARDED if s is None else s.columns() for s in columns.pop("sharding")]
        columns.update({name: [shard[name] for shard in shards]
                        for name in fmt.SHARDING_COLUMNS})
        return columns


_NOT_SHARDED = dict.fromkeys(fmt.SHARDING_COLUMNS, "")


def core_left_for_writer() -> bool:
    """Whether torch's CPU (intra-op) threads leave a core of this process to the writer."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return torch.get_num_threads() < (cores or 1)


class StepWriter:
    """Writes the records of one step into the step file ``claim`` holds, atomically.

    The file is written under a hidden temporary name, unique to this writer, by a dedicated
    thread (all h5py calls of the step happen there) and renamed to its final name by
    :meth:`finish`, after ``before_publish(final path)`` (which raises to refuse). :meth:`abort`,
    or an error, removes the temporary file; a file under the final name is always complete.
    The claim is released once the file is published or discarded. ``release(record)`` is
    called for every record once the writer is done with it.

    Records are held back until the step ends or until :meth:`flush` is called (by a producer
    about to wait for bytes). They are written during the step ("write-ahead") once
    ``WRITE_AHEAD_BYTES`` are held, if the step leaves a core to the writer: the held records
    include an accelerator's tensors (its host threads mostly wait), or torch's CPU threads are
    fewer than this process's cores (:func:`core_left_for_writer`). The threshold keeps small
    tensors back: h5py holds the GIL for its per-dataset work, and writing many small tensors
    while the training thread runs makes both wait on it. Large ones are written without the
    GIL, which pays only on a free core (figures in docs/benchmarks.md, "Dump").
    """

    def __init__(self, claim: StepClaim, step_group: str, attrs: dict,
                 release: Callable[[Record], None], fsync: bool = False,
                 before_publish: Callable[[Path], None] = lambda path: None,
                 consumers: Optional[StepConsumers] = None):
        self.final_path = claim.path
        self.temp_path = claim.path.with_name(fmt.temp_file_name(
            claim.path.name, f"{os.getpid()}-{secrets.token_hex(4)}"))
        self._claim = claim
        self._before_publish = before_publish
        self._consumers = consumers  # called with each written record (dumper.consumers)
        self._step_group = step_group
        self._attrs = attrs
        self._release = release
        self._fsync = fsync
        self._incomplete = ""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[Record] = []     # submitted, not yet handed to the thread
        self._held_bytes = 0
        self._held_lock = threading.Lock()
        self._core_free = core_left_for_writer()
        self._held_accelerator = False  # whether a held record comes from an accelerator
        self._saw_accelerator = False   # whether any record of the step did
        self._step_bytes = 0              # bytes of values held in the step
        self._index = _IndexRows()
        # id of a record whose values were written -> (that record, kept so that the id stays
        # its own, group, dataset, encoding, checksum): for the records sharing them
        self._written: dict[int, tuple[Record, str, str, str, int]] = {}
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"h5cmp-writer:{claim.path.name}",
                                        daemon=True)
        self._thread.start()

    # -- producer side (training and autograd threads) --------------------------------
    def submit(self, record: Record) -> None:
        """Queue ``record``. Never raises: after a write error records are dropped and
        :meth:`finish` reports it."""
        if self.error is not None:
            self._release(record)
            return
        with self._held_lock:
            self._held.append(record)
            self._held_bytes += record.nbytes
            self._step_bytes += record.nbytes
            accelerator = getattr(record.device, "type", "cpu") != "cpu"
            self._held_accelerator |= accelerator
            self._saw_accelerator |= accelerator
            write_ahead = (self._held_bytes >= WRITE_AHEAD_BYTES
                           and (self._core_free or self._held_accelerator))
        if write_ahead:
            self.flush()

    def flush(self) -> None:
        """Hand what is held to the thread and have it written now (frees bytes for waiting
        producers)."""
        self._hand_over()
        self._queue.put(_FLUSH)

    def _hand_over(self) -> None:
        with self._held_lock:
            batch, self._held, self._held_bytes = self._held, [], 0
            self._held_accelerator = False
        if batch:
            self._queue.put(batch)

    def finish(self, incomplete: str = "") -> Path:
        """Write the index, close and publish the file, marked ``incomplete`` for that reason
        if one is given; raises :class:`DumpWriteError` on failure."""
        self.finish_later(incomplete)
        return self.wait()

    def finish_later(self, incomplete: str = "") -> None:
        """Have the thread write what is left and publish the file while the caller goes on;
        :meth:`wait` for it. No record may be submitted after this."""
        self._incomplete = incomplete
        self._hand_over()
        self._queue.put(_FINISH)

    @property
    def done(self) -> bool:
        """Whether the thread has ended (published, or failed)."""
        return not self._thread.is_alive()

    @property
    def held_accelerator_tensors(self) -> bool:
        """Whether the step recorded tensors that live on an accelerator."""
        return self._saw_accelerator

    def wait(self) -> Path:
        """Wait for the file to be published; raises :class:`DumpWriteError` on failure."""
        self._thread.join()
        if self.error is not None:
            raise DumpWriteError(self._error_message()) from self.error
        return self.final_path

    def abort(self) -> None:
        """Stop writing and remove the temporary file; nothing is published."""
        self._hand_over()
        self._queue.put(_ABORT)
        self._thread.join()

    def _error_message(self) -> str:
        what = str(self.error).splitlines()[0] if str(self.error) else type(self.error).__name__
        if isinstance(self.error, StepConflictError):
            return f"{what}; this step is not saved"
        message = (f"h5cmp: writing {self.final_path} failed ({what}); this step is not saved, "
                   f"earlier steps are intact")
        if _is_disk_full(self.error):
            return message + ". Free disk space or choose another file_path."
        if isinstance(self.error, PermissionError) or getattr(self.error, "errno", None) == \
                errno.EROFS:
            return message + ". Make file_path writable or choose another."
        return message + "."

    # -- writer thread -----------------------------------------------------------------
    def _run(self) -> None:
        ended = False  # whether the producer's FINISH/ABORT has been consumed
        try:
            with h5py.File(self.temp_path, "w", **FILE_OPTIONS) as f:
                write_attributes(f, self._attrs)  # now, while the step runs
                step_group = f.create_group(self._step_group)
                datasets = LowLevelGroup(step_group, named_types=f)
                pending: deque[Record] = deque()
                try:
                    while (item := self._queue.get()) is not _FINISH:
                        if item is _ABORT:
                            ended = True
                            raise _Aborted
                        if item is _FLUSH:
                            self._write_all(datasets, pending)
                        else:
                            pending.extend(item)
                    ended = True
                    self._write_all(datasets, pending)
                    crc = self._write_index(datasets)
                    write_attributes(f, {fmt.ATTR_INDEX_CRC: crc,
                                         fmt.ATTR_INCOMPLETE: self._incomplete})
                finally:
                    for record in pending:  # left by an error or an abort
                        self._release(record)
                    datasets.close()
            if self._fsync:
                with open(self.temp_path, "rb+") as fh:
                    os.fsync(fh.fileno())
            self._before_publish(self.final_path)
            os.replace(self.temp_path, self.final_path)
        except _Aborted:
            self._discard()
        except BaseException as exc:  # surfaced to the producer by finish()
            self.error = exc
            self._discard()
            if not ended:
                self._drain()
        finally:
            self._written.clear()  # the records it kept for their sharers
            self._claim.release()
            if self._step_bytes >= TRIM_AFTER_BYTES:
                trim_heap()

    def _write_all(self, datasets: LowLevelGroup, records: deque) -> None:
        while records:
            self._write(datasets, records.popleft())

    def _write(self, datasets: LowLevelGroup, record: Record) -> None:
        try:
            encoding, checksum, values = fmt.ENC_NONE, fmt.NO_CHECKSUM, None
            group, dataset = self._index.group(record.call), record.dataset
            first = getattr(record.snapshot, "first", None)  # (dumper.known.SharedValues)
            linked = self._written.get(id(first))
            if linked is not None and linked[0] is first:  # values a record wrote: linked
                values = record.snapshot.wait()
                _, first_group, first_dataset, encoding, checksum = linked
                datasets.link(group, dataset, first_group, first_dataset)
            elif record.snapshot is not None:
                try:
                    values = record.snapshot.wait()
                    array, encoding = encode(values)
                except (RuntimeError, TypeError) as exc:  # copied by the hook, yet unreadable
                    record.status, record.value, dataset = fmt.ST_UNSUPPORTED, unreadable(exc), ""
                    values = None
                else:
                    datasets.write(group, dataset, array, dtype_name(record.dtype)
                                   if encoding == fmt.ENC_BITS else None)
                    checksum = fmt.data_checksum(array)
                    self._written[id(record)] = (record, group, dataset, encoding, checksum)
            try:
                stats, sketch = (_numbers(record.stats, _NO_STATS),
                                 _numbers(record.sketch, _NO_SKETCH))
                digest = _numbers(record.digest, fmt.NO_DIGEST)
            except Exception as exc:  # taken by the hook, yet its batch could not be reduced
                record.status, record.value = fmt.ST_UNSUPPORTED, unreadable(exc)
                stats, sketch, digest = _NO_STATS, _NO_SKETCH, fmt.NO_DIGEST
            self._index.add(record, group, dataset, encoding, stats, sketch, checksum, digest)
            if self._consumers is not None and record.status == fmt.ST_OK and (
                    values is not None or record.stats is not None):
                self._consumers(record, values, None if record.stats is None else stats)
        finally:
            self._release(record)

    def _write_index(self, datasets: LowLevelGroup) -> int:
        """Write the index table; returns its checksum (``fmt.ATTR_INDEX_CRC``)."""
        table = _index_table(self._index.columns())
        datasets.write_here(fmt.INDEX_DATASET, table)
        return zlib.crc32(table.tobytes())

    def _drain(self) -> None:
        """After a failure: consume what producers still queue, releasing it."""
        while True:
            item = self._queue.get()
            if item is _FINISH or item is _ABORT:
                return
            if item is not _FLUSH:
                for record in item:
                    self._release(record)

    def _discard(self) -> None:
        try:
            self.temp_path.unlink(missing_ok=True)
        except OSError as exc:
            warnings.warn(f"h5cmp: could not remove temporary file {self.temp_path}: {exc}")


def _is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk or quota is full (HDF5 reports errno in the text)."""
    if getattr(exc, "errno", None) in _DISK_FULL:
        return True
    text = str(exc)
    return any(f"errno = {code}," in text or os.strerror(code) in text for code in _DISK_FULL)


def _numbers(numbers, missing):
    """A record's statistics, sketch or digest: computed in the hook (a tuple, an int), or
    taken in the step's batch (:class:`dumper.arena.Pending`)."""
    if numbers is None:
        return missing
    return numbers if isinstance(numbers, (tuple, int)) else numbers.wait()


class _Aborted(Exception):
    pass
