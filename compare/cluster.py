"""Comparing on a Dask cluster (the optional extra ``h5cmp[dask]``).

``compare_dumps(..., client=client)`` sends its work units — a step's (and rank's) pairs, split
in tensor ranges so that every worker has work — to the cluster's workers, which read the step
files themselves: they must see the dumps at the same paths (shared storage) and have h5cmp
installed. Pairing and the verdict stay in the calling process, so the rows are those of a local
comparison.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from .errors import DumpError

CONNECT_TIMEOUT = "20s"  # how long connect() waits for the scheduler
STALL_TIMEOUT = 600.0  # seconds run_on() waits for the next work unit before giving up


def connect(address: str) -> Any:
    """A ``distributed.Client`` of the scheduler at ``address`` (e.g. ``tcp://host:8786``)."""
    try:
        from distributed import Client
    except ImportError as exc:
        raise DumpError(f"--scheduler {address}: comparing on a Dask cluster needs dask and "
                        f"distributed: pip install 'h5cmp[dask]'") from exc
    try:
        return Client(address, timeout=CONNECT_TIMEOUT)
    except (OSError, TimeoutError, ValueError) as exc:  # ValueError: not an address
        raise DumpError(f"--scheduler {address}: cannot reach the Dask scheduler "
                        f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                        f"start it (dask scheduler) or check the address") from exc


def worker_count(client: Any) -> int:
    """How many workers the cluster has now (at least 1)."""
    return max(1, len(client.scheduler_info().get("workers", {})))


def run_on(client: Any, fn: Callable, tasks: Iterable) -> Iterator:
    """``fn(task)`` for each task on the cluster's workers, results as they complete. A task
    that raises raises here; when no task finishes for :data:`STALL_TIMEOUT` seconds (workers
    gone or stuck) :class:`DumpError` says so. Either way the remaining tasks are cancelled."""
    from distributed import wait
    pending = client.map(fn, list(tasks), pure=False)
    try:
        while pending:
            try:  # (only the wait: a task's own TimeoutError is its error, raised as it is)
                done, pending = wait(pending, timeout=STALL_TIMEOUT,
                                     return_when="FIRST_COMPLETED")
            except TimeoutError as exc:
                raise DumpError(f"--scheduler {client.scheduler.address}: no work unit "
                                f"finished in {STALL_TIMEOUT:g} s ({len(pending)} waiting; "
                                f"workers: {_workers_now(client)}); the workers are gone, "
                                f"stuck or busy: check the cluster") from exc
            for future in done:
                yield future.result()
    finally:
        client.cancel(list(pending))


def _workers_now(client: Any) -> str:
    """How many workers the scheduler reports, or "unknown" where it does not answer."""
    try:
        return str(len(client.scheduler_info().get("workers", {})))
    except Exception:  # the scheduler itself gone: the stall is still what to report
        return "unknown"
