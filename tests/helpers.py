"""Test helpers: read a dump back as exact torch tensors, keyed by (module, call_idx, kind, index)."""
from __future__ import annotations

import torch

from compare.dump import load_dump
from dumper.encoding import decode_to_tensor


def read_tensors(path) -> dict[tuple, torch.Tensor]:
    """Every stored tensor of a one-step dump, bit-exact, keyed by (module, call_idx, kind, index),
    with the occurrence appended for a repeated gradient."""
    dump = load_dump(path)
    out = {}
    for step in dump.steps:
        with step.open() as reader:
            for row in step.index[step.index["dataset"] != ""].itertuples():
                key = (row.module, row.call_idx, row.kind, row.index) + (
                    (row.occurrence,) if row.occurrence else ())
                assert key not in out, f"duplicate record {key}"
                out[key] = decode_to_tensor(reader.read_raw(row), row.dtype)
    return out
