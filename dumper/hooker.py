"""``HookerAndDumper``: the public entry point of the capture side."""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import warnings
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

from torch import nn
from torch.utils.hooks import RemovableHandle

from compare import format as fmt
from compare.dump import Dump

from .arena import StepBatch
from .calls import HookedModel, Modules, hooked_model, runs_hooks, unhookable_roots, unwrapped
from .capture import StepCapture
from .claim import PublishedFiles, StepClaim, StepConflictError
from .collector import CollectorPause
from .consumers import Consumer, Consumers
from .injection import LOCALIZING, Injector, StepReference
from .memory import trim_heap
from .record import ByteBudget, RecordMaker
from .run_info import distributed_rank, run_attrs
from .selection import Patterns, Selection, Types
from .sentinel import NonFiniteError, NonFiniteSentinel, check_action
from .sharding import ShardMarks
from .snapshot import SnapshotPool
from .window import Window, WindowSpec
from .writer import DumpWriteError, StepWriter

DEFAULT_MAX_BYTES_IN_FLIGHT = 1 << 30
PUBLISH_MODES = ("auto", "background", "wait")
BACKGROUND_STEPS = 2  # steps at most being published while training goes on


class HookerAndDumper:
    """Capture every module call's tensors of the chosen steps into per-step HDF5 files.

    ``register_hooks(model, epoch, step)`` before a step and ``remove_hooks()`` after it; outside
    the ``epochs`` x ``steps`` window both are no-ops that install nothing and touch no file.
    Each step is written to ``file_path/{epoch}-epoch_{step}-step_dump.hdf5`` (see
    ``docs/format.md``), published atomically by ``remove_hooks``. The model's numerics are not
    changed: hooks only read. A model inside ``DistributedDataParallel``, ``DataParallel`` or
    ``torch.compile`` is hooked through the module it wraps (names as in a plain run); compiled
    code skips hooks, so dumped steps must run eagerly (a warning says how).

    ``mode="stats"`` stores statistics (min, max, mean, std, norm, NaN/Inf/zero counts) in the
    index instead of values, ``mode="hash"`` a digest of each tensor's bits (a few bytes: every
    step of a long run can be checked for bitwise determinism; :mod:`dumper.digest`), except
    for modules matching a ``full_tensors`` glob.

    Hooks only take snapshots; one writer thread does all HDF5 work. At most
    ``max_bytes_in_flight`` bytes of snapshots wait for it: past that a hook waits
    (``when_full="wait"``) or the tensor is dropped and the drop recorded (``"drop"``).

    ``publish="background"`` makes ``remove_hooks`` return once the step's records are taken
    and have the writer publish the file while training goes on (at most
    ``BACKGROUND_STEPS`` steps at a time; the next dumped step waits beyond that, and
    :meth:`wait` or :meth:`close` wait for all); ``"wait"`` makes it return once the file is
    published; ``"auto"`` (default) publishes in the background the steps that recorded
    accelerator tensors (the host mostly waits for the device there) and waits on CPU-only
    steps (h5py holds the GIL for its per-dataset work: writing while the next step computes
    gained nothing on a 2-core CPU, docs/benchmarks.md).

    ``on_error="raise"`` (default) makes ``remove_hooks`` raise :class:`DumpWriteError` when the
    step could not be written, or, for a step published in the background, the next call of
    ``register_hooks``, ``remove_hooks``, :meth:`wait` or :meth:`close`, naming the step's file;
    ``"warn"`` warns and lets training go on. Either way earlier step files are untouched.

    ``on_nonfinite="raise"`` or ``"warn"`` turns on the NaN/Inf sentinel
    (:mod:`dumper.sentinel`) on *every* step ``register_hooks`` is called for, in the window or
    not: the first module call whose output, or the first gradient, holds NaN/Inf is reported
    with its inputs' state and the ``nonfinite_history`` events before it
    (:class:`~dumper.sentinel.NonFiniteError`, or a warning): on the CPU from the failing hook,
    on a GPU at the next read of the checks it leaves on the device (see :mod:`dumper.sentinel`).
    In a dumped step the records so far are published, the step marked incomplete, also under
    ``with d.hooks(...)``.

    ``ops`` (globs, like ``include``; ``"*"`` for all) also records, in the modules they match,
    every op of the module's own code (torch functions, ``F.*``, tensor methods, operators;
    not those run by its hooked submodules, which have their own records) as a call of its own
    named ``{module}/{op}#{n}``, with the same kinds, modes and budget (:mod:`dumper.ops`); ops
    that move no numbers (views, reshapes, copies, indexing) are skipped unless ``skip_ops``
    (op names) says otherwise.

    ``inject`` makes the dumped steps a localizing re-run (:mod:`dumper.injection`): a reference
    dump (its directory; it must hold the same steps, dumped with ``params=True`` for the
    weights to be injected), whose inputs, weights and incoming gradients replace the run's in
    every hooked module call, after what arrived is recorded; or an :class:`Injector` choosing
    other kinds or modules. ``compare.localize`` (``h5cmp A B --injected C``) then tells each
    module's own error. The run's numerics change in those steps, by design.

    ``scaler``: the ``torch.amp.GradScaler`` the training loop scales its loss with (fp16
    mixed precision): each dumped step records the scale its gradients carry (the index's
    ``grad_scale``: read with ``get_scale()`` as ``register_hooks`` begins the step, one host
    sync), so that ``h5cmp`` compares them with another run's unscaled ones. A parameter's
    gradient taken as an optimizer step begins is taken as ``GradScaler.step`` leaves it:
    unscaled, but for a fused optimizer's (it unscales inside its step); one taken again
    as the step ends after ``scaler.unscale_(optimizer)`` (before clipping), unscaled.

    ``pause_gc`` (default True) turns Python's automatic cyclic garbage collection off from
    ``register_hooks`` of a dumped step to its ``remove_hooks`` (:mod:`dumper.collector`): the
    step's many short-lived objects would otherwise trigger full collections of the whole
    process. A collector the user turned off stays off.
    """

    def __init__(self, file_path: Union[str, os.PathLike] = "dumps/", epochs: WindowSpec = None,
                 steps: WindowSpec = None, *, include: Patterns = None, exclude: Patterns = None,
                 module_types: Types = None, kinds: Optional[Iterable[str]] = None,
                 params: bool = False, mode: str = fmt.MODE_TENSORS,
                 full_tensors: Patterns = None, on_error: str = "raise",
                 max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT,
                 when_full: str = "wait", fsync: bool = False,
                 on_nonfinite: Optional[str] = None, nonfinite_history: int = 8,
                 inject: Union[str, os.PathLike, Dump, Injector, None] = None,
                 ops: Patterns = None, skip_ops: Optional[Iterable[str]] = None,
                 publish: str = "auto", pause_gc: bool = True, scaler: Optional[Any] = None):
        self.directory = _prepare_directory(file_path)
        self.epochs = Window(epochs, "epochs")
        self.steps = Window(steps, "steps")
        self.selection = Selection(include, exclude, module_types, kinds, mode, full_tensors,
                                   ops, skip_ops)
        self.params = bool(params)
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        self.on_error = on_error
        if publish not in PUBLISH_MODES:
            raise ValueError(f"publish must be one of {PUBLISH_MODES}, got {publish!r}")
        self.publish = publish
        self._publishing: deque[StepWriter] = deque()  # steps published in the background
        self.pause_gc = bool(pause_gc)
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(f"scaler must be a torch.amp.GradScaler (or have get_scale()), got "
                            f"{type(scaler).__name__}")
        self.scaler = scaler
        self._gc_pause: Optional[CollectorPause] = None  # while a dumped step runs
        if max_bytes_in_flight <= 0:
            raise ValueError(f"max_bytes_in_flight must be positive, got {max_bytes_in_flight}")
        if when_full not in ("wait", "drop"):
            raise ValueError(f"when_full must be 'wait' or 'drop', got {when_full!r}")
        self.max_bytes_in_flight = max_bytes_in_flight
        self._budget = ByteBudget(max_bytes_in_flight)
        self._pool = SnapshotPool(max_bytes_in_flight)
        self._shard_marks = ShardMarks()
        self._maker = RecordMaker(self._pool, self._budget, drop_when_full=when_full == "drop",
                                  marks=self._shard_marks)
        self._published = PublishedFiles(self.directory)
        self.fsync = fsync
        if on_nonfinite is not None:
            check_action(on_nonfinite)
        self.on_nonfinite = on_nonfinite
        self.nonfinite_history = nonfinite_history
        self._sentinel: Optional[NonFiniteSentinel] = None
        self.nonfinite_report: Optional[str] = None  # the sentinel's report of the last step
        self._consumers = Consumers()
        self.written_files: list[Path] = []
        self._registered = False
        self._globs_checked = False  # whether the selection's globs match modules: said once
        self._capture: Optional[StepCapture] = None
        self._writer: Optional[StepWriter] = None
        self.injector: Optional[Injector] = (
            inject if isinstance(inject, Injector) or inject is None
            else Injector(inject, kinds=LOCALIZING))
        if self.injector is not None and not self.injector.kinds <= set(LOCALIZING):
            raise ValueError(f"inject: a dumper injects {list(LOCALIZING)} (what arrived is "
                             f"recorded first); {sorted(self.injector.kinds - set(LOCALIZING))} "
                             f"is for Injector.register, without a dumper")
        self._reference: Optional[StepReference] = None  # the injected step's values

    def add_consumer(self, fn: Consumer, kinds: Optional[Iterable[str]] = None,
                     modules: Patterns = None) -> RemovableHandle:
        """Call ``fn(record)`` (a :class:`~dumper.consumers.CapturedRecord`: names, values or
        statistics) for each record of the dumped steps, of ``kinds`` and of modules matching
        the ``modules`` globs (all by default), on the writer's thread: off the training
        thread, as the step is written. A consumer that raises gets a warning and is left out
        for the rest of the step; training goes on. ``handle.remove()`` takes it out from the
        next dumped step on."""
        return self._consumers.add(fn, kinds, modules)

    def mark_sharded(self, modules: Patterns, kinds: Union[str, Iterable[str]], dim: int,
                     index: Optional[int] = None, group: Optional[object] = None) -> None:
        """Declare plain tensors to be shards (a hand-written tensor-parallel layer): for
        modules matching the ``modules`` globs, tensor ``index`` (all when None) of each of
        ``kinds`` is this rank's equal part, along dimension ``dim``, of a tensor split over the ranks of
        the process ``group`` (the default group; one rank without torch.distributed) in rank
        order. Their rows get the sharding columns a ``DTensor``'s get (docs/format.md), so
        that a comparison can put the shards together. ``DTensor`` needs no mark."""
        patterns = (modules,) if isinstance(modules, str) else tuple(modules or ())
        if not patterns:
            raise ValueError("mark_sharded needs at least one module glob")
        for kind in (kinds,) if isinstance(kinds, str) else kinds:
            self._shard_marks.add(patterns, kind, int(dim), index, group)

    def in_window(self, epoch: int, step: int) -> bool:
        return epoch in self.epochs and step in self.steps

    def register_hooks(self, model: nn.Module, epoch: int, step: int) -> bool:
        """Hook ``model`` for step ``(epoch, step)`` if it is in the window; returns whether it is."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"register_hooks needs a torch.nn.Module, got {type(model).__name__}")
        if not runs_hooks(model):
            raise TypeError("register_hooks: the model is a TorchScript module (torch.jit.script "
                            "or trace), which runs no Python hooks; pass the original nn.Module")
        for name, value in (("epoch", epoch), ("step", step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self._registered:
            raise RuntimeError("register_hooks was called twice without remove_hooks; call "
                               "remove_hooks() at the end of every step (or use `with d.hooks(...)`)")
        self._collect_published(block=False)  # a background step's error is raised here
        self._registered = True
        if not self.in_window(epoch, step):
            self._give_back_memory()
            self._start_sentinel(model)
            return False
        hooked = hooked_model(model)
        _warn_if_scripted_inside(hooked.every)
        _warn_if_compiled(hooked)
        self._warn_if_unmatched(hooked.every)
        rank, _ = distributed_rank()
        try:
            self._reference = self.injector.step(epoch, step, rank) if self.injector else None
        except KeyError:
            self._registered = False
            raise
        path = self.directory / fmt.step_file_name(epoch, step, rank)
        try:
            self._make_room_to_publish(path)
            claim = self._claim(path)
        except BaseException:
            self._registered = False
            self._close_reference()
            raise
        if claim is None:
            self._close_reference()
            self._start_sentinel(model)
            return False
        injected_from = self.injector.describe() if self.injector else ""
        attrs = run_attrs(unwrapped(model), epoch, step, self.selection.mode, injected_from,
                          hooked.compiled)
        self._gc_pause = CollectorPause() if self.pause_gc else None  # before the hooks' objects
        try:
            try:
                self._writer = StepWriter(claim, fmt.step_group_name(epoch, step), attrs,
                                          self._maker.release, self.fsync,
                                          self._published.check,
                                          self._consumers.for_step(epoch, step))
            except BaseException:
                claim.release()
                raise
            self._budget.on_pressure = self._writer.flush
            self._maker.start_step(StepBatch(self._pool), self._loss_scale(), self.scaler)
            if self._reference is not None:
                self._reference.grad_scale = self._maker.grad_scale
            self._capture = StepCapture(hooked, self._writer.submit, self._maker,
                                        self.selection, self.params, self._reference)
            self._start_sentinel(model)  # after the capture: a failing call's tensors recorded
        except BaseException:  # nothing stays hooked, claimed or paused
            self.abort_step()
            raise
        return True

    def _warn_if_unmatched(self, modules: Modules) -> None:
        """At the first dumped step: the globs that match no module of the model (a typo)."""
        if self._globs_checked:
            return
        self._globs_checked = True
        unmatched = self.selection.unmatched(modules)
        if unmatched:
            examples = ", ".join(repr(p) for p, _ in modules[1:4])
            verb = "matches" if len(unmatched) == 1 else "match"
            warnings.warn(f"h5cmp: {', '.join(unmatched)} {verb}"
                          f" no module of the model (its modules are named like {examples}; "
                          f"globs match a module's path or path.Class)", RuntimeWarning,
                          stacklevel=3)

    def _start_sentinel(self, model: nn.Module) -> None:
        self.nonfinite_report = None
        if self.on_nonfinite is not None:
            self._sentinel = NonFiniteSentinel(model, self.on_nonfinite,
                                               self.nonfinite_history)

    def _stop_sentinel(self) -> None:
        sentinel, self._sentinel = self._sentinel, None
        if sentinel is not None:
            try:
                sentinel.remove()  # then reads the checks still on the device (may warn)
            finally:
                self.nonfinite_report = sentinel.report

    def _claim(self, path: Path) -> Optional[StepClaim]:
        """The right to write ``path``; None (after a warning, with ``on_error="warn"``) when
        another dumper writes or has published it, or the lock file cannot be created."""
        try:
            self._published.check(path)
            return StepClaim(path)
        except StepConflictError as exc:
            error: Exception = exc
        except OSError as exc:
            error = DumpWriteError(f"h5cmp: cannot start writing {path} ({exc}); this step is "
                                   f"not saved, earlier steps are intact")
        if self.on_error == "raise":
            self._registered = False
            raise error
        warnings.warn(str(error), RuntimeWarning, stacklevel=3)
        return None

    def _loss_scale(self) -> float:
        """The loss scale the step's gradients will carry: the scaler's, as the step begins
        (``GradScaler.update`` changes it after the optimizer step; a disabled scaler's is 1)."""
        if self.scaler is None:
            return fmt.NO_GRAD_SCALE
        enabled = getattr(self.scaler, "is_enabled", lambda: True)()
        return float(self.scaler.get_scale()) if enabled else fmt.NO_GRAD_SCALE

    def remove_hooks(self) -> Optional[Path]:
        """Remove every hook and publish this step's file; returns its path (None outside the
        window, or when it could not be written and ``on_error="warn"``). A step published in
        the background (``publish``) is at that path once :meth:`wait` returns. A step that
        ends while an exception propagates, or with module calls that never returned, is
        published marked incomplete (``h5cmp`` says so); ``with d.hooks(...)`` discards such a
        step instead."""
        self._registered = False
        try:
            path = self._publish_step()
            self._collect_published(block=False)  # an earlier background step's error
            return path
        finally:
            self._resume_gc()  # once the step's records are written (or handed over)
            self._stop_sentinel()  # last: whatever its read raises, nothing is left behind

    def _resume_gc(self) -> None:
        pause, self._gc_pause = self._gc_pause, None
        if pause is not None:
            pause.resume()

    def _publish_step(self) -> Optional[Path]:
        capture, writer = self._capture, self._writer
        self._capture = self._writer = None
        if capture is None:
            return None
        incomplete = _why_incomplete(capture.open_calls)
        try:
            capture.finish()  # its last records (sums of gradients, parameter gradients) too
            self._maker.batch.seal()  # go from the device to the host, for the writer
        finally:
            self._maker.end_step()
            capture.remove()
            self._close_reference()
        if not capture.modules_run:
            why = ("no module of the model is selected (include=, exclude=, module_types=)"
                   if not capture.modules_hooked else
                   "the hooked model did not run between register_hooks and remove_hooks (hook "
                   "the model as the training code calls it: a torch.compile or DDP wrapper, "
                   "not the module inside it)")
            warnings.warn(f"h5cmp: no module call was recorded in {writer.final_path.name}: "
                          f"{why}", RuntimeWarning, stacklevel=3)
        if incomplete:
            warnings.warn(f"h5cmp: {writer.final_path} is marked incomplete: {incomplete}",
                          RuntimeWarning, stacklevel=3)
        writer.finish_later(incomplete)
        if self.publish == "background" or (self.publish == "auto"
                                             and writer.held_accelerator_tensors):
            self._publishing.append(writer)
            _waited_at_exit.add(self)
            return writer.final_path
        return self._published_by(writer)

    def _published_by(self, writer: StepWriter) -> Optional[Path]:
        """Wait for ``writer`` to publish its step; its path, or None after a write error
        that ``on_error="warn"`` turned into a warning (pointing at the caller's caller: the
        user's call of remove_hooks, register_hooks or wait)."""
        try:
            path = writer.wait()
        except DumpWriteError as exc:
            if self.on_error == "raise":
                raise
            warnings.warn(str(exc), RuntimeWarning, stacklevel=4)
            return None
        self._published.published(path)
        self.written_files.append(path)
        return path

    def _collect_published(self, block: bool) -> None:
        """Take in the steps published in the background (all of them with ``block``, else
        those done): their files join ``written_files``; the first write error is raised (or
        warned about) once the others are taken in."""
        error: Optional[DumpWriteError] = None
        while self._publishing and (block or self._publishing[0].done):
            try:
                self._published_by(self._publishing.popleft())
            except DumpWriteError as exc:
                error = error or exc
        if error is not None:
            raise error

    def _make_room_to_publish(self, path: Path) -> None:
        """Before a dumped step: wait for the oldest steps still being published beyond
        ``BACKGROUND_STEPS - 1``, and for one being published to ``path`` (its claim)."""
        while self._publishing and (len(self._publishing) >= BACKGROUND_STEPS or any(
                w.final_path == path for w in self._publishing)):
            writer = self._publishing.popleft()
            self._published_by(writer)

    def wait(self) -> list[Path]:
        """Wait until every step handed to the writer is published; returns ``written_files``.
        Raises :class:`DumpWriteError` for a step that could not be written (with
        ``on_error="raise"``)."""
        self._collect_published(block=True)
        return self.written_files

    def abort_step(self) -> None:
        """Remove every hook and discard the step in flight (nothing is published)."""
        self._registered = False
        capture, writer = self._capture, self._writer
        self._capture = self._writer = None
        self._maker.end_step()
        try:
            if capture is not None:
                capture.remove()
            if writer is not None:
                writer.abort()
        finally:
            self._resume_gc()
            self._close_reference()
            self._stop_sentinel()

    def _close_reference(self) -> None:
        reference, self._reference = self._reference, None
        if reference is not None:
            self.injector.injected += reference.injected
            reference.close()

    @contextlib.contextmanager
    def hooks(self, model: nn.Module, epoch: int, step: int) -> Iterator[bool]:
        """``with d.hooks(model, epoch, step):`` one step; a step that raises is discarded,
        except one the NaN/Inf sentinel stopped: its records so far are published (marked
        incomplete) for ``h5cmp``."""
        active = self.register_hooks(model, epoch, step)
        try:
            yield active
        except BaseException as exc:
            self.end_step_after(exc)
            raise
        self.remove_hooks()

    def end_step_after(self, exc: BaseException) -> None:
        """End the step in flight that ``exc`` interrupted: published, marked incomplete, when
        the NaN/Inf sentinel stopped it (its records so far show how the values got there);
        else discarded. Either way no hook stays on the model (a trainer's exception hook)."""
        if isinstance(exc, NonFiniteError):
            self.remove_hooks()
        else:
            self.abort_step()

    def close(self) -> None:
        """Discard a step left open (hooks registered, never removed), wait for the steps
        being published (:meth:`wait`) and give the snapshot buffers kept for reuse back to
        the system."""
        try:
            self.abort_step()
            self.wait()
        finally:
            _waited_at_exit.discard(self)
            self._give_back_memory()

    def _give_back_memory(self) -> None:
        """Free the snapshot buffers kept for the next dumped step, and the C heap's free pages:
        between dumped steps the process is as large as without a dumper."""
        if self._pool.clear():
            trim_heap()

    def __enter__(self) -> "HookerAndDumper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_h5py_data(self, path: Union[str, os.PathLike, None] = None) -> None:
        """Print the structure of the dump (groups, datasets, dtypes, shapes); default: all of it."""
        from compare.inspect import print_tree
        print_tree(self.directory if path is None else path)


_waited_at_exit: "weakref.WeakSet[HookerAndDumper]" = weakref.WeakSet()


@atexit.register
def _publish_before_exit() -> None:
    """At interpreter exit (before daemon threads stop): finish the background publishing of
    dumpers that were never closed, so that their last steps are not lost."""
    for dumper in list(_waited_at_exit):
        try:
            dumper.wait()
        except DumpWriteError as exc:
            warnings.warn(str(exc), RuntimeWarning)


def given_or_new(owner: str, dumper: Optional[HookerAndDumper], args: tuple,
                 options: dict) -> HookerAndDumper:
    """The dumper of an integration (``owner``, e.g. a trainer callback): ``dumper`` if given,
    else one made from :class:`HookerAndDumper`'s ``args`` and ``options``, not both."""
    if dumper is not None and (args or options):
        raise TypeError(f"{owner}: pass either a dumper or HookerAndDumper's arguments")
    return dumper if dumper is not None else HookerAndDumper(*args, **options)


def _why_incomplete(open_calls: int) -> str:
    """Why a step ending now is incomplete ("" if it is not): an exception is propagating (the
    caller's ``finally``), or module calls started and never returned."""
    reasons = []
    exc = sys.exc_info()[1]
    if exc is not None:
        reasons.append(f"the step ended while {type(exc).__name__} was raised")
    if open_calls:
        reasons.append(f"{open_calls} module call(s) never returned")
    return "; ".join(reasons)


def _warn_if_scripted_inside(modules: Modules) -> None:
    outermost = unhookable_roots(modules)
    if outermost:
        more = f" and {len(outermost) - 3} more" if len(outermost) > 3 else ""
        warnings.warn(f"h5cmp: TorchScript submodules run no Python hooks and are not recorded: "
                      f"{', '.join(outermost[:3])}{more}", RuntimeWarning, stacklevel=3)


def _warn_if_compiled(hooked: HookedModel) -> None:
    """Compiled code (regional compilation, a ``torch.compile``'d model) is recorded at its
    boundaries; the modules inside it are not hooked (:class:`~dumper.calls.HookedModel`)."""
    if hooked.inside:
        names = ", ".join(c or fmt.ROOT_NAME for c in hooked.compiled[:3])
        more = f" and {len(hooked.compiled) - 3} more" if len(hooked.compiled) > 3 else ""
        one = len(hooked.compiled) == 1
        warnings.warn(f"h5cmp: {names}{more} run{'s' if one else ''} as compiled code "
                      f"(torch.compile): recorded at "
                      f"{'its boundary' if one else 'their boundaries'}"
                      f"; the {hooked.inside} module{'s' if hooked.inside > 1 else ''} inside "
                      f"{'it' if one else 'them'} {'are' if hooked.inside > 1 else 'is'} not "
                      f"recorded (hooks there would change the compiled code and its numerics; "
                      f"run the dumped steps eagerly, e.g. inside "
                      f"torch.compiler.set_stance('force_eager'), to record them)",
                      RuntimeWarning, stacklevel=3)


def _prepare_directory(file_path: Union[str, os.PathLike]) -> Path:
    if not isinstance(file_path, (str, os.PathLike)):
        raise TypeError(f"file_path must be a directory path, got {type(file_path).__name__}")
    directory = Path(file_path)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"file_path {str(directory)!r} exists and is not a directory; "
                                 f"pass a directory for the step files")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PermissionError(f"cannot create dump directory {str(directory)!r}: "
                              f"{exc.strerror}; choose a writable file_path") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(f"dump directory {str(directory)!r} is not writable; "
                              f"choose a writable file_path")
    return directory
