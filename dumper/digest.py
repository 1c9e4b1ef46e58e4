"""Hash mode: a digest of a tensor's bits instead of its values (see docs/format.md).

The digest is the ``checksum`` its dataset would have (``compare.format.DataChecksum``): the sum,
modulo 2**64, of the tensor's bytes in C order read as little-endian 64-bit words (the last one
padded with zero bytes), folded to 53 bits. So a hash record pairs with a value record of the
other run by that record's checksum, without reading it. It is computed where the tensor lives,
with integer sums only (a few kernels, no host sync on an accelerator).
"""
from __future__ import annotations

import sys
from typing import Union

import torch

from compare import format as fmt

assert sys.byteorder == "little", "digests read a tensor's bytes as little-endian words"

Digest = Union[int, torch.Tensor]  # a digest (CPU), or its unfolded word sum on the device


def tensor_digest(t: torch.Tensor) -> Digest:
    """The digest of ``t`` (an int, for a CPU tensor), or, for a tensor on an accelerator, a
    one-element int64 tensor on its device holding the word sum: :func:`finish_digest` makes
    the digest of it once it is on the host."""
    x = t.detach()
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
    return fmt.fold_word_sum(int(total)) if raw.device.type == "cpu" else total.reshape(1)


def finish_digest(value: Union[int, torch.Tensor]) -> int:
    """The digest of a :func:`tensor_digest` result, on the host."""
    return value if isinstance(value, int) else fmt.fold_word_sum(int(value.reshape(-1)[0]))
