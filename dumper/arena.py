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
arena* (:class:`~dumper.stores.HostArena`) and reduced together with numpy's segmented reductions when it
is sealed (docs/benchmarks.md). Their values, when wanted, are snapshots as before.
"""
from __future__ import annotations

import threading
from typing import Optional, Union

import torch

from compare import format as fmt

from .snapshot import SnapshotPool
from .stats import RAW_SUMS, stats_of_sums
from . import stores
from .stores import (HOST_FLOATS, HOST_SMALL, DeviceArena, HostArena, NumbersTable, Seal, Slot,
                     Store)

SMALL_BYTES = 1 << 18   # tensors up to this size go into an arena
VALUES = "values"  # what a record can take of a tensor: its values, or its numbers
NUMBERS = ("stats", "sketch", "digest")
WANTS = (VALUES, *NUMBERS)


def on_host_arena(t: torch.Tensor) -> bool:
    """Whether the numbers of CPU tensor ``t`` (not empty; no values wanted) are taken into
    the step's :class:`StepBatch` (a :class:`HostArena`): a small float32/float64 one, whose
    own reductions would cost more inside a step than its copy and its share of the arena's."""
    return t.dtype in HOST_FLOATS and t.device.type == "cpu" and t.numel() <= HOST_SMALL


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s records go through the step's :class:`StepBatch`: it lives on an
    accelerator (tests force CPU tensors through it, to count its syncs without one)."""
    return t.device.type != "cpu"


class Pending:
    """A record's values, statistics, sketch or digest from an arena or a table: :meth:`wait`
    returns them on the host once their seal has landed (sealing first if it has not
    happened: the writer got there before the step ended); :meth:`release` lets them go."""

    __slots__ = ("_batch", "_open", "_slot", "what")

    def __init__(self, batch: "StepBatch", where: Store, slot: Slot, what: str):
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
            return DeviceArena.view(where.host["values"], slot)
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
        self._open: dict[tuple, Store] = {}
        self._full: list[Store] = []  # reduced on their device, sent with the next seal
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
        tensor (:func:`on_host_arena`) go into a :class:`HostArena`."""
        t = t.detach()
        nbytes = t.numel() * t.element_size()
        small = nbytes <= min(SMALL_BYTES, stores.ARENA_BYTES)
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
                    HostArena(t.dtype, self._pool) if host else
                    DeviceArena(t.device, t.dtype, self._pool) if small else
                    NumbersTable(t.device, self._pool))
                slot = where.add(t, nbytes, values, stats, sketch, digest)
            return {what: Pending(self, where, slot, what)
                    for what, wanted in zip(WANTS, (values, stats, sketch, digest)) if wanted}

    def _full_one(self, key: tuple, where: Store) -> None:
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

    def seal(self, where: Optional[Store] = None) -> None:
        """Send to the host what was taken (all of it, or what ``where`` holds if it is still
        open): when the step ends, when the writer needs it, when the byte budget needs room."""
        with self.lock:
            if where is None:
                self._seal_now(list(self._open.values()) + self._full)
            elif where.seal is None:
                self._seal_now([where])

    def _seal_now(self, opened: list[Store]) -> None:
        if not opened:
            return
        self.seals += 1
        seal = Seal(self)
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
