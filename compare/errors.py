"""Errors the compare side reports to users as one line (CLI exit code 2), and the checks that
raise them before any work starts."""
import os
from pathlib import Path


class DumpError(Exception):
    """A dump cannot be read: the message names the file and what to do."""


def check_writable(path: Path) -> None:
    """Raise :class:`DumpError` now if a file cannot be written at ``path`` (before a compare
    that may take minutes)."""
    parent = path.parent
    if path.is_dir():
        raise DumpError(f"{path}: is a directory; name a file to write")
    if not parent.is_dir():
        raise DumpError(f"{path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise DumpError(f"{path}: not writable; choose another place")
