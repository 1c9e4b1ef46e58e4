"""Compare side of h5cmp (torch-free): read dumps, pair tensors, measure errors, report.

    >>> from compare import compare_dumps, summarize
    >>> result = compare_dumps("cpu_dumps/", "gpu_dumps/")
    >>> print(summarize(result))

Names are imported on first use, so that ``h5cmp --help`` starts without loading pandas/h5py.
"""
import importlib

_EXPORTS = {
    "compare_dumps": "comparison", "load_dump": "dump", "Dump": "dump", "StepFile": "dump",
    "DumpError": "errors", "format_tree": "inspect", "summarize": "summary", "Summary": "summary",
    "Divergence": "summary", "Tolerance": "tolerance", "pair_tolerance": "tolerance",
    "localize": "injection", "describe_origins": "injection", "ops_suspects": "injection",
    "origin_aliases": "injection",
    "judge": "verdict",
    "NameMapping": "mapping", "Rule": "mapping", "load_mapping": "mapping",
    "suggest_mapping": "suggest",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'compare' has no attribute {name!r}")


def __dir__():
    return __all__
