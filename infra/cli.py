"""How the command-line programs (train, finetune, eval, sample, data, checkpoint) end.

A mistake in what the user gave (a config value, a path, a damaged file) prints one line that names it, with
no traceback, and exits with status 1; under torchrun only rank 0 prints it, since every rank meets the same
mistake. Anything else is a bug and keeps Python's full traceback.

The rule that tells them apart: a user error is an exception raised by one of this repository's own `raise`
statements, which are written for users and name the problem. An exception raised inside torch, numpy or
Python itself (an IndexError, a shape mismatch, a failed assertion) is not.
"""
from __future__ import annotations

import linecache
import os
import sys
import traceback
from typing import Callable

ROOT = os.path.dirname(os.path.abspath(__file__))


def is_user_error(error: BaseException) -> bool:
    """Whether `error` comes from a `raise` statement in this repository's code (see the module doc)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    origin = frames[-1]
    relative = os.path.relpath(os.path.abspath(origin.filename), ROOT)
    if relative.startswith("..") or "site-packages" in relative.split(os.sep):
        return False
    return linecache.getline(origin.filename, origin.lineno).lstrip().startswith("raise ")


def message(error: BaseException) -> str:
    # str(KeyError("x")) is "'x'": show the text as written.
    return error.args[0] if len(error.args) == 1 and isinstance(error.args[0], str) else str(error)


def run(main: Callable[[list[str]], object]) -> None:
    """Call main(sys.argv[1:]) and end the process as the module doc says; an int that main returns is the
    exit status."""
    prog = os.path.basename(sys.argv[0])
    speaks = int(os.environ.get("RANK", "0")) == 0
    try:
        status = main(sys.argv[1:])
    except KeyboardInterrupt:
        if speaks:
            print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:
        if not is_user_error(error):
            raise
        if speaks:
            print(f"{prog}: error: {message(error)}", file=sys.stderr)
        sys.exit(1)
    sys.exit(status if isinstance(status, int) else 0)
