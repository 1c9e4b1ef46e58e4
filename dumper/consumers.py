"""Live consumers: user code called with each captured record on the writer's thread, off the
training thread (``HookerAndDumper.add_consumer``), e.g. to stream statistics to TensorBoard.

Data flows one way: the writer, once it has a record's values or statistics, hands a
:class:`CapturedRecord` to every consumer whose ``kinds``/``modules`` select it. A consumer
that raises is reported (one warning per consumer and step) and left out for the rest of the
step; training and the dump go on.
"""
from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Callable, Iterable, Optional

import torch
from torch.utils.hooks import RemovableHandle

from compare import format as fmt

from .record import Record
from .selection import Patterns


@dataclasses.dataclass(frozen=True)
class CapturedRecord:
    """One captured tensor, as a consumer sees it (fields as the index's columns). ``values`` is
    the snapshot (a CPU tensor, valid only during the call and shared by the records of the
    same tensor, :mod:`dumper.known`: read it, copy what you keep, never change it), None for
    statistics-only records, which carry ``stats`` (``stat_min`` ... as in the index) instead."""

    epoch: int
    step: int
    module: str
    cls: str
    call: int
    call_idx: int
    micro_batch: int
    kind: str
    index: int
    path: str
    values: Optional[torch.Tensor]
    stats: Optional[dict]


Consumer = Callable[[CapturedRecord], None]


@dataclasses.dataclass
class _Registered:
    fn: Consumer
    kinds: Optional[frozenset]
    modules: Optional[tuple]

    def wants(self, record: Record) -> bool:
        return ((self.kinds is None or record.kind in self.kinds)
                and (self.modules is None or fmt.module_matches(record.call.module,
                                                                 record.call.cls, self.modules)))


class Consumers:
    """The consumers of a dumper (a mapping of handles to registrations, like torch's hook
    dicts): :meth:`add` returns a handle whose ``remove()`` takes the consumer out."""

    def __init__(self):
        # an OrderedDict: RemovableHandle keeps a weak reference to it (a dict allows none)
        self._registered: collections.OrderedDict[int, _Registered] = collections.OrderedDict()

    def add(self, fn: Consumer, kinds: Optional[Iterable[str]] = None,
            modules: Patterns = None) -> RemovableHandle:
        if not callable(fn):
            raise TypeError(f"add_consumer needs a callable, got {type(fn).__name__}")
        kinds = None if kinds is None else frozenset(kinds)
        unknown = sorted((kinds or frozenset()) - set(fmt.KINDS))
        if unknown:
            raise ValueError(f"unknown record kind(s) {unknown}; choose among {list(fmt.KINDS)}")
        modules = None if modules is None else ((modules,) if isinstance(modules, str)
                                                else tuple(modules))
        handle = RemovableHandle(self._registered)
        self._registered[handle.id] = _Registered(fn, kinds, modules)
        return handle

    def __bool__(self) -> bool:
        return bool(self._registered)

    def for_step(self, epoch: int, step: int) -> Optional["StepConsumers"]:
        """The consumers of one step, or None if there are none."""
        return StepConsumers(list(self._registered.values()), epoch, step) if self else None


class StepConsumers:
    """Calls the consumers of one step (on the writer's thread)."""

    def __init__(self, registered: list[_Registered], epoch: int, step: int):
        self._registered, self._epoch, self._step = registered, epoch, step

    def __call__(self, record: Record, values: Optional[torch.Tensor],
                 stats: Optional[tuple]) -> None:
        wanting = [r for r in self._registered if r.wants(record)]
        if not wanting:
            return
        call = record.call
        captured = CapturedRecord(
            self._epoch, self._step, call.module, call.cls, call.number, call.call_idx,
            record.micro_batch, record.kind, record.index, record.path, values,
            None if stats is None else dict(zip(fmt.STAT_COLUMNS, stats)))
        for registered in wanting:
            try:
                registered.fn(captured)
            except Exception as exc:  # user code must not stop training or the dump
                self._registered.remove(registered)
                name = getattr(registered.fn, "__qualname__", repr(registered.fn))
                warnings.warn(f"h5cmp: consumer {name} raised {type(exc).__name__}: {exc}; it "
                              f"is left out for the rest of step {self._epoch}:{self._step}",
                              RuntimeWarning)
