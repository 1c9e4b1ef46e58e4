"""Where a step's batch (:mod:`dumper.arena`) keeps what the hooks took, until its seal.

A :class:`DeviceArena` holds small tensors of one accelerator and dtype, copied one after
another into one buffer and reduced together (segmented reductions) when sealed; a
:class:`HostArena` the small CPU float tensors whose numbers alone are wanted, reduced with
numpy's segmented reductions; a :class:`NumbersTable` the numbers of larger accelerator
tensors, reduced one by one into rows. Each is a :class:`Store` of slots (:class:`Slot`) that a
:class:`Seal` sends to the host.
"""
from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from compare.statistics import SKETCH_SIZE

from .digest import word_sum
from .host_memory import tensor_address
from .snapshot import SnapshotPool
from .stats import (RAW_SUMS, SKETCH_SMALL, reduced, sketch_of_small, sketch_on_device,
                    tensor_sums)

if TYPE_CHECKING:
    from .arena import StepBatch

ARENA_BYTES = 16 << 20  # one arena; a full one is sealed and a new one started
ALIGN = 16              # slots start here: any dtype's view, and whole 64-bit words
TABLE_ROWS = 256        # rows of one table of numbers
WIDTH = len(RAW_SUMS) + SKETCH_SIZE  # a row of numbers: the raw sums, then the sketch

_CPU = torch.device("cpu")
HOST_SMALL = SKETCH_SMALL  # CPU tensors up to this many elements go into a host arena
#                            (beyond, measured level with or slower than their own reductions)
HOST_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}  # those numpy reduces
HOST_CHUNK = 1 << 16     # elements widened to float64 at a time by a host arena's reduction


def _int64_on(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without a host sync (from pinned memory, on CUDA)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Slot:
    """One record's tensor in an arena or a table: its row, where its bytes are, what it is."""

    __slots__ = ("row", "offset", "nbytes", "numel", "dtype", "shape", "sketch")

    def __init__(self, row: int, offset: int, nbytes: int, t: torch.Tensor, sketch: bool):
        self.row, self.offset, self.nbytes, self.numel = row, offset, nbytes, t.numel()
        self.dtype, self.shape, self.sketch = t.dtype, t.shape, sketch


class Seal:
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


class Store:
    """Records of one device taken since the last seal: an arena or a table."""

    def __init__(self, device: torch.device, pool: SnapshotPool):
        self.device, self._pool = device, pool
        self.slots: list[Slot] = []
        self.seal: Optional[Seal] = None
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

    def row(self, slot: Slot) -> list[float]:
        """``slot``'s numbers, once landed (the table read as lists once)."""
        if self._rows is None:
            self._rows = self.host["numbers"].tolist()
        return self._rows[slot.row]

    def word_sum(self, slot: Slot) -> int:
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


class DeviceArena(Store):
    """Small tensors of one device and dtype, copied one after another into one buffer."""

    def __init__(self, device: torch.device, dtype: torch.dtype, pool: SnapshotPool):
        super().__init__(device, pool)
        self.dtype = dtype
        self.buffer = torch.empty(ARENA_BYTES, dtype=torch.uint8, device=device)
        self._typed = self.buffer.view(dtype)  # the arena as elements of its dtype
        self.used = 0
        self.stats = self.digests = self.values = False  # what some slot wants

    def add(self, t: torch.Tensor, nbytes: int, values: bool, stats: bool, sketch: bool,
            digest: bool) -> Optional[Slot]:
        """Copy ``t`` into the next slot; None when it is full."""
        offset = -(-self.used // ALIGN) * ALIGN
        if offset + nbytes > ARENA_BYTES:
            return None
        slot = Slot(len(self.slots), offset, nbytes, t, sketch)
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
    def view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
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


class HostArena(Store):
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
            digest: bool) -> Optional[Slot]:
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
        slot = Slot(len(self.slots), offset, nbytes, t, sketch)
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
        """As :meth:`Store.release`; the buffer also goes back when every record taken is
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


class NumbersTable(Store):
    """Numbers of larger tensors of one device, reduced one by one into rows."""

    def __init__(self, device: torch.device, pool: SnapshotPool):
        super().__init__(device, pool)
        self.numbers = torch.full((TABLE_ROWS, WIDTH), float("nan"), dtype=torch.float64,
                                  device=device)
        self.digests = torch.zeros(TABLE_ROWS, dtype=torch.int64, device=device)

    def add(self, t: torch.Tensor, nbytes: int, values: bool, stats: bool, sketch: bool,
            digest: bool) -> Optional[Slot]:
        if len(self.slots) == TABLE_ROWS:
            return None
        slot = Slot(len(self.slots), 0, nbytes, t, sketch)
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
