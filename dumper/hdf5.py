"""HDF5 through h5py's low-level API: the few calls the step writer makes, at a fraction of
the high-level API's cost, storing what the high-level API would store."""
from __future__ import annotations

from typing import Optional

import h5py
import numpy as np
from h5py import h5a, h5d, h5g, h5p, h5s, h5t

from compare import format as fmt


_HDF5_TYPES: dict[tuple, h5t.TypeID] = {}  # shared by steps: the index's compound type
_MAX_HDF5_TYPES = 64                         # costs ~250 us to build, and repeats per step


def _hdf5_type(dtype: np.dtype, logical: bool = True) -> h5t.TypeID:
    """HDF5 type of ``dtype`` as h5py makes it: ``logical`` for the file (what h5py's
    high-level API stores), else the in-memory type (bit-for-bit). Transient, immutable once
    made, shared by writer threads. The key adds the string encodings h5py keeps in dtype
    metadata, which numpy's dtype equality ignores (UTF-8 and ASCII ``S10`` compare equal)."""
    fields = dtype.names or ()
    key = (dtype, logical, tuple(h5py.check_string_dtype(dtype.fields[name][0])
                                 for name in fields) if fields else h5py.check_string_dtype(dtype))
    tid = _HDF5_TYPES.get(key)
    if tid is None:
        if len(_HDF5_TYPES) >= _MAX_HDF5_TYPES:  # e.g. index string widths changing per step
            _HDF5_TYPES.clear()
        tid = _HDF5_TYPES[key] = h5t.py_create(dtype, logical=logical)
    return tid


def write_attributes(obj: h5py.HLObject, attrs: dict) -> None:
    """``obj.attrs.update(attrs)`` through h5py's low-level API, with the same HDF5 types
    (str: variable-length UTF-8; int, bool: as h5py stores them): ~40 instead of ~140 us each
    (h5py's high-level path checks for, and would replace, an existing attribute)."""
    scalar = h5s.create_simple(())
    for name, value in attrs.items():
        data = np.asarray(value, dtype=h5py.string_dtype() if isinstance(value, str) else None)
        attr = h5a.create(obj.id, name.encode(), _hdf5_type(data.dtype), scalar)
        attr.write(data, mtype=_hdf5_type(data.dtype, logical=False))
        attr.close()


class LowLevelGroup:
    """Creates datasets through h5py's low-level API: a third of the high-level cost per dataset.

    With ``named_types`` (the file), a dataset holding the bits of a dtype HDF5 has no type for
    (the ``bits`` encoding: bfloat16, float8...) gets the committed datatype
    ``/{fmt.DTYPES_GROUP}/{dtype}`` (a copy of its integer storage type, committed on first use),
    so that HDF5 tools show ``bfloat16`` where they would show a bare ``uint16``."""

    def __init__(self, parent: h5py.Group, named_types: Optional[h5py.Group] = None):
        self._parent = parent.id
        self._groups: dict[str, h5g.GroupID] = {}
        self._spaces: dict[tuple[int, ...], h5s.SpaceID] = {}
        self._lcpl = h5p.create(h5p.LINK_CREATE)
        self._lcpl.set_char_encoding(h5t.CSET_UTF8)
        self._types_in = named_types.id if named_types is not None else None
        self._named: dict[str, h5t.TypeID] = {}

    def write(self, group: str, name: str, array: np.ndarray, dtype: Optional[str] = None
              ) -> None:
        """Dataset ``name`` holding ``array`` in subgroup ``group`` (created on first use);
        ``dtype``: the name of the dtype whose bits ``array`` holds (its named datatype)."""
        self._create(self._group(group), name, array, dtype)

    def _group(self, group: str) -> h5g.GroupID:
        gid = self._groups.get(group)
        if gid is None:
            gid = self._groups[group] = h5g.create(self._parent, fmt.name_bytes(group),
                                                   lcpl=self._lcpl)
        return gid

    def link(self, group: str, name: str, target_group: str, target_name: str) -> None:
        """``name`` in subgroup ``group``: a hard link to dataset ``target_name`` of subgroup
        ``target_group`` (written before), the same HDF5 object under two names."""
        gid = self._group(group)
        target = fmt.name_bytes(target_group) + b"/" + target_name.encode()  # from the parent
        gid.links.create_hard(name.encode(), self._parent, target, lcpl=self._lcpl)

    def write_here(self, name: str, array: np.ndarray) -> None:
        """Dataset ``name`` holding ``array`` in the parent group itself."""
        self._create(self._parent, name, array)

    def _named_type(self, dtype: str, storage: np.dtype) -> h5t.TypeID:
        tid = self._named.get(dtype)
        if tid is None:
            tid = self._named[dtype] = h5t.py_create(storage).copy()
            lcpl = h5p.create(h5p.LINK_CREATE)
            lcpl.set_create_intermediate_group(True)
            tid.commit(self._types_in, f"{fmt.DTYPES_GROUP}/{dtype}".encode(), lcpl=lcpl)
        return tid

    def _create(self, gid: h5g.GroupID, name: str, array: np.ndarray,
                dtype: Optional[str] = None) -> None:
        tid = _hdf5_type(array.dtype)
        space = self._spaces.get(array.shape)
        if space is None:  # one dataspace per shape: training repeats shapes (12 us each)
            space = self._spaces[array.shape] = (h5s.create_simple(array.shape) if array.ndim
                                                 else h5s.create(h5s.SCALAR))
        stored = tid if dtype is None or self._types_in is None else \
            self._named_type(dtype, array.dtype)
        ds = h5d.create(gid, name.encode(), stored, space, lcpl=self._lcpl)
        if array.size:
            ds.write(h5s.ALL, h5s.ALL, np.ascontiguousarray(array), mtype=tid)
        ds.close()

    def close(self) -> None:
        for gid in self._groups.values():
            gid.close()
        self._groups.clear()
        self._named.clear()
