"""A CPU tensor's memory read in place by numpy, for the hooks' statistics and digests.

``x.numpy()`` would do it, but exposing a tensor's storage to numpy marks the storage not
resizable for good, and FSDP frees unsharded parameters by resizing theirs. Reading by address
leaves the storage as it is, and costs ~1 us where a torch cast or a few torch views of a
small tensor cost 10-30 us of dispatcher work.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np
import torch


def tensor_bytes(x: torch.Tensor) -> Optional[np.ndarray]:
    """The bytes of ``x``'s elements in C order, as a flat uint8 array over its memory (valid
    while ``x`` lives; never written), where ``x`` is a plain contiguous CPU tensor whose
    bytes are its values (no negative or conjugate bit); else None."""
    if type(x) is not torch.Tensor or not x.is_cpu or not x.is_contiguous() or x.is_neg() \
            or x.is_conj() or x.layout is not torch.strided:
        return None
    nbytes = x.numel() * x.element_size()
    if nbytes == 0:  # an empty tensor may have no address at all
        return np.empty(0, dtype=np.uint8)
    memory = (ctypes.c_char * nbytes).from_address(x.data_ptr())
    return np.frombuffer(memory, dtype=np.uint8)
