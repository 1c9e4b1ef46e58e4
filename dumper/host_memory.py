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


def tensor_address(x: torch.Tensor) -> Optional[int]:
    """The address of ``x``'s elements in C order (valid while ``x``'s storage is neither
    freed nor resized: read them at once), where ``x`` is a plain contiguous CPU tensor, not
    empty, whose memory holds its values (no negative or conjugate bit, not a zero tensor
    without memory, not a wrapper without storage); else None."""
    if type(x) is not torch.Tensor or not x.is_cpu or not x.is_contiguous() or x.is_neg() \
            or x.is_conj() or x.layout is not torch.strided or not x.numel():
        return None
    try:
        address = x.data_ptr()
    except RuntimeError:  # e.g. a functorch wrapper: no storage of its own
        return None
    return address or None  # torch's zero tensors (_efficientzerotensor) have no memory


def tensor_bytes(x: torch.Tensor) -> Optional[np.ndarray]:
    """The bytes of ``x``'s elements in C order, as a flat read-only uint8 array over its
    memory (read it at once), where ``x`` is a tensor :func:`tensor_address` reads or an empty
    plain one; else None."""
    address = tensor_address(x)
    if address is None:
        if type(x) is not torch.Tensor or x.numel() or not x.is_cpu or \
                x.layout is not torch.strided:
            return None
        memory = np.empty(0, dtype=np.uint8)  # an empty tensor may have no address at all
    else:
        nbytes = x.numel() * x.element_size()
        memory = np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=np.uint8)
    memory.flags.writeable = False
    return memory
