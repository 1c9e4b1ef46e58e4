"""What a step already took of a tensor, for its other records: numbers and values.

One tensor is often recorded several times in a step: a module's output is the next module's
input and its parent's output; the gradient a layer sends back is the gradient its neighbour
receives. Its statistics, sketch, digest and values are taken once: a later record of the same
tensor shares them, and the writer stores its values as a hard link to the first record's
dataset (docs/format.md, "Layout").

"The same tensor" means the same tensor object, at the same autograd version (bumped by every
in-place change autograd sees, as :mod:`dumper.dataflow` uses it), at the same address with
the same shape and dtype, whose first, middle and last bytes (:data:`WINDOW` each) are what
they were: a write that autograd does not see (an in-place collective, GradScaler's unscaling,
a fused optimizer, a kernel writing through a raw pointer, ``.data``) changes those bytes
unless it spares all three windows. Only plain contiguous CPU tensors are shared (their bytes
are read by address, :mod:`dumper.host_memory`; an accelerator's would cost a sync), and never
parameters or their gradients (:data:`UNSHARED`), which optimizers, scalers and collectives
change in place in the very step. Anything else is taken anew.
"""
from __future__ import annotations

import weakref
from ctypes import string_at
from typing import Any, Optional

import torch

from compare import format as fmt

from .arena import VALUES, Pending
from .snapshot import Snapshot

WINDOW = 32  # bytes compared at the start, the middle and the end of a tensor
UNSHARED = frozenset({fmt.PARAM, fmt.PARAM_GRAD})  # kinds whose records are never shared
Taken = dict  # what -> a tuple (statistics, sketch), an int (digest), or a Pending of them


# A CPU tensor as it is now (see the module docstring): address, shape, dtype, version, and
# its first, middle and last WINDOW bytes
Identity = tuple


def identity(t: torch.Tensor) -> Optional[Identity]:
    """``t``'s :data:`Identity`, or None for a tensor that is not shared (a hook's every
    microsecond counts: a plain tuple, a few reads by address)."""
    if type(t) is not torch.Tensor or not t.is_cpu or not t.is_contiguous() or \
            t.is_inference():
        return None
    try:
        address = t.data_ptr()
    except RuntimeError:  # e.g. a functorch wrapper: no storage of its own
        return None
    nbytes = t.nbytes
    if not address or not nbytes:
        return None
    if nbytes <= 3 * WINDOW:
        sample = string_at(address, nbytes)
    else:
        middle = address + nbytes // 2 // 8 * 8
        sample = (string_at(address, WINDOW) + string_at(middle, WINDOW)
                  + string_at(address + nbytes - WINDOW, WINDOW))
    return address, t.shape, t.dtype, t._version, sample


class SharedValues:
    """A record's values that an earlier record of the same tensor (``first``) took: read
    through that one's snapshot, held until :meth:`release`; no bytes of its own in the
    budget. The writer links the record's dataset to ``first``'s where that one is written."""

    __slots__ = ("first", "_values")
    nbytes = 0

    def __init__(self, first: Any, values: Snapshot):
        self.first, self._values = first, values

    def wait(self) -> torch.Tensor:
        return self._values.wait()

    def release(self) -> int:
        """Let go of the snapshot; the budget's bytes it gives back (the last holder's)."""
        return self._values.release()


class KnownTensors:
    """What was taken of each tensor in one step, weakly by tensor (thread-safe: a race only
    takes a tensor anew)."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, Identity, Taken]] = {}

    def identify(self, t: torch.Tensor, kind: str) -> Optional[Identity]:
        """``t``'s identity now, for :meth:`numbers`, :meth:`values` and the ``put_`` methods;
        None where a record of ``kind`` does not share."""
        return None if kind in UNSHARED else identity(t)

    def _taken(self, t: torch.Tensor, now: Identity) -> Optional[Taken]:
        entry = self._known.get(id(t))
        if entry is None:
            return None
        ref, then, taken = entry
        return taken if ref() is t and then == now else None

    def _remember(self, t: torch.Tensor, then: Identity, what: Taken) -> None:
        """Add ``what``, taken of ``t`` when it was ``then``, to what is known of it."""
        taken = self._taken(t, then)
        if taken is None:
            self._known[id(t)] = (weakref.ref(t), then, dict(what))
        else:
            taken.update(what)

    def numbers(self, t: torch.Tensor, now: Identity, wanted: tuple[str, ...]
                ) -> Optional[Taken]:
        """The numbers ``wanted`` of ``t`` if they were taken of it as it is ``now``, each a
        record's own (a :class:`Pending` is shared through :meth:`Pending.again`); None if not."""
        taken = self._taken(t, now)
        if taken is None or any(what not in taken for what in wanted):
            return None
        shared: Taken = {}
        for what in wanted:
            value = taken[what]
            if isinstance(value, Pending):
                value = value.again()
                if value is None:  # the first record was written and let its buffers go
                    for earlier in shared.values():
                        if isinstance(earlier, Pending):
                            earlier.release()
                    return None
            shared[what] = value
        return shared

    def put_numbers(self, t: torch.Tensor, then: Identity, numbers: Taken) -> None:
        """Remember ``numbers``, taken of ``t`` as it was ``then``."""
        self._remember(t, then, numbers)

    def values(self, t: torch.Tensor, now: Identity) -> Optional[SharedValues]:
        """``t``'s values as a record took them of it as it is ``now``, or None."""
        taken = self._taken(t, now)
        if taken is None or VALUES not in taken:
            return None
        record, snapshot = taken[VALUES]
        again = snapshot.again()
        return None if again is None else SharedValues(record, again)

    def put_values(self, t: torch.Tensor, then: Identity, record: Any) -> None:
        """Remember that ``record`` took ``t``'s values (its snapshot) as it was ``then``."""
        if isinstance(record.snapshot, Snapshot):
            self._remember(t, then, {VALUES: (record, record.snapshot)})
