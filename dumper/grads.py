"""Exact per-module ``grad_input`` without changing the autograd graph.

A module's ``grad_input[i]`` is the gradient that flows into its input tensor ``i`` *through this
module only*. Inserting an identity node in front of the module would give it, but would also
regroup the summation of gradients of tensors used inside and outside the module, changing the
user's numerics. Instead we find, after the forward pass, the autograd nodes created during the
call that have an edge to the input's gradient edge, and read the gradient they send along it
with a node post-hook. Contributions are summed in the order autograd delivers them.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable

import torch
from torch.utils.hooks import RemovableHandle

Node = torch.autograd.graph.Node
EdgeKey = tuple[int, int]  # (id of the node, output_nr): where a tensor's gradient is delivered


def current_sequence_nr() -> int:
    """Sequence number the next autograd node created on this thread will get."""
    return torch._C._autograd._get_sequence_nr()


def gradient_edge(t: torch.Tensor) -> tuple[Node, int]:
    """Node and slot receiving ``t``'s gradient (the AccumulateGrad node for a leaf)."""
    node = torch.autograd.graph._get_grad_fn_or_grad_acc(t)
    return node, (t.output_nr if t.grad_fn is not None else 0)


class GradInputCollector:
    """Sums one module call's gradient contributions per input and emits each when complete.

    ``emit(index, grad, owned)`` is called once per input that received a gradient. ``owned``:
    ``grad`` is a copy or sum the collector made and no longer references; otherwise it is the
    tensor autograd delivered, which the receiver must copy before autograd reuses it.
    """

    def __init__(self, edges: dict[EdgeKey, int], keep_alive: list[Node],
                 emit: Callable[[int, torch.Tensor, bool], None]):
        self._edges = edges            # input edge -> input index
        self._keep_alive = keep_alive  # input edge nodes, so their ids stay unique
        self._emit = emit
        self._expected: dict[int, int] = {}  # contributions per input in one backward pass
        self._pending: dict[int, int] = {}
        self._sums: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def attach(self, outputs: Iterable[torch.Tensor], seq_lo: int, seq_hi: int,
               handles: list[RemovableHandle]) -> list[tuple[torch.Tensor, int]]:
        """Hook the consumers of the inputs among the nodes numbered ``[seq_lo, seq_hi)``.

        Returns ``(output, input index)`` for outputs that are an input passed through unchanged:
        their gradient is that input's contribution and must be fed to :meth:`add_passthrough`.
        """
        passthrough, roots = [], []
        for out in outputs:
            node, nr = gradient_edge(out)
            if (id(node), nr) in self._edges:
                passthrough.append((out, self._edges[(id(node), nr)]))
            else:
                roots.append(node)
        for node, slots in self._find_consumers(roots, seq_lo, seq_hi).items():
            for idx in {i for _, i in slots}:
                self._expected[idx] = self._expected.get(idx, 0) + 1
            handles.append(node.register_hook(self._node_hook(slots)))
        for _, idx in passthrough:
            self._expected[idx] = self._expected.get(idx, 0) + 1
        self._pending = dict(self._expected)
        self._keep_alive = []
        return passthrough

    def _find_consumers(self, roots: list[Node], lo: int, hi: int) -> dict[Node, list[tuple[int, int]]]:
        consumers: dict[Node, list[tuple[int, int]]] = {}
        # visited nodes by id, the wrappers kept alive: some torch releases (2.11) make a new
        # Python wrapper per access, and a freed one's id can be reused by another node's
        seen: dict[int, Node] = {}
        stack = [n for n in roots if lo <= n._sequence_nr() < hi]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            for slot, (nxt, nr) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                idx = self._edges.get((id(nxt), nr))
                if idx is not None:
                    consumers.setdefault(node, []).append((slot, idx))
                elif lo <= nxt._sequence_nr() < hi:
                    stack.append(nxt)
        return consumers

    def _node_hook(self, slots: list[tuple[int, int]]):
        def hook(grad_inputs, grad_outputs):
            with self._lock:
                for idx in {i for _, i in slots}:
                    self._contribute(idx, [grad_inputs[slot] for slot, i in slots
                                           if i == idx and grad_inputs[slot] is not None])
        return hook

    def add_passthrough(self, idx: int, grad: torch.Tensor) -> None:
        with self._lock:
            self._contribute(idx, [grad])

    def _contribute(self, idx: int, grads: list[torch.Tensor]) -> None:
        """One expected contribution to input ``idx`` (the gradients one node sends it, maybe
        none), summed left to right after the earlier ones, in delivery order."""
        # autograd's own tensor, not a detached alias, where it is not part of a graph: the
        # object later records of it see (dumper.known)
        parts = [g.detach() if g.requires_grad else g for g in grads]
        earlier = self._sums.pop(idx, None)
        if earlier is not None:
            parts.insert(0, earlier)
        self._pending[idx] -= 1
        complete = self._pending[idx] == 0
        if complete:
            self._pending[idx] = self._expected[idx]  # ready for another backward pass
        if not parts:
            return
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        made_here = len(parts) > 1 or earlier is not None  # else autograd's own tensor
        if complete:
            self._emit(idx, total, made_here)
        else:
            self._sums[idx] = total if made_here else total.clone()

    def flush(self) -> None:
        """Emit partial sums of inputs whose other consumers never ran (called at step end)."""
        with self._lock:
            for idx in sorted(self._sums):
                self._emit(idx, self._sums.pop(idx), True)
