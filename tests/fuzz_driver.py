"""Child process of tests/test_fuzz.py: runs ``h5cmp A CASE`` for each case directory named
in a JSON list, printing one JSON line per case (its exit code and output, and any exception
that escaped the CLI), so that the parent can hold every case to a time limit."""
from __future__ import annotations

import json
import sys

from click.testing import CliRunner

from compare.cli import main


def run(reference: str, cases: list[str]) -> None:
    for case in cases:
        result = CliRunner().invoke(main, [reference, case])
        escaped = result.exception if not isinstance(result.exception, (SystemExit,
                                                                          type(None))) else None
        print(json.dumps({"case": case, "code": result.exit_code, "output": result.output,
                          "escaped": repr(escaped) if escaped is not None else None}),
              flush=True)


if __name__ == "__main__":
    run(sys.argv[1], json.loads(sys.argv[2]))
