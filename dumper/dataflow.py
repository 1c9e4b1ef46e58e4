"""Which hooked call made a tensor, for the index's ``producer`` and ``addends`` columns.

A call's output is remembered, weakly, with its version: the input of a later call that is that
tensor at that version was made by that call (``producer``). A tensor that no hooked call
returned may still be a sum computed between modules (a residual ``x + f(x)``, an in-place
``out += shortcut``): autograd's graph says which recorded outputs it adds unchanged
(``addends``), whose gradients are then the sum's gradient, in A and in B.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from compare import format as fmt

# autograd nodes that send the gradient they receive on to their inputs unchanged, or only cast
# (an add of alpha 1, a clone, a dtype or device move); an add with a scalar has one input
PASS_THROUGH = frozenset({"AddBackward0", "CloneBackward0", "ToCopyBackward0"})
# how many nodes a walk visits at most: sums between modules are a few adds deep
WALK_LIMIT = 64


class Dataflow:
    """The step's outputs of hooked calls: by tensor (``producer``) and by gradient slot (the
    autograd node and input number that receives their gradient: ``addends``)."""

    def __init__(self):
        # id(tensor) -> (weak reference, call that output it, tensor version then)
        self._producers: dict[int, tuple[weakref.ref, int, int]] = {}
        # (id(node), nr) -> (the node, kept alive so that its id stays its own; call, output
        # index, shape): the innermost call that output a tensor with that gradient slot
        self._slots: dict[tuple[int, int], tuple[Any, int, int, torch.Size]] = {}

    def clear(self) -> None:
        self._producers.clear()
        self._slots.clear()

    def note_output(self, t: torch.Tensor, call: int, index: int) -> bool:
        """Remember, weakly, the innermost call that output ``t``'s current value: the first
        call to return it at this version (a parent returning its child's output keeps the
        child; an in-place module returning a modified tensor takes over). Inference tensors
        have no version counter, so in-place changes cannot be seen: they are not tracked.
        Returns whether ``call`` is that call (its own code made the value)."""
        if t.is_inference() or self.producer_of(t) >= 0:
            return False
        self._producers[id(t)] = (weakref.ref(t), call, t._version)
        node = t.grad_fn
        if node is not None:
            self._slots.setdefault((id(node), t.output_nr), (node, call, index, t.shape))
        return True

    def producer_of(self, t: torch.Tensor) -> int:
        """Call that output ``t``'s current value, or -1 (unknown: made, or modified since,
        outside any hooked call, or an inference tensor)."""
        known = self._producers.get(id(t))
        if known is None or known[0]() is not t or t.is_inference() or known[2] != t._version:
            return -1
        return known[1]

    def addends_of(self, t: torch.Tensor) -> str:
        """For a tensor made by code between hooked calls (an input without a producer, or an
        output a call's own code made), the recorded outputs that it sums unchanged
        (``fmt.addends_text``: ``call:index`` pairs), found by walking its autograd graph back
        through :data:`PASS_THROUGH` nodes to the gradient slots of hooked calls' outputs; an
        add of another alpha, or an output of another shape than ``t`` (broadcast, its gradient
        summed), ends a branch. "" for none."""
        node = t.grad_fn
        if node is None or type(node).__name__ not in PASS_THROUGH:
            return ""
        found: list[tuple[int, int]] = []
        todo, seen = [node], 0
        while todo and seen < WALK_LIMIT:
            node = todo.pop()
            seen += 1
            if type(node).__name__ not in PASS_THROUGH or getattr(node, "_saved_alpha", 1) != 1:
                continue
            for source, nr in node.next_functions:
                if source is None:
                    continue
                known: Optional[tuple] = self._slots.get((id(source), nr))
                if known is None:
                    todo.append(source)
                elif known[0] is source and known[3] == t.shape:
                    found.append((known[1], known[2]))
        return fmt.addends_text(sorted(set(found)))
