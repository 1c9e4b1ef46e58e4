"""Reading ahead: the next chunks are read by a background thread while this one is compared."""
from __future__ import annotations

import queue
import threading
from typing import Iterator


def prefetched(items: Iterator, depth: int = 2) -> Iterator:
    """Iterate ``items`` produced by a background thread, ``depth`` ahead: reading the next chunk
    (h5py, GIL released) overlaps with computing on this one (numpy, GIL released)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(end)
        except BaseException as exc:  # handed to the consumer
            q.put(exc)

    thread = threading.Thread(target=produce, name="h5cmp-prefetch", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()
