"""Run metadata written as root attributes of every step file."""
from __future__ import annotations

import datetime
from typing import Optional

import torch
from torch import nn

from compare import format as fmt

from .encoding import dtype_name


def distributed_rank() -> tuple[Optional[int], int]:
    """``(rank, world_size)`` under an initialised ``torch.distributed``, else ``(None, 1)``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None, 1


def model_device(model: nn.Module) -> str:
    for tensor in model.parameters():
        return str(tensor.device)
    for tensor in model.buffers():
        return str(tensor.device)
    return "cpu"


def run_attrs(model: nn.Module, epoch: int, step: int, mode: str, injected_from: str = "",
              compiled: tuple[str, ...] = ()) -> dict:
    """The root attributes of a step file (names in ``compare.format``); ``injected_from``:
    what a localizing re-run injects (``Injector.describe()``); ``compiled``: the paths of the
    modules that run as compiled code (:class:`dumper.calls.HookedModel`)."""
    rank, world_size = distributed_rank()
    attrs = {
        fmt.ATTR_FORMAT_NAME: fmt.FORMAT_NAME,
        fmt.ATTR_FORMAT_VERSION: fmt.FORMAT_VERSION,
        "mode": mode,
        "epoch": epoch,
        "step": step,
        "rank": -1 if rank is None else rank,
        "world_size": world_size,
        "torch_version": str(torch.__version__),
        "device": model_device(model),
        "default_dtype": dtype_name(torch.get_default_dtype()),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        fmt.ATTR_INJECTED_FROM: injected_from,
        fmt.ATTR_COMPILED: "\n".join(path or fmt.ROOT_NAME for path in compiled),
    }
    assert set(attrs) == {fmt.ATTR_FORMAT_NAME, fmt.ATTR_FORMAT_VERSION, *fmt.RUN_ATTRS}
    return attrs
