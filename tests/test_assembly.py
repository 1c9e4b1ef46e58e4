"""Sharded tensors put together (compare.assembly): region by region, in slabs, against numpy's
own figures on the whole tensors; partial sums added; a damaged shard refused."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from compare import format as fmt
from compare.assembly import Part, PartReader, compare_parts, whole_part
from compare.errors import DumpError
from compare.tolerance import pair_tolerance


def _store(path, values: np.ndarray, rank: int = -1, offsets=None, partial=False) -> Part:
    with h5py.File(path, "w") as f:
        f.create_group("step").create_group("call").create_dataset("output_0", data=values)
    if rank < 0:
        return whole_part(path, "step", "call", "output_0", "float32", fmt.ENC_RAW,
                          values.shape, fmt.data_checksum(values))
    return Part(str(path), "step", "call", "output_0", "float32", fmt.ENC_RAW, values.shape,
                tuple(offsets), fmt.data_checksum(values), rank, partial)


@pytest.fixture
def tol():
    return pair_tolerance("float32", "float32", None, None)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("max_elements", [1, 7, 10_000])  # slabs of a row or less; whole
@pytest.mark.parametrize("off_rank", [0, 1])
def test_shards_compare_as_the_whole_tensor(tmp_path, tol, dim, max_elements, off_rank):
    rng = np.random.default_rng(dim)
    whole = rng.standard_normal((8, 6)).astype(np.float32)
    shards = np.split(whole, 2, axis=dim)
    shards[off_rank] = shards[off_rank] * np.float32(1.01)  # this rank's shard is off
    planted = np.concatenate(shards, axis=dim)
    parts = tuple(_store(tmp_path / f"r{r}.h5", shard, r,
                         [0, 0][:dim] + [r * shard.shape[dim]] + [0] * (1 - dim))
                  for r, shard in enumerate(shards))
    reader = PartReader(max_elements)
    try:
        result = compare_parts(parts, (_store(tmp_path / "whole.h5", whole),), tol, reader,
                               max_elements)
    finally:
        reader.close()
    diff = planted.astype(np.float64) - whole
    assert result["numel"] == whole.size and result["shard_rank"] == off_rank
    assert result["max_abs_err"] == pytest.approx(np.abs(diff).max())
    assert result["rel_l2_err"] == pytest.approx(np.linalg.norm(diff) / np.linalg.norm(planted))


def test_partial_shards_are_added_up(tmp_path, tol):
    rng = np.random.default_rng(1)
    first = rng.standard_normal((4, 5)).astype(np.float32)
    second = rng.standard_normal((4, 5)).astype(np.float32)
    parts = tuple(_store(tmp_path / f"p{r}.h5", v, r, (0, 0), partial=True)
                  for r, v in enumerate((first, second)))
    total = (first.astype(np.float64) + second).astype(np.float32)
    reader = PartReader(3)
    result = compare_parts(parts, (_store(tmp_path / "whole.h5", total),), tol, reader, 3)
    reader.close()
    assert result["max_abs_err"] < 1e-6 and result["status"] in ("equal", "close")


@pytest.mark.parametrize("max_elements", [4, 100])  # read in slabs; read whole
def test_a_shard_whose_bytes_changed_is_refused(tmp_path, tol, max_elements):
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    part = _store(tmp_path / "r0.h5", values, 0, (0, 0))
    with h5py.File(tmp_path / "r0.h5", "r+") as f:
        f["step/call/output_0"][1, 1] = 99.0
    reader = PartReader(max_elements)
    with pytest.raises(DumpError, match="does not match its checksum"):
        compare_parts((part,), (_store(tmp_path / "whole.h5", values),), tol, reader,
                      max_elements)
    reader.close()


@pytest.mark.parametrize("regions, shape, tiles", [
    ([((0,), (3,)), ((3,), (2,))], (5,), True),             # uneven shards
    ([((0,), (3,)), ((2,), (3,))], (5,), False),            # overlapping: as many elements
    ([((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], (4, 4), True),
    ([((0,), (0,)), ((0,), (4,))], (4,), True),             # a rank's empty shard
    ([((0,), (0,))], (0,), True),                           # an empty tensor
    ([((), ())], (), True),                                 # a 0-d tensor
])
def test_shards_put_together_must_tile_the_tensor(regions, shape, tiles):
    from compare.assembly import _tile
    assert _tile(regions, shape) is tiles
