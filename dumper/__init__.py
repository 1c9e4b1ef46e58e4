"""Capture side of h5cmp: hook a model and dump its tensors per step into HDF5."""
from .hooker import HookerAndDumper
from .window import every
from .writer import DumpWriteError

__all__ = ["HookerAndDumper", "DumpWriteError", "every"]
