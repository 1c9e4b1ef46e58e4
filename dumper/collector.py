"""Python's cyclic garbage collector, paused while a step is dumped.

A dumped step makes thousands of small objects that live until the step ends: hook handles and
closures, records, their shapes. Each one that survives a young collection counts towards the
next *full* collection, which walks every object of the process (0.1 s for a process that has
imported torch and pandas on a 2-core CPU; more with a real model's code loaded): on a model of
many small tensors, a full collection every few dumped steps (docs/benchmarks.md, "Dump").
Paused, none of these collections runs during the step, and the step's objects, freed by
reference counting once the step is written, never reach an older generation.

The pause does not change the user's numerics; what it changes is that cyclic garbage made
during a dumped step (rare in a training step: autograd frees by reference counting) is
collected after the step instead of during it. A step left open (hooks registered, never
removed) keeps the collector paused until ``remove_hooks``, ``close`` or the dumper's end.
``HookerAndDumper(pause_gc=False)`` leaves the collector alone.
"""
from __future__ import annotations

import gc
import os
import threading

_lock = threading.RLock()  # a pause may end in __del__, inside another pause's call
_pauses = 0              # pauses in effect in this process, over every dumper
_turned_off = False      # whether the first of them turned the collector off


class CollectorPause:
    """Automatic garbage collection off from construction until :meth:`resume` (idempotent;
    also when the pause is freed).

    Pauses nest across dumpers: the collector is turned back on when the last one resumes,
    and only if a pause turned it off (a collector the user disabled stays disabled; one the
    user disables during a step is turned back on). ``gc.collect()`` still works during a
    pause. A process forked during a pause starts with none (:func:`_forked`)."""

    def __init__(self):
        global _pauses, _turned_off
        self._pid = None
        with _lock:
            if _pauses == 0:
                _turned_off = gc.isenabled()
                gc.disable()
            _pauses += 1
            self._pid = os.getpid()

    def resume(self) -> None:
        global _pauses, _turned_off
        with _lock:
            if self._pid != os.getpid():  # resumed already (this one ended), or forked
                return
            self._pid = None
            _pauses -= 1
            if _pauses == 0 and _turned_off:
                _turned_off = False
                gc.enable()

    def __del__(self) -> None:
        self.resume()


def _forked() -> None:
    """In a child forked during a pause: the parent's pauses are not the child's to end."""
    global _lock, _pauses, _turned_off
    _lock = threading.RLock()
    if _pauses and _turned_off:
        gc.enable()
    _pauses, _turned_off = 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
