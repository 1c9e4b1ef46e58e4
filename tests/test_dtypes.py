"""Every dtype round-trips bit-exactly through a dump, and decodes to the values torch gives."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from compare.decoding import decode
from compare.dump import load_dump
from dumper import HookerAndDumper
from dumper.encoding import decode_to_tensor

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                      "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)]
DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, *FLOAT8,
          torch.float4_e2m1fn_x2, torch.complex32, torch.complex64, torch.complex128,
          torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
          torch.uint32, torch.uint64, torch.bool]


def _all_bit_patterns(dtype: torch.dtype, shape=(4, 64)) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: NaNs, infinities, subnormals, -0 included."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, shape[:-1] + (shape[-1] * nbytes,), dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw % 2).bool()
    return raw.view(dtype)


class Emit(nn.Module):
    def __init__(self, tensors):
        super().__init__()
        self.tensors = tensors

    def forward(self, x):
        return self.tensors


def _raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8)) if t.numel() else b""


def test_every_dtype_round_trips_bit_exactly(tmp_path):
    tensors = {str(dt): _all_bit_patterns(dt) for dt in DTYPES}
    tensors["scalar_bf16"] = torch.tensor(1.5, dtype=torch.bfloat16)
    tensors["empty_f8"] = torch.empty(0, 3, dtype=torch.float8_e4m3fn)
    tensors["noncontig"] = torch.randn(6, 4).t()
    tensors["conj"] = torch.randn(3, dtype=torch.complex64).conj()
    model = Emit(tensors)
    dumper = HookerAndDumper(tmp_path)
    with dumper.hooks(model, 0, 0):
        model(torch.zeros(1))
    step = load_dump(tmp_path).steps[0]
    rows = step.index[step.index["kind"] == "output"].set_index("path")
    with step.open() as reader:
        for name, t in tensors.items():
            row = rows.loc[f"output[{name!r}]"]
            back = decode_to_tensor(reader.read_raw(row), row["dtype"])
            assert back.dtype == t.dtype and back.shape == t.shape, name
            expected = t.resolve_conj()
            assert _raw_bytes(back) == _raw_bytes(expected), name


def test_dtypes_hdf5_has_no_type_for_are_named_datatypes(tmp_path):
    tensors = {str(dt): _all_bit_patterns(dt) for dt in DTYPES}
    model = Emit(tensors)
    with HookerAndDumper(tmp_path).hooks(model, 0, 0):
        model(torch.zeros(1))
    step = load_dump(tmp_path).steps[0]
    rows = step.index[step.index["kind"] == "output"]
    with h5py.File(step.path, "r") as f:
        named = set(f["dtypes"])
        for row in rows.itertuples():
            stored_type = f[step.group_name][row.group][row.dataset].id.get_type()
            if row.encoding == "bits":  # bfloat16, float8..., complex32: named in the file
                assert stored_type.committed(), row.dtype
                assert h5py.h5i.get_name(stored_type) == f"/dtypes/{row.dtype}".encode()
                assert isinstance(f["dtypes"][row.dtype], h5py.Datatype)
            else:
                assert not stored_type.committed(), row.dtype
    assert named == set(rows[rows["encoding"] == "bits"]["dtype"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, *FLOAT8, torch.complex32])
def test_decoded_values_equal_torch_conversion(dtype, tmp_path):
    t = _all_bit_patterns(dtype, (8, 256))
    from dumper.encoding import encode, dtype_name
    array, encoding = encode(t)
    got = decode(array, dtype_name(dtype), encoding)
    wide = torch.complex64 if dtype.is_complex else torch.float32
    expected = t.to(wide).numpy()
    assert got.dtype == expected.dtype
    if dtype.is_complex:  # compare the parts' bits: NaN payloads and -0 included
        got, expected = got.view(np.float32), expected.view(np.float32)
    np.testing.assert_array_equal(got, expected)
