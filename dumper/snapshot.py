"""Snapshots: private host copies of tensors taken at hook time, in reused buffers.

A fresh allocation per tensor costs a page fault per 4 KiB on first touch; buffers are therefore
taken from a pool and given back once written. Accelerator tensors are copied into pinned host
buffers with ``non_blocking=True`` after the producing stream; the writer waits on an event
before reading them, so the training stream is never synchronised per tensor.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Optional

import torch

MIN_POOLED = 1 << 17  # smaller snapshots are plain clones (malloc reuses its heap for them)


GRANULE = 1 << 16  # buffer sizes are rounded up to this: training repeats shapes, so reuse is exact


def _size_class(nbytes: int) -> int:
    if nbytes < GRANULE:  # small (e.g. statistics of accelerator tensors): powers of two
        return 1 << max(nbytes - 1, 63).bit_length()
    return (nbytes + GRANULE - 1) // GRANULE * GRANULE


_SHARING = threading.Lock()  # a snapshot's holders: shared by a hook, released by the writer


class Snapshot:
    """The values of a tensor at hook time, as a dense CPU tensor (see :meth:`wait`); held by
    one record, or by more through :meth:`again` (each releases it)."""

    __slots__ = ("tensor", "nbytes", "_buffer", "_pool", "_ready", "_pinned", "_holders")

    def __init__(self, tensor: torch.Tensor, buffer: Optional[torch.Tensor] = None,
                 pool: Optional["SnapshotPool"] = None, ready=None, pinned: bool = False):
        self.tensor, self._buffer, self._pool, self._ready = tensor, buffer, pool, ready
        self.nbytes = tensor.numel() * tensor.element_size()
        self._pinned = pinned
        self._holders = 1

    def again(self) -> Optional["Snapshot"]:
        """This snapshot, held once more (released once more); None once it was released."""
        with _SHARING:
            if self._holders == 0:
                return None
            self._holders += 1
            return self

    def wait(self) -> torch.Tensor:
        """The tensor, once its (possibly asynchronous) copy has landed."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self.tensor

    def release(self) -> int:
        """Let go of it; the last holder gives the buffer back to the pool (the tensor must
        not be used afterwards). Returns the bytes given back: :attr:`nbytes` for the last
        holder, else 0 (what the byte budget counted, once)."""
        with _SHARING:
            if self._holders == 0:
                return 0
            self._holders -= 1
            if self._holders:
                return 0
        if self._pool is not None and self._buffer is not None:
            self._pool.give(self._buffer, self._pinned)
        self._buffer = self._pool = None
        self.tensor = None
        return self.nbytes


class SnapshotPool:
    """Reusable host buffers by size class. Buffers in use plus buffers kept for reuse stay
    within ``max_bytes`` (beyond it, given-back buffers are freed)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = defaultdict(list)
        self._cached = 0
        self._in_use = 0
        self._lock = threading.Lock()

    def take(self, t: torch.Tensor) -> Snapshot:
        """Copy ``t``'s current values into a private buffer."""
        src = t.detach()
        nbytes = src.numel() * src.element_size()
        on_host = src.device.type == "cpu"
        if on_host and nbytes < MIN_POOLED:
            return Snapshot(src.clone(memory_format=torch.contiguous_format))
        if not on_host and src.device.type != "cuda":  # other accelerators: plain synchronous copy
            return Snapshot(src.to("cpu", copy=True))
        buffer = self._take_buffer(_size_class(nbytes), pinned=not on_host)
        view = buffer[:nbytes].view(src.dtype).view(src.shape)
        if on_host:
            view.copy_(src)
            return Snapshot(view, buffer, self)
        view.copy_(src, non_blocking=True)  # ordered after the producing (current) stream
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(src.device))
        return Snapshot(view, buffer, self, ready, pinned=True)

    def host_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A host buffer (uint8) of at least ``nbytes`` from the pool; :meth:`give` it back."""
        return self._take_buffer(_size_class(nbytes), pinned)

    def _take_buffer(self, size: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            self._in_use += size
            free = self._free[(size, pinned)]
            if free:
                self._cached -= size
                return free.pop()
            while self._cached and self._cached + self._in_use > self.max_bytes:
                self._evict_one()
        return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)

    def _evict_one(self) -> None:
        key = next(k for k, v in self._free.items() if v)
        self._free[key].pop()
        self._cached -= key[0]

    def clear(self) -> int:
        """Free the buffers kept for reuse; returns how many bytes they held."""
        with self._lock:
            freed, self._cached = self._cached, 0
            self._free.clear()
        return freed

    def give(self, buffer: torch.Tensor, pinned: bool) -> None:
        size = buffer.numel()
        with self._lock:
            self._in_use -= size
            if self._cached + self._in_use + size <= self.max_bytes:
                self._free[(size, pinned)].append(buffer)
                self._cached += size
