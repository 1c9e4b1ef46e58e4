"""Records: one row of a step's index table each, made by the hooks and consumed by the writer."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Optional, Union

import torch

from compare import format as fmt

from .arena import NUMBERS, Pending, StepBatch, on_device, on_host_arena
from .flatten import clip, leaf_text
from .known import KnownTensors, SharedValues
from .snapshot import Snapshot, SnapshotPool
from .digest import tensor_digest
from .sharding import ShardMarks, Sharding, local_part
from .stats import tensor_sketch, tensor_stats


@dataclasses.dataclass(slots=True)
class CallInfo:
    """Identity of one module call within a step."""

    number: int
    module: str
    cls: str
    call_idx: int
    mode: str = fmt.MODE_TENSORS  # what this call's tensors are stored as (fmt.MODES)
    micro_batch: int = 0       # the step's micro-batch this call is part of (calls.MicroBatches)

    @property
    def group(self) -> str:
        return fmt.call_group_name(self.number, fmt.module_key(self.module, self.cls))


@dataclasses.dataclass(slots=True)
class Record:
    """A leaf seen by a hook: its index row, and the snapshot (values) or statistics to store.

    ``dtype``, ``shape`` and ``device`` are kept as torch objects (or a Python type name) and
    turned into index strings by the writer thread, off the training thread.
    """

    seq: int
    call: CallInfo
    kind: str
    index: int
    path: str
    dtype: Any
    shape: Any
    device: Any
    requires_grad: bool
    status: str
    value: str = ""
    snapshot: Union[Snapshot, Pending, SharedValues, None] = None  # values: a host copy,
    #                                          in an arena, or another record's (dumper.known)
    stats: Union[tuple, Pending, None] = None  # a tuple (CPU), or numbers on their device
    sketch: Union[tuple, Pending, None] = None  # likewise (parameter statistics)
    digest: Union[int, Pending, None] = None  # hash mode: the digest (CPU), or on the device
    occurrence: int = 0
    producer: int = fmt.NO_PRODUCER
    addends: str = ""  # the outputs the tensor sums unchanged (dumper.dataflow.Dataflow.addends_of)
    injected: bool = False  # the call ran on the reference's value instead (dumper.injection)
    grad_scale: float = fmt.NO_GRAD_SCALE  # the loss scale a gradient carries (fmt.INDEX_COLUMNS)
    sharding: Optional[Sharding] = None  # the values are this rank's shard of a global tensor

    @property
    def micro_batch(self) -> int:
        """Its call's micro-batch; none for a parameter gradient (accumulated over them)."""
        return fmt.NO_MICRO_BATCH if self.kind == fmt.PARAM_GRAD else self.call.micro_batch

    @property
    def dataset(self) -> str:
        if self.snapshot is None:
            return ""
        return fmt.dataset_name(self.kind, self.index, self.occurrence)

    @property
    def nbytes(self) -> int:
        return 0 if self.snapshot is None else self.snapshot.nbytes


class ByteBudget:
    """Bounds the bytes of snapshots taken but not yet written (shared by hooks and writer)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._used = 0
        self._cond = threading.Condition()
        self.on_pressure: Optional[Callable[[], None]] = None  # called before a producer waits

    def try_acquire(self, n: int) -> bool:
        with self._cond:
            if self._used == 0 or self._used + n <= self.limit:
                self._used += n
                return True
            return False

    def request_room(self) -> None:
        """Ask the consumer to free bytes (write what it holds)."""
        if self.on_pressure is not None:
            self.on_pressure()

    def acquire(self, n: int) -> None:
        """Wait until ``n`` more bytes fit (a snapshot larger than the limit waits to go alone)."""
        if self.try_acquire(n):
            return
        self.request_room()
        with self._cond:
            self._cond.wait_for(lambda: self._used == 0 or self._used + n <= self.limit)
            self._used += n

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()


_is_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor",
                                lambda t: False)


def _unsupported_reason(t: torch.Tensor) -> str:
    if t.layout is not torch.strided:
        return f"layout {t.layout} is not stored"
    if t.is_nested:
        return "nested tensors are not stored"
    if t.is_quantized:
        return "quantized tensors are not stored"
    if t.is_meta:
        return "meta tensors have no data"
    if _is_functorch_wrapped(t):
        return "inside a torch.func transform (vmap, grad): values are not readable by hooks"
    return ""


class RecordMaker:
    """Turns hooked leaves into records: snapshots within the byte budget, or statistics.

    When the budget is full a snapshot waits for the writer (``drop_when_full=False``) or is
    dropped, leaving a ``dropped`` row that readers report.
    """

    def __init__(self, pool: SnapshotPool, budget: ByteBudget, drop_when_full: bool,
                 marks: Optional[ShardMarks] = None):
        self._pool, self._budget, self._drop = pool, budget, drop_when_full
        self._marks = marks if marks is not None else ShardMarks()
        self._batch: Optional[StepBatch] = None
        self._known: Optional[KnownTensors] = None
        # the loss scale the dumped step's gradients carry, and the scaler (HookerAndDumper's
        # scaler=) that may unscale the parameters' gradients before the step ends
        self.grad_scale = fmt.NO_GRAD_SCALE
        self.scaler: Any = None

    @property
    def batch(self) -> Optional[StepBatch]:
        """The dumped step's arenas (:mod:`dumper.arena`), if any; setting one also starts the
        step's :class:`~dumper.known.KnownTensors`."""
        return self._batch

    @batch.setter
    def batch(self, batch: Optional[StepBatch]) -> None:
        self._batch = batch
        self._known = None if batch is None else KnownTensors()

    def tensor(self, seq: int, call: CallInfo, kind: str, index: int, path: str,
               t: torch.Tensor, owned: bool = False, stats: bool = False,
               sketch: bool = False, digest: bool = False) -> Record:
        """Record for tensor leaf ``t``, whose values (or, by the call's mode, statistics or
        a digest; statistics with ``stats`` too, with its sketch if ``sketch``; a digest with
        ``digest`` too) are taken now: numbers instead of values if any are wanted.

        ``owned``: ``t`` is a private tensor nothing else references or modifies (e.g. a sum
        made by the dumper); on the CPU it becomes the snapshot itself, without a copy.

        A ``DTensor``, or a tensor a :class:`ShardMarks` mark covers, is recorded as this
        rank's shard, with its ``sharding``. An accelerator's tensor is taken into the step's
        :attr:`batch` (:mod:`dumper.arena`) where it can be: no host work, no sync; so are
        the numbers (not the values) of a small CPU float tensor, reduced with the others.
        A tensor recorded again at the same version shares what was taken of it
        (:mod:`dumper.known`)."""
        requires_grad = t.requires_grad
        t, sharding = local_part(t)
        if sharding is None and self._marks:
            sharding = self._marks.sharding(call.module, call.cls, kind, index, t)
        reason = _unsupported_reason(t)
        shape = () if reason and (t.layout is not torch.strided or t.is_nested) else t.shape
        rec = Record(seq, call, kind, index, path, t.dtype, shape, t.device, requires_grad,
                     fmt.ST_UNSUPPORTED if reason else fmt.ST_OK, reason, sharding=sharding,
                     grad_scale=self.grad_scale if kind in fmt.BACKWARD_KINDS
                     else fmt.NO_GRAD_SCALE)
        if reason:
            return rec
        hashed = call.mode == fmt.MODE_HASH or digest
        summed = call.mode == fmt.MODE_STATS or stats
        batch = self._batch if self._batch is not None and t.numel() else None
        known = self._known if sharding is None and not owned else None  # (new tensors)
        now = known.identify(t, kind) if known is not None else None
        if hashed or summed:
            wanted = tuple(what for what, wants in zip(
                NUMBERS, (summed, summed and sketch, hashed)) if wants)
            numbers = known.numbers(t, now, wanted) if now is not None else None
            if numbers is None:
                try:
                    numbers = _take_numbers(t, wanted, batch)
                except Exception as exc:  # a tensor type nobody foresaw must not stop training
                    rec.status, rec.value = fmt.ST_UNSUPPORTED, unreadable(exc)
                    return rec
                if now is not None:
                    known.put_numbers(t, now, numbers)
            rec.stats, rec.sketch, rec.digest = (numbers.get(what) for what in NUMBERS)
            return rec
        shared = known.values(t, now) if now is not None else None
        if shared is not None:
            rec.snapshot = shared
            return rec
        nbytes = t.numel() * t.element_size()
        if not self._budget.try_acquire(nbytes):
            if self._drop:
                self._budget.request_room()
                rec.status, rec.value = fmt.ST_DROPPED, "dropped: bytes in flight at the limit"
                return rec
            self._budget.acquire(nbytes)
        try:
            taken = batch.take(t, values=True) if batch is not None and on_device(t) else None
            if taken is not None:
                rec.snapshot = taken["values"]
            elif owned and t.device.type == "cpu":
                rec.snapshot = Snapshot(t.detach())
            else:
                rec.snapshot = self._pool.take(t)
        except Exception as exc:  # as above
            self._budget.release(nbytes)
            rec.status, rec.value = fmt.ST_UNSUPPORTED, unreadable(exc)
            return rec
        if now is not None:
            known.put_values(t, now, rec)
        return rec

    def start_step(self, batch: StepBatch, grad_scale: float, scaler: Any) -> None:
        """Begin a dumped step: its arenas, the loss scale its gradients carry and the scaler
        that set it (None: none)."""
        self.batch, self.grad_scale, self.scaler = batch, grad_scale, scaler

    def end_step(self) -> None:
        """Forget the step's arenas, loss scale and scaler."""
        self.batch, self.grad_scale, self.scaler = None, fmt.NO_GRAD_SCALE, None

    def param_grad_scale(self) -> float:
        """The loss scale a parameter's gradient carries now: the step's, unless the scaler
        unscaled its optimizers' gradients since (``GradScaler.unscale_``, as a loop that
        clips calls it: every optimizer's stage ``UNSCALED``, a private field of torch's
        GradScaler read defensively; with several optimizers in other stages, the step's)."""
        states = getattr(self.scaler, "_per_optimizer_states", None)
        stages = {getattr(s.get("stage"), "name", "") for s in (states or {}).values()}
        return fmt.NO_GRAD_SCALE if stages == {"UNSCALED"} else self.grad_scale

    def release(self, record: Record) -> None:
        """Return a written (or discarded) record's buffers and budget."""
        if record.snapshot is not None:
            self._budget.release(record.snapshot.release())
        for numbers in (record.stats, record.sketch, record.digest):
            if isinstance(numbers, Pending):
                numbers.release()


_COMPUTED = {"stats": tensor_stats, "sketch": tensor_sketch, "digest": tensor_digest}


def _take_numbers(t: torch.Tensor, wanted: tuple[str, ...], batch: Optional[StepBatch]
                  ) -> dict:
    """The numbers ``wanted`` (of :data:`NUMBERS`) of ``t``: taken into ``batch`` where it
    takes them (an accelerator's tensor, a small CPU float one), else computed now."""
    if batch is not None and (on_device(t) or on_host_arena(t)):
        return batch.take(t, stats="stats" in wanted, sketch="sketch" in wanted,
                          digest="digest" in wanted)
    return {what: _COMPUTED[what](t) for what in wanted}


def unreadable(exc: BaseException, limit: int = 200) -> str:
    """Index text for a tensor whose values could not be taken: the error's first line."""
    first_line = next(iter(str(exc).splitlines()), "")
    return clip(f"values not readable: {type(exc).__name__}: {first_line}", limit)


def leaf_record(seq: int, call: CallInfo, kind: str, path: str, leaf: Any,
                text: Optional[str] = None) -> Record:
    """Record for a non-tensor leaf: its type and, as its value, ``text`` or else its short
    repr; no data."""
    type_name, value = leaf_text(leaf)
    return Record(seq, call, kind, -1, path, type_name, (), "", False, fmt.ST_OK,
                  value if text is None else text)
