"""The one exception type for mistakes a user can make (bad data, bad flags, bad run folders).

CLIs catch it, print its message on one line and exit non-zero; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class ClassifyError(Exception):
    """A problem the user can fix; the message is written for a person."""


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None, prog: str = "classify") -> int:
    """Run a CLI ``main``; a ClassifyError (or Ctrl-C) becomes one line on stderr and an exit code."""
    try:
        return main(argv)
    except ClassifyError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
