"""Per-step bookkeeping of module calls shared by every set of module hooks."""
from __future__ import annotations

import sys
import threading
from collections import defaultdict
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from compare import format as fmt


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (e.g. checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


COMPILED_ATTRIBUTE = "_orig_mod"  # where a torch.compile wrapper keeps the module it compiles


def _layers(model: nn.Module) -> Iterator[nn.Module]:
    """``model``, then each model a ``torch.compile``, ``DistributedDataParallel`` or
    ``DataParallel`` wrapper holds, the innermost last."""
    while True:
        yield model
        if _is_compiled(model):
            model = getattr(model, COMPILED_ATTRIBUTE)
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return


def _is_compiled(model: nn.Module) -> bool:
    return (type(model).__name__ == "OptimizedModule"
            and isinstance(getattr(model, COMPILED_ATTRIBUTE, None), nn.Module))


def module_class(module: nn.Module) -> type:
    """The class a module's records, ``include=`` globs and ``module_types`` go by: the
    compiled module's for a ``torch.compile`` wrapper (a submodule replaced by it is recorded
    at its boundary), through the wrappers it compiles (``compile(checkpoint_wrapper(block))``
    is a ``block``'s class), so that a compiled run pairs with, and selects as, an eager one."""
    if not _is_compiled(module):
        return type(module)
    while _is_compiled(module) or _is_wrapper(module, WRAPPED_ATTRIBUTES):
        module = next(module._modules[a] for a in (COMPILED_ATTRIBUTE, *WRAPPED_ATTRIBUTES)
                      if module._modules.get(a) is not None)
    return type(module)


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside wrappers (see :func:`_layers`): they call it, so its hooks run, and its
    module names are those of a plain run, which is what dumps pair by."""
    *_, inner = _layers(model)
    return inner


def _compile_wrapper(model: nn.Module) -> Optional[nn.Module]:
    """The outermost ``torch.compile`` wrapper of ``model`` that runs it as compiled code (not
    under ``torch.compiler.set_stance('force_eager')``), or None."""
    *wrappers, _ = _layers(model)
    compiled = [w for w in wrappers if _is_compiled(w)]
    return compiled[0] if compiled and not _forced_eager() else None


def _forced_eager() -> bool:
    """Whether ``torch.compiler.set_stance('force_eager')`` is in effect (no public getter:
    read where torch keeps it, if torch._dynamo is loaded; False when unknown)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(getattr(eval_frame, "_stance", None), "stance", None) == "force_eager"


def _runs_compiled(module: nn.Module) -> bool:
    """Whether a module of a model runs its calls as compiled code: ``module.compile()``
    (regional compilation), or it is a submodule's ``torch.compile`` wrapper; not under
    ``force_eager``."""
    return ((getattr(module, "_compiled_call_impl", None) is not None or _is_compiled(module))
            and not _forced_eager())


# Attributes under which wrapper modules keep the module they wrap and call: FSDP1's
# FullyShardedDataParallel, activation checkpointing's checkpoint_wrapper / offload_wrapper.
WRAPPED_ATTRIBUTES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _wrapped_attributes() -> tuple[str, ...]:
    """The attributes of :data:`WRAPPED_ATTRIBUTES`, and, under ``force_eager``, a submodule's
    ``torch.compile`` wrapper's: it then only calls the module it wraps, eagerly (compiled, it
    is recorded at its boundary instead and the module inside it is not hooked)."""
    return WRAPPED_ATTRIBUTES + ((COMPILED_ATTRIBUTE,) if _forced_eager() else ())


def _is_wrapper(module: nn.Module, attributes: tuple[str, ...]) -> bool:
    if not runs_hooks(module):  # TorchScript: its submodules are no wrappers
        return False
    if COMPILED_ATTRIBUTE in attributes and not _is_compiled(module):
        attributes = WRAPPED_ATTRIBUTES  # (a module of the user's own with that attribute)
    children = module._modules  # a submodule's attribute lives here: no __getattr__ fallback
    return any(children.get(a) is not None for a in attributes)


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` as dumps name them: without the wrapper modules of
    :func:`_wrapped_attributes`, each wrapped module under its wrapper's path (so that a model
    wrapped by FSDP1 or activation checkpointing, or a submodule's ``torch.compile`` wrapper
    run under ``force_eager``, pairs with the plain one; the wrapper only calls the module it
    wraps, whose hooks record the call)."""
    attributes = _wrapped_attributes()
    wrappers: set[str] = set()  # (named_modules goes parents first)
    for path, module in model.named_modules():
        if _is_wrapper(module, attributes):
            wrappers.add(path)
            continue
        parts = path.split(".")
        yield ".".join(part for i, part in enumerate(parts)
                       if not (part in attributes and ".".join(parts[:i]) in wrappers)), module


Modules = list[tuple[str, nn.Module]]  # a model's (path, module) pairs, from named_modules


class HookedModel(NamedTuple):
    """What of a model the dumper hooks: ``modules``, the (path, module) pairs whose hooks run,
    of ``every`` module of the model (named as in a plain run; TorchScript modules run none),
    and ``compiled``, the paths of the outermost modules that run as compiled code: each
    module compiled in place (``module.compile()``), a submodule replaced by its
    ``torch.compile`` wrapper, or the root of a model in a ``torch.compile`` ``wrapper``. Such
    a module is hooked at its boundary (:meth:`hook`); the modules :attr:`inside` it are not
    hooked at all, as dynamo would trace their hooks into the compiled code, changing its
    graphs, its kernels and so the run's numerics."""

    modules: Modules
    every: Sequence[tuple[str, nn.Module]] = ()
    compiled: tuple[str, ...] = ()
    wrapper: Optional[nn.Module] = None

    @property
    def inside(self) -> int:
        """How many modules that would run hooks are inside compiled code."""
        return sum(map(runs_hooks, (m for _, m in self.every))) - len(self.modules)

    def hook(self, path: str, module: nn.Module, hook: Callable, pre: bool = False,
             **options) -> RemovableHandle:
        """Register forward (``pre``: pre-) ``hook`` for ``module`` at ``path``. On a module
        that runs as compiled code it is excluded from compilation (torch.compiler.disable),
        so that it runs as written, at the compiled code's boundary, instead of being traced
        into its graph; for the root of a model in a ``torch.compile`` wrapper, it goes on the
        wrapper, whose own hooks run before and after the compiled code (the root's own ones
        run inside it, and not at all where a graph compiled without them is reused). The
        module a hook is given is the one it is registered on."""
        host = self.wrapper if path == "" and self.wrapper is not None else module
        register = host.register_forward_pre_hook if pre else host.register_forward_hook
        return register(torch.compiler.disable(hook) if path in self.compiled else hook,
                        **options)


def hooked_model(model: nn.Module) -> HookedModel:
    """:class:`HookedModel` of ``model`` (given as the user's code calls it: wrappers too)."""
    wrapper = _compile_wrapper(model)
    every = list(named_modules(unwrapped(model)))
    modules = [(path, m) for path, m in every if runs_hooks(m)]
    compiled = tuple(outermost([path for path, m in modules if _runs_compiled(m)
                                or (wrapper is not None and path == "")]))
    hooked = [(path, m) for path, m in modules
              if not any(fmt.contains(c, path) and path != c for c in compiled)]
    return HookedModel(hooked, every, compiled, wrapper)


def outermost(paths: list[str]) -> list[str]:
    """Those of module ``paths`` inside none of the others."""
    return [p for p in paths if not any(fmt.contains(q, p) for q in paths if q != p)]


def runs_hooks(module: nn.Module) -> bool:
    """False for TorchScript modules: they run no Python hooks (and refuse module hooks)."""
    return not isinstance(module, torch.jit.ScriptModule)


def hookable_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """:func:`named_modules` less the modules that do not :func:`runs_hooks`."""
    return ((path, m) for path, m in named_modules(model) if runs_hooks(m))


def unhookable_roots(modules: Modules) -> list[str]:
    """Paths of the outermost of a model's ``modules`` that do not :func:`runs_hooks`."""
    return outermost([path for path, m in modules if not runs_hooks(m)])


class MicroBatches:
    """Numbers a step's micro-batches (``micro_batch``): its forward work, cut by backward
    passes. A call that starts while no hooked call is open, after a backward pass went through
    the outputs of an earlier such call, starts the next micro-batch. Every module of the model
    takes part, recorded or not, so the numbering does not depend on what is selected."""

    def __init__(self) -> None:
        self.number = 0  # the current micro-batch
        self._open = 0
        self._backward_ran = False
        self._lock = threading.Lock()

    def enter(self) -> None:
        """A call starts."""
        with self._lock:
            if self._open == 0 and self._backward_ran:
                self.number += 1
                self._backward_ran = False
            self._open += 1

    def leave(self) -> bool:
        """A call returned or raised; True when no call is open any more (its outputs are the
        ones to watch for a backward pass)."""
        with self._lock:
            self._open = max(0, self._open - 1)
            return self._open == 0

    def backward_ran(self, grad: Any = None) -> None:
        """A backward pass went through an outermost call's output (a gradient hook)."""
        self._backward_ran = True


class CallTracker:
    """Numbers each module's calls within a step (``call_idx``: the n-th call of that module,
    from 0 — the numbering dumps and injection agree on) and carries per-call state from a
    forward pre-hook to the forward hook of the same call: a stack per module (calls can nest)
    and per thread (a call's two hooks run on the thread that calls the module, so forward
    passes of one model on several threads at once keep their calls apart).
    """

    def __init__(self) -> None:
        self._counts: dict[int, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._open = 0

    def next_index(self, module: nn.Module) -> int:
        """``call_idx`` of the call starting now."""
        with self._lock:
            index = self._counts[id(module)]
            self._counts[id(module)] = index + 1
        return index

    def _stacks(self) -> dict[int, list[Any]]:
        stacks = getattr(self._local, "stacks", None)
        if stacks is None:
            stacks = self._local.stacks = defaultdict(list)
        return stacks

    def push(self, module: nn.Module, state: Any) -> None:
        """Open a call of ``module`` with ``state`` (None: a call that is not tracked, e.g. a
        recomputation, which may be stopped early)."""
        self._stacks()[id(module)].append(state)
        if state is not None:
            with self._lock:
                self._open += 1

    def peek(self, module: nn.Module) -> Any:
        """State of this thread's innermost open call of ``module`` (None if none)."""
        stack = self._stacks()[id(module)]
        return stack[-1] if stack else None

    def pop(self, module: nn.Module) -> Any:
        """State pushed by this thread's innermost open call of ``module`` (None if none)."""
        stack = self._stacks()[id(module)]
        state = stack.pop() if stack else None
        if state is not None:
            with self._lock:
                self._open -= 1
        return state

    @property
    def open_calls(self) -> int:
        """Tracked calls started on any thread and not finished: an exception left them open."""
        return self._open

    def clear(self) -> None:
        with self._lock:
            self._counts.clear()
            self._open = 0
        self._local = threading.local()


# enter(module, path, call_idx, args, kwargs) -> (state, (args, kwargs) to run on instead or None)
Enter = Callable[[nn.Module, str, int, tuple, dict], tuple[Any, Optional[tuple[tuple, dict]]]]
# leave(module, state, output) -> the output to return instead, or None
Leave = Callable[[nn.Module, Any, Any], Any]


class CallHooks:
    """The call-numbering walk every set of module hooks shares (the capture, ``io_shapes``,
    the ``Injector``), so that they agree on which call of a module is which.

    :meth:`install` puts a forward pre-hook and a forward hook on a module. When a call starts,
    ``enter(module, path, call_idx, args, kwargs)`` gets its ``call_idx`` (the n-th call of
    that module in the step, from 0) and returns ``(state, replacement)``: the state handed to
    the same call's ``leave(module, state, output)``, and the ``(args, kwargs)`` the module is
    to run on instead, or None. ``leave`` returns the output to return instead, or None. A state
    of None means "not tracked": ``leave`` is not called. Recomputations of activation
    checkpointing (forward calls run again during backward) are not calls: neither callback
    sees them. With ``always_call``, ``leave`` runs also when the forward raised, with
    ``output`` None; otherwise such a call stays open (:attr:`open_calls`). With
    ``enter_first`` the pre-hook goes before the pre-hooks already registered (so that they
    see what it replaces); the forward hook always goes last. :meth:`remove` removes every
    hook and forgets the numbering.
    """

    def __init__(self, enter: Enter, leave: Leave, always_call: bool = False,
                 enter_first: bool = False):
        self._enter, self._leave = enter, leave
        self._always_call, self._enter_first = always_call, enter_first
        self._tracker = CallTracker()
        self._handles: list[RemovableHandle] = []

    def install(self, path: str, module: nn.Module, hooked: Optional[HookedModel] = None
                ) -> None:
        """Hook ``module`` at ``path``, where ``hooked`` places hooks (:meth:`HookedModel.hook`)
        if given, else on the module itself."""
        def pre_hook(_, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            if in_backward():  # a recomputation: not a call
                self._tracker.push(module, None)
                return None
            state, replacement = self._enter(module, path, self._tracker.next_index(module),
                                             args, kwargs)
            self._tracker.push(module, state)
            return replacement

        def hook(_, args: tuple, kwargs: dict, output: Any) -> Any:
            state = self._tracker.pop(module)
            return None if state is None else self._leave(module, state, output)

        place = hooked or HookedModel([])
        self._handles.append(place.hook(path, module, pre_hook, pre=True, with_kwargs=True,
                                        prepend=self._enter_first))
        self._handles.append(place.hook(path, module, hook, with_kwargs=True,
                                        always_call=self._always_call))

    def state(self, module: nn.Module) -> Any:
        """The state of this thread's innermost open call of ``module`` (None if none)."""
        return self._tracker.peek(module)

    @property
    def open_calls(self) -> int:
        """Calls that started and have not returned (an exception left them open)."""
        return self._tracker.open_calls

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._tracker.clear()
