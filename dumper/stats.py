"""Statistics mode: a few numbers per tensor instead of its values (see docs/format.md)."""
from __future__ import annotations

import torch

from compare.format import STAT_COLUMNS  # noqa: F401  (the order of the values below)


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """``[min, max, mean, std, norm, nan, inf, zero]`` of ``t`` as float64, on ``t``'s device.

    Computed without a host sync (one small tensor). Complex tensors are described by their
    magnitudes; integers and bool as float64. NaNs propagate into min/max/mean/std/norm; the
    counts tell how many there are. ``std`` is the population standard deviation.
    """
    x = t.detach()
    if x.is_complex():
        x = x.abs()
    if not x.is_floating_point():
        x = x.to(torch.float64)
    elif x.element_size() < 4:  # float16, bfloat16, float8: reduce in float32
        x = x.float()
    if x.numel() == 0:
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=x.device)
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        return torch.stack([nan, nan, nan, nan, zero, zero, zero, zero])
    lo, hi = torch.aminmax(x)
    values = [lo, hi, x.mean(), x.std(correction=0), torch.linalg.vector_norm(x),
              torch.isnan(x).sum(), torch.isinf(x).sum(), (x == 0).sum()]
    return torch.stack([v.to(torch.float64) for v in values])
