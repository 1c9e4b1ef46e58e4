"""Which hooked call made a tensor, for the index's ``producer`` and ``addends`` columns.

A call's output is remembered, weakly, with its version: the input of a later call that is that
tensor at that version was made by that call (``producer``). A tensor that no hooked call
returned may still be a sum computed between modules (a residual ``x + f(x)``, an in-place
``out += shortcut``): autograd's graph says which recorded outputs it adds unchanged
(``addends``). The gradient arriving at such an output is the sum's where nothing else uses the
output (compare.transit checks that in A before it links the two).
"""
from __future__ import annotations

import weakref
from collections import Counter
from typing import NamedTuple

import torch

from compare import format as fmt

# autograd nodes that send the gradient they receive on to their inputs unchanged, or only cast
# (an add of alpha 1, a clone, a dtype or device move); an add with a scalar has one input
PASS_THROUGH = frozenset({"AddBackward0", "CloneBackward0", "ToCopyBackward0"})
# how many nodes a walk visits at most: sums between modules are a few adds deep
WALK_LIMIT = 64


class _Output(NamedTuple):
    """A recorded output, or input, by the gradient slot it gets its gradient at."""
    call: int
    index: int
    shape: torch.Size


def _slot(node, nr: int) -> tuple[int, int, str]:
    """A gradient slot, named without holding its node (which would keep the graph before it
    and its saved tensors alive) or its Python wrapper's id (made anew once none is held): the
    node's sequence number, unique on the thread that made it, its type and the input."""
    return node._sequence_nr(), nr, type(node).__name__


class Dataflow:
    """The step's outputs of hooked calls, by tensor (``producer``) and by gradient slot
    (``addends``), and the gradient slots of the calls' inputs (where a walk stops)."""

    def __init__(self):
        # id(tensor) -> (weak reference, call that output it, tensor version then)
        self._producers: dict[int, tuple[weakref.ref, int, int]] = {}
        self._outputs: dict[tuple[int, int, str], _Output] = {}  # the innermost call's
        self._consumed: dict[tuple[int, int, str], _Output] = {}  # the outermost call's input

    def clear(self) -> None:
        self._producers.clear()
        self._outputs.clear()
        self._consumed.clear()

    def note_output(self, t: torch.Tensor, call: int, index: int) -> bool:
        """Remember, weakly, the innermost call that output ``t``'s current value: the first
        call to return it at this version (a parent returning its child's output keeps the
        child; an in-place module returning a modified tensor takes over). Inference tensors
        have no version counter, so in-place changes cannot be seen: they are not tracked.
        Returns whether ``call`` became that call: its own code made the value, or it passed
        on a tensor that no hooked call output."""
        if t.is_inference() or self.producer_of(t) >= 0:
            return False
        self._producers[id(t)] = (weakref.ref(t), call, t._version)
        node = t.grad_fn
        if node is not None and not t.is_nested:  # a nested tensor has no one shape
            self._outputs.setdefault(_slot(node, t.output_nr), _Output(call, index, t.shape))
        return True

    def note_input(self, t: torch.Tensor, call: int, index: int) -> bool:
        """``t``, which no hooked call output (a known output's slot is named as that), is
        input ``index`` of hooked call ``call``: a walk from a later sum stops at its slot,
        and names it, since the gradient there also has that use's share. Returns whether
        this is the first call to consume ``t`` (the outermost: a parent before its
        children), which names what ``t`` sums."""
        node = t.grad_fn
        if node is None or t.is_nested:
            return True
        slot = _slot(node, t.output_nr)
        if slot in self._consumed:
            return False
        self._consumed[slot] = _Output(call, index, t.shape)
        return True

    def producer_of(self, t: torch.Tensor) -> int:
        """Call that output ``t``'s current value, or ``fmt.NO_PRODUCER`` (unknown: made, or
        modified since, outside any hooked call, or an inference tensor)."""
        known = self._producers.get(id(t))
        if known is None or known[0]() is not t or t.is_inference() or known[2] != t._version:
            return fmt.NO_PRODUCER
        return known[1]

    def addends_of(self, t: torch.Tensor) -> str:
        """For a tensor made by code between hooked calls (an input without a producer, or an
        output a call's own code made), the tensors it adds once each, unchanged
        (``fmt.addends_text``): hooked calls' outputs, and partial sums that a hooked call
        consumed (named as that call's input). The walk follows its autograd graph back through
        :data:`PASS_THROUGH` nodes, at most :data:`WALK_LIMIT` of them, to the slots of such
        tensors of ``t``'s shape (another shape was broadcast: its gradient is the sum's,
        summed); it ends there, at an add of another alpha and at any other node. A tensor
        reached twice (``x + x``) is none. "" for none."""
        node = t.grad_fn
        if node is None or type(node).__name__ not in PASS_THROUGH or t.is_nested:
            return ""
        reached: Counter = Counter()
        todo, visits = [node], 0
        while todo and visits < WALK_LIMIT:
            node = todo.pop()
            visits += 1
            if type(node).__name__ not in PASS_THROUGH or getattr(node, "_saved_alpha", 1) != 1:
                continue
            for source, nr in node.next_functions:
                if source is None:
                    continue
                slot = _slot(source, nr)
                if slot in self._outputs:
                    reached[fmt.OUTPUT, self._outputs[slot]] += 1
                elif slot in self._consumed:
                    reached[fmt.INPUT, self._consumed[slot]] += 1
                else:
                    todo.append(source)
        return fmt.addends_text(sorted(
            (kind, term.call, term.index) for (kind, term), times in reached.items()
            if times == 1 and term.shape == t.shape))
