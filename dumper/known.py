"""Numbers a step already took of a tensor, for its other records.

One tensor is often recorded several times in a step: a module's output is the next module's
input and its parent's output; the gradient a layer sends back is the gradient its neighbour
receives. Its statistics, sketch and digest are taken once: a later record of the *same tensor
object at the same version* (autograd's version counter, bumped by every in-place change, as
:mod:`dumper.dataflow` uses it) gets the same numbers. Those are bit for bit what taking them
again would give; a tensor changed in place in between, one that died and whose id was reused,
or an inference tensor (no version counter) is taken anew.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .arena import Pending

Numbers = dict  # what -> a tuple (statistics, sketch), an int (digest), or a Pending of them


class KnownNumbers:
    """The numbers taken of each tensor in one step, weakly by tensor (thread-safe: a race
    only takes numbers anew)."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, int, Numbers]] = {}

    def get(self, t: torch.Tensor, wanted: tuple[str, ...]) -> Optional[Numbers]:
        """The numbers ``wanted`` of ``t`` if they were taken at its current version, each a
        record's own (a :class:`Pending` is shared through :meth:`Pending.again`); None if not."""
        entry = self._known.get(id(t))
        if entry is None or t.is_inference():
            return None
        ref, version, numbers = entry
        if ref() is not t or t._version != version or any(w not in numbers for w in wanted):
            return None
        shared: Numbers = {}
        for what in wanted:
            value = numbers[what]
            if isinstance(value, Pending):
                value = value.again()
                if value is None:  # the first record was written and let its buffers go
                    for taken in shared.values():
                        if isinstance(taken, Pending):
                            taken.release()
                    return None
            shared[what] = value
        return shared

    def put(self, t: torch.Tensor, numbers: Numbers) -> None:
        """Remember ``numbers``, taken of ``t`` now (kept while the record that owns them is)."""
        if not t.is_inference():
            self._known[id(t)] = (weakref.ref(t), t._version, numbers)
