"""Module hooks for one step: number every call, snapshot its tensors, follow its gradients.

Data flows one way: hooks -> :class:`~dumper.record.Record` -> ``sink`` (the step writer).
Every hook registered here is kept in ``handles`` and removed by :meth:`StepCapture.remove`.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from compare import format as fmt

from .calls import (CallHooks, CallTracker, HookedModel, MicroBatches, in_backward,
                    module_class)
from .dataflow import Dataflow
from .flatten import call_leaves, leaves, map_tensors
from .grads import GradInputCollector, current_sequence_nr, gradient_edge
from . import ops
from .injection import StepReference, restore_parameters
from .ops import OpMode, written
from .param_grads import ParamGrads
from .record import CallInfo, Record, RecordMaker, leaf_record
from .selection import Selection

Sink = Callable[[Record], None]


def _eps_of(module: nn.Module, args: tuple) -> Optional[float]:
    """A normalization's eps (``fmt.EPS_ATTRIBUTES``; torch's ``RMSNorm`` without one uses its
    input dtype's machine epsilon), None where the module has none, and for a BatchNorm that
    normalizes by its running statistics (not training): an affine map."""
    attributes = vars(module)  # plain attributes: no nn.Module.__getattr__ miss (~4 µs each)
    if not module.training and module._buffers.get("running_mean") is not None:
        return None
    if isinstance(module, nn.RMSNorm) and module.eps is None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return torch.finfo(first.dtype).eps if first is not None and (
            first.is_floating_point()) else None
    return next((value for value in map(attributes.get, fmt.EPS_ATTRIBUTES)
                 if isinstance(value, float)), None)


# whose geometry is recorded (fmt.CONV_PATH)
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                nn.ConvTranspose3d)


def _geometry_text(module: nn.Module) -> Optional[str]:
    """A convolution's geometry as the dump records it (``fmt.conv_text`` on a
    ``fmt.CONV_PATH`` row), sizes one per spatial dimension; None for other modules, and for
    a subclass whose attributes are not torch's kind (nothing recorded: never an error in
    the user's step)."""
    if not isinstance(module, CONVOLUTIONS):
        return None
    dims = module.weight.dim() - 2 if isinstance(module.weight, torch.Tensor) else 0

    def sizes(value: Any) -> tuple[int, ...]:
        return tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else (
            (int(value),) * dims)

    try:
        padding = module.padding if module.padding in fmt.CONV_PADDINGS else sizes(
            module.padding)
        geometry = fmt.ConvGeometry(sizes(module.stride), padding, sizes(module.dilation),
                                    int(module.groups), str(module.padding_mode))
    except (TypeError, ValueError):
        return None
    text = fmt.conv_text(geometry)
    return text if fmt.parse_conv(text) == geometry else None  # (sizes a reader refuses)


def hook_gradient(t: torch.Tensor, on_grad: Callable[[torch.Tensor], Optional[torch.Tensor]]
                  ) -> RemovableHandle:
    """Call ``on_grad(grad of t)`` when autograd computes it; a tensor it returns is used
    instead of the gradient (injection). A pre-hook on ``t``'s node reads it from the node's
    incoming gradients as they arrive, before the node runs (so the record precedes the
    gradients the node sends on, as in execution): the same value as a tensor hook sees after
    the hooks registered on ``t`` (the node is fixed now, so a later in-place op does not
    change which gradient is read) at a seventh of the registration cost. Leaves have no node
    and get a tensor hook."""
    node = t.grad_fn
    if node is None:
        return t.register_hook(on_grad)
    slot = t.output_nr

    def hook(grad_outputs):
        if grad_outputs[slot] is None:
            return None
        instead = on_grad(grad_outputs[slot])
        if instead is None:
            return None
        return (*grad_outputs[:slot], instead, *grad_outputs[slot + 1:])
    return node.register_prehook(hook)


class _OpenCall:
    """State of a call between its pre-hook and its forward hook."""

    __slots__ = ("info", "seq", "seq_lo", "grads", "inputs", "dropped")

    def __init__(self, info: CallInfo, seq: int, seq_lo: int,
                 grads: Optional[GradInputCollector]):
        self.info, self.seq, self.seq_lo, self.grads = info, seq, seq_lo, grads
        self.inputs: dict[int, int] = {}  # injecting: id of an input as it arrived or as put in
        self.dropped: set[int] = set()    # inputs whose grad_input is not recorded


class StepCapture:
    """Hooks a model (``hooked``: :func:`~dumper.calls.hooked_model`) for one step and sends a
    :class:`Record` per captured leaf to ``sink``.

    With ``inject`` (a localizing re-run, :mod:`dumper.injection`), each hooked call records
    what arrives (inputs, its own parameters, incoming gradients), flagged ``injected`` where
    the reference has a value for it, then runs on the reference's value instead."""

    def __init__(self, hooked: HookedModel, sink: Sink, maker: RecordMaker, selection: Selection,
                 params: bool, inject: Optional[StepReference] = None):
        self._sink = sink
        self._inject = inject
        self._swapped = CallTracker()  # parameters swapped for the reference's, per open call
        self._maker = maker
        self._sel = selection
        self._params = params
        self._seq = itertools.count()
        self._calls = itertools.count()
        self._lock = threading.Lock()
        self._micro_batches = MicroBatches()
        self._collectors: list[GradInputCollector] = []
        self._first_call: dict[int, CallInfo] = {}
        self._param_grads = ParamGrads(maker, self._next_seq, self._first_call.get) if (
            params and selection.wants_kind(fmt.PARAM_GRAD)) else None
        self._occurrences: dict[tuple[int, str, int], int] = defaultdict(int)
        self._flow = Dataflow()
        # injected inputs: id -> (weak reference to it, its chain: see _injected_chain)
        self._injected_inputs: dict[int, tuple[weakref.ref, frozenset[int]]] = {}
        # injected gradients: (id of the node, slot) -> (weak reference to it, what arrived)
        self._replaced_grads: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}
        self.handles: list[RemovableHandle] = []
        self._hooked = hooked
        modules = hooked.modules
        # op-level capture (dumper.ops), if any is selected
        self._ops: Optional[OpMode] = OpMode(self._run_op, selection.skip_ops) if (
            selection.ops and any(selection.wants_ops(path, m) for path, m in modules
                                  if selection.wants_module(path, m))) else None
        self._op_counts: dict[tuple[int, str], int] = defaultdict(int)
        # the hooks' own ops are not the model's
        quiet = ops.quietly if self._ops is not None else (lambda fn: fn)
        self._calls_hooks = CallHooks(quiet(self._enter), quiet(self._leave))
        self._installed: dict[int, tuple[str, Optional[StepReference]]] = {}  # mode, injection
        for path, module in modules:
            self._count_micro_batches(path, module)  # first: its pre-hook goes before the capture's
            if selection.wants_module(path, module):
                self._install(path, module)
            elif self._ops is not None:  # its ops are its own, not its parent's: not recorded
                self._own_ops(path, module, lambda: None)

    @property
    def modules_hooked(self) -> int:
        """How many modules this step's capture hooks (the selected ones)."""
        return len(self._installed)

    @property
    def modules_run(self) -> int:
        """How many of the hooked modules ran (and were recorded) in this step so far."""
        return len(self._first_call)

    @property
    def open_calls(self) -> int:
        """Module calls that started and have not returned (an exception left them)."""
        return self._calls_hooks.open_calls

    # -- lifetime ----------------------------------------------------------------------
    def _install(self, path: str, module: nn.Module) -> None:
        inject = self._inject if self._inject is not None and self._inject.wants(path, module) \
            else None
        self._installed[id(module)] = (self._sel.mode_of(path, module), inject)
        self._calls_hooks.install(path, module, self._hooked)
        if self._ops is not None:  # not in compiled code: it runs its ops as compiled code
            records_ops = self._sel.wants_ops(path, module) and path not in self._hooked.compiled
            self._own_ops(path, module,
                          lambda: self._first_call_owner(module, inject, records_ops))
        if inject is not None and fmt.PARAM in inject.kinds:  # put them back, also on errors,
            self._add_hook(path, module, lambda m, args, out: self._restore_parameters(module),
                           always_call=True, prepend=True)  # before other forward hooks
        if self._param_grads is not None:
            self._param_grads.watch(module)

    def _add_hook(self, path: str, module: nn.Module, hook: Callable, pre: bool = False,
                  **options) -> None:
        """Register a forward (``pre``: pre-) hook for ``module``, kept in ``handles``, where
        :meth:`~dumper.calls.HookedModel.hook` places it."""
        self.handles.append(self._hooked.hook(path, module, hook, pre, **options))

    def _own_ops(self, path: str, module: nn.Module, owner: Callable[[], Optional[tuple]]
                 ) -> None:
        """Hooks that make ``module``'s calls own the ops their code runs (:mod:`dumper.ops`):
        ``owner()`` (None: they are not recorded) from the start of the call, after the
        capture's pre-hook, to its end, also when the forward raises."""
        mode = self._ops

        def enter(m, args) -> None:
            mode.enter(None if in_backward() else owner())  # recomputation: already recorded
        self._add_hook(path, module, enter, pre=True)
        self._add_hook(path, module, lambda m, args, out: mode.leave(), always_call=True)

    def _first_call_owner(self, module: nn.Module, inject: Optional[StepReference],
                          records_ops: bool) -> Optional[tuple]:
        """The owner of the ops of ``module``'s call that started now: its call and injection."""
        call = self._calls_hooks.state(module) if records_ops else None
        return None if call is None else (call.info, inject)

    def _count_micro_batches(self, path: str, module: nn.Module) -> None:
        """Hooks that feed :class:`MicroBatches`: calls opening and closing (also when the
        forward raises), and a gradient hook on the outputs of outermost calls."""
        batches = self._micro_batches

        def enter(m, args) -> None:
            if not in_backward():
                batches.enter()

        def leave(m, args, output) -> None:
            if not in_backward() and batches.leave():
                for _, leaf in leaves(output, "output"):
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        self.handles.append(hook_gradient(leaf, batches.backward_ran))
        self._add_hook(path, module, enter, pre=True)
        self._add_hook(path, module, leave, always_call=True)

    def finish(self) -> None:
        """Emit what only completes at step end (partial grad sums, final parameter grads)."""
        for collector in self._collectors:
            collector.flush()
        if self._param_grads is not None:
            for record in self._param_grads.finish():
                self._sink(record)

    def remove(self) -> None:
        """Remove every hook this capture registered (module, tensor, node and parameter hooks)."""
        self._calls_hooks.remove()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._collectors.clear()
        if self._param_grads is not None:  # all its records, if the step is discarded
            self._param_grads.release()
        self._flow.clear()
        if self._ops is not None:
            self._ops.clear()
        self._injected_inputs.clear()
        self._replaced_grads.clear()

    # -- forward -----------------------------------------------------------------------
    def _next_seq(self) -> int:
        with self._lock:
            return next(self._seq)

    def _enter(self, module: nn.Module, path: str, call_idx: int, args: tuple, kwargs: dict
               ) -> tuple[_OpenCall, Optional[tuple[tuple, dict]]]:
        """A module call starts (:class:`~dumper.calls.CallHooks`): record what arrives."""
        mode, inject = self._installed[id(module)]
        if self._inject is not None:  # which of the reference's calls this one pairs with
            self._inject.enter_call(path, call_idx, self._micro_batches.number, args, kwargs)
        info = CallInfo(next(self._calls), path, module_class(module).__name__, call_idx, mode,
                        self._micro_batches.number)
        self._first_call.setdefault(id(module), info)
        call = self._open(info, inject, args, kwargs)
        injects = inject.kinds if inject is not None else frozenset()
        if self._sel.wants_kind(fmt.PARAM) and (self._params or info.call_idx == 0):
            # values with params=True; otherwise, once per module, a digest (whether the bits
            # are the same) and, but in hash mode, statistics and a sketch (how much weights
            # differ): in hash mode those would cost more than the step's every digest
            described = not self._params and info.mode != fmt.MODE_HASH
            for i, (name, p) in enumerate(module.named_parameters(recurse=False)):
                record = self._maker.tensor(call.seq, info, fmt.PARAM, i, name, p,
                                            stats=described, sketch=described,
                                            digest=not self._params)
                record.injected = fmt.PARAM in injects and inject.has(
                    (path, info.call_idx, fmt.PARAM, i))
                self._sink(record)
            eps = _eps_of(module, args) if info.call_idx == 0 else None
            if eps is not None:
                self._sink(leaf_record(call.seq, info, fmt.PARAM, fmt.EPS_PATH, eps))
            text = _geometry_text(module) if info.call_idx == 0 else None
            if text is not None:  # the text is the leaf, written as it is
                self._sink(leaf_record(call.seq, info, fmt.PARAM, fmt.CONV_PATH, text, text))
        if fmt.PARAM in injects:
            self._swapped.push(module, inject.swap_parameters(path, info.call_idx, module))
        if fmt.INPUT in injects:
            return call, self._inject_inputs(inject, call, args, kwargs)
        return call, None

    def _leave(self, module: nn.Module, call: _OpenCall, output: Any) -> None:
        """A module call returns: record its outputs (and what it will get in backward)."""
        self._close(call, output, self._installed[id(module)][1])
        if self._inject is not None:
            self._inject.leave_call(call.info.module, call.info.call_idx)

    def _open(self, info: CallInfo, inject: Optional[StepReference], args: tuple,
              kwargs: dict, sink: Optional[Sink] = None, kept: frozenset[int] = frozenset()
              ) -> _OpenCall:
        """Record a call's inputs as it starts (a module call, or an op: :meth:`_run_op`) into
        ``sink`` (default: the step's) and prepare for the gradients they will get; ``kept``:
        the ids of inputs a localizing re-run leaves in place (what an op writes into)."""
        sink = sink or self._sink
        seq = self._next_seq()
        seq_lo = current_sequence_nr()  # the call's autograd nodes, the injection's included
        injects = inject.kinds if inject is not None else frozenset()
        want_input = self._sel.wants_kind(fmt.INPUT)
        want_grad = self._sel.wants_kind(fmt.GRAD_INPUT) and torch.is_grad_enabled()
        edges, keep_alive, paths, index = {}, [], {}, 0
        for leaf_path, leaf in call_leaves(args, kwargs):
            if isinstance(leaf, torch.Tensor):
                producer = self._flow.producer_of(leaf)
                if producer < 0 and isinstance(leaf, nn.Parameter):
                    producer = fmt.PRODUCER_PARAMETER
                # made outside hooked calls: maybe a sum, named where first consumed
                summed = producer == fmt.NO_PRODUCER and self._flow.note_input(
                    leaf, info.number, index)
                if want_input:
                    record = self._maker.tensor(seq, info, fmt.INPUT, index, leaf_path, leaf)
                    record.producer = producer
                    if summed:
                        record.addends = self._flow.addends_of(leaf)
                    record.injected = fmt.INPUT in injects and id(leaf) not in kept and \
                        inject.injects((info.module, info.call_idx, fmt.INPUT, index), leaf)
                    sink(record)
                if want_grad and leaf.requires_grad:
                    node, nr = gradient_edge(leaf)
                    edges.setdefault((id(node), nr), index)
                    keep_alive.append(node)
                    paths[index] = leaf_path
                index += 1
            elif want_input:
                sink(leaf_record(seq, info, fmt.INPUT, leaf_path, leaf))
        call = _OpenCall(info, seq, seq_lo, None)
        if edges:
            call.grads = GradInputCollector(edges, keep_alive,
                                            self._grad_input_emitter(info, paths, call.dropped))
            self._collectors.append(call.grads)
        return call

    def _run_op(self, owner: tuple[CallInfo, Optional[StepReference]], name: str,
                func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run one op of ``owner``'s code (:class:`~dumper.ops.OpMode`) as a call of its own,
        named ``{module}/{name}#{n}`` (its n-th ``name`` op in that module call) and numbered
        with the module's call: inputs, outputs and gradients as for a module call, and
        injected likewise in a localizing re-run."""
        parent, inject = owner
        key = (parent.number, name)  # an owner's ops run on the thread that runs the owner
        info = CallInfo(next(self._calls), fmt.op_module(parent.module, name, self._op_counts[key]),
                        name, parent.call_idx, parent.mode, parent.micro_batch)
        inputs = [(t, t._version) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and not t.is_inference()]
        opened: list[Record] = []
        # a re-run leaves in place what the op writes into: the code goes on with it
        kept = written(name, func, args, kwargs) if inject is not None else frozenset()
        if inject is not None:
            inject.pair_op(info.module, info.call_idx, tuple(
                tuple(t.shape) for _, t in call_leaves(args, kwargs)
                if isinstance(t, torch.Tensor)))
        call = self._open(info, inject, args, kwargs, opened.append, kept)
        if inject is not None and fmt.INPUT in inject.kinds:
            args, kwargs = self._inject_inputs(inject, call, args, kwargs, kept) or (args, kwargs)
        try:
            output = func(*args, **kwargs)
        except BaseException:  # its records go nowhere: their buffers go back
            for record in opened:
                self._maker.release(record)
            raise
        if any(output is t and t._version == version for t, version in inputs):
            # it returned an input untouched (x.to(its own dtype), x.float() of a float):
            # nothing happened, and its "output" is the input, whose gradient sums every use
            for record in opened:
                self._maker.release(record)
            if call.grads is not None:
                self._collectors.remove(call.grads)
            if inject is not None:
                inject.unpair_op(info.module, info.call_idx)
            return output
        self._op_counts[key] += 1
        for record in opened:
            self._sink(record)
        self._close(call, output, inject)
        return output

    def _inject_inputs(self, inject: StepReference, call: _OpenCall, args: tuple,
                       kwargs: dict, kept: frozenset[int] = frozenset()
                       ) -> Optional[tuple[tuple, dict]]:
        """``call``'s arguments with the reference's values in place of its tensors, but those
        whose ids are ``kept``; None where none was replaced."""
        made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        replace = inject.leaf_replacer(call.info.module, call.info.call_idx, fmt.INPUT, made,
                                       kept)
        args, kwargs = map_tensors(args, replace), map_tensors(kwargs, replace)
        inject.forget_ready()
        for index, (arrived, put) in made.items():
            call.inputs.update({id(arrived): index, id(put): index})
            chain = frozenset({id(put), id(arrived), *self._injected_chain(arrived)})
            self._injected_inputs[id(put)] = (weakref.ref(put), chain)
        return (args, kwargs) if made else None

    def _note_replaced_gradient(self, slot: tuple, instead: torch.Tensor,
                                arrived: torch.Tensor) -> None:
        """Hooks of enclosing calls on the same gradient slot (a parent returning its child's
        output) run after the child's replaced it: they record what arrived, not that."""
        with self._lock:
            self._replaced_grads[slot] = (weakref.ref(instead), arrived)

    def _arrived(self, slot: tuple, grad: torch.Tensor) -> torch.Tensor:
        known = self._replaced_grads.get(slot)
        return known[1] if known is not None and known[0]() is grad else grad

    def _injected_chain(self, t: torch.Tensor) -> frozenset[int]:
        """For an injected input, the ids of it, of the tensor it was put in for, and so on back
        to what arrived at the outermost injecting call, taken while they all lived (empty when
        ``t`` is not an injected input). Matched against a call's live inputs only."""
        known = self._injected_inputs.get(id(t))
        return known[1] if known is not None and known[0]() is t else frozenset()

    def _restore_parameters(self, module: nn.Module) -> None:
        if in_backward():  # a recomputation swapped nothing
            return
        swapped = self._swapped.pop(module)
        if swapped:
            restore_parameters(module, swapped)

    def _close(self, call: _OpenCall, output: Any, inject: Optional[StepReference]) -> None:
        """Record a call's outputs as it returns, and hook the gradients they will get."""
        seq = self._next_seq()
        want_output = self._sel.wants_kind(fmt.OUTPUT)
        want_grad = self._sel.wants_kind(fmt.GRAD_OUTPUT)
        grad_outputs: list[tuple[int, str, torch.Tensor]] = []
        index = 0
        for leaf_path, leaf in leaves(output, "output"):
            if isinstance(leaf, torch.Tensor):
                made_here = self._flow.note_output(leaf, call.info.number, index)
                if want_output:
                    record = self._maker.tensor(seq, call.info, fmt.OUTPUT, index, leaf_path, leaf)
                    if made_here:  # by its own code: a sum, maybe
                        record.addends = self._flow.addends_of(leaf)
                    self._sink(record)
                if leaf.requires_grad:
                    grad_outputs.append((index, leaf_path, leaf))
                index += 1
            elif want_output:
                self._sink(leaf_record(seq, call.info, fmt.OUTPUT, leaf_path, leaf))
        passthrough: dict[int, int] = {}
        if call.grads is not None:
            found = call.grads.attach([t for _, _, t in grad_outputs], call.seq_lo,
                                      current_sequence_nr(), self.handles)
            by_tensor = {id(t): idx for t, idx in found}
            passthrough = {i: by_tensor[id(t)] for i, _, t in grad_outputs if id(t) in by_tensor}
        if inject is None or fmt.GRAD_OUTPUT not in inject.kinds:
            inject = None
        for i, leaf_path, t in grad_outputs:
            key = (call.info.module, call.info.call_idx, fmt.GRAD_OUTPUT, i)
            # An input passed through: its gradient sums the uses of the input upstream too, so
            # the reference's would count them twice. One injected in its place (here or in an
            # inner call) gets only the uses after the injection, which the reference's record
            # of the same tensor does not tell apart: it is not recorded either.
            chain = self._injected_chain(t)
            replacement = bool(chain)
            # an input of this call passed through by way of injections: the gradient sent to
            # it sums uses the reference's record of the same tensor does not: not recorded
            call.dropped.update(call.inputs[c] for c in chain if c in call.inputs)
            injecting = inject is not None and not replacement and i not in passthrough \
                and inject.has(key)
            record = want_grad and not replacement
            if record or i in passthrough or injecting:
                on_grad = self._grad_output_hook(call, i, leaf_path, record, passthrough.get(i),
                                                 inject if injecting else None,
                                                 (id(t.grad_fn or t), t.output_nr))
                self.handles.append(hook_gradient(t, on_grad))

    # -- backward ----------------------------------------------------------------------
    def _grad_output_hook(self, call: _OpenCall, index: int, path: str, record: bool,
                          passthrough_input: Optional[int], inject: Optional[StepReference],
                          slot: tuple):
        """Records the gradient that arrived; returns the reference's instead when injecting."""
        key = (call.info.module, call.info.call_idx, fmt.GRAD_OUTPUT, index)

        def hook(grad: torch.Tensor) -> Optional[torch.Tensor]:
            grad = self._arrived(slot, grad)  # what an inner call's injection replaced, if any
            instead = inject.tensor(key, grad) if inject is not None else None
            if instead is not None:
                self._note_replaced_gradient(slot, instead, grad)
            if record:
                made = self._maker.tensor(self._next_seq(), call.info, fmt.GRAD_OUTPUT, index,
                                          path, grad)
                made.injected = instead is not None
                self._emit_gradient(made)
            if passthrough_input is not None:
                call.grads.add_passthrough(passthrough_input, grad if instead is None else instead)
            return instead
        return hook

    def _grad_input_emitter(self, info: CallInfo, paths: dict[int, str], dropped: set[int]
                            ) -> Callable[[int, torch.Tensor, bool], None]:
        def emit(index: int, grad: torch.Tensor, owned: bool) -> None:
            if index in dropped:
                return
            self._emit_gradient(self._maker.tensor(self._next_seq(), info, fmt.GRAD_INPUT,
                                                   index, paths[index], grad, owned))
        return emit

    def _emit_gradient(self, record: Record) -> None:
        """Send a gradient record, numbering repeats (a backward pass run again on the graph)."""
        key = (record.call.number, record.kind, record.index)
        with self._lock:
            record.occurrence = self._occurrences[key]
            self._occurrences[key] += 1
        self._sink(record)
