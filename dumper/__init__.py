"""Capture side of h5cmp: hook a model and dump its tensors per step into HDF5."""
from .consumers import CapturedRecord
from .hooker import HookerAndDumper
from .inspection import io_shapes, module_keys
from .injection import Injector
from .perturbation import Perturbation, perturb
from .sentinel import NonFiniteError
from .window import every
from .writer import DumpWriteError

__all__ = ["HookerAndDumper", "DumpWriteError", "every", "module_keys", "io_shapes", "Injector",
           "Perturbation", "perturb", "NonFiniteError",
           "CapturedRecord"]
