"""Hash mode: a digest of a tensor's bits instead of its values (see docs/format.md).

The digest is the ``checksum`` its dataset would have (``compare.format.DataChecksum``): the sum,
modulo 2**64, of the tensor's bytes in C order read as little-endian 64-bit words (the last one
padded with zero bytes), folded to 53 bits. So a hash record pairs with a value record of the
other run by that record's checksum, without reading it. It is computed where the tensor lives,
with integer sums only (a few kernels, no host sync on an accelerator).
"""
from __future__ import annotations

import sys

import torch

from compare import format as fmt

from .host_memory import tensor_bytes

assert sys.byteorder == "little", "digests read a tensor's bytes as little-endian words"


# Up to this many bytes numpy's single-threaded sum is faster than torch's (2-core CPU: 10 vs
# 15 us for 32 KiB in a loop; within a training step 1 MiB tensors were ~50 us slower each,
# and 16 MiB 3x slower in a loop)
HOST_SUM_BYTES = 1 << 18


def tensor_digest(t: torch.Tensor) -> int:
    """The digest of ``t``. For a tensor on an accelerator this reads the result (a host sync);
    the dumper batches those instead (:func:`word_sum`, :mod:`dumper.arena`). A small plain
    CPU tensor's bytes are summed in place by numpy (:mod:`dumper.host_memory`): the same sum,
    without torch's half-dozen views and casts (a large one's by torch: its threads)."""
    x = t.detach()
    memory = tensor_bytes(x) if x.numel() * x.element_size() <= HOST_SUM_BYTES else None
    if memory is not None:
        return fmt.data_checksum(memory)
    return fmt.fold_word_sum(int(word_sum(x)))


def word_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum, modulo 2**64, of ``t``'s bytes in C order as little-endian 64-bit words (the
    last one padded with zeros): a 0-d int64 tensor on ``t``'s device (no host sync)."""
    x = t.detach().resolve_conj().resolve_neg()  # the bits of its values, not of a lazy view
    if x.is_complex() or x.dtype is torch.bool:  # no integer view of their own width
        x = torch.view_as_real(x) if x.is_complex() else x.view(torch.uint8)
    raw = x.contiguous().reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 8:  # a slice of a larger buffer: realign for the 64-bit view
        raw = raw.clone()
    whole = raw.numel() // 8 * 8
    total = raw[:whole].view(torch.int64).sum(dtype=torch.int64)  # wraps modulo 2**64
    tail = raw[whole:]
    if tail.numel():
        shifts = torch.arange(0, 8 * tail.numel(), 8, dtype=torch.int64, device=tail.device)
        total = total + (tail.to(torch.int64) << shifts).sum()
    return total
