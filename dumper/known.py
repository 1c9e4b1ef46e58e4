"""What a step already took of a tensor, for its other records: numbers and values.

One tensor is often recorded several times in a step: a module's output is the next module's
input and its parent's output; the gradient a layer sends back is the gradient its neighbour
receives. Its statistics, sketch, digest and values are taken once: a later record of the
*same tensor object at the same version* (autograd's version counter, bumped by every
in-place change, as :mod:`dumper.dataflow` uses it) shares them, and the writer stores its
values as a hard link to the first record's dataset (docs/format.md). They are bit for bit
what taking them again would give; a tensor changed in place in between, one that died and
whose id was reused, or an inference tensor (no version counter) is taken anew. A change
autograd does not see either (through ``.data``) is not seen.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional, Union

import torch

from .arena import Pending
from .snapshot import Snapshot

VALUES = "values"
Taken = dict  # what -> a tuple (statistics, sketch), an int (digest), or a Pending of them


class SharedValues:
    """A record's values that an earlier record of the same tensor (``first``) took: read
    through that one's copy, held until :meth:`release`; no bytes of its own in the budget.
    The writer links the record's dataset to ``first``'s where that one is written."""

    __slots__ = ("first", "_values")
    nbytes = 0

    def __init__(self, first: Any, values: Union[Snapshot, Pending]):
        self.first, self._values = first, values

    def wait(self) -> torch.Tensor:
        return self._values.wait()

    def release(self) -> None:
        self._values.release()


class KnownTensors:
    """What was taken of each tensor in one step, weakly by tensor (thread-safe: a race only
    takes a tensor anew)."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, int, Taken]] = {}

    def _taken(self, t: torch.Tensor) -> Optional[Taken]:
        entry = self._known.get(id(t))
        if entry is None or t.is_inference():
            return None
        ref, version, taken = entry
        return taken if ref() is t and t._version == version else None

    def _remember(self, t: torch.Tensor, what: Taken) -> None:
        """Add ``what`` to what is known of ``t`` at its current version."""
        if t.is_inference():
            return
        taken = self._taken(t)
        if taken is None:
            self._known[id(t)] = (weakref.ref(t), t._version, dict(what))
        else:
            taken.update(what)

    def numbers(self, t: torch.Tensor, wanted: tuple[str, ...]) -> Optional[Taken]:
        """The numbers ``wanted`` of ``t`` if they were taken at its current version, each a
        record's own (a :class:`Pending` is shared through :meth:`Pending.again`); None if not."""
        taken = self._taken(t)
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

    def put_numbers(self, t: torch.Tensor, numbers: Taken) -> None:
        """Remember ``numbers``, taken of ``t`` now (shared while the record owning them is
        not written)."""
        self._remember(t, numbers)

    def values(self, t: torch.Tensor) -> Optional[SharedValues]:
        """``t``'s values as a record took them at its current version, or None."""
        taken = self._taken(t)
        if taken is None or VALUES not in taken:
            return None
        record, values = taken[VALUES]
        again = values.again()
        return None if again is None else SharedValues(record, again)

    def put_values(self, t: torch.Tensor, record: Any) -> None:
        """Remember that ``record`` took ``t``'s values now (its ``snapshot``)."""
        self._remember(t, {VALUES: (record, record.snapshot)})
