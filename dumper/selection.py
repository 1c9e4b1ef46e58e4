"""Which modules and which kinds of record a dump keeps."""
from __future__ import annotations

from typing import Iterable, Optional, Union

from torch import nn

from compare import format as fmt

from .calls import module_class
from .ops import MOVES_NO_NUMBERS

Patterns = Union[str, Iterable[str], None]
Types = Union[type, str, Iterable[Union[type, str]], None]


def _as_tuple(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, type)):
        return (value,)
    return tuple(value)


def _globs(name: str, value: Patterns) -> tuple[str, ...]:
    """``value`` of option ``name``: a glob or an iterable of globs, as a tuple."""
    try:
        globs = _as_tuple(value)
    except TypeError:  # not iterable
        globs = (value,)
    bad = [g for g in globs if not isinstance(g, str)]
    if bad:
        raise TypeError(f"{name} takes module globs (str) or a list of them, e.g. "
                        f"['layer1.*'], not {bad[0]!r}")
    return globs


class Selection:
    """Module and kind filters, and which modules keep full values.

    A module is kept when its path or key (``path.Class``) matches an ``include`` glob (all are
    included when none is given), matches no ``exclude`` glob, and, if ``module_types`` is given,
    is an instance of one of them (classes, or class names). In ``mode="stats"`` (``"hash"``)
    only modules matching a ``full_tensors`` glob store values; the others store statistics
    (digests). Kept modules
    matching an ``ops`` glob also record the ops of their own code (:mod:`dumper.ops`), but
    those named in ``skip_ops`` (default: ``MOVES_NO_NUMBERS``).
    """

    def __init__(self, include: Patterns = None, exclude: Patterns = None,
                 module_types: Types = None, kinds: Optional[Iterable[str]] = None,
                 mode: str = fmt.MODE_TENSORS, full_tensors: Patterns = None,
                 ops: Patterns = None, skip_ops: Optional[Iterable[str]] = None):
        if mode not in fmt.MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, fmt.MODES))}, "
                             f"got {mode!r}")
        if full_tensors is not None and mode == fmt.MODE_TENSORS:
            raise ValueError("full_tensors selects the modules that keep values in mode='stats' "
                             "or 'hash'; in mode='tensors' every module keeps values")
        self.mode = mode
        self.full_tensors = _globs("full_tensors", full_tensors)
        self.include = _globs("include", include)
        if include is not None and not self.include:
            raise ValueError("include=[] chooses no module; leave include out to record every "
                             "module")
        self.exclude = _globs("exclude", exclude)
        self.module_types = _as_tuple(module_types)
        self.ops = _globs("ops", ops)
        self.skip_ops = MOVES_NO_NUMBERS if skip_ops is None else frozenset(_as_tuple(skip_ops))
        self.kinds = frozenset(fmt.KINDS if kinds is None else _as_tuple(kinds))
        unknown = self.kinds - set(fmt.KINDS)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}; choose from {list(fmt.KINDS)}")
        for t in self.module_types:
            if not isinstance(t, (str, type)):
                raise TypeError(f"module_types takes classes or class names, not {t!r}")

    def unmatched(self, modules: Iterable[tuple[str, nn.Module]]) -> list[str]:
        """The globs given to choose modules (``include=``, ``full_tensors=``, ``ops=``) that
        match none of ``modules``, e.g. ``"include='layer9.*'"``: most likely a typo, which
        would leave out what was asked for (an ``exclude=`` glob may well match nothing)."""
        modules = list(modules)
        return [f"{name}={glob!r}" for name in ("include", "full_tensors", "ops")
                for glob in getattr(self, name)
                if not any(_matches(path, m, (glob,)) for path, m in modules)]

    def wants_kind(self, kind: str) -> bool:
        return kind in self.kinds

    def mode_of(self, path: str, module: nn.Module) -> str:
        """How ``module``'s tensors are stored: the dump's mode, or whole (``MODE_TENSORS``)
        for a module matching ``full_tensors``."""
        return fmt.MODE_TENSORS if _matches(path, module, self.full_tensors) else self.mode

    def wants_ops(self, path: str, module: nn.Module) -> bool:
        """Whether the ops of a (kept) module's own code are recorded (:mod:`dumper.ops`): it
        matches an ``ops`` glob and is not one of torch's own layers without submodules
        (``Linear``, ``Conv2d``, ``BatchNorm2d``...), whose forward is one functional call that
        its module record already holds."""
        return _matches(path, module, self.ops) and not _torch_layer(module)

    def wants_module(self, path: str, module: nn.Module) -> bool:
        if self.include and not _matches(path, module, self.include):
            return False
        if _matches(path, module, self.exclude):
            return False
        if self.module_types:
            cls = module_class(module)
            return any(issubclass(cls, t) if isinstance(t, type) else cls.__name__ == t
                       for t in self.module_types)
        return True


def _torch_layer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn.") and next(module.children(), None) is None


def _matches(path: str, module: nn.Module, patterns: tuple) -> bool:
    return fmt.module_matches(path, module_class(module).__name__, patterns)
