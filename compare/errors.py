"""Errors the compare side reports to users as one line (CLI exit code 2)."""


class DumpError(Exception):
    """A dump cannot be read: the message names the file and what to do."""
