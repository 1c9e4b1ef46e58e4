"""Op-level capture: the torch functions, tensor methods and operators a module's own code runs.

A :class:`OpMode` (a ``TorchFunctionMode``) is pushed on a thread's torch-function mode stack
when the first module call that records ops starts on that thread and popped when the last one
returns: nothing is patched, and outside those calls torch runs as without the dumper. Each call
of a hooked module pushes an *owner* for the time it runs: its :class:`~dumper.record.CallInfo`
if the module records ops, else None. An op is recorded for the innermost owner only, so an op
belongs to the module whose own ``forward`` code ran it: ``F.linear`` inside a ``q_proj`` is
``q_proj``'s business (its module record), the rotary embedding and ``softmax`` around it are
the attention module's.

Why a torch-function mode rather than a dispatch mode: it sees calls as the model's code wrote
them (``F.scaled_dot_product_attention``, ``a @ b``, ``x.softmax(-1)``), before autocast and
decompositions, under names that stay the same across devices and kernels, and tensor
subclasses (``DTensor``) arrive whole; a dispatch mode would see aten ops after autocast's
casts and backend-specific decompositions, which pair badly between runs.
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

# Ops that move no numbers: views, reshapes, copies, indexing, concatenation, queries and
# factories shaped like their input. Skipped by default (``HookerAndDumper(skip_ops=...)``).
MOVES_NO_NUMBERS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
    "permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t", "expand",
    "expand_as", "contiguous", "clone", "detach", "detach_", "split", "split_with_sizes",
    "tensor_split", "chunk", "unbind", "narrow", "select", "getitem", "setitem", "as_strided",
    "unfold", "repeat", "repeat_interleave", "tile", "cat", "concat", "concatenate", "stack",
    "hstack", "vstack", "flip", "roll", "index_select", "gather", "masked_select",
    "size", "dim", "numel", "stride", "storage_offset", "data_ptr", "element_size",
    "is_contiguous", "is_floating_point", "is_complex", "item", "tolist", "len", "bool",
    "requires_grad_", "retain_grad", "register_hook", "type", "get_device", "cpu", "cuda",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "eq", "ne", "lt", "le",
    "gt", "ge", "isfinite", "isnan", "isinf", "any", "all", "argmax", "argmin", "nonzero",
    "where", "masked_fill", "masked_fill_", "triu", "tril", "arange",
})

# Python operators whose reflected (``__rX__``) and in-place (``__iX__``) forms are named as
# the op itself (``2 * x`` is ``mul``) and as its in-place method (``x += y`` is ``add_``).
_OPERATORS = frozenset({"add", "sub", "mul", "matmul", "truediv", "div", "floordiv", "mod",
                        "pow", "and", "or", "xor", "lshift", "rshift"})
_RENAMED = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder",
            "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor"}


def op_name(func: Callable) -> str:
    """The name an op record carries: the function's or method's name, operators by the
    method they call (``a + b`` and ``torch.add`` are ``add``, ``x += y`` is ``add_``,
    ``2 / x`` is ``div``); "" for attribute access (``x.shape``), never recorded."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return ""
    if not (name.startswith("__") and name.endswith("__")):
        return name
    bare = name.strip("_")
    suffix = ""
    if bare not in _OPERATORS and bare[:1] in ("r", "i") and bare[1:] in _OPERATORS:
        suffix = "_" if bare[0] == "i" else ""
        bare = bare[1:]
    return _RENAMED.get(bare, bare) + suffix


OnOp = Callable[[Any, str, Callable, tuple, dict], Any]


def written(name: str, func: Callable, args: tuple, kwargs: dict) -> frozenset[int]:
    """The ids of the tensors op ``name`` (running ``func``) writes into: an in-place method's
    own tensors (its name ends in ``_``: ``index_add_``, ``x += y`` as ``add_``, a
    ``_foreach_mul_``'s list), an indexed assignment's (``out[:, t] = y``), those of a
    function given ``inplace=True`` (by name or at its place: ``F.relu(x, True)``), and an
    ``out=`` tensor. Code goes on with those very tensors (a loop of ``out.index_add_(...)`` or
    of ``out[:, t] =`` returns nothing to use), so a localizing re-run must not put a copy in
    their place."""
    try:
        at = _inplace_position(func)
    except TypeError:  # a callable that cannot be a cache key
        at = None
    given = kwargs.get("inplace", args[at] if at is not None and at < len(args) else False)
    in_place = name.endswith("_") or name == "setitem" or given is True
    targets = tree_leaves(args[0]) if in_place and args else []
    targets += tree_leaves(kwargs.get("out"))
    return frozenset(id(t) for t in targets if isinstance(t, torch.Tensor))


@functools.lru_cache(maxsize=None)
def _inplace_position(func: Callable) -> Optional[int]:
    """Where ``func`` takes ``inplace`` by position (``F.relu(input, inplace)``), if it does."""
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin without a Python signature
        return None
    return names.index("inplace") if "inplace" in names else None


def quietly(fn: Callable) -> Callable:
    """``fn`` run quietly: what it does is the dumper's own work (its hooks run inside the
    forward of a module that records ops), never recorded as the model's ops. Its torch calls
    bypass torch-function handling altogether, modes and subclasses' ``__torch_function__``
    alike: under a mode each torch call of a hook would cost a Python round trip through it
    (2 us; a third of an op record's cost). Tensors it makes for the model keep their
    subclass by hand (:meth:`dumper.injection.StepReference.tensor`)."""
    def run(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)
    return run


class OpMode(TorchFunctionMode):
    """Sends each recordable op run by an owner's own code to ``on_op(owner, name, func, args,
    kwargs)``, which must run ``func(*args, **kwargs)`` and return its result; every other call
    runs untouched. ``skip``: op names never recorded."""

    def __init__(self, on_op: OnOp, skip: frozenset[str]):
        super().__init__()
        self._on_op = on_op
        self._skip = skip
        self._local = threading.local()

    def _owners(self) -> list:
        local = self._local
        if not hasattr(local, "owners"):
            local.owners = []
        return local.owners

    def enter(self, owner: Optional[Any]) -> None:
        """A hooked module call starts on this thread: ``owner`` (None if it records no ops)
        owns the ops its own code runs until :meth:`leave`."""
        owners = self._owners()
        if owner is not None and not any(o is not None for o in owners):
            torch.overrides._push_mode(self)
        owners.append(owner)

    def leave(self) -> None:
        """The innermost call of this thread returned (or raised)."""
        owners = self._owners()
        if not owners:
            return
        owners.pop()
        if not any(o is not None for o in owners) and self._is_on_top():
            torch.overrides._pop_mode()

    def _is_on_top(self) -> bool:
        stack = torch.overrides._get_current_function_mode_stack()
        return bool(stack) and stack[-1] is self

    def clear(self) -> None:
        """Leave every call still entered on this thread (a step that ended in an exception)."""
        while self._owners():
            self.leave()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owners = self._owners()
        owner = owners[-1] if owners else None
        if owner is None:
            return func(*args, **kwargs)
        name = op_name(func)
        if not name or name in self._skip or not _has_tensor(args, kwargs):
            return func(*args, **kwargs)
        return self._on_op(owner, name, func, args, kwargs)


def _has_tensor(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves((args, kwargs)))
