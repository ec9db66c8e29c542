"""The ``fastload`` command: thin commands over the library (see ``fastload --help``).

Exit codes: 0 success, 1 a runtime failure (or any sample that failed), 2 a usage error,
130 interrupted. Errors are one line on stderr; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    try:  # typer and rich are the 'cli' extra: imported only when the command runs
        from fastload._cli.app import run  # noqa: PLC0415
    except ImportError as exc:
        sys.stderr.write(f"fastload: the command line needs 'fastload[cli]' ({exc.name} missing)\n")
        return 2
    return run(sys.argv[1:] if argv is None else argv)
