"""A step's records taken in batches: copied in the hooks, reduced and read once per seal.

A hook that records a small tensor launches one copy of it into the step's *arena* for its
device and dtype: no reduction, no host sync. A larger accelerator tensor's statistics, sketch
or digest are reduced on its device into a row of the step's *table* (a few reductions each);
its values are copied as before (:mod:`dumper.snapshot`). When the step ends, when an arena or
table fills, or when the writer needs a record sooner, what is open is *sealed*: the arenas'
numbers are reduced for all their tensors at once, what the host needs (values, numbers) is
copied there in a few large non-blocking transfers, and one event is recorded per device. The
writer's thread waits for that event when it reaches the seal's first record: one host sync per
seal, none on the training thread (host arenas, below, are reduced by the thread that seals
them: the training thread at the step's end or when one fills, the writer's if it needs a
record sooner).

The numbers are the raw sums of :data:`dumper.stats.RAW_SUMS` (and the sketch, and the 64-bit
word sum of the digest); the host turns them into the statistics with
:func:`dumper.stats.stats_of_sums`, the definition the per-tensor path of CPU tensors and the
reader share. CPU tensors are reduced in their hooks instead (:mod:`dumper.stats`,
:mod:`dumper.digest`), but for the numbers of small float32/float64 ones
(:func:`on_host_arena`): a hook's numpy calls on a few thousand elements cost 2-3 times as
much inside a training step as in a loop of their own, so those are copied into a *host
arena* (:class:`_HostArena`) and reduced together with numpy's segmented reductions when it
is sealed (docs/benchmarks.md). Their values, when wanted, are snapshots as before.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional, Union

import numpy as np
import torch

from compare import format as fmt
from compare.statistics import SKETCH_SIZE

from .digest import word_sum
from .host_memory import tensor_address
from .snapshot import SnapshotPool
from .stats import (RAW_SUMS, SKETCH_SMALL, reduced, sketch_of_small, sketch_on_device,
                    stats_of_sums, tensor_sums)

SMALL_BYTES = 1 << 18   # tensors up to this size go into an arena
ARENA_BYTES = 16 << 20  # one arena; a full one is sealed and a new one started
ALIGN = 16              # slots start here: any dtype's view, and whole 64-bit words
TABLE_ROWS = 256        # rows of one table of numbers
WIDTH = len(RAW_SUMS) + SKETCH_SIZE  # a row of numbers: the raw sums, then the sketch
WANTS = ("values", "stats", "sketch", "digest")  # what a record can take of a tensor


_CPU = torch.device("cpu")
HOST_SMALL = SKETCH_SMALL  # CPU tensors up to this many elements go into a host arena
#                            (beyond, measured level with or slower than their own reductions)
HOST_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}  # those numpy reduces
HOST_CHUNK = 1 << 16     # elements widened to float64 at a time by a host arena's reduction


def on_host_arena(t: torch.Tensor) -> bool:
    """Whether the numbers of CPU tensor ``t`` (not empty; no values wanted) are taken into
    the step's :class:`StepBatch` (a :class:`_HostArena`): a small float32/float64 one, whose
    own reductions would cost more inside a step than its copy and its share of the arena's."""
    return t.dtype in HOST_FLOATS and t.device.type == "cpu" and t.numel() <= HOST_SMALL


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s records go through the step's :class:`StepBatch`: it lives on an
    accelerator (tests force CPU tensors through it, to count its syncs without one)."""
    return t.device.type != "cpu"


def _int64_on(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without a host sync (from pinned memory, on CUDA)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _Slot:
    """One record's tensor in an arena or a table: its row, where its bytes are, what it is."""

    __slots__ = ("row", "offset", "nbytes", "numel", "dtype", "shape", "sketch")

    def __init__(self, row: int, offset: int, nbytes: int, t: torch.Tensor, sketch: bool):
        self.row, self.offset, self.nbytes, self.numel = row, offset, nbytes, t.numel()
        self.dtype, self.shape, self.sketch = t.dtype, t.shape, sketch


class _Seal:
    """What one seal sent to the host: :meth:`wait` returns once it has landed."""

    def __init__(self, batch: "StepBatch"):
        self._batch = batch
        self._events: list = []
        self._landed = False
        self._lock = threading.Lock()

    def record(self, devices: set) -> None:
        for device in devices:
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._events.append(event)

    def wait(self) -> None:
        with self._lock:
            if not self._landed:
                self._batch.waited_for_seal()
                for event in self._events:
                    event.synchronize()
                self._landed = True


class _Open:
    """Records of one device taken since the last seal: an arena or a table."""

    def __init__(self, device: torch.device, pool: SnapshotPool):
        self.device, self._pool = device, pool
        self.slots: list[_Slot] = []
        self.seal: Optional[_Seal] = None
        self.host: dict[str, torch.Tensor] = {}   # what landed: "values", "numbers", "digests"
        self._rows: Optional[list] = None           # the numbers as lists, once landed
        self._words: Optional[list] = None          # the digests' word sums, once landed
        self._streams: set = set()                 # the streams its kernels ran on
        self._pooled: list[tuple] = []             # (host buffer, pinned) to give back
        self._pending = 0                         # records not yet released
        self.error: Optional[Exception] = None    # why its seal failed, if it did
        self._reduced: Optional[dict[str, torch.Tensor]] = None  # reduced, not yet sent

    def note_stream(self) -> None:
        if self.device.type == "cuda":
            self._streams.add(torch.cuda.current_stream(self.device))

    holds_values = False  # whether a record wants values from it (not only numbers)

    def reduce(self) -> None:
        """Launch the reductions now (the sealing stream ordered after every stream that
        wrote into it); :meth:`send` copies their results later."""
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            for stream in self._streams - {current}:
                current.wait_stream(stream)
            self._streams = {current}
        self._reduced = self.device_side()

    def send(self) -> None:
        """Copy :meth:`device_side` (reduced now, unless :meth:`reduce` ran) to the host,
        non-blocking from CUDA, into pinned buffers."""
        if self._reduced is None:
            self.reduce()
        reduced, self._reduced = self._reduced, None
        for name, t in reduced.items():
            if self.device.type == "cpu":
                self.host[name] = t
            elif self.device.type == "cuda":
                nbytes = t.numel() * t.element_size()
                buffer = self._pool.host_buffer(nbytes, pinned=True)
                self._pooled.append((buffer, True))
                host = buffer[:nbytes].view(t.dtype).view(t.shape)
                self.host[name] = host.copy_(t, non_blocking=True)
            else:  # other accelerators: a plain synchronous copy
                self.host[name] = t.to("cpu")

    def device_side(self) -> dict[str, torch.Tensor]:
        """What the host needs, still on the device (reductions launched now)."""
        raise NotImplementedError

    def row(self, slot: _Slot) -> list[float]:
        """``slot``'s numbers, once landed (the table read as lists once)."""
        if self._rows is None:
            self._rows = self.host["numbers"].tolist()
        return self._rows[slot.row]

    def word_sum(self, slot: _Slot) -> int:
        if self._words is None:
            self._words = self.host["digests"].tolist()
        return self._words[slot.row]

    def taken(self) -> None:
        self._pending += 1

    def release(self) -> None:
        """One record is done; the last one, once sealed, gives the host buffers back."""
        self._pending -= 1
        if self._pending == 0 and self.seal is not None:
            for buffer, pinned in self._pooled:
                self._pool.give(buffer, pinned)
            self._pooled.clear()
            self.host.clear()


class _Arena(_Open):
    """Small tensors of one device and dtype, copied one after another into one buffer."""

    def __init__(self, device: torch.device, dtype: torch.dtype, pool: SnapshotPool):
        super().__init__(device, pool)
        self.dtype = dtype
        self.buffer = torch.empty(ARENA_BYTES, dtype=torch.uint8, device=device)
        self._typed = self.buffer.view(dtype)  # the arena as elements of its dtype
        self.used = 0
        self.stats = self.digests = self.values = False  # what some slot wants

    def add(self, t: torch.Tensor, nbytes: int, values: bool, stats: bool, sketch: bool,
            digest: bool) -> Optional[_Slot]:
        """Copy ``t`` into the next slot; None when it is full."""
        offset = -(-self.used // ALIGN) * ALIGN
        if offset + nbytes > ARENA_BYTES:
            return None
        slot = _Slot(len(self.slots), offset, nbytes, t, sketch)
        first = offset // t.element_size()
        self._typed[first:first + slot.numel].view(t.shape).copy_(t)
        if digest and nbytes % 8:  # a digest reads the last 64-bit word padded with zeros
            self.buffer[offset + nbytes:-(-(offset + nbytes) // 8) * 8].zero_()
        self.note_stream()
        self.slots.append(slot)
        self.used = offset + nbytes
        self.values |= values
        self.stats |= stats
        self.digests |= digest
        return slot

    @property
    def holds_values(self) -> bool:
        return self.values

    @staticmethod
    def view(buffer: torch.Tensor, slot: _Slot) -> torch.Tensor:
        return buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)

    def device_side(self) -> dict[str, torch.Tensor]:
        out = {}
        if self.values:
            out["values"] = self.buffer[:self.used]
        if self.stats:
            out["numbers"] = self._numbers()
        if self.digests:
            out["digests"] = self._word_sums()
        return out

    def _segments(self, size: int) -> list[int]:
        """Segment lengths in units of ``size`` bytes over the used buffer: (gap, slot) pairs."""
        lengths, end = [], 0
        for slot in self.slots:
            lengths += [(slot.offset - end) // size, -(-slot.nbytes // size)]
            end = slot.offset + -(-slot.nbytes // size) * size
        return lengths

    def _numbers(self) -> torch.Tensor:
        """Every slot's raw sums (segmented reductions over the arena, the gaps between slots
        being segments of their own) and, where wanted, sketch."""
        x = reduced(self.buffer[:self.used].view(self.dtype))
        lengths = _int64_on(self._segments(self.dtype.itemsize), self.device)
        wide = x.to(torch.float64)
        numbers = torch.full((len(self.slots), WIDTH), float("nan"), dtype=torch.float64,
                             device=self.device)
        for column, (values, how) in enumerate((
                (x, "min"), (x, "max"), (wide, "sum"), (torch.square(wide), "sum"),
                (torch.isnan(x).to(torch.float64), "sum"),
                (torch.isinf(x).to(torch.float64), "sum"),
                ((x == 0).to(torch.float64), "sum"))):
            numbers[:, column] = torch.segment_reduce(values, how, lengths=lengths,
                                                      unsafe=True)[1::2]
        for slot in self.slots:
            if slot.sketch:
                numbers[slot.row, len(RAW_SUMS):] = sketch_on_device(
                    self.view(self.buffer, slot))
        return numbers

    def _word_sums(self) -> torch.Tensor:
        """Every slot's 64-bit word sum (docs/format.md, "Digest"), wrapping modulo 2**64."""
        words = self.buffer[:-(-self.used // 8) * 8].view(torch.int64)
        gap = len(self.slots)  # the gaps' sums land in a last, dropped, row
        owners = _int64_on([i // 2 if i % 2 else gap for i in range(2 * gap)], self.device)
        lengths = self._segments(8)
        ids = torch.repeat_interleave(owners, _int64_on(lengths, self.device),
                                      output_size=sum(lengths))  # known: no sync for it
        sums = torch.zeros(len(self.slots) + 1, dtype=torch.int64, device=self.device)
        return sums.index_add_(0, ids, words)[:-1]


class _HostArena(_Open):
    """Small CPU float tensors of one dtype whose numbers alone are wanted (statistics, sketch,
    digest): copied one after another into a buffer of the snapshot pool, 8-byte aligned for
    the digests' words, and reduced together when sealed (or full), the buffer then given
    back. Its numbers are those of the per-tensor path (:mod:`dumper.stats`,
    :mod:`dumper.digest`) but for the float64 sums' order."""

    def __init__(self, dtype: torch.dtype, pool: SnapshotPool):
        super().__init__(_CPU, pool)
        self.dtype = dtype
        self.buffer = pool.host_buffer(ARENA_BYTES, pinned=False)
        self._typed = self.buffer.view(dtype)
        self._address = self.buffer.data_ptr()
        self.used = 0
        self.stats = self.digests = False  # what some slot wants

    def add(self, t: torch.Tensor, nbytes: int, values: bool, stats: bool, sketch: bool,
            digest: bool) -> Optional[_Slot]:
        """Copy ``t`` into the next slot; None when full (a word is kept spare: the
        segmented reductions end each slot with an index of its own). A plain tensor's bytes
        are copied by address (:mod:`dumper.host_memory`): a hook's every microsecond counts."""
        offset = -(-self.used // 8) * 8
        if self.buffer is None or offset + nbytes + 8 > ARENA_BYTES:  # given back: see release
            return None
        address = tensor_address(t)
        if address is not None:
            ctypes.memmove(self._address + offset, address, nbytes)
        else:  # a view, a wrapper: torch copies it
            first = offset // self.dtype.itemsize
            self._typed[first:first + t.numel()].view(t.shape).copy_(t)
        if digest and nbytes % 8:  # a digest reads the last 64-bit word padded with zeros
            ctypes.memset(self._address + offset + nbytes, 0, 8 - nbytes % 8)
        slot = _Slot(len(self.slots), offset, nbytes, t, sketch)
        self.slots.append(slot)
        self.used = offset + nbytes
        self.stats |= stats or sketch
        self.digests |= digest
        return slot

    def device_side(self) -> dict[str, torch.Tensor]:
        """Every slot's numbers, reduced with numpy; the buffer goes back to the pool."""
        if self.buffer is None:
            raise RuntimeError("the step's records were discarded before their numbers were read")
        out = {"numbers": torch.from_numpy(self._numbers())} if self.stats else {}
        if self.digests:
            out["digests"] = torch.from_numpy(self._word_sums())
        self._give_back()
        return out

    def release(self) -> None:
        """As :meth:`_Open.release`; the buffer also goes back when every record taken is
        released before the seal (a step aborted, a writer failed): the arena takes no more."""
        super().release()
        if self._pending == 0:
            self._give_back()

    def _give_back(self) -> None:
        if self.buffer is not None:
            buffer, self.buffer = self.buffer, None
            self._typed = None
            self._pool.give(buffer, pinned=False)

    def _bounds(self) -> tuple[np.ndarray, np.ndarray]:
        size = self.dtype.itemsize
        starts = np.fromiter((slot.offset // size for slot in self.slots), dtype=np.int64,
                             count=len(self.slots))
        return starts, starts + np.fromiter((slot.numel for slot in self.slots),
                                            dtype=np.int64, count=len(self.slots))

    def _numbers(self) -> np.ndarray:
        """The raw sums by segmented reductions over the slots (each slot's end an index too:
        the gaps' results are dropped), a chunk of slots at a time so that the chunk and its
        float64 copy stay in cache; NaN/Inf counts for the slots whose extremes are not
        finite; sketches slot by slot."""
        starts, ends = self._bounds()
        x = self._typed[:ends[-1] + 1].numpy()  # the pool's own buffer; one spare element
        edges = np.stack([starts, ends], axis=1).reshape(-1)
        numbers = np.full((len(self.slots), WIDTH), np.nan)
        columns = {name: numbers[:, i] for i, name in enumerate(RAW_SUMS)}
        scratch = np.empty(HOST_CHUNK + HOST_SMALL + 1)
        first = np.searchsorted(starts, np.arange(0, ends[-1], HOST_CHUNK))
        with np.errstate(all="ignore"):  # inf - inf, overflowing squares: counted below
            for lo, hi in zip(first, np.append(first[1:], len(starts))):
                if lo == hi:
                    continue
                part = x[starts[lo]:ends[hi - 1] + 1]
                local = edges[2 * lo:2 * hi] - starts[lo]
                columns["min"][lo:hi] = np.minimum.reduceat(part, local)[::2]
                columns["max"][lo:hi] = np.maximum.reduceat(part, local)[::2]
                columns["zero"][lo:hi] = np.add.reduceat(part == 0, local, dtype=np.int64)[::2]
                wide = scratch[:len(part)]
                wide[:] = part
                columns["sum"][lo:hi] = np.add.reduceat(wide, local)[::2]
                np.multiply(wide, wide, out=wide)
                columns["sumsq"][lo:hi] = np.add.reduceat(wide, local)[::2]
        columns["nan"][:] = columns["inf"][:] = 0.0
        for i in np.flatnonzero(~np.isfinite(columns["min"]) | ~np.isfinite(columns["max"])):
            values = x[starts[i]:ends[i]]
            columns["nan"][i] = np.count_nonzero(np.isnan(values))
            columns["inf"][i] = np.count_nonzero(np.isinf(values))
        for slot, start, end in zip(self.slots, starts, ends):
            if slot.sketch:
                numbers[slot.row, len(RAW_SUMS):] = sketch_of_small(x[start:end].astype(
                    np.float64))
        return numbers

    def _word_sums(self) -> np.ndarray:
        """Every slot's 64-bit word sum (docs/format.md, "Digest"), wrapping modulo 2**64
        (meaningless for a slot that wants none: its last word was not padded)."""
        words = self.buffer[:(-(-self.used // 8) + 1) * 8].view(torch.int64).numpy()  # spare
        edges = np.array([[slot.offset // 8, -(-(slot.offset + slot.nbytes) // 8)]
                          for slot in self.slots], dtype=np.int64).reshape(-1)
        return np.add.reduceat(words, edges)[::2]  # integers wrap, as the definition does


class _Table(_Open):
    """Numbers of larger tensors of one device, reduced one by one into rows."""

    def __init__(self, device: torch.device, pool: SnapshotPool):
        super().__init__(device, pool)
        self.numbers = torch.full((TABLE_ROWS, WIDTH), float("nan"), dtype=torch.float64,
                                  device=device)
        self.digests = torch.zeros(TABLE_ROWS, dtype=torch.int64, device=device)

    def add(self, t: torch.Tensor, nbytes: int, values: bool, stats: bool, sketch: bool,
            digest: bool) -> Optional[_Slot]:
        if len(self.slots) == TABLE_ROWS:
            return None
        slot = _Slot(len(self.slots), 0, nbytes, t, sketch)
        row = self.numbers[slot.row]
        if stats:
            tensor_sums(reduced(t.reshape(-1)), row)
        if sketch:
            row[len(RAW_SUMS):] = sketch_on_device(t)
        if digest:
            self.digests[slot.row] = word_sum(t)
        self.note_stream()
        self.slots.append(slot)
        return slot

    def device_side(self) -> dict[str, torch.Tensor]:
        rows = len(self.slots)
        return {"numbers": self.numbers[:rows], "digests": self.digests[:rows]}


class Pending:
    """A record's values, statistics, sketch or digest from an arena or a table: :meth:`wait`
    returns them on the host once their seal has landed (sealing first if it has not
    happened: the writer got there before the step ended); :meth:`release` lets them go."""

    __slots__ = ("_batch", "_open", "_slot", "what")

    def __init__(self, batch: "StepBatch", where: _Open, slot: _Slot, what: str):
        self._batch, self._open, self._slot, self.what = batch, where, slot, what
        where.taken()

    @property
    def nbytes(self) -> int:
        """Bytes of values held for the record (the byte budget counts them)."""
        return self._slot.nbytes if self.what == "values" else 0

    def wait(self) -> Union[torch.Tensor, tuple, int]:
        """The values (a CPU tensor), the statistics or the sketch (tuples of float), or the
        digest (an int)."""
        where, slot = self._open, self._slot
        if where.seal is None:
            self._batch.seal(where)
        where.seal.wait()
        if where.error is not None:
            raise where.error.with_traceback(None)
        if self.what == "values":
            return _Arena.view(where.host["values"], slot)
        if self.what == "digest":
            return fmt.fold_word_sum(where.word_sum(slot))
        row = where.row(slot)
        if self.what == "sketch":
            return tuple(row[len(RAW_SUMS):])
        return stats_of_sums(row, slot.numel)

    def again(self) -> Optional["Pending"]:
        """The same numbers for another record of the same tensor (released on its own);
        None once this one is released (its buffers may be gone)."""
        with self._batch.lock:
            if self._open is None:
                return None
            return Pending(self._batch, self._open, self._slot, self.what)

    def release(self) -> int:
        """Let it go; returns the budget's bytes given back (:attr:`nbytes`, once)."""
        with self._batch.lock:  # against hooks adding to its arena, a seal reading it
            where, self._open = self._open, None
            if where is None:
                return 0
            where.release()
            return self.nbytes


class StepBatch:
    """The arenas and tables of one step (see the module docstring); thread-safe (hooks run on
    the training thread and on autograd's)."""

    def __init__(self, pool: SnapshotPool):
        self._pool = pool
        self._open: dict[tuple, _Open] = {}
        self._full: list[_Open] = []  # reduced on their device, sent with the next seal
        self.lock = threading.RLock()  # Pending.release takes it too
        self.seals = 0       # seals so far
        self.host_syncs = 0  # seals waited for on the host (a device sync each, by the writer)

    def waited_for_seal(self) -> None:
        with self.lock:
            self.host_syncs += 1

    def take(self, t: torch.Tensor, values: bool = False, stats: bool = False,
             sketch: bool = False, digest: bool = False) -> Optional[dict[str, Pending]]:
        """Take ``t`` (not empty): a :class:`Pending` for each of what is wanted; None for
        values of a tensor too large for an arena (snapshot it instead). The numbers of a CPU
        tensor (:func:`on_host_arena`) go into a :class:`_HostArena`."""
        t = t.detach()
        nbytes = t.numel() * t.element_size()
        small = nbytes <= min(SMALL_BYTES, ARENA_BYTES)
        if values and not small:
            return None
        host = small and not values and on_host_arena(t)
        key = (t.device, t.dtype, host) if small else (t.device, None, False)
        with self.lock:  # also while the copy is launched: a seal must come after it
            where = self._open.get(key)
            slot = None if where is None else where.add(t, nbytes, values, stats, sketch,
                                                        digest)
            if slot is None:
                if where is not None:
                    self._full_one(key, where)
                where = self._open[key] = (
                    _HostArena(t.dtype, self._pool) if host else
                    _Arena(t.device, t.dtype, self._pool) if small else
                    _Table(t.device, self._pool))
                slot = where.add(t, nbytes, values, stats, sketch, digest)
            return {what: Pending(self, where, slot, what)
                    for what, wanted in zip(WANTS, (values, stats, sketch, digest)) if wanted}

    def _full_one(self, key: tuple, where: _Open) -> None:
        """``where`` is full: values go to the host now (a seal); numbers only are reduced
        now and sent with the next seal (one sync per step for statistics and digests)."""
        if where.holds_values:
            self._seal_now([where])
            return
        del self._open[key]
        try:
            where.reduce()
        except Exception as exc:  # as in _seal_now
            where.error = exc
        self._full.append(where)

    def seal(self, where: Optional[_Open] = None) -> None:
        """Send to the host what was taken (all of it, or what ``where`` holds if it is still
        open): when the step ends, when the writer needs it, when the byte budget needs room."""
        with self.lock:
            if where is None:
                self._seal_now(list(self._open.values()) + self._full)
            elif where.seal is None:
                self._seal_now([where])

    def _seal_now(self, opened: list[_Open]) -> None:
        if not opened:
            return
        self.seals += 1
        seal = _Seal(self)
        for where in opened:
            for key, value in list(self._open.items()):
                if value is where:
                    del self._open[key]
            if where in self._full:
                self._full.remove(where)
            if where.error is not None:  # its reduction failed already
                where.seal = seal
                continue
            try:
                where.send()
            except Exception as exc:  # a tensor type nobody foresaw must not stop training:
                where.error = exc     # its records are written without numbers
            where.seal = seal
        seal.record({where.device for where in opened})
