"""Which of a reference's op records an op of a localizing re-run takes its values from.

An op record is named by its module call, its name and its number among that call's ops of
the name (``model.layers.0.mixer/to#1``). Two runs' numbers part where their op sequences
differ: a cast that one precision makes and the other's skips, the ``x.to(float32)`` that
returns a float32 ``x`` itself and records nothing (a Mamba mixer's ``to#0`` is a (96,) table
in float64 and a (2, 96, 12) batch in float32). The comparison aligns the records afterwards
(:mod:`compare.alignment`); a re-run must pair them as they run. Here each op of the run,
as it starts, takes the first of the reference's ops of its name in that call, after the one
its previous op of the name took, that was given tensors of the same shapes: the ops between
are the reference's alone. None where none is: the op gets no values (it computes from what
it was given).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import pandas as pd

from compare import format as fmt

Shapes = tuple[tuple[int, ...], ...]


class OpPairing:
    """The reference's op records of one step, and the pairs made so far (per reference call
    of a module, per op name: how far its ops were taken)."""

    def __init__(self, index: pd.DataFrame):
        inputs = index[(index["kind"] == fmt.INPUT) & (index["occurrence"] == 0)
                       & (index["index"] >= 0)]  # (tensors: not the non-tensor arguments)
        given: dict[tuple[str, int], list[tuple[int, tuple]]] = defaultdict(list)
        for module, call_idx, i, shape in zip(inputs["module"], inputs["call_idx"],
                                              inputs["index"], inputs["shape"]):
            if fmt.split_op(module) is not None:
                given[(module, int(call_idx))].append((int(i), tuple(shape)))
        # per (op module, call_idx): the shapes of its tensors, by index
        self._shapes = {key: tuple(shape for _, shape in sorted(found))
                        for key, found in given.items()}
        self._next: dict[tuple[str, str, int], int] = {}  # (parent, name, call_idx) -> number
        self._paired: dict[tuple[str, int], Optional[str]] = {}

    def pair(self, module: str, call_idx: int, shapes: Shapes) -> Optional[str]:
        """The reference's op module that the run's op ``module`` (of the reference's call
        ``call_idx``, given tensors of ``shapes``) takes its values from: see the module
        docstring. A reference that recorded no op inputs pairs by name and number."""
        if not self._shapes:
            return module
        key = (module, call_idx)
        if key not in self._paired:
            parent, op = fmt.split_op(module)
            name = op.rpartition("#")[0]
            where = (parent, name, call_idx)
            number = self._next.get(where, 0)
            self._paired[key] = None
            while (candidate := fmt.op_module(parent, name, number), call_idx) in self._shapes:
                number += 1
                if self._shapes[(candidate, call_idx)] == shapes:
                    self._paired[key], self._next[where] = candidate, number
                    break
        return self._paired[key]

    def forget(self, module: str, call_idx: int) -> None:
        """The run's op ``module`` of ``call_idx`` returned a tensor it was given, untouched
        (``x.to`` its own dtype), and records nothing: its name passes to the run's next op
        of the name, which pairs afresh (after the reference op this one took)."""
        self._paired.pop((module, call_idx), None)

    def paired(self, module: str, call_idx: int) -> Optional[str]:
        """What :meth:`pair` gave the run's op ``module`` of ``call_idx``; itself where it was
        not asked (its records are looked up by name and number)."""
        return self._paired.get((module, call_idx), module) if self._shapes else module
